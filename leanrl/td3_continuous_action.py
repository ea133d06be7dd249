# TD3 for continuous actions, as CleanRL defines it, in plain eager PyTorch.
# Docs: docs/td3.md
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

import gymnasium as gym
import mujoco
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tqdm
import tyro
from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment"""
    num_envs: int = 1
    """the number of parallel environments"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    buffer_size: int = 1000000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    policy_noise: float = 0.2
    """the scale of policy noise"""
    exploration_noise: float = 0.1
    """the scale of exploration noise"""
    learning_starts: int = 25000
    """timestep to start learning"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    noise_clip: float = 0.5
    """noise clip parameter of the Target Policy Smoothing Regularization"""
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


# Steps after learning_starts that count as warm-up: the fps window starts after them.
WARMUP_STEPS = 200
# Steps profiled with --profile-dir, at the start of the steady window.
PROFILE_STEPS = 100
# The agent's parts with a state_dict, as a checkpoint holds them.
AGENT_STATE = ("actor", "qf1", "qf2", "target_actor", "qf1_target", "qf2_target", "q_optimizer", "actor_optimizer")
# The replay buffer's arrays, as a checkpoint holds them.
BUFFER_ARRAYS = ("obs", "next_obs", "actions", "rewards", "dones")
# The statistics of an update, in the order they are logged.
STATS = ("qf_loss", "qf1_values", "qf2_values", "actor_loss")
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
# A MuJoCo env's state in a checkpoint: all that its next steps depend on.
MUJOCO_STATE = mujoco.mjtState.mjSTATE_INTEGRATION
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
    for name in ("total_timesteps", "num_envs", "buffer_size", "batch_size", "policy_frequency"):
        if getattr(args, name) <= 0:
            fail(f"{flag(args, name, argv)} must be positive")
    if args.total_timesteps % args.num_envs:
        fail(f"{flag(args, 'total_timesteps', argv)} must be a multiple of {flag(args, 'num_envs', argv)}")
    if args.buffer_size < args.num_envs:
        fail(f"{flag(args, 'buffer_size', argv)} is below {flag(args, 'num_envs', argv)}: each step stores one per env")
    for name in ("policy_noise", "exploration_noise", "noise_clip"):
        if getattr(args, name) < 0:
            fail(f"{flag(args, name, argv)} must not be negative")
    if not 0 <= args.learning_starts < args.total_timesteps:
        fail(
            f"{flag(args, 'learning_starts', argv)} must be in [0, {flag(args, 'total_timesteps', argv)}): "
            "pass a smaller --learning-starts"
        )


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


def make_envs(env_id, seed, num_envs, video=None):
    """num_envs envs in a vector env that resets in the same step, so the true final observation comes in infos;
    env 0 records the video, as in CleanRL."""
    try:
        envs = gym.vector.SyncVectorEnv(
            [make_env(env_id, seed + i, video if i == 0 else None) for i in range(num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
    except gym.error.Error as e:
        fail(f"cannot make env {env_id!r}: {e}")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        fail(f"{env_id} has a {type(envs.single_action_space).__name__} action space; TD3 needs a continuous (Box) one")
    return envs


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
    """What the next steps of a gymnasium vector env depend on, per env: the simulator's state (MuJoCo's
    integration state, or a classic-control env's `state`; None for other envs), each wrapper's counters and
    running statistics, and the random generators of the env, its action space and the vector env's."""
    states = []
    for env in envs.envs:
        sim = env.unwrapped
        if isinstance(sim, MujocoEnv):
            physics = np.empty(mujoco.mj_stateSize(sim.model, MUJOCO_STATE))
            mujoco.mj_getState(sim.model, sim.data, physics, MUJOCO_STATE)
        else:
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
        elif isinstance(sim, MujocoEnv):
            mujoco.mj_setState(sim.model, sim.data, numpy_value(saved["physics"]), MUJOCO_STATE)
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
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, action_low, action_high, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mu = nn.Linear(256, n_act, device=device)
        low = torch.as_tensor(action_low, dtype=torch.float32, device=device)
        high = torch.as_tensor(action_high, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = torch.tanh(self.fc_mu(x))
        return x * self.action_scale + self.action_bias


class ReplayBuffer:
    """Transitions in numpy arrays on the host, sampled uniformly with replacement."""

    def __init__(self, size, n_obs, n_act, device):
        self.obs = np.zeros((size, n_obs), dtype=np.float32)
        self.next_obs = np.zeros((size, n_obs), dtype=np.float32)
        self.actions = np.zeros((size, n_act), dtype=np.float32)
        self.rewards = np.zeros(size, dtype=np.float32)
        self.dones = np.zeros(size, dtype=np.float32)
        self.max_size, self.ptr, self.size, self.device = size, 0, 0, device

    def add(self, obs, next_obs, actions, rewards, dones):
        """One transition per env, in rows."""
        n = len(obs)
        rows = (self.ptr + np.arange(n)) % self.max_size
        self.obs[rows] = obs
        self.next_obs[rows] = next_obs
        self.actions[rows] = actions
        self.rewards[rows] = rewards
        self.dones[rows] = dones
        self.ptr = (self.ptr + n) % self.max_size
        self.size = min(self.size + n, self.max_size)

    def state(self):
        """The filled part, and where the next transition goes."""
        filled = {name: torch.from_numpy(getattr(self, name)[: self.size]) for name in BUFFER_ARRAYS}
        return {**filled, "ptr": self.ptr, "size": self.size}

    def restore(self, state):
        for name in BUFFER_ARRAYS:
            getattr(self, name)[: state["size"]] = state[name].numpy()
        self.ptr, self.size = state["ptr"], state["size"]

    def sample(self, batch_size):
        idx = np.random.randint(0, self.size, size=batch_size)
        return tuple(
            torch.as_tensor(a[idx], device=self.device)
            for a in (self.obs, self.actions, self.rewards, self.next_obs, self.dones)
        )


class Agent:
    """The networks, their targets and the optimizers TD3 trains."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        self.qf1 = QNetwork(n_obs, n_act, device=device)
        self.qf2 = QNetwork(n_obs, n_act, device=device)
        self.qf1_target = QNetwork(n_obs, n_act, device=device)
        self.qf2_target = QNetwork(n_obs, n_act, device=device)
        self.target_actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        self.target_actor.load_state_dict(self.actor.state_dict())
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_optimizer = optim.Adam(list(self.qf1.parameters()) + list(self.qf2.parameters()), lr=args.learning_rate)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.learning_rate)
        # Per-dimension action bounds on the device, for clamping actions there.
        self.action_low = torch.as_tensor(action_low, dtype=torch.float32, device=device)
        self.action_high = torch.as_tensor(action_high, dtype=torch.float32, device=device)


def run_state(agent, rb, envs, obs, stats):
    """The script's part of a checkpoint: networks, optimizers, replay buffer, envs, the latest statistics."""
    state = {name: getattr(agent, name).state_dict() for name in AGENT_STATE}
    state.update(buffer=rb.state(), envs=env_state(envs), stats=stats)
    return {**state, "obs": torch.from_numpy(obs)}


def restore_run(state, agent, rb, envs, obs, stats):
    """run_state's parts back in place; returns the observation the run goes on from."""
    for name in AGENT_STATE:
        getattr(agent, name).load_state_dict(state[name])
    rb.restore(state["buffer"])
    # A progress tick before the next actor update logs the actor's loss as saved.
    stats.update({name: value.to(rb.device) for name, value in state["stats"].items()})
    if restore_env_state(envs, state["envs"]):
        return state["obs"].numpy()
    print("the env's state is not in the checkpoint: its episode restarts", file=sys.stderr)
    return obs


def make_update_fns(agent, args):
    """The two steps of a TD3 update: the critic; and the delayed actor step with the soft update of every
    target network, which TD3 always does together."""

    def update_critic(obs, actions, rewards, next_obs, dones):
        with torch.no_grad():
            # Target policy smoothing: clipped noise on the target actor's action.
            clipped_noise = (torch.randn_like(actions) * args.policy_noise).clamp(
                -args.noise_clip, args.noise_clip
            ) * agent.target_actor.action_scale
            next_state_actions = agent.target_actor(next_obs) + clipped_noise
            next_state_actions = next_state_actions.clamp(agent.action_low, agent.action_high)
            qf1_next_target = agent.qf1_target(next_obs, next_state_actions)
            qf2_next_target = agent.qf2_target(next_obs, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target)
            next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * min_qf_next_target.view(-1)

        qf1_a_values = agent.qf1(obs, actions).view(-1)
        qf2_a_values = agent.qf2(obs, actions).view(-1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss

        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        return {"qf_loss": qf_loss.detach(), "qf1_values": qf1_values, "qf2_values": qf2_values}

    def update_actor_and_targets(obs):
        # The gradients this leaves on qf1 are discarded: the critic step zeroes them before it steps.
        actor_loss = -agent.qf1(obs, agent.actor(obs)).mean()

        agent.actor_optimizer.zero_grad()
        actor_loss.backward()
        agent.actor_optimizer.step()

        pairs = ((agent.actor, agent.target_actor), (agent.qf1, agent.qf1_target), (agent.qf2, agent.qf2_target))
        for net, target in pairs:
            for param, target_param in zip(net.parameters(), target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)
        return {"actor_loss": actor_loss.detach()}

    return update_critic, update_actor_and_targets


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
    """--eval-checkpoint: the saved actor's action, without exploration noise, on a fresh env, --eval-episodes."""
    video = (os.path.join("videos", meter.run_name), lambda episode: episode < args.eval_episodes)
    video = video if args.capture_video else None
    envs = make_envs(args.env_id, args.seed, 1, video)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    n_act = int(np.prod(envs.single_action_space.shape))
    space = envs.single_action_space
    actor = Actor(n_obs, n_act, space.low, space.high, device=meter.device)
    actor.load_state_dict(checkpoint["state"]["actor"])
    obs, _ = envs.reset(seed=args.seed)
    done = False
    while not done:
        with torch.no_grad():
            actions = actor(torch.as_tensor(obs, device=meter.device, dtype=torch.float32))
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                done = meter.evaluated(infos["final_info"]["episode"]["r"][i]) or done
    envs.close()


def train(args, meter, checkpoint):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase, n_envs = meter.device, meter.phase, args.num_envs

    video = (os.path.join("videos", meter.run_name), None) if args.capture_video else None  # CleanRL's schedule
    envs = make_envs(args.env_id, args.seed, args.num_envs, video)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    n_act = int(np.prod(envs.single_action_space.shape))
    space = envs.single_action_space
    agent = Agent(args, n_obs, n_act, space.low, space.high, device)
    update_critic, update_actor_and_targets = make_update_fns(agent, args)
    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)
    stats = {}  # the latest value of each of STATS

    obs, _ = envs.reset(seed=args.seed)
    if checkpoint is not None:
        obs = restore_run(checkpoint["state"], agent, rb, envs, obs, stats)
    first_step = meter.start(
        checkpoint, args.total_timesteps, args.learning_starts, WARMUP_STEPS, PROFILE_STEPS, n_envs
    )
    # global_step counts env steps, n_envs per vector step; the update schedule counts vector steps, as CleanRL's
    # global_step does: one gradient step per vector step.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        vector_step = global_step // n_envs
        meter.unit(global_step)
        with phase("policy"):
            if global_step < args.learning_starts:
                actions = envs.action_space.sample()
            else:
                with torch.no_grad():
                    actions = agent.actor(torch.as_tensor(obs, device=device, dtype=torch.float32))
                    # Noise of its own for each env.
                    actions += torch.normal(0, (agent.actor.action_scale * args.exploration_noise).expand_as(actions))
                    actions = actions.cpu().numpy().clip(space.low, space.high)

        with phase("env_step"):
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        with phase("data"):
            # A finished episode's last transition keeps its true final observation.
            real_next_obs = next_obs.copy()
            if "final_obs" in infos:
                for i in np.flatnonzero(infos["_final_obs"]):
                    real_next_obs[i] = infos["final_obs"][i]
                    episode = infos["final_info"]["episode"]
                    meter.episode(global_step, episode["r"][i], episode["l"][i])
            rb.add(obs, real_next_obs, actions, rewards, terminations)
            obs = next_obs

        if global_step >= args.learning_starts:
            with phase("data"):
                obs_b, actions_b, rewards_b, next_obs_b, dones_b = rb.sample(args.batch_size)
            with phase("update"):
                stats.update(update_critic(obs_b, actions_b, rewards_b, next_obs_b, dones_b))
                if vector_step % args.policy_frequency == 0:  # delayed policy and target updates
                    stats.update(update_actor_and_targets(obs_b))

        with phase("other"):
            # By then an actor update has run: its statistics exist.
            logged = global_step >= args.learning_starts + args.policy_frequency * n_envs
            if meter.tick(global_step + n_envs) and logged:
                meter.log(global_step, {f"losses/{name}": stats[name] for name in STATS})
            final = global_step + n_envs == args.total_timesteps
            meter.checkpoint(global_step + n_envs, lambda: run_state(agent, rb, envs, obs, stats), final)
    envs.close()


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
