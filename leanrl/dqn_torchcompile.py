# DQN for discrete actions, as CleanRL defines it, made fast: on-device buffer, one captured graph per env step.
# Docs: docs/dqn.md
import functools
import os
import random
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tensordict.nn import CudaGraphModule


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the id of the gymnasium environment"""
    total_timesteps: int = 500000
    """total timesteps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments (one, as in CleanRL's dqn.py)"""
    buffer_size: int = 10000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 500
    """the timesteps it takes to update the target network"""
    batch_size: int = 128
    """the batch size of sample from the reply memory"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 10000
    """timestep to start learning"""
    train_frequency: int = 10
    """the frequency of training"""
    capture_video: bool = False
    """record videos under videos/<run name>/ (env 0 in training; every episode of --eval-checkpoint)"""
    compile: bool = False
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture each kind of training step, acting included, as a CUDA graph (tensordict's CudaGraphModule)"""
    # ---- run options: the same in every script (stamped from leanrl/harness.py) ----
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, in the run's name"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """use CUDA when it is available"""
    torch_threads: int = 1
    """torch's intra-op CPU threads (0: torch's default, one per core)"""
    track: bool = False
    """track the experiment with Weights and Biases"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    tensorboard: bool = True
    """write TensorBoard scalars under runs/<run name>/"""
    speed_log: str | None = None
    """append the speed record (the last stdout line, one JSON object) to this file"""
    profile_dir: str | None = None
    """profile the start of the steady window and write the trace into this directory"""
    save_dir: str | None = None
    """write checkpoints into this directory: every --save-every env steps, at the end, and on Ctrl-C"""
    save_every: int = 0
    """env steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: str | None = None
    """continue the run saved in this checkpoint (a file, or a --save-dir); checkpoints go on there"""
    eval_checkpoint: str | None = None
    """evaluate the policy of this checkpoint (file or --save-dir) for --eval-episodes and exit"""
    eval_episodes: int = 10
    """episodes that --eval-checkpoint runs"""
    # ---- end of run options ----


# Steps after learning_starts that count as warm-up: the fps window starts after them. At the default
# frequencies they hold the twin's third call (the one --cudagraphs captures) of each kind of training step,
# the target update's (every 500 steps) included.
WARMUP_STEPS = 2000
# Steps profiled with --profile-dir, at the start of the steady window.
PROFILE_STEPS = 500
# The statistics of an update, in the order they are logged.
STATS = ("td_loss", "q_values")


def check_args(args):
    if args.num_envs != 1:
        fail(f"--num-envs {args.num_envs}: DQN runs one env, as CleanRL's dqn.py does")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size}")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    if not 0 < args.exploration_fraction <= 1:
        fail(f"--exploration-fraction {args.exploration_fraction} must be in (0, 1]")
    if max(args.start_e, args.end_e) > 1:
        fail(f"--start-e {args.start_e} and --end-e {args.end_e} must be in [0, 1]")


def make_env(env_id, seed, video_folder=None, episode_trigger=None):
    """video_folder: record videos there, of the episodes episode_trigger says (None: CleanRL's schedule)."""

    def thunk():
        try:
            env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        except gym.error.Error as e:
            fail(f"cannot make env {env_id!r}: {e}")
        if not isinstance(env.action_space, gym.spaces.Discrete):
            fail(f"{env_id} has a {type(env.action_space).__name__} action space; DQN needs a discrete one")
        if len(env.observation_space.shape) != 1:
            fail(f"{env_id} has observations of shape {env.observation_space.shape}; DQN's MLP needs flat ones")
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=episode_trigger, disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


