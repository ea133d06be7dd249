# PPO for Atari on envpool, as CleanRL defines it, made fast: uint8 frames moved once into on-device storage,
# GAE as one matrix product, torch.compile and CUDA graphs for the policy, GAE and update, env stepping
# overlapped with device work; data-parallel over the ranks that torchrun starts (one per GPU): gradients averaged
# over the ranks, in one all-reduce of one flat buffer, between the captured backward and the captured step.
# Docs: docs/multigpu.md, docs/ppo_atari.md
# Docs: docs/ppo_atari.md
import datetime
import hashlib
import json
import logging
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

import envpool
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import tqdm
import tyro
from tensordict.nn import CudaGraphModule
from torch.distributions.categorical import Categorical
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 10000000
    """total timesteps of the experiment (rounded down to whole iterations of num_envs * num_steps)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop an iteration's epochs early once the approximate KL divergence exceeds this threshold"""
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
    compile: bool = False
    """compile the policy, GAE and update functions with torch.compile"""
    cudagraphs: bool = False
    """capture the policy, GAE and update functions as CUDA graphs (tensordict's CudaGraphModule)"""


# Iterations that count as warm-up: the fps window starts after them.
WARMUP_ITERATIONS = 3
# Iterations profiled with --profile-dir, at the start of the steady window.
PROFILE_ITERATIONS = 1
# The statistics of a minibatch update, in the order they are logged.
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")
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
    if args.capture_video:
        fail("--capture-video: envpool renders no frames, so this script cannot record videos")


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


def average_gradients(grads):
    """The flat gradient buffer (Agent.grads) replaced, in place, by its mean over the ranks: one all-reduce."""
    dist.all_reduce(grads)
    grads /= dist.get_world_size()


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


def make_envs(env_id, num_envs, seed):
    """envpool's Atari preprocessing: 4 stacked 84x84 gray frames, a life loss ends an episode for the
    learner (episodic_life) and rewards are clipped to their sign (reward_clip)."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id {env_id!r}: not an envpool environment")
    if "episodic_life" not in envpool.make_spec(env_id).config._fields:
        fail(f"{env_id} is not an envpool Atari game")
    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=seed
    )


class EpisodeReturns:
    """Returns of whole games, as a person would score them.

    envpool reports the unclipped reward in info["reward"]. A game ends when it is over (info["terminated"],
    no lives left) or at its time limit (truncated, after which envpool restarts the game); a lost life
    ends an episode for the learner only. The step after any end is envpool's reset step, with reward 0.
    """

    def __init__(self, num_envs):
        self.running = np.zeros(num_envs)
        self.lengths = np.zeros(num_envs, dtype=np.int64)

    def add(self, info, truncations):
        """Count one env step; return (return, length) of each game that ended in it."""
        self.running += info["reward"]
        self.lengths += 1
        game_over = info["terminated"].astype(bool) | truncations
        ended = list(zip(self.running[game_over].tolist(), self.lengths[game_over].tolist()))
        self.running[game_over] = 0.0
        self.lengths[game_over] = 0
        return ended


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """The Nature CNN with a policy head and a value head; it takes uint8 frames and scales them itself."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        # No argument validation: its checks read values back to the host, which stalls the stream and
        # cannot be captured in a graph.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


class Rollout:
    """One iteration's transitions, num_steps x num_envs of each, preallocated on the device; frames stay uint8.

    The host side stages what the envs return in pinned memory: each step's frames go to the device at once,
    straight into their slot of the storage; rewards and done flags go in one copy per iteration.
    """

    def __init__(self, num_steps, num_envs, obs_shape, device):
        self.obs = torch.zeros((num_steps, num_envs) + obs_shape, dtype=torch.uint8, device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        # dones[t]: obs[t] ended its episode (it is the last observation before envpool's reset step)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)
        # The observation and done flag after the last step, which GAE bootstraps from.
        self.next_obs = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, device=device)
        self.next_done = torch.zeros(num_envs, device=device)
        pin = torch.device(device).type == "cuda"
        self.next_obs_host = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, pin_memory=pin)
        self.rewards_host = torch.zeros((num_steps, num_envs), pin_memory=pin)
        self.dones_host = torch.zeros((num_steps + 1, num_envs), pin_memory=pin)  # the last row is next_done

    def to_device(self):
        """Queue the copies of the staged rewards, done flags and last observation to the device."""
        self.rewards.copy_(self.rewards_host, non_blocking=True)
        self.dones.copy_(self.dones_host[:-1], non_blocking=True)
        self.next_done.copy_(self.dones_host[-1], non_blocking=True)
        self.next_obs.copy_(self.next_obs_host, non_blocking=True)


