# SAC at GPU scale with the FastSAC recipe (FastTD3's repository, fast_sac/): thousands of batched MuJoCo envs simulated
# with MuJoCo Warp on the device that torch uses, the replay buffer there, large critics and batches, in eager PyTorch.
# Docs: docs/sac_gpu_mujoco.md
import math
import os
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import mujoco
import mujoco_warp as mjw
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import warp as wp

from harness import Run, RunOptions, exit_code, fail, parse_args


@dataclass
class Args(RunOptions):
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5 or Ant-v5"""
    total_timesteps: int = 51200000
    """total timesteps of the experiment (env steps of all envs), a multiple of --num-envs"""
    num_envs: int = 1024
    """the number of parallel environments (MuJoCo Warp worlds)"""
    buffer_size: int = 10485760
    """the replay memory buffer size, in transitions: --buffer-size // --num-envs of each env"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.1
    """target smoothing coefficient, applied after every gradient update"""
    batch_size: int = 32768
    """the batch size of samples from the replay memory, --batch-size // --num-envs from each env"""
    num_updates: int = 2
    """the gradient updates per env step (of all envs)"""
    learning_starts: int = 10240
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer (AdamW)"""
    q_lr: float = 3e-4
    """the learning rate of the Q network optimizer (AdamW) and of the entropy coefficient's (Adam)"""
    weight_decay: float = 0.1
    """the weight decay of the policy and Q network optimizers (AdamW)"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed), in gradient updates"""
    alpha: float = 0.001
    """entropy regularization coefficient: fixed without --autotune, the starting value with it"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    critic_hidden_dim: int = 1024
    """the width of the critics' first layer (then halved twice)"""
    actor_hidden_dim: int = 512
    """the width of the actor's first layer (then halved twice)"""
    amp: bool = False
    """bf16 autocast of the networks in the updates and the policy (FastTD3's --amp): faster, not fp32's result"""


# Vector steps (of all envs) after learning_starts before the fps window opens, and vector steps --profile-dir profiles.
WARMUP_STEPS, PROFILE_STEPS = 5, 2
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer and the envs.
AGENT_STATE = ("actor", "qf1", "qf2", "qf1_target", "qf2_target", "q_optimizer", "actor_optimizer", "a_optimizer",
               "log_alpha")  # fmt: skip
# The statistics of an update, logged as losses/<name>, with losses/alpha.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha_loss")


def check_args(args):
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    for name in ("total_timesteps", "batch_size"):
        if getattr(args, name) % args.num_envs:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of --num-envs {args.num_envs}")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size} and --num-envs "
             f"{args.num_envs}")  # fmt: skip
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    for name in ("num_updates", "critic_hidden_dim", "actor_hidden_dim"):
        if getattr(args, name) < {"num_updates": 1}.get(name, 4):
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is too small")
    if args.alpha <= 0:
        fail(f"--alpha {args.alpha} must be positive: the entropy coefficient is kept as its log")


# ======== MuJoCo Warp envs: the same in every script on them, stamped from ppo_continuous_action_gpu_mujoco.py ========
# gymnasium's TimeLimit of its MuJoCo envs, and the clip of normalised observations and rewards (CleanRL's wrappers).
MAX_EPISODE_STEPS, NORMALIZED_CLIP = 1000, 10.0


class HalfCheetah:
    """gymnasium's HalfCheetah-v5 with its defaults (as each class below, from gymnasium's v5 sources): reward the x
    velocity - 0.1 * sum(a^2), no termination, observation qpos[1:] and qvel, reset noise U(-0.1, 0.1) on positions
    and 0.1 * N(0, 1) on velocities."""

    xml, frame_skip, noise, normal_qvel, ctrl_cost = "half_cheetah.xml", 5, 0.1, True, 0.1
    healthy_reward, skipped_qpos, qvel_clip, contact_forces = 0.0, 1, math.inf, False

    @staticmethod
    def healthy(qpos, qvel):
        return torch.ones_like(qpos[:, 0], dtype=torch.bool)