def make_envs(env_id, seed, *video):
    """One env in a vector env that resets in the same step, so the true final observation comes in infos."""
    return gym.vector.SyncVectorEnv(
        [make_env(env_id, seed, *video)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


class QNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(n_obs, 120, device=device),
            nn.ReLU(),
            nn.Linear(120, 84, device=device),
            nn.ReLU(),
            nn.Linear(84, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at step t: from start_e down to end_e over `duration` steps, then end_e."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


class ReplayBuffer:
    """Transitions as rows of one preallocated tensor on the device, sampled uniformly with replacement there
    into one fixed batch tensor, which the update reads: a captured update then has no inputs to copy.

    A row is [obs, action, reward, next_obs, done]. Adding a transition is two parts: `stage` writes the row into
    host memory (pinned on CUDA), `push` copies it to the device and stores it (device work only, so a captured
    training step does both). The write position and the size are device tensors, for the same reason. Between a
    push and the next stage its copy must have read the row: a caller that has not waited for the device since
    the push sets `in_flight`, and stage waits.
    """

    def __init__(self, size, batch_size, n_obs, device):
        widths = [n_obs, 1, 1, n_obs, 1]
        self.storage = torch.zeros(size, sum(widths), device=device)
        self.staged = torch.zeros(1, sum(widths), pin_memory=device.type == "cuda")
        self.staged_parts = np.split(self.staged.numpy()[0], np.cumsum(widths)[:-1])  # views: writing fills it
        self.row = torch.zeros(1, sum(widths), device=device)
        self.batch = torch.zeros(batch_size, sum(widths), device=device)
        obs, actions, rewards, next_obs, dones = self.batch.split(widths, dim=1)
        # Views into self.batch: each sample overwrites what they show. Actions as floats, like the whole row.
        self.fields = (obs, actions.squeeze(1), rewards.squeeze(1), next_obs, dones.squeeze(1))
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)
        self.size = torch.zeros(1, dtype=torch.long, device=device)
        self.max_size, self.device = size, device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.in_flight = False

    def stage(self, obs, next_obs, action, reward, done):
        if self.in_flight:
            self.stream.synchronize()
            self.in_flight = False
        for part, value in zip(self.staged_parts, (obs, action, reward, next_obs, done)):
            part[:] = value

    def push(self):
        self.row.copy_(self.staged, non_blocking=True)
        self.storage.index_copy_(0, self.ptr, self.row)
        self.advance()

    def advance(self):
        """The write position and the size after a push (make_train_step compiles it with --compile: one kernel,
        not four)."""
        self.ptr.add_(1).remainder_(self.max_size)
        self.size.add_(1).clamp_(max=self.max_size)

    def sample(self):
        # Uniform over the stored rows with the size on the device: 62-bit draws reduced modulo the size
        # (a relative bias below 2**-40).
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device).remainder_(self.size)
        torch.index_select(self.storage, 0, idx, out=self.batch)


class Agent:
    """The Q network, its target and the optimizer DQN trains."""

    def __init__(self, args, n_obs, n_act, device):
        self.q_network = QNetwork(n_obs, n_act, device=device)
        # capturable: Adam keeps its step count on the device, so a replayed graph advances it
        capturable = args.cudagraphs and device.type == "cuda"
        self.optimizer = optim.Adam(self.q_network.parameters(), lr=args.learning_rate, capturable=capturable)
        self.target_network = QNetwork(n_obs, n_act, device=device)
        self.target_network.load_state_dict(self.q_network.state_dict())


def make_update_fns(agent, args, batch):
    """The two steps of DQN: the TD update of the Q network, and the target network's update; and the policy
    that acts. The update reads its batch from `batch` (obs, actions, rewards, next_obs, dones), fixed tensors
    that each sample overwrites. With --compile each is compiled; --cudagraphs captures them in make_train_step."""

    def update():
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            target_max, _ = agent.target_network(next_obs).max(dim=1)
            td_target = rewards.flatten() + args.gamma * target_max * (1 - dones.flatten())
        old_val = agent.q_network(obs).gather(1, actions.long().view(-1, 1)).squeeze(1)
        loss = F.mse_loss(td_target, old_val)

        agent.optimizer.zero_grad()
        loss.backward()
        agent.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    def update_target():
        # one fused lerp over every target parameter
        sources = [p.detach() for p in agent.q_network.parameters()]
        torch._foreach_lerp_([p.detach() for p in agent.target_network.parameters()], sources, args.tau)

    def policy(obs):
        # The greedy action only: whether to explore is the host's draw, as in the baseline (train's explore).
        with torch.no_grad():
            return agent.q_network(obs).argmax(dim=1)

    if args.compile:
        update, update_target, policy = map(torch.compile, (update, update_target, policy))

    return update, update_target, policy


def make_train_step(rb, stats, update, update_target, act, act_on_device, args):
    """train_step(q_update, target_update, obs), after each env step: store the staged transition, as asked update
    the Q network on a sampled batch (its statistics into `stats`) and the target network, then act greedily on obs
    for the next step and return the action; with obs None (the next step explores) return None, without waiting
    for the device. With --cudagraphs each kind of step, acting included, is one captured graph: one replay."""
    if args.compile:
        rb.advance = torch.compile(rb.advance)

    def step(q_update, target_update, greedy):
        rb.push()
        if q_update:
            rb.sample()
            for name, value in update().items():
                stats[name].copy_(value)
        if target_update:
            update_target()
        if greedy:
            act_on_device()

    steps = {}

    def train_step(q_update, target_update, obs):
        kind = (q_update, target_update, obs is not None)
        if kind not in steps:
            steps[kind] = functools.partial(step, *kind)
            if args.cudagraphs:
                steps[kind] = CudaGraphModule(steps[kind], warmup=3 if args.compile else 2)
        if obs is None:
            steps[kind]()
            rb.in_flight = rb.stream is not None
            return None
        return act(obs, steps[kind])

    return train_step


def make_act(policy, n_obs, device):
    """(act, act_on_device): the greedy action for one env's numpy observation. act_on_device (device work only)
    copies the observation from pinned host memory to the device, runs the policy and copies the action back; a
    training step that acts ends with it, in its captured graph. act(obs, device_work) writes the observation, runs
    device_work, waits for the device and reads the action; alone (a run's first step, once) it is not captured."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(1, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(1, n_obs, device=device)
    action_host = torch.zeros(1, dtype=torch.long, pin_memory=pinned)
    obs_view, action = obs_host.numpy()[0], action_host.numpy()  # views: numpy reads and writes them for less
    stream = torch.cuda.current_stream(device) if pinned else None

    def act_on_device():
        obs_device.copy_(obs_host, non_blocking=True)
        action_host.copy_(policy(obs_device), non_blocking=True)

    def act(obs, device_work=act_on_device):
        # The previous act's copies are done: it waited for them.
        obs_view[:] = obs
        device_work()
        if pinned:
            stream.synchronize()
        return int(action[0])

    return act, act_on_device


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = run.device, run.phase

    env = make_env(args.env_id, args.seed, run.video_folder)()  # no vector env: for one env it costs more than a step
    n_obs = int(np.prod(env.observation_space.shape))
    agent = Agent(args, n_obs, int(env.action_space.n), device)
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_obs, device)
    update, update_target, policy = make_update_fns(agent, args, rb.fields)
    stats = {name: torch.zeros((), device=device) for name in STATS}  # the latest update's, logged every second
    act, act_on_device = make_act(policy, n_obs, device)
    train_step = make_train_step(rb, stats, update, update_target, act, act_on_device, args)
    state = {"q_network": agent.q_network, "target_network": agent.target_network, "optimizer": agent.optimizer,
             "rb": {"storage": rb.storage, "ptr": rb.ptr, "size": rb.size}, "stats": stats}  # fmt: skip
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=1, warmup_from=args.learning_starts)
    # The first step that updates the Q network: its statistics are logged from there on.
    first_update = (args.learning_starts // args.train_frequency + 1) * args.train_frequency

    obs, _ = env.reset(seed=args.seed)
    action = None  # the coming step's action: each training step ends by acting for the step after it

    def explore(step):
        """The baseline's draws for env step `step`, in its order: with probability epsilon a random action, else
        None (the Q network acts greedily)."""
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step)
        return int(env.action_space.sample()) if random.random() < epsilon else None

    for global_step in range(first_step, args.total_timesteps):
        run.unit(global_step)
        with phase("policy"):
            if action is None:  # the run's first step, which no training step acted for
                action = explore(global_step)
                action = act(obs) if action is None else action

        with phase("env_step"):
            next_obs, reward, termination, truncation, info = env.step(action)

        with phase("data"):
            # The transition keeps the true final observation; then the env resets in the same step.
            rb.stage(obs, next_obs, action, reward, termination)
            if termination or truncation:
                run.episode(global_step, info["episode"]["r"], info["episode"]["l"])
                next_obs, _ = env.reset()
            obs = next_obs

        learning = global_step > args.learning_starts
        q_update = learning and global_step % args.train_frequency == 0
        target_update = learning and global_step % args.target_network_frequency == 0
        # A step that only stores the transition is mostly the round trip of acting: under "policy".
        with phase("update" if q_update or target_update else "policy"):
            # The next step's draws, then the training step, which acts for it when the draw says greedy.
            random_action = explore(global_step + 1)
            action = train_step(q_update, target_update, obs if random_action is None else None)
            action = action if random_action is None else random_action

        with phase("other"):
            if run.tick(global_step + 1) and global_step >= first_update:
                run.log(global_step, {f"losses/{name}": stats[name] for name in STATS})
    env.close()


def evaluate(args, run, saved):
    """The saved Q network's greedy action (no exploration), episode after episode."""
    envs = make_envs(args.env_id, args.seed, run.video_folder, lambda episode: episode < args.eval_episodes)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    q_network = QNetwork(n_obs, int(envs.single_action_space.n), device=run.device)
    q_network.load_state_dict(saved["q_network"])
    obs, _ = envs.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            actions = q_network(torch.as_tensor(obs, device=run.device, dtype=torch.float32)).argmax(dim=1)
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                yield infos["final_info"]["episode"]["r"][i]


# ======== harness: the same in every script, stamped from leanrl/harness.py (docs/contract.md) ========
import json, logging, math, random, signal, sys, tempfile, time, warnings  # noqa: E401, E402
from collections import deque  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from ctypes.util import find_library  # noqa: E402
from dataclasses import asdict  # noqa: E402

import gymnasium, numpy as np, tqdm, tyro  # noqa: E401, E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

CHECKPOINT_FORMAT = "leanrl-checkpoint-2"
# Numeric flags must be finite and >= 0; these, where a script has them, > 0 or in (0, 1].
POSITIVE = ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "buffer_size",
            "batch_size", "learning_rate", "policy_lr", "q_lr", "policy_frequency", "target_network_frequency",
            "train_frequency", "eval_episodes", "target_kl", "max_grad_norm")  # fmt: skip
