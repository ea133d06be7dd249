# SAC for continuous actions, as CleanRL defines it, made fast: on-device replay buffer, vmapped twin Q,
# functional parameters, torch.compile and CUDA graphs.
# Docs: docs/sac.md
import functools
import json
import os
import random
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tqdm
import tyro
from tensordict import from_module, from_modules
from tensordict.nn import CudaGraphModule
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment"""
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
    cuda: bool = True
    """use CUDA when it is available"""
    track: bool = False
    """track the experiment with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    speed_log: str | None = None
    """append the final speed record (one JSON line) to this file"""
    profile_dir: str | None = None
    """profile a short steady window after warm-up and write the trace into this directory"""
    compile: bool = False
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture the update and policy functions as CUDA graphs (tensordict's CudaGraphModule)"""


# Steps after learning_starts that count as warm-up: the fps window starts after them.
WARMUP_STEPS = 200
# Steps profiled with --profile-dir, at the start of the steady window.
PROFILE_STEPS = 100
LOG_STD_MAX = 2
LOG_STD_MIN = -5


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    for name in ("total_timesteps", "buffer_size", "batch_size", "policy_frequency", "target_network_frequency"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.learning_starts < args.total_timesteps:
        fail(f"--learning-starts must be in [0, --total-timesteps), got {args.learning_starts}")


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


def make_single_env(env_id, seed):
    """The baseline's one env without the vector env around it: for one env, the vector env's batching and info
    merging cost about as much host time as a MuJoCo step. The loop resets the env in the step that ends an
    episode, as the baseline's vector env does (same-step autoreset), so both see the same transitions."""
    try:
        env = make_env(env_id, seed)()
    except gym.error.Error as e:
        fail(f"cannot make env {env_id!r}: {e}")
    if not isinstance(env.action_space, gym.spaces.Box):
        fail(f"{env_id} has a {type(env.action_space).__name__} action space; SAC needs a continuous (Box) one")
    return env


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
    """Transitions as rows of one preallocated tensor on the device, sampled uniformly with replacement there
    into one fixed batch tensor, which the updates read: a captured update then has no inputs to copy.

    A row is [obs, action, reward, next_obs, done]. Adding a transition is two parts: `stage` copies the row
    to the device (host work), `push` stores it (device work only, so a captured training step does it). The
    write position and the size are device tensors, for the same reason.
    """

    def __init__(self, size, batch_size, n_obs, n_act, device):
        widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = torch.zeros(size, sum(widths), device=device)
        self.row = torch.zeros(1, sum(widths), device=device)
        self.batch = torch.zeros(batch_size, sum(widths), device=device)
        obs, actions, rewards, next_obs, dones = self.batch.split(widths, dim=1)
        # Views into self.batch: each sample overwrites what they show.
        self.fields = (obs, actions, rewards.squeeze(1), next_obs, dones.squeeze(1))
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)
        self.size = torch.zeros(1, dtype=torch.long, device=device)
        self.max_size, self.device = size, device

    def stage(self, obs, next_obs, action, reward, done):
        row = np.concatenate([obs, action, [reward], next_obs, [done]], dtype=np.float32)
        # From pageable memory: the copy has read `row` when it returns.
        self.row.copy_(torch.from_numpy(row)[None], non_blocking=True)

    def push(self):
        self.storage.index_copy_(0, self.ptr, self.row)
        self.ptr.add_(1).remainder_(self.max_size)
        self.size.add_(1).clamp_(max=self.max_size)

    def sample(self):
        # Uniform over the stored rows with the size on the device: 62-bit draws reduced modulo the size
        # (a relative bias below 2**-40).
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device).remainder_(self.size)
        torch.index_select(self.storage, 0, idx, out=self.batch)