class Hopper(HalfCheetah):
    """Hopper-v5: + 1 while healthy, which it must stay; velocities clipped to 10 in the observation."""

    xml, frame_skip, noise, normal_qvel, ctrl_cost = "hopper.xml", 4, 5e-3, False, 1e-3
    healthy_reward, qvel_clip = 1.0, 10.0

    @staticmethod
    def healthy(qpos, qvel):
        state, z, angle = torch.cat((qpos[:, 2:], qvel), 1), qpos[:, 1], qpos[:, 2]
        return (state.abs() < 100).all(1) & (z > 0.7) & (angle > -0.2) & (angle < 0.2)


class Walker2d(Hopper):
    """Walker2d-v5: Hopper's reward, healthy while 0.8 < z < 2 and the torso's angle is within (-1, 1)."""

    xml = "walker2d_v5.xml"

    @staticmethod
    def healthy(qpos, qvel):
        z, angle = qpos[:, 1], qpos[:, 2]
        return (z > 0.8) & (z < 2.0) & (angle > -1.0) & (angle < 1.0)


class Ant(HalfCheetah):
    """Ant-v5: its torso's x velocity + 1 while healthy - 0.5 * sum(a^2) - 5e-4 * the sum of the squared external
    contact forces (cfrc_ext) clipped to [-1, 1], which the observation holds too (105 values)."""

    xml, ctrl_cost, contact_cost, healthy_reward, skipped_qpos, contact_forces = "ant.xml", 0.5, 5e-4, 1, 2, True

    @staticmethod
    def healthy(qpos, qvel):
        finite = torch.isfinite(qpos).all(1) & torch.isfinite(qvel).all(1)
        return finite & (qpos[:, 2] >= 0.2) & (qpos[:, 2] <= 1.0)


ENVS = {"HalfCheetah-v5": HalfCheetah, "Hopper-v5": Hopper, "Walker2d-v5": Walker2d, "Ant-v5": Ant}


class RunningMeanStd:
    """gymnasium's RunningMeanStd (of its normalisation wrappers) on the device in float64, updated in place."""

    def __init__(self, shape, device):
        self.mean = torch.zeros(shape, dtype=torch.float64, device=device)
        self.var = torch.ones(shape, dtype=torch.float64, device=device)
        self.count = torch.full((), 1e-4, dtype=torch.float64, device=device)

    def update(self, x):
        x, n = x.double(), x.shape[0]
        delta, total = x.mean(0) - self.mean, self.count + n
        self.var.copy_((self.var * self.count + x.var(0, correction=0) * n + delta**2 * self.count * n / total) / total)
        self.mean.add_(delta * n / total)
        self.count.copy_(total)

    def normalize(self, x, center=True):
        return ((x - self.mean * center) / torch.sqrt(self.var + 1e-8)).clamp(-NORMALIZED_CLIP, NORMALIZED_CLIP).float()