FRACTIONS = ("gamma", "gae_lambda", "tau")
PROGRESS_SECONDS, CONSOLE_SECONDS = 1.0, 10.0  # the bar's refresh and fps log; a progress line off a terminal
# Notes that are not the user's concern; the last: the episode an evaluation leaves unfinished is not recorded.
QUIET_WARNINGS = (r".*The environment \S+-v4 is out of date", r"Using lock_\(\) inside a compiled graph",
                  r"TensorFloat32 tensor cores", r"The AccumulateGrad node's stream does not match",
                  r".*Unable to save last video")  # fmt: skip


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def checkpoint_file(path, script):
    return os.path.join(path, f"{script}.pt") if os.path.isdir(path) else path


def parse_args(script, argv):
    """(args, checkpoint): argv over the arguments of the checkpoint to resume or evaluate, range-checked."""
    args, checkpoint = tyro.cli(Args, args=argv), None
    if args.resume and args.eval_checkpoint:
        fail("--resume and --eval-checkpoint exclude each other")
    if args.resume or args.eval_checkpoint:
        path = checkpoint_file(args.resume or args.eval_checkpoint, script)
        try:  # tensors and plain values only: loading runs no code
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
            assert checkpoint["format"] == CHECKPOINT_FORMAT and checkpoint["script"] == script
            saved = Args(**checkpoint["args"])
        except Exception as e:  # missing, truncated, another script's or another version's
            fail(f"{'--resume' if args.resume else '--eval-checkpoint'} {path}: no checkpoint of this {script} "
                 f"({type(e).__name__})")  # fmt: skip
        save_dir, args = args.save_dir, tyro.cli(Args, args=argv, default=saved)
        # A resumed run saves where it was resumed from, unless --save-dir names another folder.
        args.save_dir = (save_dir or os.path.dirname(os.path.abspath(path))) if args.resume else None
    for name, value in asdict(args).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if name in FRACTIONS and not 0 < value <= 1:
                fail(f"--{name.replace('_', '-')} {value} must be in (0, 1]")
            if not (math.isfinite(value) and value >= 0 and (value > 0 or name not in POSITIVE)):
                fail(f"--{name.replace('_', '-')} {value} must be {'positive' if name in POSITIVE else '0 or more'}")
    if args.save_every and not args.save_dir:
        fail(f"--save-every {args.save_every} needs --save-dir")
    if args.track and not args.tensorboard:
        fail("--track mirrors the TensorBoard scalars to wandb: drop --no-tensorboard")
    check_args(args)
    return args, checkpoint


