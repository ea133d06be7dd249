# PPO for discrete actions, as CleanRL defines it (ppo.py), on classic-control environments that live on the GPU as
# batched torch tensors, stepped in plain eager PyTorch: one Python call chain per env step. Under torchrun,
# data-parallel over its ranks (one per GPU): gradients averaged over the ranks in one all-reduce per minibatch.
# Docs: docs/gpu_collection.md, docs/multigpu.md
import datetime
import hashlib
import json
import logging
import math
import netrc
import os
import random
import signal
import sys
import tempfile
import time
import urllib.parse
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tqdm
import tyro
from torch.distributions.categorical import Categorical
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the id of the environment: CartPole-v1, Acrobot-v1 or MountainCar-v0"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 500000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of minibatches a rollout is split into"""
    update_epochs: int = 4
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the PPO paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop the epochs of an update early once the approximate KL divergence exceeds this threshold"""
    cuda: bool = True
    """use CUDA when it is available"""
    torch_threads: int = 1
    """torch's intra-op CPU threads (0: torch's default, one per core); see the README's CPU notes"""
    track: bool = False
    """track the experiment with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    tensorboard: bool = True
    """write TensorBoard scalars under runs/<run name>/"""
    speed_log: str | None = None
    """append the final speed record (one JSON line) to this file"""
    profile_dir: str | None = None
    """profile the start of the steady window (after warm-up) and write the trace into this directory"""
    save_dir: str | None = None
    """write checkpoints into this directory: every --save-every env steps, at the end, and on Ctrl-C"""
    save_every: int = 0
    """env steps between checkpoints in --save-dir (0: only the one at the end)"""
    resume: str | None = None
    """continue the run saved in this checkpoint file, or in this directory's checkpoint of the script"""
    eval_checkpoint: str | None = None
    """evaluate the policy of this checkpoint (file or directory, as for --resume) and exit, without training"""
    eval_episodes: int = 10
    """episodes that --eval-checkpoint runs"""
    capture_video: bool = False
    """record videos under videos/<run name>/: of env 0 while training, of every episode of --eval-checkpoint"""


# Iterations that count as warm-up: the fps window starts after them (the twin captures its rollout at the third).
WARMUP_ITERATIONS = 3
# Iterations profiled with --profile-dir, at the start of the steady window.
PROFILE_ITERATIONS = 1
# The statistics of a minibatch update, in the order they are logged.
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")
# Envs' tensors, as a checkpoint holds them: all that the envs' next steps depend on.
ENVS_STATE = ("state", "elapsed", "episode_return", "ended")

# Seconds between refreshes of the progress bar, and between progress lines where stderr is not a terminal.
PROGRESS_SECONDS = 1.0
CONSOLE_SECONDS = 10.0
# Warnings that are not the user's concern (docs/contract.md says what each one is): (category, message).
QUIET_WARNINGS = (
    (DeprecationWarning, r".*The environment \S+-v4 is out of date"),
    (UserWarning, r"Using lock_\(\) inside a compiled graph"),
)
# What a checkpoint file says it is (docs/checkpoints.md).
CHECKPOINT_FORMAT = "leanrl-checkpoint-1"
# Arguments a resumed run may change: they change where it writes, how long it runs and how fast, not what it learns.
RESUMABLE_ARGS = (
    "total_timesteps", "save_dir", "save_every", "resume", "eval_checkpoint", "eval_episodes", "capture_video",
    "cuda", "torch_threads", "track", "wandb_project_name", "wandb_entity", "tensorboard", "speed_log",
    "profile_dir", "compile", "cudagraphs",
)  # fmt: skip
# Seconds a rank waits for the others in a collective (the start's checks, an all-reduce) before the job fails,
# so that a rank that died or hangs ends the run instead of stalling it; long enough for torch.compile and
# graph capture, which run between two collectives.
DIST_TIMEOUT_SECONDS = 900


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def flag(args, name, argv):
    """`--name value` for an error line, saying so when the value is a default that argv does not set."""
    option = "--" + name.replace("_", "-")
    given = any(a.split("=")[0].replace("_", "-") == option for a in argv)
    return f"{option} {getattr(args, name)}" + ("" if given else " (the default)")


def wandb_credentials():
    """Whether wandb can log without asking for a key: offline or disabled, a key in the environment, or a
    `wandb login` (which writes the key to ~/.netrc). Nothing goes over the network."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def checkpoint_file(path, script):
    """The checkpoint file a path names: the path itself, or the script's checkpoint in a directory."""
    return os.path.join(path, f"{script}.pt") if os.path.isdir(path) else path