class Agent:
    """The networks, optimizers and entropy coefficient SAC trains."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        # The policy used to act: shares the actor's storage, records no gradients.
        self.actor_detach = Actor(n_obs, n_act, action_low, action_high, device="meta")
        from_module(self.actor).data.to_module(self.actor_detach)
        self.actor_detach.requires_grad_(False)  # to_module wraps the detached tensors as Parameters again
        # Both Q networks as one stacked set of parameters, evaluated with vmap over a stateless module.
        qf1 = SoftQNetwork(n_obs, n_act, device=device)
        qf2 = SoftQNetwork(n_obs, n_act, device=device)
        self.qnet_params = from_modules(qf1, qf2, as_module=True)
        self.qnet_target = self.qnet_params.data.clone()
        self.qnet = SoftQNetwork(n_obs, n_act, device="meta")
        # Plain dicts of the same tensors for functional_call, built once (updates happen in place).
        self.q_params, self.q_params_data, self.q_target = (
            dict(td.flatten_keys(".").items()) for td in (self.qnet_params, self.qnet_params.data, self.qnet_target)
        )
        # capturable: Adam keeps its step count on the device, so a replayed graph advances it
        capturable = args.cudagraphs and device.type == "cuda"
        self.q_optimizer = optim.Adam(self.qnet_params.values(True, True), lr=args.q_lr, capturable=capturable)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.policy_lr, capturable=capturable)
        # Automatic entropy tuning; alpha stays a device tensor so that no update reads it back to the host
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr, capturable=capturable)
        self.alpha = self.log_alpha.detach().exp() if args.autotune else torch.tensor([args.alpha], device=device)

    def qvalues(self, params, obs, actions):
        """Q values of both networks, stacked: shape (2, batch, 1)."""
        return torch.vmap(lambda p: torch.func.functional_call(self.qnet, p, (obs, actions)))(params)


def make_update_fns(agent, args, batch):
    """The three steps of a SAC update: critic, actor (with the entropy coefficient), target networks;
    and the policy that acts. The updates read their batch from `batch` (obs, actions, rewards, next_obs,
    dones), fixed tensors that each sample overwrites. With --compile each is compiled; --cudagraphs captures
    them in make_train_step (the updates) and make_act (the policy)."""

    def update_critic():
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
            qf_next_target = agent.qvalues(agent.q_target, next_obs, next_state_actions)
            min_qf_next_target = qf_next_target.min(0).values - agent.alpha * next_state_log_pi
            next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * min_qf_next_target.view(-1)

        qf_a_values = agent.qvalues(agent.q_params, obs, actions).view(2, -1)
        qf_loss = (qf_a_values - next_q_value).pow(2).mean(1).sum()
        qf1_a_values, qf2_a_values = qf_a_values

        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        return torch.stack([qf_loss, qf1_a_values.mean(), qf2_a_values.mean()]).detach()

    def actor_step():
        obs = batch[0]
        pi, log_pi, _ = agent.actor.get_action(obs)
        min_qf_pi = agent.qvalues(agent.q_params_data, obs, pi).min(0).values
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
        return torch.stack([actor_loss, alpha_loss]).detach()

    def update_targets():
        # one fused lerp over every target parameter
        agent.qnet_target.lerp_(agent.qnet_params.data, args.tau)

    def policy(obs):
        actions, _, _ = agent.actor_detach.get_action(obs)
        return actions

    if args.compile:
        # One actor step per compiled function: its graph breaks (at the optimizer calls) cannot resume inside a
        # loop, so a compiled loop would run eagerly.
        update_critic, actor_step, update_targets, policy = map(
            torch.compile, (update_critic, actor_step, update_targets, policy)
        )

    def update_actor():
        # policy_frequency updates on the same batch, compensating for the delay
        for _ in range(args.policy_frequency):
            info = actor_step()
        return info

    return update_critic, update_actor, update_targets, policy


def make_train_step(rb, update_critic, update_actor, update_targets, args):
    """train(actor_update, target_update): what follows an env step once learning has started. It stores the
    staged transition, samples a batch, updates the critic, then the actor and the targets if asked. With
    --cudagraphs each kind of step is one captured graph: one replay per env step. The latest losses land in
    `losses` (qf_loss, qf1 values, qf2 values, actor_loss, alpha_loss), on the device."""
    losses = torch.zeros(5, device=rb.device)

    def step(actor_update, target_update):
        rb.push()
        rb.sample()
        losses[:3].copy_(update_critic())
        if actor_update:  # TD3-style delayed update
            losses[3:].copy_(update_actor())
        if target_update:
            update_targets()

    steps = {}

    def train(actor_update, target_update):
        kind = (actor_update, target_update)
        if kind not in steps:
            steps[kind] = functools.partial(step, *kind)
            if args.cudagraphs:
                steps[kind] = CudaGraphModule(steps[kind], warmup=3 if args.compile else 2)
        steps[kind]()

    return train, losses


def make_act(policy, args, n_obs, n_act, device):
    """act(obs) -> action, numpy arrays in and out, for one env.

    The observation reaches a fixed device tensor through pinned host memory, and the action comes back the
    same way. With --cudagraphs both copies are part of the captured graph: acting costs one replay and one
    wait for the device."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(1, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(1, n_obs, device=device)
    action_host = torch.zeros(1, n_act, pin_memory=pinned)

    def staged():
        obs_device.copy_(obs_host, non_blocking=True)
        action_host.copy_(policy(obs_device), non_blocking=True)

    if args.cudagraphs:
        staged = CudaGraphModule(staged, warmup=3 if args.compile else 2)

    def act(obs):
        obs_host.numpy()[0] = obs  # the previous act's copies are done: it waited for them
        staged()
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        return action_host.numpy()[0].copy()

    return act