def check_outputs(args, script):
    """Before the run: every output writable, and no other run's checkpoint overwritten."""
    speed_log_folder = args.speed_log and os.path.dirname(os.path.abspath(args.speed_log))
    folders = {"--save-dir": args.save_dir, "--profile-dir": args.profile_dir, "--speed-log": speed_log_folder,
               "runs": args.tensorboard and "runs", "videos": getattr(args, "capture_video", False) and "videos"}
    for option, folder in folders.items():
        try:
            if folder:
                os.makedirs(folder, exist_ok=True)
                tempfile.TemporaryFile(dir=folder).close()
                open(args.speed_log, "a").close() if option == "--speed-log" else None
        except OSError as e:
            fail(f"{option} {folder} cannot be written: {e.strerror or e}")
    existing = args.save_dir and checkpoint_file(args.save_dir, script)
    resumed = args.resume and checkpoint_file(args.resume, script)
    if existing and os.path.exists(existing) and not (resumed and os.path.samefile(resumed, existing)):
        fail(f"--save-dir {args.save_dir} holds another run's checkpoint: --resume it, or pass another --save-dir")


def headless_video(args):
    """Without a display, MuJoCo renders videos through EGL, else OSMesa, or --capture-video is refused at start."""
    if getattr(args, "capture_video", False) and not (os.environ.get("DISPLAY") or os.environ.get("MUJOCO_GL")):
        gl = next((gl for gl, lib in (("egl", "EGL"), ("osmesa", "OSMesa")) if find_library(lib)), None)
        if gl:
            os.environ["MUJOCO_GL"] = os.environ["PYOPENGL_PLATFORM"] = gl
        elif "mujoco" in str(getattr(gymnasium.envs.registry.get(args.env_id), "entry_point", "")):
            fail("--capture-video of MuJoCo without a display needs EGL or OSMesa: apt-get install libegl1")