class Envs:
    """num_envs copies of one of ENVS as MuJoCo Warp worlds on torch's device, whose arrays torch reads and writes in
    place (wp.to_torch: no copy), with gymnasium's time limit and same-step auto-reset, and CleanRL's wrappers as
    gymnasium's vector ones: actions clipped; observations and rewards normalised with statistics of all envs, then
    clipped. The envs' returns and lengths are summed on the device until ended_episodes() reads them. `state`: the
    tensors the envs go on from, for checkpoints."""

    def __init__(self, env_id, num_envs, gamma, device):
        self.task, self.num_envs, self.gamma = ENVS[env_id], num_envs, gamma
        assets = os.path.join(os.path.dirname(gym.__file__), "envs", "mujoco", "assets")
        mjm = mujoco.MjModel.from_xml_path(os.path.join(assets, self.task.xml))  # gymnasium's own model file
        self.dt, self.n_act, self.graph = mjm.opt.timestep * self.task.frame_skip, mjm.nu, None
        wp.config.log_level = wp.LOG_WARNING  # not a line per kernel module loaded
        wp.init()
        wp.set_device(str(device))  # "cuda": the current CUDA device, as torch's
        try:
            self.model, self.data = mjw.put_model(mjm), mjw.make_data(mjm, nworld=num_envs)
        except (ValueError, RuntimeError) as e:  # too many worlds for an array, or for the memory
            fail(f"--num-envs {num_envs}: MuJoCo Warp cannot make that many worlds here: {str(e).splitlines()[0]}")
        views = [wp.to_torch(getattr(self.data, name)) for name in ("qpos", "qvel", "qacc_warmstart", "ctrl", "xpos")]
        self.qpos, self.qvel, self.warmstart, self.ctrl, self.xpos = views
        self.cfrc_ext, self.qpos0 = wp.to_torch(self.data.cfrc_ext), torch.as_tensor(mjm.qpos0, device=device).float()
        self.low, self.high = torch.as_tensor(mjm.actuator_ctrlrange, device=device).float().unbind(1)
        # The kernels load here (built on first use: about a minute on a GPU, more on a CPU; then cached).
        if device.type == "cuda":  # the MuJoCo steps of an env step as one Warp graph
            with wp.ScopedCapture() as capture:
                self.mujoco_steps()
            self.graph = capture.graph
        else:
            self.mujoco_steps()
        wp.synchronize_device()
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.x_before, self.episode_return, self.ended = zeros(num_envs), zeros(num_envs), zeros(3, num_envs)
        self.elapsed, self.discounted_return = zeros(num_envs, dtype=torch.int32), zeros(num_envs, dtype=torch.float64)
        everyone = torch.ones(num_envs, dtype=torch.bool, device=device)
        self.reset(everyone)
        raw_obs = self.observe(fresh=everyone)
        self.obs_rms, self.return_rms = RunningMeanStd(raw_obs.shape[1:], device), RunningMeanStd((), device)
        self.obs_rms.update(raw_obs)
        self.obs, self.done = self.obs_rms.normalize(raw_obs), zeros(num_envs)
        names = "qpos", "qvel", "warmstart", "x_before", "elapsed", "episode_return", "discounted_return", "obs", "done"
        self.state = {name: getattr(self, name) for name in names}
        for name, rms in (("obs", self.obs_rms), ("return", self.return_rms)):
            self.state.update({f"{name}_{key}": value for key, value in vars(rms).items()})

    def mujoco_steps(self):
        """gymnasium's do_simulation: frame_skip MuJoCo steps, and Ant's contact forces (mj_rnePostConstraint)."""
        for _ in range(self.task.frame_skip):
            mjw.step(self.model, self.data)
        if self.task.contact_forces:
            mjw.rne_postconstraint(self.model, self.data)

    def observe(self, fresh=None):
        """gymnasium's _get_obs; no contact forces where an episode has just reset, `fresh` (mj_resetData zeroes them
        and mj_forward leaves them)."""
        task = self.task
        parts = [self.qpos[:, task.skipped_qpos :], self.qvel.clamp(-task.qvel_clip, task.qvel_clip)]
        if task.contact_forces:
            forces = self.cfrc_ext[:, 1:].clamp(-1, 1).flatten(1)
            parts.append(forces if fresh is None else torch.where(fresh[:, None], 0.0, forces))
        return torch.cat(parts, 1)

    def reset(self, mask):
        """gymnasium's reset of the envs in mask: qpos0 and zero velocities plus the noise, the solver's warm start
        cleared (mj_resetData). Noise is drawn for every env: the same random stream whichever reset."""
        task = self.task
        qpos = self.qpos0 + (torch.rand_like(self.qpos) * 2 - 1) * task.noise
        qvel = torch.randn_like(self.qvel) if task.normal_qvel else torch.rand_like(self.qvel) * 2 - 1
        self.qpos.copy_(torch.where(mask[:, None], qpos, self.qpos))
        self.qvel.copy_(torch.where(mask[:, None], qvel * task.noise, self.qvel))
        self.warmstart.masked_fill_(mask[:, None], 0.0)
        self.x_before.copy_(torch.where(mask, self.qpos[:, 0], self.x_before))  # Ant's torso: at its free joint's qpos

    def step_raw(self, action):
        """gymnasium's vector env of these envs with ClipAction, the time limit and RecordEpisodeStatistics: (next
        observation, final observation, reward, terminated, truncated); the next observation is the first of a new
        episode where the step ended one, the final the one it ended in."""
        task, action = self.task, torch.clamp(action, self.low, self.high)
        self.ctrl.copy_(action)
        self.simulate()
        # The x the reward differentiates: qpos[0]; Ant's, its torso's xpos (as of the last MuJoCo step's start).
        x_after = self.xpos[:, 1, 0] if task.contact_forces else self.qpos[:, 0]
        healthy = task.healthy(self.qpos, self.qvel)
        reward = (x_after - self.x_before) / self.dt + task.healthy_reward * healthy
        reward -= task.ctrl_cost * action.square().sum(1)
        if task.contact_forces:
            reward -= task.contact_cost * self.cfrc_ext.clamp(-1, 1).square().sum((1, 2))
        self.elapsed += 1
        terminated, truncated = ~healthy, self.elapsed >= MAX_EPISODE_STEPS
        done, final_obs = terminated | truncated, self.observe()
        self.x_before.copy_(x_after)
        self.reset(done)
        self.episode_return += reward
        self.ended += torch.stack((done.float(), self.episode_return, self.elapsed.float())) * done
        self.elapsed.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return torch.where(done[:, None], self.observe(fresh=done), final_obs), final_obs, reward, terminated, truncated

    def ended_episodes(self):
        """(episodes ended, sum of their returns, sum of their lengths) since the last call, device scalars."""
        ended = self.ended.sum(1)
        self.ended.zero_()
        return ended

    # ======== end of MuJoCo Warp envs ========

    def simulate(self):
        """mujoco_steps; on CUDA, their Warp graph launched on torch's current stream."""
        if self.graph is None:
            return self.mujoco_steps()
        wp.capture_launch(self.graph, stream=wp.stream_from_torch(torch.cuda.current_stream()))