class Agent:
    """The actor-critic network PPO trains and its optimizer."""

    def __init__(self, args, n_act, device):
        self.network = ActorCritic(n_act, device=device)
        # The learning rate is a device tensor, annealed in place, so a captured update reads its current value
        # (and compiled code does not recompile for each new value). capturable: Adam keeps its step count on
        # the device too, so a replayed graph advances it; without it, a tensor lr disables the foreach kernels.
        lr = torch.tensor(args.learning_rate, device=device)
        capturable = torch.device(device).type == "cuda"
        self.optimizer = optim.Adam(self.network.parameters(), lr=lr, eps=1e-5, capturable=capturable)
        # The gradients are views into one flat buffer, which the update zeroes and fills in place: the
        # all-reduce reads and writes them with no copy, and captured graphs find them at fixed addresses.
        parameters = list(self.network.parameters())
        self.grads = torch.zeros(sum(p.numel() for p in parameters), device=device)
        for p, grad in zip(parameters, self.grads.split([p.numel() for p in parameters])):
            p.grad = grad.view_as(p)


def run_state(agent):
    """The script's part of a checkpoint: the network and the optimizer. The iteration follows from the global
    step, the annealed learning rate from the iteration; envpool's envs cannot be saved."""
    return {"network": agent.network.state_dict(), "optimizer": agent.optimizer.state_dict()}


def restore_run(state, agent):
    """run_state's parts back in place, before any call of the update functions."""
    agent.network.load_state_dict(state["network"])
    # load_state_dict puts the saved learning rate, a CPU tensor, in the group: the device tensor that annealing
    # fills in place (and captured updates read) stays, with the saved value.
    lr = agent.optimizer.param_groups[0]["lr"]
    agent.optimizer.load_state_dict(state["optimizer"])
    agent.optimizer.param_groups[0]["lr"] = lr.copy_(agent.optimizer.param_groups[0]["lr"])
    print("envpool's env state is not in the checkpoint: the episodes restart", file=sys.stderr)


