# DQN for discrete actions, as CleanRL defines it, made fast: on-device replay buffer, the greedy action on the
# device, the training step and the next action in one captured graph, torch.compile and CUDA graphs.
# Docs: docs/dqn.md
import functools
import json
import logging
import netrc
import os
import random
import signal
import sys
import tempfile
import time
import types
import urllib.parse
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tqdm
import tyro
from tensordict.nn import CudaGraphModule
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the id of the gymnasium environment"""
    seed: int = 1
    """seed of the experiment"""
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
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture the update and policy functions as CUDA graphs (tensordict's CudaGraphModule)"""


# Steps after learning_starts that count as warm-up: the fps window starts after them. At the default
# frequencies they hold the twin's third call (the one --cudagraphs captures) of each kind of training step,
# the target update's (every 500 steps) included.
WARMUP_STEPS = 2000
# Steps profiled with --profile-dir, at the start of the steady window.
PROFILE_STEPS = 500
# The agent's parts with a state_dict, as a checkpoint holds them.
AGENT_STATE = ("q_network", "target_network", "optimizer")
# The statistics of an update, in the order they are logged.
STATS = ("td_loss", "q_values")
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
# What a checkpoint keeps of gymnasium's wrappers: step and episode counters, and running statistics.
WRAPPER_STATE = ("_elapsed_steps", "episode_returns", "episode_lengths", "discounted_reward")
WRAPPER_STATISTICS = ("obs_rms", "return_rms")



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
    for name in ("total_timesteps", "buffer_size", "batch_size", "train_frequency", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"{flag(args, name, argv)} must be positive")
    if args.num_envs != 1:
        fail(f"{flag(args, 'num_envs', argv)}: DQN runs one env, as CleanRL's dqn.py does")
    if not 0 <= args.learning_starts < args.total_timesteps:
        fail(
            f"{flag(args, 'learning_starts', argv)} must be in [0, {flag(args, 'total_timesteps', argv)}): "
            "pass a smaller --learning-starts"
        )
    if not 0 < args.exploration_fraction <= 1:
        fail(f"{flag(args, 'exploration_fraction', argv)} must be in (0, 1]")
    for name in ("start_e", "end_e", "tau"):
        if not 0 <= getattr(args, name) <= 1:
            fail(f"{flag(args, name, argv)} must be in [0, 1]")


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at step t: from start_e down to end_e over `duration` steps, then end_e."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def make_env(env_id, seed, video=None):
    """video: (folder, which episodes) to record, or None."""

    def thunk():
        if video is None:
            env = gym.make(env_id)
        else:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, video[0], episode_trigger=video[1], disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


def make_single_env(env_id, seed, video=None):
    """The baseline's one env without the vector env around it: for one env, the vector env's batching and info
    merging cost more host time than a classic-control step. The loop resets the env in the step that ends an
    episode, as the baseline's vector env does (same-step autoreset)."""
    try:
        env = make_env(env_id, seed, video)()
    except gym.error.Error as e:
        fail(f"cannot make env {env_id!r}: {e}")
    if not isinstance(env.action_space, gym.spaces.Discrete):
        fail(f"{env_id} has a {type(env.action_space).__name__} action space; DQN needs a discrete one")
    if len(env.observation_space.shape) != 1:
        fail(f"{env_id} has observations of shape {env.observation_space.shape}; DQN's MLP needs flat ones")
    return env


def vector_view(env):
    """The one env as env_state and restore_env_state take a vector env (they are the baseline's): its only env,
    and its action space."""
    return types.SimpleNamespace(envs=[env], action_space=env.action_space)


def saved_value(value):
    """A numpy value as a tensor, which a weights_only load reads back; other values as they are."""
    return torch.as_tensor(np.asarray(value)) if isinstance(value, (np.ndarray, np.generic)) else value


def numpy_value(value):
    """saved_value's inverse: a tensor as a numpy array (0-d: a numpy scalar)."""
    return value.numpy()[()] if isinstance(value, torch.Tensor) else value


def stateful_wrappers(env):
    """An env's wrappers, outside in, but the video recorder, which a resumed run may add or drop."""
    wrappers = []
    while isinstance(env, gym.Wrapper):
        if not isinstance(env, gym.wrappers.RecordVideo):
            wrappers.append(env)
        env = env.env
    return wrappers