def open_checkpoint(args, argv, script):
    """(checkpoint, args) for --resume or --eval-checkpoint: the file loaded (tensors and plain values only) and
    checked, and the arguments of its run with argv's on top; one that would change the run must not differ
    (evaluation may take another --seed)."""
    if args.resume and args.eval_checkpoint:
        fail("--resume and --eval-checkpoint exclude each other: resume a run, or evaluate its policy")
    option, path = ("--resume", args.resume) if args.resume else ("--eval-checkpoint", args.eval_checkpoint)
    path = checkpoint_file(path, script)
    if not os.path.isfile(path):
        fail(f"{option} {path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not written by torch.save, or holding objects weights_only refuses
        fail(f"{option} {path} does not load as a checkpoint ({type(e).__name__}): truncated, or not a checkpoint")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        fail(f"{option} {path} is not a checkpoint of this collection")
    if checkpoint["script"] != script:
        fail(f"{option} {path} is a checkpoint of {checkpoint['script']}, not of {script}")
    if set(checkpoint["args"]) != {field.name for field in fields(Args)}:
        fail(f"{option} {path} was written by another version of {script}: its arguments differ")
    saved = Args(**checkpoint["args"])
    args = tyro.cli(Args, args=argv, default=saved)
    free = RESUMABLE_ARGS + (("seed",) if args.eval_checkpoint else ())
    for name in checkpoint["args"]:
        if name not in free and getattr(args, name) != getattr(saved, name):
            fail(f"{option} {path}: {flag(args, name, argv)} differs from the checkpoint's {getattr(saved, name)}")
    return checkpoint, args


def rng_states():
    """The global random generators' states, in types a weights_only load reads back."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states):
    numpy_state = states["numpy"]
    numpy_state["state"]["key"] = numpy_state["state"]["key"].numpy().astype(np.uint32)
    random.setstate(states["python"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


def check_args(args, argv):
    setup_distributed(args)
    _, world_size = world()
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "learning_rate"):
        if getattr(args, name) <= 0:
            fail(f"{flag(args, name, argv)} must be positive")
    for name in ("gamma", "gae_lambda"):
        if not 0 <= getattr(args, name) <= 1:
            fail(f"{flag(args, name, argv)} must be in [0, 1]")
    batch = f"{flag(args, 'num_envs', argv)} * {flag(args, 'num_steps', argv)} = {args.num_envs * args.num_steps}"
    if args.num_envs * args.num_steps % args.num_minibatches:
        minibatches = flag(args, "num_minibatches", argv)
        fail(f"{batch} does not split evenly into {minibatches}: every minibatch must have the same size")
    if args.norm_adv and args.num_envs * args.num_steps // args.num_minibatches < 2:
        fail(f"{flag(args, 'num_minibatches', argv)} leaves minibatches of one sample; --norm-adv needs two")
    if args.total_timesteps < args.num_envs * args.num_steps * world_size:
        fail(f"{flag(args, 'total_timesteps', argv)} is below one rollout, {batch} on each of {world_size} ranks")
    if args.target_kl is not None and args.target_kl <= 0:
        fail(f"--target-kl {args.target_kl} must be positive")
    if args.capture_video and not args.eval_checkpoint:
        fail(
            "--capture-video records evaluation only: the training envs are tensors, which do not render; "
            "record a saved policy with --eval-checkpoint DIR --capture-video"
        )


def world():
    """(rank, world size) of this process: (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def leave_process_group():
    """dist.destroy_process_group, after a short sleep: a worker thread of the last collectives may still wait for the
    interpreter's lock to drop its hold on their tensors, and a process that exits first aborts ("terminate called
    without an active exception", seen once in ten 2-rank runs on the CPU); the sleep hands it the lock."""
    time.sleep(0.1)
    dist.destroy_process_group()


def fail_on_every_rank(message):
    """Bad input that every rank sees: one error line, from rank 0, and exit code 2 on every rank."""
    rank = dist.get_rank()
    leave_process_group()
    if rank == 0:
        fail(message)
    sys.exit(2)


def digests_differ(digest):
    """The ranks whose digest (a string) differs from rank 0's; one all-gather."""
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return [rank for rank, other in enumerate(digests) if other != digests[0]]


def setup_distributed(args):
    """Under torchrun (WORLD_SIZE set): put this rank on its GPU (cuda:LOCAL_RANK), join the process group (NCCL
    on CUDA, gloo on the CPU) and check that every rank runs the same arguments. Ranks other than 0 then write
    nothing: no TensorBoard, wandb, speed log, profile, checkpoint or stdout. Without torchrun, nothing to do."""
    if "WORLD_SIZE" not in os.environ:
        return
    cuda = torch.cuda.is_available() and args.cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(seconds=DIST_TIMEOUT_SECONDS)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    differ = digests_differ(hashlib.sha256(json.dumps(asdict(args), sort_keys=True).encode()).hexdigest())
    if differ:
        fail_on_every_rank(f"ranks {differ} were started with other arguments than rank 0: every rank needs the same")
    if dist.get_rank():
        args.tensorboard = args.track = False
        args.speed_log = args.profile_dir = args.save_dir = None
        args.save_every = 0
        sys.stdout = open(os.devnull, "w")


def average_gradients(parameters):
    """Every rank's gradients replaced by their mean over the ranks, in one all-reduce: they are copied into one
    flat buffer and back (CleanRL all-reduces each parameter, one call with its own latency per tensor)."""
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def stop_together(meter, rank):
    """Ctrl-C under torchrun reaches every rank, from the terminal and again from torchrun: each rank notes it and
    goes on to the end of the iteration, where the ranks agree to stop (agree), rank 0 writes its checkpoint with
    --save-dir, and all end with their record. Stopping at once would leave the other ranks in an all-reduce."""

    def requested(signum, frame):
        if rank == 0 and not meter.stop:
            print("Ctrl-C: every rank stops at the end of this iteration", file=sys.stderr, flush=True)
        meter.stop = True

    signal.signal(signal.SIGINT, requested)


def agree(value, op, device):
    """A number every rank gives, reduced over the ranks by op (dist.ReduceOp), as every rank's float."""
    reduced = torch.tensor([float(value)], device=device)
    dist.all_reduce(reduced, op=op)
    return reduced.item()


def broadcast_parameters(network):
    """Rank 0's parameters to every rank, so that all start from the same network."""
    for tensor in network.state_dict().values():
        dist.broadcast(tensor, 0)


def check_ranks_agree(network, global_step, rank_fps):
    """The end of a distributed run: every rank must hold rank 0's parameters bit for bit (they start equal and
    take the same averaged steps), else the run is an error; rank 0 prints each rank's own fps on stderr."""
    tensors = network.state_dict().values()
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors)).hexdigest()
    differ = digests_differ(digest)
    if differ:
        fail_on_every_rank(f"after {global_step} env steps, the parameters of ranks {differ} differ from rank 0's")
    fps = [None] * dist.get_world_size()
    dist.all_gather_object(fps, round(rank_fps, 1))
    if dist.get_rank() == 0:
        print(f"env steps per second of each rank over its whole loop: {fps}", file=sys.stderr, flush=True)
    leave_process_group()