def make_update_fns(agent, args):
    """The two steps of a PPO iteration's learning: advantages (GAE) and the update on one minibatch; and the
    policy that acts. The update writes its STATS into `stats`, fixed tensors. With --compile and --cudagraphs,
    each is compiled and captured."""
    stats = {name: torch.zeros((), device=agent.optimizer.param_groups[0]["lr"].device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        with torch.no_grad():
            # bootstrap value if not done
            next_value = agent.network.get_value(next_obs).reshape(1, -1)
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            # The recursion advantages[t] = delta[t] + c[t] * advantages[t + 1], solved in closed form:
            # advantages[t] = sum over k >= t of c[t] * ... * c[k - 1] * delta[k]. One cumprod over a
            # num_steps x num_steps matrix gives the products, so the compiled graph is a few kernels instead
            # of num_steps unrolled steps. Memory: num_steps^2 * num_envs floats.
            c = args.gamma * args.gae_lambda * nextnonterminal
            upper = torch.ones(args.num_steps, args.num_steps, dtype=torch.bool, device=c.device).triu()[..., None]
            products = torch.cumprod(torch.where(upper, c, 1.0), dim=1)  # [t, k]: c[t] * ... * c[k] for k >= t
            discounts = torch.cat([torch.ones_like(products[:, :1]), products[:, :-1]], dim=1) * upper
            advantages = (discounts * delta).sum(1)
            returns = advantages + values
        return advantages, returns

    def update(obs, actions, logprobs, advantages, returns, values):
        _, newlogprob, entropy, newvalue = agent.network.get_action_and_value(obs, actions)
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
            v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
            v_loss = 0.5 * v_loss_max.mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

        agent.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    def backward_in_place(*minibatch):
        # No outputs: a captured function would copy each one out of its graph.
        for name, value in update(*minibatch).items():
            stats[name].copy_(value)

    def step():
        nn.utils.clip_grad_norm_(agent.network.parameters(), args.max_grad_norm)
        agent.optimizer.step()

    def policy(obs):
        with torch.no_grad():
            action, logprob, _, value = agent.network.get_action_and_value(obs)
        return action, logprob, value.flatten()

    if args.compile:
        gae, backward_in_place, step, policy = map(torch.compile, (gae, backward_in_place, step, policy))
    if args.cudagraphs:
        gae, backward_in_place, step, policy = (
            CudaGraphModule(f, warmup=3 if args.compile else 2) for f in (gae, backward_in_place, step, policy)
        )

    def update_in_place(*minibatch):
        # The all-reduce runs between the two graphs, not inside one: a collective captured in a CUDA graph is
        # not tested yet (docs/multigpu.md).
        backward_in_place(*minibatch)
        if dist.is_initialized():
            average_gradients(agent.grads)
        step()

    return gae, update_in_place, policy, stats


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
    """--eval-checkpoint: the saved policy's greedy action (the most likely one) on fresh envs, whole games counted
    as training counts them, until --eval-episodes have ended."""
    num_envs = min(args.num_envs, args.eval_episodes)
    envs = make_envs(args.env_id, num_envs, args.seed)
    network = ActorCritic(envs.single_action_space.n, device=meter.device)
    network.load_state_dict(checkpoint["state"]["network"])
    episodes = EpisodeReturns(num_envs)
    obs, _ = envs.reset()
    done = False
    while not done:
        with torch.no_grad():
            logits = network.actor(network.network(torch.as_tensor(obs, device=meter.device) / 255.0))
        obs, _, _, truncations, info = envs.step(logits.argmax(1).cpu().numpy())
        for episodic_return, _ in episodes.add(info, truncations):
            done = done or meter.evaluated(episodic_return)
    envs.close()


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
    # Every convolution has a fixed shape: let cuDNN pick the fastest algorithm for each once.
    torch.backends.cudnn.benchmark = device.type == "cuda"

    envs = make_envs(args.env_id, args.num_envs, args.seed + rank)
    agent = Agent(args, envs.single_action_space.n, device)
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.single_observation_space.shape, device)
    episodes = EpisodeReturns(args.num_envs)

    # The host writes the pinned staging buffers through numpy views of them.
    next_obs_host = rollout.next_obs_host.numpy()
    rewards_host = rollout.rewards_host.numpy()
    dones_host = rollout.dones_host.numpy()
    next_obs_host[:] = envs.reset()[0]
    next_done = np.zeros(args.num_envs, dtype=bool)
    if checkpoint is not None:
        restore_run(checkpoint["state"], agent)
    if world_size > 1:
        broadcast_parameters(agent.network)
    steps_per_iteration = batch_size * world_size
    steps = num_iterations * steps_per_iteration
    warmup_steps, profile_steps = WARMUP_ITERATIONS * steps_per_iteration, PROFILE_ITERATIONS * steps_per_iteration
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = meter.start(checkpoint, steps, 0, warmup_steps, profile_steps, args.num_envs * world_size)
    if world_size > 1:
        stop_together(meter, rank)
    first_step, t_loop = global_step, time.perf_counter()
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        meter.unit(global_step)
        # Annealing the rate if instructed to do so.
        if args.anneal_lr:
            agent.optimizer.param_groups[0]["lr"].fill_((1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate)

        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            with phase("data"):
                # The frames go to the device once, as uint8, into their slot of the storage.
                rollout.obs[step].copy_(rollout.next_obs_host, non_blocking=True)

            with phase("policy"):
                action, logprob, value = policy(rollout.obs[step])
                # This wait for the device also means that every copy out of the pinned buffers has run, so
                # the host may write them again below.
                action_np = action.cpu().numpy()

            with phase("env_step"):
                # envpool's step, split in two: the writes between send and recv are done while the envs step.
                envs.send(action_np)
                with phase("data"):
                    rollout.values[step] = value
                    rollout.actions[step] = action
                    rollout.logprobs[step] = logprob
                    dones_host[step] = next_done
                next_obs, reward, terminations, truncations, info = envs.recv()

            with phase("data"):
                next_obs_host[:] = next_obs
                rewards_host[step] = reward
                next_done = terminations | truncations

            with phase("other"):
                ended = episodes.add(info, truncations)
                # Rank 0 alone shows progress and counts returns: of its own envs, as CleanRL does.
                if rank == 0:
                    for episodic_return, length in ended:
                        meter.episode(global_step, episodic_return, length)
                    meter.tick(global_step)

        with phase("data"):
            dones_host[-1] = next_done
            rollout.to_device()
        with phase("update"):
            advantages, returns = gae(
                rollout.next_obs, rollout.next_done, rollout.rewards, rollout.values, rollout.dones
            )

        # flatten the batch
        b_obs = rollout.obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = rollout.logprobs.reshape(-1)
        b_actions = rollout.actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = rollout.values.reshape(-1)

        # Optimizing the policy and value network
        for epoch in range(args.update_epochs):
            with phase("data"):
                # Shuffled on the device: no indices cross from the host.
                b_inds = torch.randperm(batch_size, device=device).split(minibatch_size)
            for mb_inds in b_inds:
                with phase("data"):
                    minibatch = (b_obs[mb_inds], b_actions[mb_inds], b_logprobs[mb_inds])
                    minibatch += (b_advantages[mb_inds], b_returns[mb_inds], b_values[mb_inds])
                with phase("update"):
                    update(*minibatch)

            # Every rank stops its epochs at the same one, by the ranks' mean KL: the all-reduces must pair up.
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        with phase("other"):
            # On the device, so that it is read back with the statistics, in one sync.
            var_y = b_returns.var(correction=0)
            explained_var = torch.where(var_y == 0, torch.nan, 1 - (b_returns - b_values).var(correction=0) / var_y)
            scalars = {f"losses/{name}": stats[name] for name in STATS}
            learning_rate = agent.optimizer.param_groups[0]["lr"]
            scalars.update({"losses/explained_variance": explained_var, "charts/learning_rate": learning_rate})
            meter.log(global_step, scalars)
            if world_size > 1:
                meter.stop = bool(agree(meter.stop, dist.ReduceOp.MAX, device))
                if meter.stop and rank:
                    sys.stderr = open(os.devnull, "w")  # rank 0 tells where the run stopped; this rank counted none
            meter.checkpoint(global_step, lambda: run_state(agent), final=iteration == num_iterations)
    envs.close()
    if dist.is_initialized():
        rank_fps = (global_step - first_step) / world_size / (time.perf_counter() - t_loop)
        check_ranks_agree(agent.network, global_step, rank_fps)


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