def state_dict(state):
    """A checkpoint's copy of {name: module, optimizer, object with state_dict(), tensor, or such a dict}."""
    if isinstance(state, dict):
        return {name: state_dict(part) for name, part in state.items()}
    return state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state.state_dict()


def load_state(state, saved, name="state"):
    """state_dict's inverse, in place: into the very tensors that compiled functions and captured graphs hold."""
    if isinstance(state, dict):
        return [load_state(part, saved[key], f"{name}.{key}") for key, part in state.items()]
    try:
        if isinstance(state, torch.Tensor) and saved.shape != state.shape:
            raise ValueError(f"shape {tuple(saved.shape)}, here {tuple(state.shape)}")
        if isinstance(state, torch.Tensor):
            return state.detach().copy_(saved)
        if not isinstance(state, torch.optim.Optimizer):
            return state.load_state_dict(saved)
        # capturable (--cudagraphs) is this run's; a tensor in a group (a learning rate on the device) stays the one
        # that graphs hold, with the saved value.
        now = state.param_groups
        tensors = [{key: value for key, value in g.items() if isinstance(value, torch.Tensor)} for g in now]
        groups = [{**g, "capturable": n.get("capturable", False)} for g, n in zip(saved["param_groups"], now)]
        state.load_state_dict({**saved, "param_groups": groups})
        for group, kept in zip(state.param_groups, tensors):
            group.update({key: tensor.copy_(torch.as_tensor(group[key])) for key, tensor in kept.items()})
    except (RuntimeError, ValueError, KeyError) as e:  # another network or env size than the checkpoint's
        fail(f"--resume: the checkpoint's {name} does not fit this run: {str(e).splitlines()[0]}")


def rng_states():
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states):
    states["numpy"]["state"]["key"] = states["numpy"]["state"]["key"].numpy().astype(np.uint32)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