def layer_widths(hidden_dim):
    """FastSAC's layers: the first of hidden_dim, then halved twice."""
    return hidden_dim, hidden_dim // 2, hidden_dim // 4


class QNetwork(nn.Module):
    """A critic: the Q value of an observation and an action."""

    def __init__(self, n_obs, n_act, hidden_dim, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs + n_act, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc4 = nn.Linear(w3, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x).float()  # fp32 values under --amp too, for the target and the loss


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, hidden_dim, action_low, action_high, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc_mu = nn.Linear(w3, n_act, device=device)
        self.fc_logstd = nn.Linear(w3, n_act, device=device)
        nn.init.normal_(self.fc_mu.weight, 0.0, 0.01)  # FastSAC's init_scale: means near the middle at first
        nn.init.zeros_(self.fc_mu.bias)
        self.register_buffer("action_scale", (action_high - action_low) / 2.0)
        self.register_buffer("action_bias", (action_high + action_low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        mean = self.fc_mu(x).float()  # fp32 under --amp too: the sample and its log-probability
        log_std = torch.tanh(self.fc_logstd(x).float())
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # reparameterization trick: mean + std * N(0,1)
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing action bounds
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


# ======== replay buffer: the same in the off-policy baselines on GPU MuJoCo, stamped from td3_gpu_mujoco.py ========
class ReplayBuffer:
    """FastTD3's buffer on the device: per-env circular storage, rows [obs, action, reward, next_obs, done] of
    buffer_size // num_envs steps of each env; a sample draws batch_size // num_envs of each env's rows, with
    replacement. Observations are stored raw and normalised when sampled."""

    def __init__(self, size, num_envs, n_obs, n_act, device):
        self.widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = torch.zeros(size // num_envs, num_envs, sum(self.widths), device=device)
        self.envs = torch.arange(num_envs, device=device)
        self.ptr, self.size = 0, 0

    def add(self, obs, actions, rewards, next_obs, dones):
        self.storage[self.ptr] = torch.cat([obs, actions, rewards[:, None], next_obs, dones[:, None].float()], 1)
        self.ptr = (self.ptr + 1) % len(self.storage)
        self.size = min(self.size + 1, len(self.storage))

    def sample(self, batch_size):
        idx = torch.randint(0, self.size, (batch_size // len(self.envs), len(self.envs)), device=self.envs.device)
        obs, actions, rewards, next_obs, dones = self.storage[idx, self.envs].flatten(0, 1).split(self.widths, dim=1)
        return obs, actions, rewards.flatten(), next_obs, dones.flatten()

    def state_dict(self):
        """The filled rows, and where the next transitions go."""
        return {"storage": self.storage[: self.size].to("cpu", copy=True), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: state["size"]] = state["storage"]
        self.ptr, self.size = state["ptr"], state["size"]
# ======== end of replay buffer ========


class Agent:
    """The networks, the critics' targets, the optimizers and the entropy coefficient (no target actor: FastSAC's)."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, args.actor_hidden_dim, action_low, action_high, device=device)
        self.qf1 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf2 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf1_target = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf2_target = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        q_params = list(self.qf1.parameters()) + list(self.qf2.parameters())
        self.q_optimizer = optim.AdamW(q_params, lr=args.q_lr, weight_decay=args.weight_decay)
        actor_params = list(self.actor.parameters())
        self.actor_optimizer = optim.AdamW(actor_params, lr=args.policy_lr, weight_decay=args.weight_decay)
        # The entropy coefficient alpha = exp(log_alpha), from --alpha; --autotune steps it towards the target entropy.
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.full((1,), math.log(args.alpha), device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr)


def autocast(args, device):
    """--amp: the networks' layers in bf16 (the critics' values and the actor's mean and log std leave them in fp32)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.amp)


def make_update_fns(agent, args):
    """The steps of an update on a batch of normalised observations: the critics; the delayed actor step, then the
    entropy coefficient's with --autotune; the soft update of the critics' targets, after every gradient update
    (FastSAC's)."""

    def update_critic(obs, actions, rewards, next_obs, dones):
        alpha = agent.log_alpha.detach().exp()
        with autocast(args, obs.device):
            with torch.no_grad():
                # The next action sampled from the actor itself (FastSAC: no target actor).
                next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
                qf1_next_target = agent.qf1_target(next_obs, next_state_actions)
                qf2_next_target = agent.qf2_target(next_obs, next_state_actions)
                min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                next_q_value = rewards + (1 - dones) * args.gamma * min_qf_next_target.view(-1)
            qf1_a_values = agent.qf1(obs, actions).view(-1)
            qf2_a_values = agent.qf2(obs, actions).view(-1)
            qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
            qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
            qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def update_actor(obs):
        alpha = agent.log_alpha.detach().exp()
        # The smaller of the two critics' values. The gradients this leaves on the critics are discarded: the critic
        # step zeroes them before it steps.
        with autocast(args, obs.device):
            pi, log_pi, _ = agent.actor.get_action(obs)
            min_qf_pi = torch.min(agent.qf1(obs, pi), agent.qf2(obs, pi))
            actor_loss = (alpha * log_pi - min_qf_pi).mean()
        agent.actor_optimizer.zero_grad()
        actor_loss.backward()
        agent.actor_optimizer.step()
        alpha_loss = torch.zeros((), device=obs.device)
        if args.autotune:  # from a fresh sample of the stepped actor (FastSAC's)
            with autocast(args, obs.device):
                with torch.no_grad():
                    _, log_pi, _ = agent.actor.get_action(obs)
                alpha_loss = -(agent.log_alpha.exp() * (log_pi + agent.target_entropy)).mean()
            agent.a_optimizer.zero_grad()
            alpha_loss.backward()
            agent.a_optimizer.step()
        return {"actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach()}

    def update_targets():
        for net, target in ((agent.qf1, agent.qf1_target), (agent.qf2, agent.qf2_target)):
            for param, target_param in zip(net.parameters(), target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

    return update_critic, update_actor, update_targets


def actor_updates(args, vector_step):
    """Which of a vector step's gradient updates step the actor: every --policy-frequency-th of the run."""
    return [(vector_step * args.num_updates + k) % args.policy_frequency == args.policy_frequency - 1
            for k in range(args.num_updates)]  # fmt: skip


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase, n_envs = run.device, run.phase, args.num_envs
    envs = Envs(args.env_id, n_envs, args.gamma, device)
    n_obs, n_act, obs_rms = envs.obs.shape[1], envs.n_act, envs.obs_rms  # statistics of the first observations
    agent = Agent(args, n_obs, n_act, envs.low, envs.high, device)
    update_critic, update_actor, update_targets = make_update_fns(agent, args)
    rb = ReplayBuffer(args.buffer_size, n_envs, n_obs, n_act, device)
    obs = envs.observe(fresh=torch.ones(n_envs, dtype=torch.bool, device=device))  # raw; updated in place
    stats = {}  # the latest value of each of STATS
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one.
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb, "envs": envs.state, "obs": obs}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS * n_envs,
                           profile_steps=PROFILE_STEPS * n_envs, env_steps_per_call=n_envs,
                           warmup_from=args.learning_starts)  # fmt: skip
    # global_step counts env steps, n_envs per vector step.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        run.unit(global_step)
        with phase("policy"), torch.no_grad(), autocast(args, device):
            actions, _, _ = agent.actor.get_action(obs_rms.normalize(obs))
        with phase("env_step"):
            next_obs, final_obs, rewards, terminations, _ = envs.step_raw(actions)
        with phase("data"):
            # A finished episode's last transition keeps its true final observation; a truncation is no end.
            rb.add(obs, actions, rewards, final_obs, terminations)
            obs_rms.update(next_obs)
            obs.copy_(next_obs)
        if global_step >= args.learning_starts:
            for actor_update in actor_updates(args, global_step // n_envs):
                with phase("data"):
                    b_obs, b_actions, b_rewards, b_next_obs, b_dones = rb.sample(args.batch_size)
                    b_obs, b_next_obs = obs_rms.normalize(b_obs), obs_rms.normalize(b_next_obs)
                with phase("update"):
                    stats.update(update_critic(b_obs, b_actions, b_rewards, b_next_obs, b_dones))
                    if actor_update:  # delayed policy updates
                        stats.update(update_actor(b_obs))
                    update_targets()
        with phase("other"):
            if run.tick(global_step + n_envs):
                # The episodes ended since the last tick count as one, their mean; read back in one sync.
                ended, return_sum, length_sum = envs.ended_episodes().tolist()
                if ended:
                    run.episode(global_step + n_envs, return_sum / ended, length_sum / ended)
                if "actor_loss" in stats:
                    losses = {f"losses/{name}": stats[name] for name in STATS}
                    run.log(global_step, {**losses, "losses/alpha": agent.log_alpha.detach().exp()})


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved actor's deterministic action (its squashed mean), episode after episode on
    gymnasium's own env of the same id (MuJoCo's C simulator, which the batched envs reproduce), observations
    normalised with the saved statistics, frozen."""
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
    n_obs, n_act = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = (torch.as_tensor(bound, device=run.device) for bound in (env.action_space.low, env.action_space.high))
    actor = Actor(n_obs, n_act, args.actor_hidden_dim, low, high, device=run.device)
    actor.load_state_dict(saved["actor"])
    obs_rms = RunningMeanStd((n_obs,), run.device)
    for key in ("mean", "var", "count"):
        getattr(obs_rms, key).copy_(saved["envs"][f"obs_{key}"])
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            _, _, action = actor.get_action(obs_rms.normalize(torch.as_tensor(obs, device=run.device)[None]))
        obs, _, terminated, truncated, info = env.step(action[0].cpu().numpy())
        if terminated or truncated:
            yield info["episode"]["r"]
            obs, _ = env.reset()


def main(argv=None):
    """Train, or with --eval-checkpoint evaluate, as the arguments say; returns the record printed last."""
    args, checkpoint = parse_args(Args, __file__, argv)
    check_args(args)
    run = Run(args, __file__, checkpoint)
    if args.eval_checkpoint:
        return run.evaluation(evaluate(args, run, checkpoint["state"]))
    with run.stoppable():
        train(args, run)
    return run.finish()


if __name__ == "__main__":
    sys.exit(exit_code(main()))