def resumed_apart(args, rank, global_step):
    """After a resume every rank holds rank 0's checkpoint, its generators and envs included: the other ranks
    reseed their generators apart again (from --seed, the rank and the step), so that their rollouts do not repeat
    rank 0's. Their envs go on from rank 0's states, and part from them at the first draw."""
    if rank:
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(args.seed + rank + global_step)


class CartPole:
    """gymnasium's CartPole-v1: state (x, x_dot, theta, theta_dot), Euler integration, reward 1 per step, ended
    when the cart leaves [-2.4, 2.4] or the pole tilts past 12 degrees; reset uniform in [-0.05, 0.05).

    A heavier simulator for data-collection studies (collect_bench.py --sweep sc, docs/gpu_collection.md) is a
    subclass with `copies` carts per env (the state holds each component for every copy, component after
    component; n_noise is 4 per copy; the policy sees copy 0; the episode ends when any copy does) and `substeps`
    Euler steps of tau / substeps per env step. With one of each it is gymnasium's CartPole, operation for
    operation."""

    n_obs, n_act, n_noise, max_episode_steps = 4, 2, 4, 500
    gravity, masspole, total_mass, length, force_mag, tau = 9.8, 0.1, 1.1, 0.5, 10.0, 0.02
    polemass_length = masspole * length
    x_threshold, theta_threshold = 2.4, 12 * 2 * math.pi / 360
    copies, substeps = 1, 1

    @staticmethod
    def initial(noise):
        return noise * 0.1 - 0.05

    @classmethod
    def observe(cls, state):
        return state[:, :: cls.copies]

    @classmethod
    def substep(cls, x, x_dot, theta, theta_dot, force, costheta, sintheta):
        """One Euler step of tau / substeps: arithmetic only, so any array library's arrays step through it."""
        tau = cls.tau / cls.substeps
        temp = (force + cls.polemass_length * theta_dot**2 * sintheta) / cls.total_mass
        thetaacc = (cls.gravity * sintheta - costheta * temp) / (
            cls.length * (4.0 / 3.0 - cls.masspole * costheta**2 / cls.total_mass)
        )
        xacc = temp - cls.polemass_length * thetaacc * costheta / cls.total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        return x, x_dot, theta, theta_dot

    @classmethod
    def step(cls, state, action):
        x, x_dot, theta, theta_dot = state.unflatten(-1, (4, cls.copies)).unbind(-2)
        force = torch.where(action == 1, cls.force_mag, -cls.force_mag)[:, None]
        for _ in range(cls.substeps):
            x, x_dot, theta, theta_dot = cls.substep(x, x_dot, theta, theta_dot, force, theta.cos(), theta.sin())
        terminated = ((x.abs() > cls.x_threshold) | (theta.abs() > cls.theta_threshold)).any(-1)
        return torch.cat((x, x_dot, theta, theta_dot), -1), torch.ones_like(x[:, 0]), terminated


