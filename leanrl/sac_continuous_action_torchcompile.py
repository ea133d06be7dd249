# SAC for continuous actions, as CleanRL defines it, made fast: on-device replay buffer, vmapped twin Q,
# functional parameters, torch.compile and CUDA graphs.
# Docs: docs/sac.md
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
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 1000000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    learning_starts: int = 5000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """entropy regularization coefficient (without --autotune)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    capture_video: bool = False
    """record videos under videos/<run name>/ (env 0 in training; every episode of --eval-checkpoint)"""
    compile: bool = False
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture the update and policy functions as CUDA graphs (tensordict's CudaGraphModule)"""
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


# Env steps after learning_starts before the fps window opens, and steps --profile-dir profiles at its start.
WARMUP_STEPS = 200
PROFILE_STEPS = 100
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer.
AGENT_STATE = ("actor", "qnet_params", "qnet_target", "q_optimizer", "actor_optimizer", "a_optimizer", "log_alpha")
# The statistics of an update, logged as losses/<name>, with losses/alpha.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha_loss")


def check_args(args):
    if args.total_timesteps % args.num_envs:
        fail(f"--total-timesteps {args.total_timesteps} must be a multiple of --num-envs {args.num_envs}")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size} and --num-envs "
             f"{args.num_envs}")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")


def make_envs(env_id, seed, num_envs, video_folder=None, episode_trigger=None):
    """num_envs envs in a vector env that resets in the step that ends an episode, so the true final observation
    comes in infos; env 0 records the video, as in CleanRL. One env steps as OneEnv."""

    def make_env(i):
        if i > 0 or video_folder is None:
            env = gym.make(env_id)
        else:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=episode_trigger, disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed + i)
        return env

    try:
        thunks = [functools.partial(make_env, i) for i in range(num_envs)]
        if num_envs == 1:
            envs = OneEnv(make_env(0))
        else:
            envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except gym.error.Error as e:
        fail(f"--env-id {env_id}: {e}")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        space = type(envs.single_action_space).__name__
        fail(f"--env-id {env_id} has a {space} action space; SAC needs a continuous (Box) one")
    return envs


class OneEnv:
    """One env stepped as make_envs' vector env steps it, without the vector env's batching and info merging (about
    as much host time as a MuJoCo step). Its batched action space draws as the vector env's: a copy of the env's."""

    def __init__(self, env):
        self.env, self.single_observation_space, self.single_action_space = env, env.observation_space, env.action_space
        self.action_space = gym.vector.utils.batch_space(env.action_space, 1)

    def reset(self, seed):
        obs, info = self.env.reset(seed=seed)
        return obs[None], info

    def step(self, actions):
        obs, reward, termination, truncation, info = self.env.step(actions[0])
        infos = {}
        if termination or truncation:
            episode = {key: np.array([value]) for key, value in info["episode"].items()}
            infos = {"final_obs": obs[None], "_final_obs": np.ones(1, bool), "final_info": {"episode": episode}}
            obs, _ = self.env.reset()
        return obs[None], np.array([reward]), np.array([termination]), np.array([truncation]), infos

    def close(self):
        self.env.close()


class SoftQNetwork(nn.Module):
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
        self.fc_mean = nn.Linear(256, n_act, device=device)
        self.fc_logstd = nn.Linear(256, n_act, device=device)
        low = torch.as_tensor(action_low, dtype=torch.float32, device=device)
        high = torch.as_tensor(action_high, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std, validate_args=False)  # validation syncs with the host
        x_t = normal.rsample()  # reparameterization trick: mean + std * N(0,1)
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing action bounds
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class ReplayBuffer:
    """Rows [obs, action, reward, next_obs, done] of one tensor on the device, sampled uniformly with replacement into
    one fixed batch that the updates read. `stage` copies a step's rows to the device; `push` stores them there."""

    def __init__(self, size, batch_size, num_envs, n_obs, n_act, device):
        widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = torch.zeros(size, sum(widths), device=device)
        self.rows = torch.zeros(num_envs, sum(widths), device=device)
        self.batch = torch.zeros(batch_size, sum(widths), device=device)
        obs, actions, rewards, next_obs, dones = self.batch.split(widths, dim=1)
        self.fields = (obs, actions, rewards.squeeze(1), next_obs, dones.squeeze(1))  # views: each sample rewrites
        self.ptr = torch.arange(num_envs, device=device)  # the row each env's next transition goes to
        self.size = torch.zeros(1, dtype=torch.long, device=device)
        self.max_size, self.device = size, device

    def stage(self, obs, next_obs, actions, rewards, dones):
        rows = np.concatenate([obs, actions, rewards[:, None], next_obs, dones[:, None]], axis=1, dtype=np.float32)
        self.rows.copy_(torch.from_numpy(rows), non_blocking=True)  # from pageable memory: `rows` is read on return

    def push(self):
        self.storage.index_copy_(0, self.ptr, self.rows)
        self.ptr.add_(len(self.rows)).remainder_(self.max_size)
        self.size.add_(len(self.rows)).clamp_(max=self.max_size)

    def sample(self):
        # Uniform with the size on the device: 62-bit draws modulo the size (a relative bias below 2**-40).
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device).remainder_(self.size)
        torch.index_select(self.storage, 0, idx, out=self.batch)

    def state_dict(self):
        """The filled rows, and where the next transition goes."""
        return {"storage": self.storage[: int(self.size)].to("cpu", copy=True), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: len(state["storage"])].copy_(state["storage"])  # in place: graphs hold these very tensors
        self.ptr.copy_(state["ptr"])
        self.size.copy_(state["size"])