def env_state(envs):
    """What the next steps of a gymnasium vector env depend on, per env: the simulator's state (a classic-control
    env's `state`; None for other envs), each wrapper's counters and running statistics, and the random generators
    of the env, its action space and the vector env's."""
    states = []
    for env in envs.envs:
        sim = env.unwrapped
        physics = getattr(sim, "state", None)
        layers = []
        for layer in stateful_wrappers(env):
            saved = {name: saved_value(vars(layer)[name]) for name in WRAPPER_STATE if name in vars(layer)}
            for name in WRAPPER_STATISTICS:
                if name in vars(layer):
                    saved[name] = {key: saved_value(value) for key, value in vars(vars(layer)[name]).items()}
            layers.append(saved)
        rng, action_rng = sim.np_random.bit_generator.state, env.action_space.np_random.bit_generator.state
        physics = None if physics is None else saved_value(np.asarray(physics))
        states.append({"physics": physics, "layers": layers, "rng": rng, "action_rng": action_rng})
    return {"envs": states, "action_rng": envs.action_space.np_random.bit_generator.state}


def restore_env_state(envs, state):
    """env_state's envs back as saved; False where an env's simulator state was not saved (its episode restarts
    from the reset)."""
    restored = True
    for env, saved in zip(envs.envs, state["envs"]):
        sim = env.unwrapped
        if saved["physics"] is None:
            restored = False
        else:
            sim.state = numpy_value(saved["physics"])
        for layer, layer_state in zip(stateful_wrappers(env), saved["layers"]):
            for name, value in layer_state.items():
                if name in WRAPPER_STATISTICS:
                    vars(vars(layer)[name]).update({key: numpy_value(v) for key, v in value.items()})
                else:
                    vars(layer)[name] = numpy_value(value)
        sim.np_random.bit_generator.state = saved["rng"]
        env.action_space.np_random.bit_generator.state = saved["action_rng"]
    envs.action_space.np_random.bit_generator.state = state["action_rng"]
    return restored


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

    def state(self):
        """The filled rows, and where the next transition goes."""
        size = int(self.size)
        return {"storage": self.storage[:size].to("cpu", copy=True), "ptr": int(self.ptr), "size": size}

    def restore(self, state):
        # In place: captured graphs and compiled functions hold these very tensors.
        self.storage[: state["size"]].copy_(state["storage"])
        self.ptr.fill_(state["ptr"])
        self.size.fill_(state["size"])

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


def run_state(agent, rb, envs, obs, stats, next_action):
    """The script's part of a checkpoint: networks, optimizer, replay buffer, envs, the latest statistics, and the
    action chosen ahead for the next step."""
    state = {name: getattr(agent, name).state_dict() for name in AGENT_STATE}
    state.update(buffer=rb.state(), envs=env_state(envs), stats=stats)
    return {**state, "obs": torch.from_numpy(obs), "next_action": next_action}


def restore_run(state, agent, rb, envs, obs, stats):
    """run_state's parts back in place, into the tensors that captured graphs and compiled functions hold;
    returns the observation the run goes on from and the action chosen ahead for it."""
    for name in AGENT_STATE:
        saved, part = state[name], getattr(agent, name)
        if isinstance(part, optim.Optimizer):
            # Adam's capturable is this run's: --cudagraphs sets it, and a resumed run may change that flag.
            groups = zip(saved["param_groups"], part.param_groups)
            saved = {**saved, "param_groups": [{**g, "capturable": now["capturable"]} for g, now in groups]}
        part.load_state_dict(saved)
    rb.restore(state["buffer"])
    with torch.no_grad():
        # A progress tick before the next update logs the statistics as saved.
        for name, value in stats.items():
            value.copy_(state["stats"][name])
    if restore_env_state(envs, state["envs"]):
        return state["obs"].numpy(), state["next_action"]
    print("the env's state is not in the checkpoint: its episode restarts", file=sys.stderr)
    return obs, None


def make_update_fns(agent, args, batch):
    """The two steps of DQN: the TD update of the Q network, and the target network's update; and the policy
    that acts. The update reads its batch from `batch` (obs, actions, rewards, next_obs, dones), fixed tensors
    that each sample overwrites. With --compile each is compiled; --cudagraphs captures them in make_train_step,
    the policy at the end of each kind of training step."""

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


def make_train_step(rb, update, update_target, act, act_on_device, args):
    """train_step(q_update, target_update, obs) -> action: what follows each env step, and the greedy action of
    the next one. It stores the staged transition, then, if asked, samples a batch and updates the Q network, and
    updates the target network; then it acts greedily on the next step's observation obs (make_act's
    act_on_device, through act), unless obs is None: the next step explores, and nothing waits for the device.
    With --cudagraphs each kind of step, acting included, is one captured graph: one replay per env step, and one
    wait when it acts. The latest value of each of STATS lands in `stats`, fixed device tensors."""
    stats = {name: torch.zeros((), device=rb.device) for name in STATS}
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

    return train_step, stats


