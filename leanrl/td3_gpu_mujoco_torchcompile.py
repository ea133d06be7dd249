# TD3 at GPU scale, the FastTD3 recipe (Seo et al. 2025): thousands of MuJoCo Warp envs on torch's device, the replay
# buffer there, a distributional (C51) pair of critics, large batches; made fast: the critics one vmapped ensemble,
# the env step (Warp's physics included) and the updates CUDA graphs, compile. Docs: docs/td3_gpu_mujoco.md
import functools
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
from tensordict.nn import CudaGraphModule

from harness import Run, RunOptions, exit_code, fail, parse_args


@dataclass
class Args(RunOptions):
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5 or Ant-v5"""
    total_timesteps: int = 51200000
    """total timesteps of the experiment (env steps of all envs), a multiple of --num-envs"""
    num_envs: int = 1024
    """the number of parallel environments (MuJoCo Warp worlds)"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizers (AdamW)"""
    weight_decay: float = 0.1
    """the weight decay of the optimizers (AdamW)"""
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
    policy_noise: float = 0.001
    """the scale of policy noise"""
    noise_clip: float = 0.5
    """noise clip parameter of the Target Policy Smoothing Regularization"""
    std_min: float = 0.001
    """the smallest scale of an env's exploration noise, drawn uniformly in [--std-min, --std-max] at each reset"""
    std_max: float = 0.4
    """the largest scale of an env's exploration noise"""
    learning_starts: int = 10240
    """timestep to start learning"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed), in gradient updates"""
    num_atoms: int = 101
    """the number of atoms of the distributional critics (C51)"""
    v_max: float = 1000.0
    """the critics' support: --num-atoms values evenly spaced in [-v_max, v_max]"""
    critic_hidden_dim: int = 1024
    """the width of the critics' first layer (then halved twice)"""
    actor_hidden_dim: int = 512
    """the width of the actor's first layer (then halved twice)"""
    amp: bool = False
    """bf16 autocast of the networks in the updates and the policy (FastTD3's --amp): faster, not fp32's result"""
    compile: bool = False
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture the env step (policy, Warp's physics, storage) and each vector step's updates as CUDA graphs"""


# Vector steps (of all envs) after learning_starts before the fps window opens, and vector steps --profile-dir profiles.
WARMUP_STEPS, PROFILE_STEPS = 5, 2
# What a checkpoint keeps of the agent, with the replay buffer, the envs and the exploration noise.
AGENT_STATE = ("actor", "qnet_params", "qnet_target", "q_optimizer", "actor_optimizer")
# The statistics of an update, logged as losses/<name>.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss")


def check_args(args):
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    for name in ("total_timesteps", "batch_size"):
        if getattr(args, name) % args.num_envs:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of --num-envs {args.num_envs}")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size} and --num-envs "
             f"{args.num_envs}")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    for name in ("num_updates", "critic_hidden_dim", "actor_hidden_dim"):
        if getattr(args, name) < {"num_updates": 1}.get(name, 4):
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is too small")
    if args.num_atoms < 2 or args.v_max == 0:
        fail(f"--num-atoms {args.num_atoms} must be >= 2 and --v-max {args.v_max} positive")
    if args.std_min > args.std_max:
        fail(f"--std-min {args.std_min} must be at most --std-max {args.std_max}")


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

    # ======== MuJoCo Warp in torch's capture: the same in every twin on those envs, stamped from the PPO twin ========
    captured = []  # the Warp graphs that simulate's captures leave, kept: they own their kernels' memory

    @torch.compiler.disable  # Warp's launches: outside what torch.compile traces
    def simulate(self):
        """mujoco_steps; on CUDA, their Warp graph launched on torch's current stream."""
        if self.graph is None:
            return self.mujoco_steps()
        stream = wp.stream_from_torch(torch.cuda.current_stream())
        if not torch.cuda.is_current_stream_capturing():
            return wp.capture_launch(self.graph, stream=stream)
        # In torch's capture of the rollout a Warp graph cannot launch, but Warp's kernels join that capture once
        # Warp is told of it (an external capture); the Warp graph it returns holds their memory, kept.
        wp.capture_begin(stream=stream, external=True, capture_mode=wp.CaptureMode.GLOBAL)
        with wp.ScopedStream(stream, sync_enter=False):
            self.mujoco_steps()
        self.captured.append(wp.capture_end(stream=stream))
    # ======== end of MuJoCo Warp in torch's capture ========


def layer_widths(hidden_dim):
    """FastTD3's layers: the first of hidden_dim, then halved twice."""
    return hidden_dim, hidden_dim // 2, hidden_dim // 4


class QNetwork(nn.Module):
    """A distributional critic (C51): logits over num_atoms values of the support, for an observation and an action."""

    def __init__(self, n_obs, n_act, hidden_dim, num_atoms, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs + n_act, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc4 = nn.Linear(w3, num_atoms, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x).float()  # fp32 logits under --amp too, for the softmax, the projection and the loss


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, hidden_dim, action_low, action_high, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc_mu = nn.Linear(w3, n_act, device=device)
        nn.init.normal_(self.fc_mu.weight, 0.0, 0.01)  # FastTD3's init_scale: actions near the middle at first
        nn.init.zeros_(self.fc_mu.bias)
        self.register_buffer("action_scale", (action_high - action_low) / 2.0)
        self.register_buffer("action_bias", (action_high + action_low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        x = torch.tanh(self.fc_mu(x))
        return x * self.action_scale + self.action_bias


def project(probs, rewards, bootstrap, gamma, support):
    """C51's projection (FastTD3's): the distribution of rewards + gamma * bootstrap * Z, Z ~ probs over `support`
    (leading dimensions of probs kept), clipped to the support and split between the two atoms around each value."""
    v_min, v_max, num_atoms = support[0], support[-1], len(support)
    target_z = (rewards[:, None] + bootstrap[:, None] * gamma * support).clamp(v_min, v_max)
    b = (target_z - v_min) / ((v_max - v_min) / (num_atoms - 1))
    lower, upper = b.floor().long(), b.ceil().long()
    # A value on an atom: all its mass there (lower and upper moved apart, the weight of the moved one is 0).
    lower = torch.where((upper > 0) & (lower == upper), lower - 1, lower)
    upper = torch.where((lower < num_atoms - 1) & (lower == upper), upper + 1, upper)
    lower, upper = lower.expand_as(probs), upper.expand_as(probs)
    projected = torch.zeros_like(probs).scatter_add_(-1, lower, probs * (upper - b))
    return projected.scatter_add_(-1, upper, probs * (b - lower))


# ======== replay buffer, graphs: the same in the off-policy twins on GPU MuJoCo, stamped from the TD3 twin ========
class ReplayBuffer:
    """FastTD3's buffer on the device: per-env circular storage, rows [obs, action, reward, next_obs, done] of
    buffer_size // num_envs steps of each env; a sample draws batch_size // num_envs of each env's rows, with
    replacement. Observations are stored raw and normalised when sampled. Where the next rows go and how many
    are held: device tensors, which captured graphs read and advance."""

    def __init__(self, size, num_envs, n_obs, n_act, device):
        self.widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = torch.zeros(size // num_envs, num_envs, sum(self.widths), device=device)
        self.envs = torch.arange(num_envs, device=device)
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)
        self.size = torch.zeros(1, dtype=torch.long, device=device)

    def add(self, obs, actions, rewards, next_obs, dones):
        rows = torch.cat([obs, actions, rewards[:, None], next_obs, dones[:, None].float()], 1)
        self.storage.index_copy_(0, self.ptr, rows[None])
        self.ptr.add_(1).remainder_(len(self.storage))
        self.size.add_(1).clamp_(max=len(self.storage))

    def sample(self, batch_size):
        # Uniform with the size on the device: 62-bit draws modulo the size (a relative bias below 2**-40).
        shape = (batch_size // len(self.envs), len(self.envs))
        idx = torch.randint(0, 2**62, shape, device=self.envs.device).remainder_(self.size)
        obs, actions, rewards, next_obs, dones = self.storage[idx, self.envs].flatten(0, 1).split(self.widths, dim=1)
        return obs, actions, rewards.flatten(), next_obs, dones.flatten()

    def state_dict(self):
        """The filled rows, and where the next transitions go."""
        return {"storage": self.storage[: int(self.size)].to("cpu", copy=True), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: len(state["storage"])].copy_(state["storage"])  # in place: graphs hold these very tensors
        self.ptr.copy_(state["ptr"])
        self.size.copy_(state["size"])
# ======== end of replay buffer, graphs ========


class Agent:
    """The networks, the critics' targets, the optimizers and the critics' support (no target actor: FastTD3's)."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, args.actor_hidden_dim, action_low, action_high, device=device)
        # Both critics as one stacked {name: tensor of both} (and its target copy), evaluated by qlogits
        qf1 = QNetwork(n_obs, n_act, args.critic_hidden_dim, args.num_atoms, device=device)
        qf2 = QNetwork(n_obs, n_act, args.critic_hidden_dim, args.num_atoms, device=device)
        self.qnet_params, _ = torch.func.stack_module_state([qf1, qf2])
        self.qnet_target = {name: p.detach().clone() for name, p in self.qnet_params.items()}
        self.qnet = QNetwork(n_obs, n_act, args.critic_hidden_dim, args.num_atoms, device="meta")  # no storage
        capturable = args.cudagraphs and device.type == "cuda"  # AdamW's step count on the device, for graphs
        self.q_optimizer = optim.AdamW(self.qnet_params.values(), lr=args.learning_rate,
                                       weight_decay=args.weight_decay, capturable=capturable)  # fmt: skip
        self.actor_optimizer = optim.AdamW(self.actor.parameters(), lr=args.learning_rate,
                                           weight_decay=args.weight_decay, capturable=capturable)  # fmt: skip
        self.support = torch.linspace(-args.v_max, args.v_max, args.num_atoms, device=device)
        self.action_low, self.action_high = action_low, action_high

    def qlogits(self, params, obs, actions):
        """Both critics' logits for the stacked parameters `params`: shape (2, batch, num_atoms)."""
        return torch.vmap(lambda p: torch.func.functional_call(self.qnet, p, (obs, actions)))(params)


def autocast(args, device):
    """--amp: the networks' layers in bf16 (the critics' logits and the actor's actions leave them in fp32)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.amp)


def make_update_fns(agent, args):
    """The steps of an update on a batch of normalised observations: the critics; the delayed actor step; the soft
    update of the critics' targets, after every gradient update (FastTD3's); and the policy that acts, with each
    env's exploration noise. --compile compiles each."""

    def update_critic(obs, actions, rewards, next_obs, dones):
        with autocast(args, agent.support.device):
            with torch.no_grad():
                # Target policy smoothing: clipped noise on the actor's action (FastTD3: the actor itself, no target).
                noise = (torch.randn_like(actions) * args.policy_noise).clamp(-args.noise_clip, args.noise_clip)
                clipped_noise = noise * agent.actor.action_scale
                next_state_actions = (agent.actor(next_obs) + clipped_noise).clamp(agent.action_low, agent.action_high)
                # Both targets' projections at once; clipped double Q: per sample, the one of smaller expected value.
                next_probs = F.softmax(agent.qlogits(agent.qnet_target, next_obs, next_state_actions), -1)
                projected = project(next_probs, rewards, 1 - dones, args.gamma, agent.support)
                values = (projected * agent.support).sum(-1)
                target_dist = torch.where((values[0] < values[1])[:, None], projected[0], projected[1])
            logits = agent.qlogits(agent.qnet_params, obs, actions)
            qf1_loss, qf2_loss = -(target_dist * F.log_softmax(logits, -1)).sum(-1).mean(-1)
            qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = (F.softmax(logits.detach(), -1) * agent.support).sum(-1).mean(-1)
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def update_actor(obs):
        # The smaller critic's expected value, through detached parameters: no gradient reaches the critics.
        params = {name: p.detach() for name, p in agent.qnet_params.items()}
        with autocast(args, agent.support.device):
            values = (F.softmax(agent.qlogits(params, obs, agent.actor(obs)), -1) * agent.support).sum(-1)
            actor_loss = -values.min(0).values.mean()
        agent.actor_optimizer.zero_grad()
        actor_loss.backward()
        agent.actor_optimizer.step()
        return {"actor_loss": actor_loss.detach()}

    def update_targets():  # one fused lerp over every target parameter
        sources = [p.detach() for p in agent.qnet_params.values()]
        torch._foreach_lerp_(list(agent.qnet_target.values()), sources, args.tau)

    def policy(obs, noise_scales):
        with torch.no_grad(), autocast(args, obs.device):
            actions = agent.actor(obs)
            actions = actions + torch.randn_like(actions) * noise_scales * agent.actor.action_scale
        return actions.clamp(agent.action_low, agent.action_high)

    fns = update_critic, update_actor, update_targets, policy
    return tuple(map(torch.compile, fns)) if args.compile else fns


def draw_noise_scales(args, num_envs, device):
    """FastTD3's per-env exploration: each env's noise scale uniform in [--std-min, --std-max]."""
    return torch.rand(num_envs, 1, device=device) * (args.std_max - args.std_min) + args.std_min


def actor_updates(args, vector_step):
    """Which of a vector step's gradient updates step the actor: every --policy-frequency-th of the run."""
    return [(vector_step * args.num_updates + k) % args.policy_frequency == args.policy_frequency - 1
            for k in range(args.num_updates)]  # fmt: skip


def make_collect(policy, envs, rb, obs, noise_scales, args):
    """collect(): one env step of all envs from `obs` (raw, updated in place): act, step, store, update the
    observation statistics, draw the noise scale of each env that reset. With --cudagraphs one CUDA graph, Warp's
    physics included."""

    def collect():
        actions = policy(envs.obs_rms.normalize(obs), noise_scales)
        next_obs, final_obs, rewards, terminations, truncations = envs.step_raw(actions)
        # A finished episode's last transition keeps its true final observation; a truncation is no end.
        rb.add(obs, actions, rewards, final_obs, terminations)
        envs.obs_rms.update(next_obs)
        obs.copy_(next_obs)
        # An env that reset draws its noise scale again (drawn for every env: the same random stream).
        dones = (terminations | truncations)[:, None]
        noise_scales.copy_(torch.where(dones, draw_noise_scales(args, len(obs), obs.device), noise_scales))

    return CudaGraphModule(collect, warmup=3 if args.compile else 2) if args.cudagraphs else collect


# ======== training step, graphs: the same in the off-policy twins on GPU MuJoCo, stamped from the TD3 twin ========
def make_train_step(rb, obs_rms, update_critic, update_actor, update_targets, args):
    """train_step(pattern): a vector step's gradient updates, pattern[k] saying whether the k-th steps the actor:
    each samples, normalises, updates; with --cudagraphs one captured graph per pattern. `stats`: fixed tensors."""
    stats = {name: torch.zeros((), device=rb.envs.device) for name in STATS}

    def step(pattern):
        for actor_update in pattern:
            obs, actions, rewards, next_obs, dones = rb.sample(args.batch_size)
            obs, next_obs = obs_rms.normalize(obs), obs_rms.normalize(next_obs)
            outputs = update_critic(obs, actions, rewards, next_obs, dones)
            if actor_update:  # delayed policy updates
                outputs.update(update_actor(obs))
            update_targets()
            for name, value in outputs.items():
                stats[name].copy_(value)

    @functools.cache
    def step_of_kind(pattern):
        fn = functools.partial(step, pattern)
        return CudaGraphModule(fn, warmup=3 if args.compile else 2) if args.cudagraphs else fn

    def train_step(pattern):
        step_of_kind(tuple(pattern))()

    return train_step, stats
# ======== end of training step, graphs ========


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase, n_envs = run.device, run.phase, args.num_envs
    envs = Envs(args.env_id, n_envs, args.gamma, device)
    n_obs, n_act = envs.obs.shape[1], envs.n_act  # envs.obs_rms: statistics of the first observations
    agent = Agent(args, n_obs, n_act, envs.low, envs.high, device)
    update_critic, update_actor, update_targets, policy = make_update_fns(agent, args)
    rb = ReplayBuffer(args.buffer_size, n_envs, n_obs, n_act, device)
    obs = envs.observe(fresh=torch.ones(n_envs, dtype=torch.bool, device=device))  # raw; updated in place
    noise_scales = draw_noise_scales(args, n_envs, device)
    collect = make_collect(policy, envs, rb, obs, noise_scales, args)
    train_step, stats = make_train_step(rb, envs.obs_rms, update_critic, update_actor, update_targets, args)
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one.
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb, "envs": envs.state, "obs": obs,
             "noise_scales": noise_scales}  # fmt: skip
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS * n_envs,
                           profile_steps=PROFILE_STEPS * n_envs, env_steps_per_call=n_envs,
                           warmup_from=args.learning_starts)  # fmt: skip
    # global_step counts env steps, n_envs per vector step.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        run.unit(global_step)
        with phase("env_step"):
            collect()
        if global_step >= args.learning_starts:
            with phase("update"):
                train_step(actor_updates(args, global_step // n_envs))
        with phase("other"):
            # By then an actor update has run (in this run, if it was resumed): its statistics exist.
            logged = global_step >= max(args.learning_starts, first_step) + args.policy_frequency * n_envs
            if run.tick(global_step + n_envs):
                # The episodes ended since the last tick count as one, their mean; read back in one sync.
                ended, return_sum, length_sum = envs.ended_episodes().tolist()
                if ended:
                    run.episode(global_step + n_envs, return_sum / ended, length_sum / ended)
                if logged:
                    run.log(global_step, {f"losses/{name}": stats[name] for name in STATS})


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved actor's action without exploration noise, episode after episode on gymnasium's
    own env of the same id (MuJoCo's C simulator, which the batched envs reproduce), observations normalised with
    the saved statistics, frozen."""
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
            action = actor(obs_rms.normalize(torch.as_tensor(obs, device=run.device)[None]))[0]
        obs, _, terminated, truncated, info = env.step(action.cpu().numpy())
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