class ScalarLog:
    """Scalars to TensorBoard (runs/<run name>/), which --track mirrors to wandb, as in CleanRL."""

    def __init__(self, args, run_name):
        self.writer = self.wandb = None
        if args.track:  # before the writer: wandb mirrors the writers made after it
            import wandb

            try:
                self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name,
                                        config=vars(args), sync_tensorboard=True, settings=wandb.Settings(silent=True))
            except Exception as e:  # no `wandb login`, WANDB_API_KEY or WANDB_MODE=offline; no network
                fail(f"--track: wandb did not start: {str(e).splitlines()[0]}")
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join("runs", run_name))
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)

    def log(self, step, scalars):  # tensors read back together, in one sync
        tensors = [key for key, value in scalars.items() if isinstance(value, torch.Tensor)]
        if self.writer and tensors:
            values = torch.stack([scalars[key].detach().float().reshape(()).cpu() for key in tensors]).tolist()
            scalars = {**scalars, **dict(zip(tensors, values))}
        for key, value in scalars.items() if self.writer else ():
            self.writer.add_scalar(key, value, step)

    def close(self):
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()


class SpeedWindow:
    """The steady fps window: from the first unit of work at or past `opens_at` env steps (after warm-up:
    compilation, graph capture) to the end of the loop, less the seconds spent saving."""

    def __init__(self, first_step, opens_at):
        self.first_step, self.opens_at, self.t_open, self.paused = first_step, opens_at, None, 0.0
        self.t_loop = time.perf_counter()

    def opens(self, step):
        if self.t_open is None and step >= self.opens_at:
            self.t_open, self.step_open, self.paused_open = time.perf_counter(), step, self.paused
            return True
        return False

    def steady(self, step):
        return self.t_open is not None and step > self.step_open

    def fps(self, step, now):
        if self.steady(step):
            return (step - self.step_open) / (now - self.t_open - self.paused + self.paused_open)
        return (step - self.first_step) / max(now - self.t_loop - self.paused, 1e-9)