def make_act(policy, n_obs, device):
    """(act, act_on_device): the Q network's greedy action for one env, a numpy observation in, an int action out.

    act(obs, device_work=act_on_device) writes the observation into pinned host memory, runs device_work, waits for
    the device and reads the action. act_on_device, device work only, copies the observation to a fixed device
    tensor, runs the policy and copies the action back to pinned host memory. make_train_step ends each training
    step that acts with act_on_device and hands the step to act: under --cudagraphs the copies and the policy are
    part of the step's captured graph. Alone, act serves a run's first step, which no training step acted ahead
    for: once a run, so it is not captured."""
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
    """--eval-checkpoint: the saved Q network's greedy action on a fresh env, --eval-episodes."""
    video = (os.path.join("videos", meter.run_name), lambda episode: episode < args.eval_episodes)
    video = video if args.capture_video else None
    env = make_single_env(args.env_id, args.seed, video)
    n_obs = int(np.prod(env.observation_space.shape))
    q_network = QNetwork(n_obs, int(env.action_space.n), device=meter.device)
    q_network.load_state_dict(checkpoint["state"]["q_network"])
    obs, _ = env.reset(seed=args.seed)
    done = False
    while not done:
        with torch.no_grad():
            action = q_network(torch.as_tensor(obs[None], device=meter.device, dtype=torch.float32)).argmax(dim=1)
        obs, _, termination, truncation, info = env.step(int(action[0]))
        if termination or truncation:
            done = meter.evaluated(info["episode"]["r"])
            obs, _ = env.reset()
    env.close()


def train(args, meter, checkpoint):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = meter.device, meter.phase

    video = (os.path.join("videos", meter.run_name), None) if args.capture_video else None  # CleanRL's schedule
    env = make_single_env(args.env_id, args.seed, video)
    n_obs = int(np.prod(env.observation_space.shape))
    agent = Agent(args, n_obs, int(env.action_space.n), device)
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_obs, device)
    update, update_target, policy = make_update_fns(agent, args, rb.fields)
    act, act_on_device = make_act(policy, n_obs, device)
    train_step, stats = make_train_step(rb, update, update_target, act, act_on_device, args)
    # The first step that updates the Q network: its statistics are logged from there on.
    first_update = (args.learning_starts // args.train_frequency + 1) * args.train_frequency

    envs = vector_view(env)
    obs, _ = env.reset(seed=args.seed)
    epsilon_at = functools.partial(linear_schedule, args.start_e, args.end_e,
                                   args.exploration_fraction * args.total_timesteps)  # fmt: skip
    # The coming step's action: each training step ends by acting for the step after it.
    action = None

    def explore(step):
        """The baseline's draws for env step `step`, in its order: with probability epsilon a random action, else
        None (the Q network acts greedily)."""
        return int(env.action_space.sample()) if random.random() < epsilon_at(step) else None

    if checkpoint is not None:
        obs, action = restore_run(checkpoint["state"], agent, rb, envs, obs, stats)
    first_step = meter.start(checkpoint, args.total_timesteps, args.learning_starts, WARMUP_STEPS, PROFILE_STEPS, 1)
    for global_step in range(first_step, args.total_timesteps):
        meter.unit(global_step)
        with phase("policy"):
            if action is None:  # the run's first step, or a resumed run's whose episode restarts
                action = explore(global_step)
                action = act(obs) if action is None else action

        with phase("env_step"):
            next_obs, reward, termination, truncation, info = env.step(action)

        with phase("data"):
            # The transition keeps the true final observation; then the env resets in the same step.
            rb.stage(obs, next_obs, action, reward, termination)
            if termination or truncation:
                meter.episode(global_step, info["episode"]["r"], info["episode"]["l"])
                next_obs, _ = env.reset()
            obs = next_obs

        learning = global_step > args.learning_starts
        q_update = learning and global_step % args.train_frequency == 0
        target_update = learning and global_step % args.target_network_frequency == 0
        # A step that only stores the transition is mostly the round trip of acting: under "policy".
        with phase("update" if q_update or target_update else "policy"):
            # It acts for the next step, the last one's too: a run resumed from its checkpoint draws as the run
            # that goes on does.
            random_action = explore(global_step + 1)
            action = train_step(q_update, target_update, obs if random_action is None else None)
            action = action if random_action is None else random_action

        with phase("other"):
            if meter.tick(global_step + 1) and global_step >= first_update:
                meter.log(global_step, {f"losses/{name}": stats[name] for name in STATS})
            final = global_step + 1 == args.total_timesteps
            meter.checkpoint(global_step + 1, lambda: run_state(agent, rb, envs, obs, stats, action), final)
    env.close()


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