class Acrobot:
    """gymnasium's Acrobot-v1 ("book" dynamics, no torque noise): state (theta1, theta2, dtheta1, dtheta2), one
    RK4 step of 0.2 s per action (torque -1, 0, 1), angles wrapped to [-pi, pi], velocities bounded; reward -1
    per step until the tip swings above the bar; reset uniform in [-0.1, 0.1)."""

    n_obs, n_act, n_noise, max_episode_steps = 6, 3, 4, 500
    dt, m1, m2, l1, lc1, lc2, moi, g = 0.2, 1.0, 1.0, 1.0, 0.5, 0.5, 1.0, 9.8
    max_vel_1, max_vel_2 = 4 * math.pi, 9 * math.pi

    @staticmethod
    def initial(noise):
        return noise * 0.2 - 0.1

    @staticmethod
    def observe(state):
        theta1, theta2, dtheta1, dtheta2 = state.unbind(-1)
        return torch.stack((theta1.cos(), theta1.sin(), theta2.cos(), theta2.sin(), dtheta1, dtheta2), -1)

    @classmethod
    def derivatives(cls, state, torque):
        m1, m2, l1, lc1, lc2, moi, g = cls.m1, cls.m2, cls.l1, cls.lc1, cls.lc2, cls.moi, cls.g
        theta1, theta2, dtheta1, dtheta2 = state.unbind(-1)
        d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * torch.cos(theta2)) + 2 * moi
        d2 = m2 * (lc2**2 + l1 * lc2 * torch.cos(theta2)) + moi
        phi2 = m2 * lc2 * g * torch.cos(theta1 + theta2 - math.pi / 2.0)
        phi1 = (
            -m2 * l1 * lc2 * dtheta2**2 * torch.sin(theta2)
            - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * torch.sin(theta2)
            + (m1 * lc1 + m2 * l1) * g * torch.cos(theta1 - math.pi / 2)
            + phi2
        )
        ddtheta2 = (torque + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * torch.sin(theta2) - phi2) / (
            m2 * lc2**2 + moi - d2**2 / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return torch.stack((dtheta1, dtheta2, ddtheta1, ddtheta2), -1)

    @classmethod
    def step(cls, state, action):
        torque = (action - 1).to(state.dtype)
        k1 = cls.derivatives(state, torque)
        k2 = cls.derivatives(state + cls.dt / 2 * k1, torque)
        k3 = cls.derivatives(state + cls.dt / 2 * k2, torque)
        k4 = cls.derivatives(state + cls.dt * k3, torque)
        theta1, theta2, dtheta1, dtheta2 = (state + cls.dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)).unbind(-1)
        state = torch.stack(
            (
                cls.wrap(theta1),
                cls.wrap(theta2),
                dtheta1.clamp(-cls.max_vel_1, cls.max_vel_1),
                dtheta2.clamp(-cls.max_vel_2, cls.max_vel_2),
            ),
            -1,
        )
        terminated = -torch.cos(state[:, 0]) - torch.cos(state[:, 1] + state[:, 0]) > 1.0
        return state, torch.where(terminated, 0.0, -1.0), terminated

    @staticmethod
    def wrap(angle):
        """Into [-pi, pi] by whole turns, as gymnasium's wrap: an angle already inside stays as it is."""
        turns = torch.where(angle > math.pi, torch.ceil((angle - math.pi) / (2 * math.pi)), 0.0)
        turns = torch.where(angle < -math.pi, -torch.ceil((-math.pi - angle) / (2 * math.pi)), turns)
        return angle - turns * (2 * math.pi)


class MountainCar:
    """gymnasium's MountainCar-v0: state (position, velocity), push left, none or right; reward -1 per step until
    the car reaches position 0.5; reset position uniform in [-0.6, -0.4), velocity 0."""

    n_obs, n_act, n_noise, max_episode_steps = 2, 3, 1, 200
    min_position, max_position, max_speed, goal_position, force, gravity = -1.2, 0.6, 0.07, 0.5, 0.001, 0.0025

    @staticmethod
    def initial(noise):
        return torch.cat((noise * 0.2 - 0.6, torch.zeros_like(noise)), -1)

    @staticmethod
    def observe(state):
        return state

    @classmethod
    def step(cls, state, action):
        position, velocity = state.unbind(-1)
        velocity = velocity + (action - 1).to(state.dtype) * cls.force + torch.cos(3 * position) * (-cls.gravity)
        velocity = velocity.clamp(-cls.max_speed, cls.max_speed)
        position = (position + velocity).clamp(cls.min_position, cls.max_position)
        velocity = torch.where((position == cls.min_position) & (velocity < 0), 0.0, velocity)
        terminated = (position >= cls.goal_position) & (velocity >= 0)
        return torch.stack((position, velocity), -1), torch.full_like(position, -1.0), terminated


ENVS = {"CartPole-v1": CartPole, "Acrobot-v1": Acrobot, "MountainCar-v0": MountainCar}


