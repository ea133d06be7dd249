# PPO for continuous actions, as CleanRL defines it, in plain eager PyTorch.
# Docs: docs/ppo_continuous.md
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
from dataclasses import asdict, dataclass, fields, replace

import gymnasium as gym
import mujoco
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tqdm
import tyro
from gymnasium.envs.mujoco.mujoco_env import MujocoEnv
from torch.distributions.normal import Normal
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of minibatches a rollout is split into"""
    update_epochs: int = 10
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the PPO paper"""
    ent_coef: float = 0.0
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


# Iterations that count as warm-up: the fps window starts after them.
WARMUP_ITERATIONS = 2
# Iterations profiled with --profile-dir, at the start of the steady window.
PROFILE_ITERATIONS = 1
# The statistics of a minibatch update, in the order they are logged.
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")

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
    if args.total_timesteps < args.num_envs * args.num_steps:
        fail(f"{flag(args, 'total_timesteps', argv)} is below one rollout, {batch}")
    if args.target_kl is not None and args.target_kl <= 0:
        fail(f"--target-kl {args.target_kl} must be positive")


def make_env(env_id, gamma, seed, video=None):
    """video: (folder, which episodes) to record, or None."""

    def thunk():
        env = gym.make(env_id) if video is None else gym.make(env_id, render_mode="rgb_array")
        if not isinstance(env.action_space, gym.spaces.Box):
            space = type(env.action_space).__name__
            fail(f"{env_id} has a {space} action space; this PPO needs a continuous (Box) one")
        if video is not None:
            env = gym.wrappers.RecordVideo(env, video[0], episode_trigger=video[1], disable_logger=True)
        env = gym.wrappers.FlattenObservation(env)  # deal with dm_control's Dict observation space
        # Before the reward wrappers, so that episode returns are the environment's own.
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=gamma)
        env = gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))
        # Never sampled here, but seeded: a checkpoint holds its generator, the same in every run of a seed.
        env.action_space.seed(seed)
        return env

    return thunk