class Run:
    """What the training loop tells the harness and gets from it (docs/contract.md): start() before the loop,
    unit() as each unit of work begins, episode() and tick() after env steps, log(); checkpoints are written, and
    Ctrl-C or SIGTERM ends the run, between units of work; finish() writes the speed record."""

    def __init__(self, args, script, checkpoint):
        self.t_start, self.args, self.script, self.checkpoint = time.perf_counter(), args, script, checkpoint
        self.run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        if getattr(args, "cudagraphs", False) and self.device.type != "cuda":
            print("warning: --cudagraphs needs CUDA; running without CUDA graphs", file=sys.stderr)
            args.cudagraphs = False
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message)
        logging.getLogger("tensordict").setLevel(logging.WARNING)  # its INFO lines on each graph capture
        # torch.compile's note that it skips the profiler scopes inside optimizer steps: they are still timed.
        logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        if args.torch_threads:  # 0: torch's own default
            torch.set_num_threads(args.torch_threads)
        if not args.eval_checkpoint:
            check_outputs(args, script)
        headless_video(args)
        self.video_folder = os.path.join("videos", self.run_name) if getattr(args, "capture_video", False) else None
        self.phase = record_function if args.profile_dir else lambda name: nullcontext()
        self.steps, self.signal, self.state, self.window, self.profiler, self.bar = 0, None, None, None, None, None
        self.stop_handler = self.on_signal
        self.catch_stops()

    def catch_stops(self):  # again as each unit begins: Triton's LLVM puts its own handlers in when it compiles
        for signum in (signal.SIGINT, signal.SIGTERM):  # set, not inherited: a background job's SIGINT is ignored
            signal.signal(signum, self.stop_handler)

    def on_signal(self, signum, frame):
        """In the loop: stop as the next unit begins, never inside a compilation or a graph capture. The same stop
        can come twice at once (`timeout` signals its command, then the command's process group), its second
        handling delayed by a blocking call: a second signal within 3 s is that one; a later one stops at once."""
        first, now = self.signal is None, time.monotonic()
        if not first and now - self.t_signal < 3.0:
            return
        self.signal, self.t_signal = signum, now
        if first and self.state is not None:
            return print("stopping at the end of this step (again: at once)", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def start(self, state, *, total_steps, warmup_steps, profile_steps, env_steps_per_call, warmup_from=0):
        """The loop's plan in env steps: total_steps; the fps window opens warmup_steps past warmup_from (SAC:
        learning_starts) or past a resumed run's first step, whichever is later; --profile-dir profiles its first
        profile_steps; one env_step phase takes env_steps_per_call. `state` is what checkpoints hold (state_dict):
        on --resume it is restored here, in place, with the random generators. Returns the first env step."""
        first_step, returns, self.curve = 0, [], []  # curve: [env step, seconds since start, mean return]
        if self.checkpoint is not None:
            load_state(state, self.checkpoint["state"])
            set_rng_states(self.checkpoint["rng"])
            first_step, returns, self.curve = (self.checkpoint[key] for key in ("global_step", "returns", "curve"))
            if first_step >= total_steps:
                fail(f"--resume {self.args.resume}: that run is finished ({first_step} env steps); "
                     "pass a larger --total-timesteps")  # fmt: skip
            print(f"resuming at env step {first_step}, episodes restarted; saving to {self.args.save_dir}",
                  file=sys.stderr)  # fmt: skip
        self.state, self.steps, self.total_steps, self.profile_steps = state, first_step, total_steps, profile_steps
        self.env_steps_per_call, self.returns = env_steps_per_call, deque(returns, maxlen=20)
        self.next_save = self.save_due(first_step)
        self.scalars = ScalarLog(self.args, self.run_name)  # now that the env and networks are made: no empty run
        self.window = SpeedWindow(first_step, max(warmup_from, first_step) + warmup_steps)
        self.t_shown = self.t_line = 0.0
        # A bar on a terminal; elsewhere (logs, CI) a line every CONSOLE_SECONDS.
        self.bar = tqdm.tqdm(total=total_steps, initial=first_step, unit="step", unit_scale=True, disable=None)
        return first_step

    def save_due(self, step):
        return self.args.save_every and (step // self.args.save_every + 1) * self.args.save_every

    def unit(self, step):
        """A unit of work begins after `step` env steps: checkpoint, stop, fps window, profiler."""
        self.steps = step
        self.catch_stops()
        if self.args.save_dir and (self.signal or self.next_save and step >= self.next_save):
            self.save(step)
        if self.signal:
            raise KeyboardInterrupt
        if self.window.opens(step) and self.args.profile_dir:
            cuda = self.device.type == "cuda"
            self.profiler = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            self.profiler.start()
            self.profiler.add_metadata_json("env_steps_per_call", str(self.env_steps_per_call))  # for breakdown.py
        elif self.profiler is not None and step >= self.window.step_open + self.profile_steps:
            self.save_profile()

    def save_profile(self):
        self.profiler.stop()
        self.profiler.export_chrome_trace(os.path.join(self.args.profile_dir, f"{self.script}.trace.json"))
        self.profiler = None

    def mean_return(self):
        return round(float(np.mean(self.returns)), 2) if self.returns else None

    def add_point(self, step, now):
        if self.returns and (not self.curve or self.curve[-1][0] < step):
            self.curve.append([step, round(now - self.t_start, 3), self.mean_return()])

    def tick(self, step):
        """After an env step, `step` in all: the return curve, and every PROGRESS_SECONDS the progress and True."""
        self.steps, now = step, time.perf_counter()
        if step * 50 // self.total_steps > (self.curve[-1][0] * 50 // self.total_steps if self.curve else 0):
            self.add_point(step, now)
        if now - self.t_shown < PROGRESS_SECONDS:
            return False
        self.t_shown, fps = now, self.window.fps(step, now)
        status = f"fps {fps:.0f}{'' if self.window.steady(step) else ' (warm-up)'}, return {self.mean_return()}"
        self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.bar.disable and now - self.t_line >= CONSOLE_SECONDS:
            self.t_line, eta = now, (self.total_steps - step) / max(fps, 1e-9) / 60
            print(f"{self.script}: {step}/{self.total_steps} steps, {status}, eta {eta:.1f} min", file=sys.stderr)
        self.log(step, {"charts/SPS": fps})
        return True

    def episode(self, step, episodic_return, length):
        self.returns.append(float(episodic_return))
        self.log(step, {"charts/episodic_return": float(episodic_return), "charts/episodic_length": int(length)})

    def log(self, step, scalars):
        self.scalars.log(step, scalars)

    def save(self, step):
        """Atomically: a temporary file, flushed to the disk, renamed over the last one. Left out of the fps."""
        t_save, args = time.perf_counter(), self.args
        checkpoint = {"format": CHECKPOINT_FORMAT, "script": self.script, "args": asdict(args), "global_step": step,
                      "returns": list(self.returns), "curve": self.curve, "rng": rng_states(),
                      "state": state_dict(self.state)}  # fmt: skip
        temporary = os.path.join(args.save_dir, f".{self.script}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, checkpoint_file(args.save_dir, self.script))
            os.fsync(folder := os.open(args.save_dir, os.O_RDONLY))  # the rename itself on the disk
            os.close(folder)
        except BaseException as e:  # a full disk, or a second Ctrl-C: no temporary file left behind
            if os.path.exists(temporary):
                os.unlink(temporary)
            if not isinstance(e, OSError):
                raise
            fail(f"--save-dir {args.save_dir}: the checkpoint of step {step} was not written: {e.strerror or e}")
        self.next_save, self.window.paused = self.save_due(step), self.window.paused + time.perf_counter() - t_save

    def evaluation(self, returns):
        """--eval-checkpoint: the first --eval-episodes of `returns`, each printed, then their record."""
        done = []
        for episodic_return in returns:
            done.append(round(float(episodic_return), 2))
            print(f"episode {len(done)}: return {done[-1]:.2f}", flush=True)
            if len(done) == self.args.eval_episodes:
                break
        record = {"script": self.script, "env_id": self.args.env_id, "episodes": len(done),
                  "checkpoint": checkpoint_file(self.args.eval_checkpoint, self.script),
                  "mean": round(float(np.mean(done)), 2), "std": round(float(np.std(done)), 2), "returns": done}
        print(json.dumps(record), flush=True)
        return record

    def finish(self, interrupted):
        """The speed record: the last stdout line, appended to --speed-log. Without a window: the whole loop's."""
        self.stop_handler = signal.SIG_IGN  # nothing cuts the record short
        self.catch_stops()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t_end, window = time.perf_counter(), self.window or SpeedWindow(0, 0)
        if self.profiler is not None:
            self.save_profile()
        if self.bar is not None:
            self.add_point(self.steps, t_end)  # the curve ends where the run did
            self.bar.update(self.steps - self.bar.n)
            self.bar.close()
            self.scalars.close()
        if interrupted:
            print(f"interrupted after {self.steps} env steps", file=sys.stderr, flush=True)
        steady, args, cuda = window.steady(self.steps), self.args, self.device.type == "cuda"
        record = {
            "script": self.script, "env_id": args.env_id, "seed": args.seed, "compile": getattr(args, "compile", False),
            "cudagraphs": getattr(args, "cudagraphs", False), "device": self.device.type,
            "gpu": torch.cuda.get_device_name() if cuda else None, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "total_timesteps": self.steps,
            "fps": round(window.fps(self.steps, t_end), 1), "steady": steady, "interrupted": interrupted,
            "fps_overall": round((self.steps - window.first_step) / (t_end - self.t_start), 1),
            "resumed_from": window.first_step if self.checkpoint is not None else None,
            "checkpoint_seconds": round(window.paused, 3),
            "warmup_seconds": round((window.t_open if steady else window.t_loop) - self.t_start, 3),
            "wall_seconds": round(t_end - self.t_start, 3), "episodic_return": self.bar and self.mean_return(),
            "return_curve": self.bar and self.curve or [],
        }  # fmt: skip
        line = json.dumps(record)
        if args.speed_log:
            with open(args.speed_log, "a") as f:  # one write of a whole line: concurrent runs never interleave
                f.write(line + "\n")
        print(line, flush=True)
        return record


def main(argv=None):
    """Train, or with --eval-checkpoint evaluate, as the arguments say; returns the record printed last on stdout."""
    script = os.path.basename(__file__)[: -len(".py")]
    args, checkpoint = parse_args(script, sys.argv[1:] if argv is None else argv)
    run = Run(args, script, checkpoint)
    if args.eval_checkpoint:
        return run.evaluation(evaluate(args, run, checkpoint["state"]))
    try:
        train(args, run)
        if args.save_dir:
            run.save(run.steps)
    except KeyboardInterrupt:
        return run.finish(interrupted=True)
    return run.finish(interrupted=False)


if __name__ == "__main__":
    sys.exit(130 if main().get("interrupted") else 0)
# ======== end of harness ========