def main(argv=None):
    args = tyro.cli(Args, args=argv)
    check_args(args)
    t_start = time.perf_counter()
    script = os.path.basename(__file__)[: -len(".py")]
    run_name = f"{args.env_id}__{script}__{args.seed}__{int(time.time())}"
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.cudagraphs and device.type != "cuda":
        print("warning: --cudagraphs needs CUDA; running without CUDA graphs", file=sys.stderr)
        args.cudagraphs = False
    # Named scopes for the profiler (--profile-dir); free when not profiling.
    phase = record_function if args.profile_dir else lambda name: nullcontext()

    env = make_single_env(args.env_id, args.seed)
    n_obs = int(np.prod(env.observation_space.shape))
    n_act = int(np.prod(env.action_space.shape))
    space = env.action_space
    agent = Agent(args, n_obs, n_act, space.low, space.high, device)
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_obs, n_act, device)
    update_critic, update_actor, update_targets, policy = make_update_fns(agent, args, rb.fields)
    train, losses = make_train_step(rb, update_critic, update_actor, update_targets, args)
    act = make_act(policy, args, n_obs, n_act, device)

    obs, _ = env.reset(seed=args.seed)
    returns = deque(maxlen=20)
    curve = []  # [global_step, seconds since start, mean return], for return-vs-time plots
    curve_every = max(1000, args.total_timesteps // 50)
    window_start = min(args.learning_starts + WARMUP_STEPS, args.total_timesteps)
    t_window = profiler = None

    next_action = None
    pbar = tqdm.tqdm(range(args.total_timesteps), mininterval=1.0)
    for global_step in pbar:
        if global_step == window_start:
            t_window = time.perf_counter()
            if args.profile_dir:
                profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA][: 1 + (device.type == "cuda")])
                profiler.start()
        elif profiler is not None and global_step == min(window_start + PROFILE_STEPS, args.total_timesteps - 1):
            profiler.stop()
            os.makedirs(args.profile_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(args.profile_dir, f"{script}.trace.json"))
            profiler = None

        with phase("policy"):
            if global_step < args.learning_starts:
                action = env.action_space.sample()
            elif next_action is not None:  # chosen ahead, before the last (critic-only) update
                action, next_action = next_action, None
            else:
                action = act(obs)

        with phase("env_step"):
            next_obs, reward, termination, truncation, info = env.step(action)

        with phase("data"):
            # The transition keeps the true final observation; then the env resets in the same step.
            rb.stage(obs, next_obs, action, reward, termination)
            if termination or truncation:
                returns.append(float(info["episode"]["r"]))
                if args.track:
                    wandb.log({"charts/episodic_return": returns[-1]}, step=global_step)
                next_obs, _ = env.reset()
            obs = next_obs

        if global_step < args.learning_starts:
            with phase("data"):
                rb.push()
        else:
            actor_update = global_step % args.policy_frequency == 0
            if not actor_update and global_step + 1 < args.total_timesteps:
                # This update leaves the actor as it is: act for the next step now, so that the env steps
                # while the device runs the critic update.
                with phase("policy"):
                    next_action = act(obs)
            with phase("update"):
                train(actor_update, global_step % args.target_network_frequency == 0)

        if global_step % curve_every == 0 and global_step > 0:
            with phase("other"):
                fps = (global_step - window_start) / (time.perf_counter() - t_window) if t_window else None
                mean_return = float(np.mean(returns)) if returns else None
                if mean_return is not None:
                    curve.append([global_step, round(time.perf_counter() - t_start, 3), round(mean_return, 2)])
                pbar.set_description(f"fps: {fps or 0:.0f}, return: {mean_return or float('nan'):.1f}")
                if args.track and global_step > args.learning_starts + args.policy_frequency:
                    qf_loss, qf1_a, qf2_a, actor_loss, alpha_loss = losses.tolist()
                    wandb.log(
                        {
                            "losses/qf_loss": qf_loss,
                            "losses/qf1_values": qf1_a,
                            "losses/qf2_values": qf2_a,
                            "losses/actor_loss": actor_loss,
                            "losses/alpha": float(agent.alpha),
                            "losses/alpha_loss": alpha_loss,
                            "charts/SPS": fps or 0.0,
                        },
                        step=global_step,
                    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    pbar.close()
    env.close()
    steps_in_window = args.total_timesteps - window_start
    record = {
        "script": script,
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": args.compile,
        "cudagraphs": args.cudagraphs,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "total_timesteps": args.total_timesteps,
        "fps": round(steps_in_window / (t_end - t_window), 1) if steps_in_window > 0 else None,
        "fps_overall": round(args.total_timesteps / (t_end - t_start), 1),
        "warmup_seconds": round(t_window - t_start, 3) if steps_in_window > 0 else None,
        "wall_seconds": round(t_end - t_start, 3),
        "episodic_return": round(float(np.mean(returns)), 2) if returns else None,
        "return_curve": curve,
    }
    if args.track:
        wandb.finish()
    line = json.dumps(record)
    if args.speed_log:
        # One write of a whole line in append mode, so concurrent runs never interleave.
        with open(args.speed_log, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return record


if __name__ == "__main__":
    main()