class Agent:
    """The networks, optimizers and entropy coefficient SAC trains."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        # Both Q networks as one stacked {name: tensor of both} (and its target copy), evaluated by qvalues
        qf1 = SoftQNetwork(n_obs, n_act, device=device)
        qf2 = SoftQNetwork(n_obs, n_act, device=device)
        self.qnet_params, _ = torch.func.stack_module_state([qf1, qf2])
        self.qnet_target = {name: p.detach().clone() for name, p in self.qnet_params.items()}
        self.qnet = SoftQNetwork(n_obs, n_act, device="meta")  # the structure, without storage
        capturable = args.cudagraphs and device.type == "cuda"  # Adam's step count on the device, for graphs
        self.q_optimizer = optim.Adam(self.qnet_params.values(), lr=args.q_lr, capturable=capturable)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.policy_lr, capturable=capturable)
        # Automatic entropy tuning; alpha stays a device tensor, which no update reads back to the host
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr, capturable=capturable)
        self.alpha = self.log_alpha.detach().exp() if args.autotune else torch.tensor([args.alpha], device=device)

    def qvalues(self, params, obs, actions):
        """The Q values of both networks for the stacked parameters `params`: shape (2, batch, 1)."""
        return torch.vmap(lambda p: torch.func.functional_call(self.qnet, p, (obs, actions)))(params)


def make_update_fns(agent, args, batch):
    """The steps of a SAC update: critic, actor (with the entropy coefficient), target networks; and the policy.
    The updates read `batch` (obs, actions, rewards, next_obs, dones), fixed tensors that each sample rewrites."""

    def update_critic():
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
            qf_next_target = agent.qvalues(agent.qnet_target, next_obs, next_state_actions)
            min_qf_next_target = qf_next_target.min(0).values - agent.alpha * next_state_log_pi
            next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * min_qf_next_target.view(-1)
        qf1_a_values, qf2_a_values = agent.qvalues(agent.qnet_params, obs, actions).view(2, -1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def actor_step():
        obs = batch[0]
        pi, log_pi, _ = agent.actor.get_action(obs)
        qnet_params = {name: p.detach() for name, p in agent.qnet_params.items()}  # no gradient for the critic
        min_qf_pi = agent.qvalues(qnet_params, obs, pi).min(0).values
        actor_loss = ((agent.alpha * log_pi) - min_qf_pi).mean()
        agent.actor_optimizer.zero_grad()
        actor_loss.backward()
        agent.actor_optimizer.step()
        alpha_loss = torch.zeros((), device=obs.device)
        if args.autotune:
            with torch.no_grad():
                _, log_pi, _ = agent.actor.get_action(obs)
            alpha_loss = (-agent.log_alpha.exp() * (log_pi + agent.target_entropy)).mean()
            agent.a_optimizer.zero_grad()
            alpha_loss.backward()
            agent.a_optimizer.step()
            agent.alpha.copy_(agent.log_alpha.detach().exp())
        return {"actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach()}

    def update_targets():  # one fused lerp over every target parameter
        sources = [p.detach() for p in agent.qnet_params.values()]
        torch._foreach_lerp_(list(agent.qnet_target.values()), sources, args.tau)

    def policy(obs):
        with torch.no_grad():
            actions, _, _ = agent.actor.get_action(obs)
        return actions

    if args.compile:  # one actor step per compiled function: a graph break inside a loop would run it eagerly
        update_critic, actor_step, update_targets, policy = map(
            torch.compile, (update_critic, actor_step, update_targets, policy)
        )

    def update_actor():
        for _ in range(args.policy_frequency):  # policy_frequency updates on one batch, compensating for the delay
            stats = actor_step()
        return stats

    return update_critic, update_actor, update_targets, policy


def make_train_step(rb, update_critic, update_actor, update_targets, args):
    """train_step(actor_update, target_update) after a (vector) env step once learning has started: store the staged
    transitions, sample, update; with --cudagraphs one captured graph per kind of step. `stats`: fixed tensors."""
    stats = {name: torch.zeros((), device=rb.device) for name in STATS}

    def step(actor_update, target_update):
        rb.push()
        rb.sample()
        outputs = update_critic()
        if actor_update:  # TD3-style delayed update
            outputs.update(update_actor())
        if target_update:
            update_targets()
        for name, value in outputs.items():
            stats[name].copy_(value)

    @functools.cache
    def step_of_kind(actor_update, target_update):
        fn = functools.partial(step, actor_update, target_update)
        return CudaGraphModule(fn, warmup=3 if args.compile else 2) if args.cudagraphs else fn

    def train_step(actor_update, target_update):
        step_of_kind(actor_update, target_update)()

    return train_step, stats


def make_act(policy, args, n_obs, n_act, device):
    """act(obs) -> actions, numpy arrays, one row per env, through pinned host memory and fixed device tensors; with
    --cudagraphs both copies are in the captured graph: one replay and one wait for the device."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(args.num_envs, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(args.num_envs, n_obs, device=device)
    action_host = torch.zeros(args.num_envs, n_act, pin_memory=pinned)

    def staged():
        obs_device.copy_(obs_host, non_blocking=True)
        action_host.copy_(policy(obs_device), non_blocking=True)

    if args.cudagraphs:
        staged = CudaGraphModule(staged, warmup=3 if args.compile else 2)

    def act(obs):
        obs_host.numpy()[:] = obs  # the previous act's copies are done: it waited for them
        staged()
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        return action_host.numpy().copy()

    return act


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, n_envs = run.device, args.num_envs
    envs = make_envs(args.env_id, args.seed, n_envs, run.video_folder)  # CleanRL's video schedule
    space = envs.single_action_space
    n_obs, n_act = int(np.prod(envs.single_observation_space.shape)), int(np.prod(space.shape))
    agent = Agent(args, n_obs, n_act, space.low, space.high, device)
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_envs, n_obs, n_act, device)
    update_critic, update_actor, update_targets, policy = make_update_fns(agent, args, rb.fields)
    train_step, stats = make_train_step(rb, update_critic, update_actor, update_targets, args)
    act = make_act(policy, args, n_obs, n_act, device)
    next_actions = None  # chosen ahead, before a critic-only update

    obs, _ = envs.reset(seed=args.seed)
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=n_envs, warmup_from=args.learning_starts)
    agent.alpha.fill_(agent.log_alpha.exp().item() if args.autotune else args.alpha)  # a resumed run's
    # global_step counts env steps, n_envs per vector step; updates count vector steps, as CleanRL's global_step does.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        vector_step = global_step // n_envs
        run.unit(global_step)
        with run.phase("policy"):
            if global_step < args.learning_starts:
                actions = envs.action_space.sample()
            elif next_actions is not None:
                actions, next_actions = next_actions, None
            else:
                actions = act(obs)
        with run.phase("env_step"):
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        with run.phase("data"):
            real_next_obs = next_obs.copy()  # a finished episode's last transition keeps its true final observation
            if "final_obs" in infos:
                for i in np.flatnonzero(infos["_final_obs"]):
                    real_next_obs[i] = infos["final_obs"][i]
                    episode = infos["final_info"]["episode"]
                    run.episode(global_step, episode["r"][i], episode["l"][i])
            rb.stage(obs, real_next_obs, actions, rewards, terminations)
            obs = next_obs
        if global_step < args.learning_starts:
            with run.phase("data"):
                rb.push()
        else:
            actor_update = vector_step % args.policy_frequency == 0
            if not actor_update:  # the actor stays as it is: act for the next step while the device updates the critic
                with run.phase("policy"):
                    next_actions = act(obs)
            with run.phase("update"):
                train_step(actor_update, vector_step % args.target_network_frequency == 0)
        with run.phase("other"):
            # By then an actor update has run (in this run, if it was resumed): its statistics exist.
            logged = global_step >= max(args.learning_starts, first_step) + args.policy_frequency * n_envs
            if run.tick(global_step + n_envs) and logged:
                losses = {f"losses/{name}": stats[name] for name in STATS}
                run.log(global_step, {**losses, "losses/alpha": agent.alpha})
    envs.close()


def evaluate(args, run, saved):
    """The saved actor's deterministic action (its mean), on one env: each episode's return."""
    envs = make_envs(args.env_id, args.seed, 1, run.video_folder, lambda episode: True)
    space = envs.single_action_space
    n_obs, n_act = int(np.prod(envs.single_observation_space.shape)), int(np.prod(space.shape))
    actor = Actor(n_obs, n_act, space.low, space.high, device=run.device)
    actor.load_state_dict(saved["actor"])
    obs, _ = envs.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            _, _, actions = actor.get_action(torch.as_tensor(obs, device=run.device, dtype=torch.float32))
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_obs" in infos:
            yield infos["final_info"]["episode"]["r"][0]


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