class Envs:
    """num_envs copies of one of ENVS as device tensors, with gymnasium's time limit and same-step auto-reset: the
    step that ends an episode returns its reward and the first observation of the next episode. The returns and
    lengths of the episodes that end are summed on the device until ended_episodes() reads them."""

    def __init__(self, env_id, num_envs, device):
        self.physics = ENVS[env_id]
        self.num_envs, self.device = num_envs, device
        self.state = self.physics.initial(self.noise())
        self.elapsed = torch.zeros(num_envs, dtype=torch.int32, device=device)
        self.episode_return = torch.zeros(num_envs, device=device)
        # Per env: episodes ended, and the sums of their returns and lengths.
        self.ended = torch.zeros(3, num_envs, device=device)

    def noise(self):
        return torch.rand(self.num_envs, self.physics.n_noise, device=self.device)

    def observe(self):
        return self.physics.observe(self.state)

    def step(self, action):
        """(next observation, reward, done), done where an episode ended by termination or the time limit."""
        state, reward, terminated = self.physics.step(self.state, action)
        self.elapsed += 1
        self.episode_return += reward
        done = terminated | (self.elapsed >= self.physics.max_episode_steps)
        # Reset noise for every env, every step: the same random stream whichever envs end.
        self.state.copy_(torch.where(done[:, None], self.physics.initial(self.noise()), state))
        self.ended += torch.stack((done.float(), self.episode_return, self.elapsed.float())) * done
        self.elapsed.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return self.observe(), reward, done

    def ended_episodes(self):
        """(episodes ended, sum of their returns, sum of their lengths) since the last call, device scalars."""
        ended = self.ended.sum(1)
        self.ended.zero_()
        return ended


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """Separate 64-64 tanh actor and critic; a categorical policy over the actor's logits."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            # Gumbel-max: a sample of the same categorical distribution as probs.sample(), drawn from uniform
            # numbers by pointwise operations that a compiled step fuses (the twin draws the same stream)
            action = torch.argmax(logits - torch.log(-torch.log(torch.rand_like(logits))), dim=-1)
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device."""

    def __init__(self, num_steps, num_envs, n_obs, device):
        self.obs = torch.zeros((num_steps, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)


class Agent:
    """The networks PPO trains and their optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=args.learning_rate, eps=1e-5)

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"] = lr

    def learning_rate(self):
        return self.optimizer.param_groups[0]["lr"]


def run_state(agent, envs, next_obs, next_done):
    """The script's part of a checkpoint: the network, its optimizer, the envs, and the observation and done flags
    the next rollout starts from."""
    state = {"net": agent.net.state_dict(), "optimizer": agent.optimizer.state_dict()}
    state["envs"] = {name: getattr(envs, name) for name in ENVS_STATE}
    return {**state, "obs": next_obs, "done": next_done}


def restore_run(state, agent, envs):
    """run_state's parts back in place; returns the observation and done flags the run goes on from."""
    agent.net.load_state_dict(state["net"])
    agent.optimizer.load_state_dict(state["optimizer"])
    for name in ENVS_STATE:
        getattr(envs, name).copy_(state["envs"][name])
    return state["obs"].to(envs.device), state["done"].to(envs.device)


def make_update_fns(agent, args):
    """GAE over a rollout, and the PPO update on one minibatch."""

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            next_value = agent.net.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values
        return advantages, returns

    def update(obs, actions, logprobs, advantages, returns, values):
        """One gradient step on one minibatch; returns its STATS."""
        _, newlogprob, entropy, newvalue = agent.net.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()

        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

        if args.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # Policy loss
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        # Value loss
        newvalue = newvalue.view(-1)
        if args.clip_vloss:
            v_loss_unclipped = (newvalue - returns) ** 2
            v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
            v_loss_clipped = (v_clipped - returns) ** 2
            v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

        agent.optimizer.zero_grad()
        loss.backward()
        if dist.is_initialized():
            average_gradients(agent.net.parameters())
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    return gae, update


class Meter:
    """What every script measures, shows and logs, word for word the same in each (docs/contract.md): the fps
    window after warm-up, the profiler, the progress bar or line, TensorBoard and wandb scalars, the return curve
    and the speed record, and the checkpoints (docs/checkpoints.md). The loop calls unit() as each unit of work
    (an env step, or a PPO iteration) begins, tick() after each env step and checkpoint() after each unit;
    finish() writes the record, after Ctrl-C too. --eval-checkpoint uses evaluated() and evaluation() instead."""

    def __init__(self, args, script):
        self.t_start = time.perf_counter()
        self.args, self.script = args, script
        self.run_name = f"{args.env_id}__{script}__{args.seed}__{int(time.time())}"
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        if getattr(args, "cudagraphs", False) and self.device.type != "cuda":
            print("warning: --cudagraphs needs CUDA; running without CUDA graphs", file=sys.stderr)
            args.cudagraphs = False
        for category, message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message, category)
        # torch.compile skips the profiler scopes inside optimizer steps, and says so; the steps are still timed.
        logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
        if args.torch_threads < 0:
            fail(f"--torch-threads {args.torch_threads} must be 0 (torch's default) or positive")
        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        # Named scopes for the profiler (--profile-dir); free when not profiling.
        self.phase = record_function if args.profile_dir else lambda name: nullcontext()
        self.check_outputs()
        self.writer = self.wandb = None
        if args.track and not args.eval_checkpoint:
            import wandb

            config = vars(args)
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=config, name=self.run_name)
            self.wandb = wandb
        self.returns = deque(maxlen=20)
        self.curve = []  # [global_step, seconds since start, mean return], for return-vs-time plots
        self.eval_returns = []
        self.steps = self.first_step = 0
        self.interrupted = self.stop = False
        self.paused = 0.0  # seconds spent writing checkpoints, left out of the fps window
        self.t_loop = self.t_window = self.profiler = self.bar = None

    def check_outputs(self):
        """Every output path is writable before training starts: missing folders are made, and one that cannot
        be written is one error line."""
        args = self.args
        if args.save_every < 0 or args.save_every and not args.save_dir:
            fail(f"--save-every {args.save_every} must be 0 (a checkpoint at the end only) or positive with --save-dir")
        if args.eval_episodes <= 0:
            fail(f"--eval-episodes {args.eval_episodes} must be positive")
        outputs = [("--speed-log", args.speed_log, False), ("--profile-dir", args.profile_dir, True)]
        if args.eval_checkpoint is None:
            outputs.append(("--save-dir", args.save_dir, True))
            if args.tensorboard:
                outputs.append(("the TensorBoard folder (or --no-tensorboard)", "runs", True))
        if args.capture_video:
            outputs.append(("the video folder", "videos", True))
        for option, path, folder in outputs:
            if path is None:
                continue
            try:
                os.makedirs(path if folder else os.path.dirname(path) or ".", exist_ok=True)
                if folder:
                    tempfile.TemporaryFile(dir=path).close()
                else:
                    open(path, "a").close()  # appends nothing: what the file holds stays as it is
            except OSError as e:
                fail(f"{option} {path} cannot be written: {e.strerror or e}")
        if args.save_dir and args.eval_checkpoint is None:
            # A checkpoint already there is another run's, unless this run continues it: never overwritten.
            existing = checkpoint_file(args.save_dir, self.script)
            if os.path.exists(existing) and not (
                args.resume and os.path.samefile(checkpoint_file(args.resume, self.script), existing)
            ):
                fail(
                    f"--save-dir {args.save_dir} already holds a checkpoint of {self.script}: continue that run with "
                    f"--resume {args.save_dir}, or pass another --save-dir"
                )
        if args.track and args.eval_checkpoint is None and not wandb_credentials():
            fail("--track needs wandb credentials: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline")

    def start(self, checkpoint, total_steps, learning_starts, warmup_steps, profile_steps, steps_per_call):
        """The loop's plan in env steps: its length; the fps window opens warmup_steps after learning_starts, or
        after the step a resumed run starts from, whichever is later (a resumed run compiles and captures again);
        the steps --profile-dir profiles from there, and the env steps one env_step phase takes. With a checkpoint
        (--resume), the returns, the curve and the random generators come back as saved. Returns the first step."""
        if checkpoint is not None:
            self.first_step = self.steps = checkpoint["global_step"]
            self.returns.extend(checkpoint["meter"]["returns"])
            self.curve = checkpoint["meter"]["curve"]
            restore_rng_states(checkpoint["rng"])
        self.total_steps, self.window_start = total_steps, max(learning_starts, self.first_step) + warmup_steps
        self.profile_steps, self.steps_per_call = profile_steps, steps_per_call
        if self.args.save_every:
            self.next_save = (self.first_step // self.args.save_every + 1) * self.args.save_every
        if self.args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Made here, once the env and the networks are built: input they refuse leaves no run folder behind.
            self.writer = SummaryWriter(os.path.join("runs", self.run_name))
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(self.args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        self.curve_every = max(1, total_steps // 50)
        self.next_curve = (self.first_step // self.curve_every + 1) * self.curve_every
        # A bar on a terminal; elsewhere (logs, CI) tqdm shows none and tick() prints a line now and then.
        self.bar = tqdm.tqdm(total=total_steps, initial=self.first_step, unit="step", unit_scale=True,
                             dynamic_ncols=True, disable=None)  # fmt: skip
        if self.args.save_dir:
            signal.signal(signal.SIGINT, self.stop_requested)
        self.t_loop = self.t_shown = self.t_line = time.perf_counter()
        return self.first_step

    def stop_requested(self, signum, frame):
        """Ctrl-C with --save-dir: the run stops after a checkpoint at the end of this unit; a second one at once."""
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True
        print("Ctrl-C: a checkpoint at the end of this step, then the run stops (Ctrl-C again: stop at once)",
              file=sys.stderr, flush=True)  # fmt: skip

    def unit(self, global_step):
        """A unit of the loop begins after global_step env steps: the fps window opens at the first one past
        warm-up, and the profiler covers its first profile_steps."""
        if self.t_window is None and global_step >= self.window_start:
            self.t_window, self.steps_window, self.paused_window = time.perf_counter(), global_step, self.paused
            if self.args.profile_dir:
                cuda = self.device.type == "cuda"
                self.profiler = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
                self.profiler.start()
                # The breakdown tool counts env steps as the record does.
                self.profiler.add_metadata_json("env_steps_per_call", str(self.steps_per_call))
        elif self.profiler is not None and global_step >= self.steps_window + self.profile_steps:
            self.save_profile()

    def save_profile(self):
        self.profiler.stop()
        self.profiler.export_chrome_trace(os.path.join(self.args.profile_dir, f"{self.script}.trace.json"))
        self.profiler = None

    def tick(self, global_step):
        """An env step is done, global_step in all. Every PROGRESS_SECONDS the bar (or, every CONSOLE_SECONDS,
        a line) shows fps and mean return, the fps is logged, and tick returns True: the caller logs its losses."""
        self.steps = global_step
        if global_step >= self.next_curve:
            if self.returns:
                seconds, mean_return = time.perf_counter() - self.t_start, float(np.mean(self.returns))
                self.curve.append([global_step, round(seconds, 3), round(mean_return, 2)])
            self.next_curve = (global_step // self.curve_every + 1) * self.curve_every
        now = time.perf_counter()
        if now - self.t_shown < PROGRESS_SECONDS:
            return False
        self.t_shown = now
        steady = self.t_window is not None and global_step > self.steps_window
        if steady:
            fps = (global_step - self.steps_window) / (now - self.t_window - self.paused + self.paused_window)
        else:
            fps = (global_step - self.first_step) / (now - self.t_loop - self.paused)
        mean_return = float(np.mean(self.returns)) if self.returns else float("nan")
        status = f"fps {fps:.0f}{'' if steady else ' (warm-up)'}, return {mean_return:.1f}"
        if not self.bar.disable:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(global_step - self.bar.n)
        elif now - self.t_line >= CONSOLE_SECONDS:
            self.t_line = now
            eta = (self.total_steps - global_step) / max(fps, 1e-9) / 60
            line = f"{self.script}: {global_step}/{self.total_steps} steps, {status}, eta {eta:.1f} min"
            print(line, file=sys.stderr, flush=True)
        self.log(global_step, {"charts/SPS": fps})
        return True

    def episode(self, global_step, episodic_return, length):
        """A finished episode: its return counts in the mean shown and recorded, and both are logged."""
        self.returns.append(float(episodic_return))
        scalars = {"charts/episodic_return": float(episodic_return), "charts/episodic_length": int(length)}
        self.log(global_step, scalars)

    def log(self, global_step, scalars):
        """Scalars to TensorBoard and, with --track, to wandb; tensor values are read back together, in one sync."""
        tensors = [key for key, value in scalars.items() if isinstance(value, torch.Tensor)]
        if tensors:
            values = torch.stack([scalars[key].float().reshape(()) for key in tensors]).tolist()
            scalars = {**scalars, **dict(zip(tensors, values))}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, global_step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=global_step)

    def checkpoint(self, global_step, state, final=False):
        """A unit of work is done, global_step env steps in all: with --save-dir, a checkpoint when --save-every
        is due, at the end of the run (final) and after Ctrl-C, which then ends the run. state() gives the
        script's part of it: everything else its run needs to go on."""
        args = self.args
        if args.save_dir and (final or self.stop or args.save_every and global_step >= self.next_save):
            self.save(global_step, state())
        if self.stop:
            raise KeyboardInterrupt

    def save(self, global_step, state):
        """Write the checkpoint atomically: a temporary file in --save-dir, flushed to the disk, then renamed over
        the last one, so that a crash at any point leaves one whole checkpoint. Its seconds are left out of fps."""
        t_save = time.perf_counter()
        args = self.args
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "script": self.script,
            "args": asdict(args),
            "global_step": global_step,
            "meter": {"returns": list(self.returns), "curve": self.curve},
            "rng": rng_states(),
            "state": state,
        }
        path = checkpoint_file(args.save_dir, self.script)
        temporary = os.path.join(args.save_dir, f".{self.script}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as f:
                try:
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                except BaseException:
                    os.unlink(temporary)
                    raise
            os.replace(temporary, path)
            folder = os.open(args.save_dir, os.O_RDONLY)  # the rename itself on the disk
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        except OSError as e:
            fail(f"--save-dir {args.save_dir}: the checkpoint of step {global_step} was not written: {e.strerror or e}")
        if args.save_every:
            self.next_save = (global_step // args.save_every + 1) * args.save_every
        self.paused += time.perf_counter() - t_save

    def evaluated(self, episodic_return):
        """--eval-checkpoint: an episode ended; its return is printed. True once --eval-episodes have ended."""
        self.eval_returns.append(float(episodic_return))
        print(f"episode {len(self.eval_returns)}: return {self.eval_returns[-1]:.2f}", flush=True)
        return len(self.eval_returns) >= self.args.eval_episodes

    def evaluation(self):
        """--eval-checkpoint's result: the returns of its episodes, printed as the last stdout line, returned."""
        returns = self.eval_returns[: self.args.eval_episodes]
        record = {
            "script": self.script,
            "env_id": self.args.env_id,
            "checkpoint": checkpoint_file(self.args.eval_checkpoint, self.script),
            "episodes": len(returns),
            "mean": round(float(np.mean(returns)), 2),
            "std": round(float(np.std(returns)), 2),
            "returns": [round(r, 2) for r in returns],
        }
        print(json.dumps(record), flush=True)
        return record

    def finish(self):
        """The speed record: printed as the last stdout line, appended to --speed-log, and returned. After Ctrl-C
        it covers the steps done; a run that never reached its fps window is measured over its whole loop."""
        if self.interrupted:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the record short
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t_end = time.perf_counter()
        if self.profiler is not None:
            self.save_profile()
        if self.bar is not None:
            self.bar.update(self.steps - self.bar.n)
            self.bar.close()
        if self.interrupted:
            print(f"interrupted after {self.steps} env steps", file=sys.stderr, flush=True)
        if self.returns and (not self.curve or self.curve[-1][0] < self.steps):
            seconds, mean_return = t_end - self.t_start, float(np.mean(self.returns))
            # The curve ends where the run did.
            self.curve.append([self.steps, round(seconds, 3), round(mean_return, 2)])
        steady = self.t_window is not None and self.steps > self.steps_window
        if steady:
            t_from, steps_from, paused = self.t_window, self.steps_window, self.paused - self.paused_window
        else:
            t_from, steps_from, paused = self.t_loop or t_end, self.first_step, self.paused
        record = {
            "script": self.script,
            "env_id": self.args.env_id,
            "seed": self.args.seed,
            "compile": getattr(self.args, "compile", False),
            "cudagraphs": getattr(self.args, "cudagraphs", False),
            "device": self.device.type,
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "total_timesteps": self.steps,
            "fps": round((self.steps - steps_from) / (t_end - t_from - paused), 1) if t_end > t_from else 0.0,
            "steady": steady,
            "interrupted": self.interrupted,
            "fps_overall": round((self.steps - self.first_step) / (t_end - self.t_start), 1),
            "resumed_from": self.first_step if self.args.resume else None,
            "checkpoint_seconds": round(self.paused, 3),
            "warmup_seconds": round(t_from - self.t_start, 3),
            "wall_seconds": round(t_end - self.t_start, 3),
            "episodic_return": round(float(np.mean(self.returns)), 2) if self.returns else None,
            "return_curve": self.curve,
        }
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        line = json.dumps(record)
        if self.args.speed_log:
            # One write of a whole line in append mode, so concurrent runs never interleave.
            with open(self.args.speed_log, "a") as f:
                f.write(line + "\n")
        print(line, flush=True)
        return record


def evaluate(args, meter, checkpoint):
    """--eval-checkpoint: the saved actor's greedy action (the argmax of its logits), --eval-episodes one after
    another on gymnasium's own env of the same id, whose dynamics the script's envs reproduce."""
    env = gym.make(args.env_id, render_mode="rgb_array" if args.capture_video else None)
    if args.capture_video:
        folder, trigger = os.path.join("videos", meter.run_name), lambda episode: episode < args.eval_episodes
        env = gym.wrappers.RecordVideo(env, folder, episode_trigger=trigger, disable_logger=True)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    physics = ENVS[args.env_id]
    net = ActorCritic(physics.n_obs, physics.n_act, device=meter.device)
    net.load_state_dict(checkpoint["state"]["net"])
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            logits = net.actor(torch.as_tensor(obs, device=meter.device, dtype=torch.float32))
        obs, _, terminated, truncated, info = env.step(int(logits.argmax()))
        if terminated or truncated:
            if meter.evaluated(info["episode"]["r"]):
                break
            obs, _ = env.reset()
    env.close()


def train(args, meter, checkpoint):
    rank, world_size = world()
    # Sizes are per rank; global_step counts the env steps of all ranks, as --total-timesteps does.
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // (batch_size * world_size)
    # Each rank seeds its envs and its sampling apart; the parameters come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    device, phase = meter.device, meter.phase

    envs = Envs(args.env_id, args.num_envs, device)
    n_obs = envs.physics.n_obs
    agent = Agent(args, n_obs, envs.physics.n_act, device)
    gae, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, device)

    next_obs = envs.observe()
    next_done = torch.zeros(args.num_envs, device=device)
    if checkpoint is not None:
        next_obs, next_done = restore_run(checkpoint["state"], agent, envs)
    if world_size > 1:
        broadcast_parameters(agent.net)
    steps_per_iteration = batch_size * world_size
    steps = num_iterations * steps_per_iteration
    warmup_steps, profile_steps = WARMUP_ITERATIONS * steps_per_iteration, PROFILE_ITERATIONS * steps_per_iteration
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = meter.start(checkpoint, steps, 0, warmup_steps, profile_steps, args.num_envs * world_size)
    if world_size > 1:
        stop_together(meter, rank)
        if checkpoint is not None:
            resumed_apart(args, rank, global_step)
    first_step, t_loop = global_step, time.perf_counter()
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        meter.unit(global_step)
        with phase("update"):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                agent.set_learning_rate(frac * args.learning_rate)

        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            with phase("data"):
                rollout.obs[step] = next_obs
                rollout.dones[step] = next_done

            with phase("policy"):
                with torch.no_grad():
                    action, logprob, _, value = agent.net.get_action_and_value(next_obs)

            with phase("data"):
                rollout.values[step] = value.flatten()
                rollout.actions[step] = action
                rollout.logprobs[step] = logprob

            with phase("env_step"):
                next_obs, reward, next_done = envs.step(action)

            with phase("data"):
                rollout.rewards[step] = reward
                next_done = next_done.float()

            with phase("other"):
                if rank == 0:  # rank 0 alone shows progress
                    meter.tick(global_step)

        with phase("update"):
            advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)

        # flatten the batch: obs, actions, logprobs, advantages, returns, values
        batch = (
            rollout.obs.reshape((-1, n_obs)),
            rollout.actions.reshape(-1),
            rollout.logprobs.reshape(-1),
            advantages.reshape(-1),
            rets.reshape(-1),
            rollout.values.reshape(-1),
        )

        # Optimizing the policy and value network
        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            with phase("data"):
                np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                with phase("data"):
                    minibatch = [b[b_inds[start : start + minibatch_size]] for b in batch]
                with phase("update"):
                    stats = update(*minibatch)
            # Every rank stops its epochs at the same one, by the ranks' mean KL: the all-reduces must pair up.
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        with phase("other"):
            # The episodes that ended in this rollout count as one, their mean: thousands end per rollout with
            # many envs. Read back in one sync.
            ended, return_sum, length_sum = envs.ended_episodes().tolist()
            if ended and rank == 0:  # rank 0 alone counts returns: of its own envs, as CleanRL does
                meter.episode(global_step, return_sum / ended, length_sum / ended)
            # On the device, so that it is read back with the statistics, in one sync.
            var_y = batch[-2].var(correction=0)
            explained_var = torch.where(var_y == 0, torch.nan, 1 - (batch[-2] - batch[-1]).var(correction=0) / var_y)
            scalars = {f"losses/{name}": stats[name] for name in STATS}
            scalars.update({"losses/explained_variance": explained_var, "charts/learning_rate": agent.learning_rate()})
            meter.log(global_step, scalars)
            if world_size > 1:
                meter.stop = bool(agree(meter.stop, dist.ReduceOp.MAX, device))
                if meter.stop and rank:
                    sys.stderr = open(os.devnull, "w")  # rank 0 tells where the run stopped; this rank counted none
            final = iteration == num_iterations
            meter.checkpoint(global_step, lambda: run_state(agent, envs, next_obs, next_done), final)
    if dist.is_initialized():
        rank_fps = (global_step - first_step) / world_size / (time.perf_counter() - t_loop)
        check_ranks_agree(agent.net, global_step, rank_fps)


def main(argv=None):
    """Train as the arguments say and return the speed record, which Ctrl-C ends the run with too; with
    --eval-checkpoint, evaluate the saved policy instead and return the evaluation's record."""
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv)
    script = os.path.basename(__file__)[: -len(".py")]
    checkpoint = None
    if args.resume or args.eval_checkpoint:
        checkpoint, args = open_checkpoint(args, argv, script)
    check_args(args, argv)
    meter = Meter(args, script)
    try:
        if args.eval_checkpoint:
            evaluate(args, meter, checkpoint)
            return meter.evaluation()
        train(args, meter, checkpoint)
    except KeyboardInterrupt:
        meter.interrupted = True
    return meter.finish()


if __name__ == "__main__":
    sys.exit(130 if main().get("interrupted") else 0)