def make_envs(args, video=None):
    """num_envs envs that reset in the same step, so the true final observation comes in infos; env 0 records
    the video, as in CleanRL."""
    try:
        return gym.vector.SyncVectorEnv(
            [make_env(args.env_id, args.gamma, args.seed, video if i == 0 else None) for i in range(args.num_envs)],
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
    except gym.error.Error as e:
        fail(f"cannot make env {args.env_id!r}: {e}")


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


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """Separate 64-64 tanh actor and critic; a Gaussian policy with a state-independent log-std."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act, device=device))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        action_logstd = self.actor_logstd.expand_as(action_mean)
        action_std = torch.exp(action_logstd)
        probs = Normal(action_mean, action_std)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device."""

    def __init__(self, num_steps, num_envs, n_obs, n_act, device):
        self.obs = torch.zeros((num_steps, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs, n_act), device=device)
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
    """The script's part of a checkpoint: network, optimizer, envs, and the observations and done flags the next
    rollout starts from (copies: a view would be saved with the whole buffer it is part of)."""
    state = {"net": agent.net.state_dict(), "optimizer": agent.optimizer.state_dict(), "envs": env_state(envs)}
    return {**state, "next_obs": next_obs.to("cpu", copy=True), "next_done": next_done.to("cpu", copy=True)}


def restore_run(state, agent, envs, next_obs, next_done):
    """run_state's parts back in place; returns the observations and done flags the next rollout starts from."""
    agent.net.load_state_dict(state["net"])
    agent.optimizer.load_state_dict(state["optimizer"])
    if restore_env_state(envs, state["envs"]):
        return state["next_obs"].to(next_obs.device), state["next_done"].to(next_done.device)
    print("the envs' state is not in the checkpoint: their episodes restart", file=sys.stderr)
    return next_obs, next_done


def bootstrap_truncated(agent, reward, terminations, truncations, infos, gamma, device):
    """The reward with gamma * V(true final observation) added where an episode was truncated, not terminated.

    The env has already reset and GAE does not bootstrap across a done, but a time limit is not the end of the
    task: its value target must continue from the state the episode stopped in.
    """
    truncated = truncations & ~terminations
    if not truncated.any():
        return reward
    final_obs = torch.as_tensor(np.stack(infos["final_obs"][truncated]), dtype=torch.float32, device=device)
    with torch.no_grad():
        final_value = agent.net.get_value(final_obs).flatten().cpu().numpy()
    reward = reward.copy()
    reward[truncated] += gamma * final_value
    return reward


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
    """--eval-checkpoint: the saved policy's deterministic action (its mean) on a fresh env, --eval-episodes; the
    observations are normalised with env 0's saved running statistics, frozen."""
    video = (os.path.join("videos", meter.run_name), lambda episode: episode < args.eval_episodes)
    # One env, so that its video records every episode.
    envs = make_envs(replace(args, num_envs=1), video if args.capture_video else None)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    n_act = int(np.prod(envs.single_action_space.shape))
    net = ActorCritic(n_obs, n_act, device=meter.device)
    net.load_state_dict(checkpoint["state"]["net"])
    layers = checkpoint["state"]["envs"]["envs"][0]["layers"]
    obs_rms = next(layer["obs_rms"] for layer in layers if "obs_rms" in layer)
    normalize = envs.envs[0]
    while not isinstance(normalize, gym.wrappers.NormalizeObservation):
        normalize = normalize.env
    vars(normalize.obs_rms).update({key: numpy_value(value) for key, value in obs_rms.items()})
    normalize.update_running_mean = False
    obs, _ = envs.reset(seed=args.seed)
    done = False
    while not done:
        with torch.no_grad():
            actions = net.actor_mean(torch.as_tensor(obs, device=meter.device, dtype=torch.float32))
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_info" in infos:
            for i in np.flatnonzero(infos["_final_info"]):
                done = meter.evaluated(infos["final_info"]["episode"]["r"][i]) or done
    envs.close()


def train(args, meter, checkpoint):
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = meter.device, meter.phase

    video = (os.path.join("videos", meter.run_name), None) if args.capture_video else None  # CleanRL's schedule
    envs = make_envs(args, video)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    n_act = int(np.prod(envs.single_action_space.shape))
    agent = Agent(args, n_obs, n_act, device)
    gae, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, n_act, device)

    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.Tensor(next_obs).to(device)
    next_done = torch.zeros(args.num_envs, device=device)
    if checkpoint is not None:
        next_obs, next_done = restore_run(checkpoint["state"], agent, envs, next_obs, next_done)
    steps = num_iterations * batch_size
    global_step = meter.start(
        checkpoint, steps, 0, WARMUP_ITERATIONS * batch_size, PROFILE_ITERATIONS * batch_size, args.num_envs
    )
    # A checkpoint is written after a whole iteration: the next one is the iteration after its steps.
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        meter.unit(global_step)
        with phase("update"):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                agent.set_learning_rate(frac * args.learning_rate)

        for step in range(args.num_steps):
            global_step += args.num_envs
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
                action = action.cpu().numpy()

            with phase("env_step"):
                next_obs, reward, terminations, truncations, infos = envs.step(action)

            with phase("data"):
                reward = bootstrap_truncated(agent, reward, terminations, truncations, infos, args.gamma, device)
                next_done = np.logical_or(terminations, truncations)
                rollout.rewards[step] = torch.tensor(reward).to(device).view(-1)
                next_obs, next_done = torch.Tensor(next_obs).to(device), torch.Tensor(next_done).to(device)
                if "final_info" in infos:
                    for i in np.flatnonzero(infos["_final_info"]):
                        episode = infos["final_info"]["episode"]
                        meter.episode(global_step, episode["r"][i], episode["l"][i])

            with phase("other"):
                meter.tick(global_step)

        with phase("update"):
            advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)

        # flatten the batch: obs, actions, logprobs, advantages, returns, values
        batch = (
            rollout.obs.reshape((-1, n_obs)),
            rollout.actions.reshape((-1, n_act)),
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
            if args.target_kl is not None and stats["approx_kl"] > args.target_kl:
                break

        with phase("other"):
            # On the device, so that it is read back with the statistics, in one sync.
            var_y = batch[-2].var(correction=0)
            explained_var = torch.where(var_y == 0, torch.nan, 1 - (batch[-2] - batch[-1]).var(correction=0) / var_y)
            scalars = {f"losses/{name}": stats[name] for name in STATS}
            scalars.update({"losses/explained_variance": explained_var, "charts/learning_rate": agent.learning_rate()})
            meter.log(global_step, scalars)
            final = iteration == num_iterations
            meter.checkpoint(global_step, lambda: run_state(agent, envs, next_obs, next_done), final)
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
