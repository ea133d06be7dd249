# PPO for discrete actions (CleanRL's ppo.py) on classic-control envs kept on the GPU as batched torch tensors, made
# fast (docs/tricks.md); data-parallel under torchrun. Docs: docs/gpu_collection.md, docs/multigpu.md
import math
import random
import sys
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tensordict.nn import CudaGraphModule
from torch.distributions.categorical import Categorical

from harness import (
    Run,
    RunOptions,
    agree,
    agree_to_stop,
    check_ranks_agree,
    exit_code,
    fail,
    join_ranks,
    parse_args,
    setup_distributed,
    world,
)

try:  # torch's CUDA build brings Triton, its CPU build does not: only --fused-rollout needs it
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@dataclass
class Args(RunOptions):
    env_id: str = "CartPole-v1"
    """the id of the environment: CartPole-v1, Acrobot-v1 or MountainCar-v0"""
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
    compile: bool = False
    """compile the rollout step, GAE and the update with torch.compile"""
    cudagraphs: bool = False
    """capture the rollout, GAE and the update as CUDA graphs (tensordict's CudaGraphModule)"""
    fused_rollout: bool = False
    """run the whole rollout (policy, sampling, env step, auto-reset, storage) as one Triton kernel per iteration"""


WARMUP_ITERATIONS = 3  # before the fps window (the twin captures its rollout at the third)
PROFILE_ITERATIONS = 1  # iterations that --profile-dir profiles, as the window opens
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")


def check_args(args):
    _, world_size = world()
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {args.num_envs * args.num_steps}"
    if args.num_envs * args.num_steps % args.num_minibatches:
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.norm_adv and args.num_envs * args.num_steps // args.num_minibatches < 2:
        fail(f"--num-minibatches {args.num_minibatches} leaves minibatches of one sample; --norm-adv needs two")
    if args.total_timesteps < args.num_envs * args.num_steps * world_size:
        fail(f"--total-timesteps {args.total_timesteps} is below one rollout, {batch} on each of {world_size} ranks")


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
        self.critic = nn.Sequential(layer_init(nn.Linear(n_obs, 64, device=device)), nn.Tanh(),
                                    layer_init(nn.Linear(64, 64, device=device)), nn.Tanh(),
                                    layer_init(nn.Linear(64, 1, device=device), std=1.0))  # fmt: skip
        self.actor = nn.Sequential(layer_init(nn.Linear(n_obs, 64, device=device)), nn.Tanh(),
                                   layer_init(nn.Linear(64, 64, device=device)), nn.Tanh(),
                                   layer_init(nn.Linear(64, n_act, device=device), std=0.01))  # fmt: skip

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        # Checking the arguments would read them back to the host: a sync, and not allowed in a CUDA graph
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            # Gumbel-max, in both scripts: probs.sample()'s distribution by pointwise operations a compiled step fuses
            action = torch.argmax(logits - torch.log(-torch.log(torch.rand_like(logits))), dim=-1)
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device. obs and dones have one more row: the
    observation after the last step, which GAE bootstraps from and the next rollout starts with."""

    def __init__(self, num_steps, num_envs, n_obs, device):
        self.obs = torch.zeros((num_steps + 1, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs, self.rewards, self.values = torch.zeros((3, num_steps, num_envs), device=device)
        self.dones = torch.zeros((num_steps + 1, num_envs), device=device)


class Agent:
    """The networks PPO trains and their optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        # A device tensor that annealing overwrites in place, so a compiled or captured step reads the current value;
        # Adam takes it without host syncs only when capturable, which it can be on CUDA alone.
        lr = torch.tensor(args.learning_rate, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, capturable=device.type == "cuda")
        self.grads = None
        if dist.is_initialized():
            # Views into one flat buffer, filled in place: the all-reduce needs no copy, captured graphs find them at
            # fixed addresses. Each starts on 16 bytes (after the critic's 1-element bias too): compiled kernels load
            # in vectors, which fail on a misaligned address.
            parameters = list(self.net.parameters())
            aligned = [-(-p.numel() // 4) * 4 for p in parameters]
            self.grads = torch.zeros(sum(aligned), device=device)
            for p, grad in zip(parameters, self.grads.split(aligned)):
                p.grad = grad[: p.numel()].view_as(p)

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"].fill_(lr)


def average_gradients(grads):
    """The flat gradient buffer (Agent.grads) replaced, in place, by its mean over the ranks: one all-reduce."""
    dist.all_reduce(grads)
    grads /= dist.get_world_size()


def make_update_fns(agent, args):
    """GAE over a rollout, the PPO update on one minibatch (its STATS written into `stats`, fixed tensors), and the
    policy that acts. --compile and --cudagraphs apply to GAE and the update here, to the policy in make_collect."""
    stats = {name: torch.zeros((), device=next(agent.net.parameters()).device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            next_value = agent.net.critic(next_obs).reshape(1, -1)
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            # advantages[t] = delta[t] + coef[t] * advantages[t + 1] by a doubling scan: log2(num_steps) rounds, not
            # num_steps (a short graph to compile). After shift s, advantages[t] holds the terms of delta[t : t + 2s]
            # and coef[t] the product of coef[t : t + 2s].
            advantages, shift = delta, 1
            while shift < args.num_steps:
                advantages = advantages + coef * F.pad(advantages[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
        return advantages, advantages + values

    def backward(obs, actions, logprobs, advantages, returns, values):
        """The loss of one minibatch and its gradients; its STATS but the gradient norm into `stats`."""
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
        agent.optimizer.zero_grad(set_to_none=agent.grads is None)  # the flat buffer's views stay
        loss.backward()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac)
        for name, value in zip(STATS, outputs):  # not returned: a captured function copies outputs out of its graph
            stats[name].copy_(value.detach())

    def step():
        """The clipped gradients' optimizer step; the gradient norm into `stats`."""
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        stats["grad_norm"].copy_(grad_norm.detach())

    def update(*minibatch):
        backward(*minibatch)
        step()

    def policy(obs):
        with torch.no_grad():
            action, logprob, _, value = agent.net.get_action_and_value(obs)
        return action, logprob, value.flatten()

    functions = (gae, update, backward, step)
    if args.compile:
        functions = map(torch.compile, functions)
    if args.cudagraphs:
        functions = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in functions)
    # Other names for the wrapped backward and step: update calls the plain ones.
    gae, update, fast_backward, fast_step = functions

    def update_distributed(*minibatch):
        # The all-reduce runs between two graphs, not inside one: a collective captured in a CUDA graph is not
        # tested yet (docs/multigpu.md). Alone, one graph does the whole update.
        fast_backward(*minibatch)
        average_gradients(agent.grads)
        fast_step()

    return gae, update_distributed if dist.is_initialized() else update, policy, stats


def make_collect(policy, envs, rollout, args):
    """collect(): one rollout of num_steps steps of all envs into `rollout`, from the observation and done flags the
    last one ended in (its last rows). With --compile the env step (policy, env, auto-reset, storage) is compiled;
    with --cudagraphs the whole rollout is one CUDA graph: one replay per iteration, no Python per step."""

    def step(t):
        action, logprob, value = policy(rollout.obs[t])
        next_obs, reward, done = envs.step(action)
        rollout.actions[t] = action
        rollout.logprobs[t] = logprob
        rollout.values[t] = value
        rollout.rewards[t] = reward
        rollout.obs[t + 1] = next_obs
        rollout.dones[t + 1] = done

    if args.compile:
        # t becomes a symbolic integer at the second call (one recompile), so every step runs the same kernels.
        step = torch.compile(step)

    def collect():
        # The observation the last rollout ended in is the first of this one.
        rollout.obs[0] = rollout.obs[-1]
        rollout.dones[0] = rollout.dones[-1]
        for t in range(args.num_steps):
            step(t)

    if args.cudagraphs:
        collect = CudaGraphModule(collect, warmup=3 if args.compile else 2)
    return collect


# ---- --fused-rollout: the whole rollout as one Triton kernel (docs/gpu_collection.md, "The fused rollout")

# tl.dot's smallest size: the observations and the logits are padded to this many columns.
FUSED_PAD = 16


def fused_rollout_unavailable(cuda):
    """Why --fused-rollout cannot run here (an error line), or None. Triton chooses between compiling a kernel and
    interpreting it when the kernel is defined, at import, from TRITON_INTERPRET."""
    if triton is None:
        return "--fused-rollout needs Triton, which torch's CUDA build brings; install it: pip install triton"
    if not cuda and isinstance(fused_rollout_kernel, triton.runtime.JITFunction):
        return ("--fused-rollout runs a Triton kernel, which needs CUDA; on the CPU only Triton's interpreter runs it "
                "(slowly): set TRITON_INTERPRET=1 before starting")  # fmt: skip
    return None


if triton is not None:  # the kernel and its parts, written as the torch code above, operation for operation, the
    # constants as literals (a kernel reads no Python globals)

    @triton.jit
    def tanh(x):
        # Through exp: tl.math has no tanh, and Triton's interpreter (the CPU tests) cannot run libdevice's.
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def cartpole_step(x, x_dot, theta, theta_dot, action, SUBSTEPS: tl.constexpr):
        force = tl.where(action == 1, 10.0, -10.0)
        tau = 0.02 / SUBSTEPS
        for _ in range(SUBSTEPS):
            costheta, sintheta = tl.cos(theta), tl.sin(theta)
            temp = (force + 0.05 * (theta_dot * theta_dot) * sintheta) / 1.1
            thetaacc = (9.8 * sintheta - costheta * temp) / (0.5 * (4.0 / 3.0 - 0.1 * (costheta * costheta) / 1.1))
            xacc = temp - 0.05 * thetaacc * costheta / 1.1
            x, x_dot = x + tau * x_dot, x_dot + tau * xacc
            theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        terminated = (tl.abs(x) > 2.4) | (tl.abs(theta) > 12 * 2 * 3.141592653589793 / 360)
        return x, x_dot, theta, theta_dot, terminated

    @triton.jit
    def acrobot_derivatives(theta1, theta2, dtheta1, dtheta2, torque):
        # Acrobot.derivatives with its constants (m1 = m2 = l1 = moi = 1, lc1 = lc2 = 0.5, g = 9.8) folded as
        # Python folds them there.
        d1 = 0.25 + (1.25 + tl.cos(theta2)) + 2.0
        d2 = (0.25 + 0.5 * tl.cos(theta2)) + 1.0
        phi2 = 4.9 * tl.cos(theta1 + theta2 - 3.141592653589793 / 2.0)
        phi1 = (
            -0.5 * (dtheta2 * dtheta2) * tl.sin(theta2)
            - 1.0 * dtheta2 * dtheta1 * tl.sin(theta2)
            + 14.700000000000001 * tl.cos(theta1 - 3.141592653589793 / 2)
            + phi2
        )
        ddtheta2 = (torque + d2 / d1 * phi1 - 0.5 * (dtheta1 * dtheta1) * tl.sin(theta2) - phi2) / (
            1.25 - (d2 * d2) / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return dtheta1, dtheta2, ddtheta1, ddtheta2

    @triton.jit
    def wrap(angle):
        turns = tl.where(angle > 3.141592653589793, tl.ceil((angle - 3.141592653589793) / 6.283185307179586), 0.0)
        turns = tl.where(
            angle < -3.141592653589793, -tl.ceil((-3.141592653589793 - angle) / 6.283185307179586), turns
        )
        return angle - turns * 6.283185307179586

    @triton.jit
    def clamp(x, bound):
        return tl.minimum(tl.maximum(x, -bound), bound)

    @triton.jit
    def acrobot_step(t1, t2, v1, v2, action):
        torque = (action - 1).to(tl.float32)
        a1, b1, c1, d1 = acrobot_derivatives(t1, t2, v1, v2, torque)
        a2, b2, c2, d2 = acrobot_derivatives(t1 + 0.1 * a1, t2 + 0.1 * b1, v1 + 0.1 * c1, v2 + 0.1 * d1, torque)
        a3, b3, c3, d3 = acrobot_derivatives(t1 + 0.1 * a2, t2 + 0.1 * b2, v1 + 0.1 * c2, v2 + 0.1 * d2, torque)
        a4, b4, c4, d4 = acrobot_derivatives(t1 + 0.2 * a3, t2 + 0.2 * b3, v1 + 0.2 * c3, v2 + 0.2 * d3, torque)
        t1 = wrap(t1 + 0.2 / 6 * (a1 + 2 * a2 + 2 * a3 + a4))
        t2 = wrap(t2 + 0.2 / 6 * (b1 + 2 * b2 + 2 * b3 + b4))
        v1 = clamp(v1 + 0.2 / 6 * (c1 + 2 * c2 + 2 * c3 + c4), 4 * 3.141592653589793)
        v2 = clamp(v2 + 0.2 / 6 * (d1 + 2 * d2 + 2 * d3 + d4), 9 * 3.141592653589793)
        terminated = -tl.cos(t1) - tl.cos(t2 + t1) > 1.0
        return t1, t2, v1, v2, terminated

    @triton.jit
    def mountaincar_step(position, velocity, action):
        velocity = velocity + (action - 1).to(tl.float32) * 0.001 + tl.cos(3 * position) * (-0.0025)
        velocity = clamp(velocity, 0.07)
        position = tl.minimum(tl.maximum(position + velocity, -1.2), 0.6)
        velocity = tl.where((position == -1.2) & (velocity < 0), 0.0, velocity)
        terminated = (position >= 0.5) & (velocity >= 0)
        return position, velocity, terminated

    @triton.jit
    def per_copy(x, COPIES: tl.constexpr):
        """A vector over envs, laid out as the state's components: as it is for one copy (the state's components are
        vectors: a [envs, 1] tile would cost about a fifth of the speed at 2^16 envs), a column for several."""
        if COPIES == 1:
            tiled = x
        else:
            tiled = x[:, None]
        return tiled

    @triton.jit
    def any_copy(x, COPIES: tl.constexpr):
        """Per env: whether any of its copies' flags is set."""
        if COPIES == 1:
            flag = x
        else:
            flag = tl.max(x.to(tl.int32), axis=1) > 0
        return flag

    @triton.jit
    def first_copy(x, COPIES: tl.constexpr):
        """Per env: copy 0's value."""
        if COPIES == 1:
            value = x
        else:
            value = tl.sum(tl.where(tl.arange(0, COPIES)[None, :] == 0, x, 0.0), axis=1)
        return value

    @triton.jit
    def env_step(ENV: tl.constexpr, s0, s1, s2, s3, action, COPIES: tl.constexpr, SUBSTEPS: tl.constexpr):
        """The physics of ENVS' env number ENV, on a state held as one vector or [envs, copies] tile per component
        (up to four): the next state, and each env's reward and termination (any copy's)."""
        action = per_copy(action, COPIES)
        if ENV == 0:
            s0, s1, s2, s3, terminated = cartpole_step(s0, s1, s2, s3, action, SUBSTEPS)
        elif ENV == 1:
            s0, s1, s2, s3, terminated = acrobot_step(s0, s1, s2, s3, action)
        else:
            s0, s1, terminated = mountaincar_step(s0, s1, action)
        terminated = any_copy(terminated, COPIES)
        if ENV == 0:
            reward = tl.full(terminated.shape, 1.0, tl.float32)
        elif ENV == 1:
            reward = tl.where(terminated, 0.0, -1.0)
        else:
            reward = tl.full(terminated.shape, -1.0, tl.float32)
        return s0, s1, s2, s3, reward, terminated

    @triton.jit
    def env_initial(ENV: tl.constexpr, u0, u1, u2, u3):
        """The env's initial(noise): a reset state from uniform numbers."""
        if ENV == 0:
            s0, s1, s2, s3 = u0 * 0.1 - 0.05, u1 * 0.1 - 0.05, u2 * 0.1 - 0.05, u3 * 0.1 - 0.05
        elif ENV == 1:
            s0, s1, s2, s3 = u0 * 0.2 - 0.1, u1 * 0.2 - 0.1, u2 * 0.2 - 0.1, u3 * 0.2 - 0.1
        else:
            s0, s1, s2, s3 = u0 * 0.2 - 0.6, tl.zeros_like(u0), tl.zeros_like(u0), tl.zeros_like(u0)
        return s0, s1, s2, s3

    @triton.jit
    def env_observe(ENV: tl.constexpr, s0, s1, s2, s3, col, COPIES: tl.constexpr):
        """The env's observe(state), of copy 0, as a tile of observations by `col`, zero in the padding."""
        s0, s1 = first_copy(s0, COPIES), first_copy(s1, COPIES)
        s2, s3 = first_copy(s2, COPIES), first_copy(s3, COPIES)
        if ENV == 1:
            o0, o1, o2, o3, o4, o5 = tl.cos(s0), tl.sin(s0), tl.cos(s1), tl.sin(s1), s2, s3
        else:
            o0, o1, o2, o3, o4, o5 = s0, s1, s2, s3, tl.zeros_like(s0), tl.zeros_like(s0)  # unused ones are zero
        obs = tl.where(col == 0, o0[:, None], 0.0)
        obs = tl.where(col == 1, o1[:, None], obs)
        obs = tl.where(col == 2, o2[:, None], obs)
        obs = tl.where(col == 3, o3[:, None], obs)
        obs = tl.where(col == 4, o4[:, None], obs)
        return tl.where(col == 5, o5[:, None], obs)

    @triton.jit
    def uniform(uniforms_ptr, seed, offset, mask, GIVEN_UNIFORMS: tl.constexpr):
        """Uniform numbers in [0, 1) for the draws numbered `offset`: the given ones, or Philox's of (seed, offset)."""
        if GIVEN_UNIFORMS:
            u = tl.load(uniforms_ptr + offset, mask=mask, other=0.5)
        else:
            # tl.rand rounds to 1.0 about once in 2^25 draws: kept below 1, as torch.rand's numbers are.
            u = tl.minimum(tl.rand(seed, offset), 0.99999994)
        return u

    @triton.jit(do_not_specialize=["seed"])
    def fused_rollout_kernel(
        state_ptr, elapsed_ptr, episode_return_ptr, ended_ptr,  # Envs' tensors: read at the start, written at the end
        w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr,  # the actor's three nn.Linear layers, weights [out, in]
        obs_ptr, actions_ptr, logprobs_ptr, rewards_ptr, dones_ptr,  # the Rollout's tensors
        uniforms_ptr, seed, num_envs, num_steps,
        ENV: tl.constexpr, N_STATE: tl.constexpr, N_OBS: tl.constexpr, N_ACT: tl.constexpr,
        N_NOISE: tl.constexpr, MAX_EPISODE_STEPS: tl.constexpr, HIDDEN: tl.constexpr, PAD: tl.constexpr,
        BLOCK: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr, COPIES: tl.constexpr, SUBSTEPS: tl.constexpr,
    ):  # fmt: skip
        """num_steps steps of BLOCK envs: make_collect's step(t) for each t, one program per block of envs."""
        env = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = env < num_envs
        col, hid = tl.arange(0, PAD), tl.arange(0, HIDDEN)
        # The actor's weights, transposed and padded with zeros, loaded once for all steps.
        w1 = tl.load(w1_ptr + hid[None, :] * N_OBS + col[:, None], mask=col[:, None] < N_OBS, other=0.0)
        w2 = tl.load(w2_ptr + hid[None, :] * HIDDEN + hid[:, None])
        w3 = tl.load(w3_ptr + col[None, :] * HIDDEN + hid[:, None], mask=col[None, :] < N_ACT, other=0.0)
        b1, b2 = tl.load(b1_ptr + hid), tl.load(b2_ptr + hid)
        b3 = tl.load(b3_ptr + col, mask=col < N_ACT, other=0.0)
        # The envs in registers: the state one vector (or [envs, copies] tile) per component, the step counts,
        # returns and episode sums.
        if COPIES == 1:
            copy = tl.zeros_like(env)
        else:
            copy = tl.arange(0, COPIES)[None, :]
        # `copy < COPIES` holds everywhere: it spreads `live` to the state's shape.
        at, tile = per_copy(env * N_STATE, COPIES) + copy, per_copy(live, COPIES) & (copy < COPIES)
        s0 = tl.load(state_ptr + at, mask=tile, other=0.0)
        s1 = tl.load(state_ptr + at + COPIES, mask=tile, other=0.0)
        s2 = tl.load(state_ptr + at + 2 * COPIES, mask=tile & (N_STATE > 2 * COPIES), other=0.0)
        s3 = tl.load(state_ptr + at + 3 * COPIES, mask=tile & (N_STATE > 3 * COPIES), other=0.0)
        elapsed = tl.load(elapsed_ptr + env, mask=live, other=0)
        episode_return = tl.load(episode_return_ptr + env, mask=live, other=0.0)
        ended_count = tl.load(ended_ptr + env, mask=live, other=0.0)
        ended_return = tl.load(ended_ptr + num_envs + env, mask=live, other=0.0)
        ended_length = tl.load(ended_ptr + 2 * num_envs + env, mask=live, other=0.0)
        obs = env_observe(ENV, s0, s1, s2, s3, col[None, :], COPIES)
        obs_mask = live[:, None] & (col[None, :] < N_OBS)
        for t in range(num_steps):
            # The policy: the actor's logits (fp32 products, as torch's), a Gumbel-max action, its log-probability.
            h = tanh(tl.dot(obs, w1, input_precision="ieee") + b1[None, :])
            h = tanh(tl.dot(h, w2, input_precision="ieee") + b2[None, :])
            logits = tl.dot(h, w3, input_precision="ieee") + b3[None, :]
            logits = tl.where(col[None, :] < N_ACT, logits, float("-inf"))
            # Draws of step t: n_act for the action, then n_noise for the reset, per env (torch's order).
            row = env.to(tl.int64) + t * num_envs  # row t of the trajectory, in int64 as the biggest ones need
            draw = row * (N_ACT + N_NOISE)
            u = uniform(uniforms_ptr, seed, draw[:, None] + col[None, :], live[:, None] & (col[None, :] < N_ACT),
                        GIVEN_UNIFORMS)  # fmt: skip
            action = tl.argmax(logits - tl.log(-tl.log(u)), axis=1)
            top = tl.max(logits, axis=1)
            logsumexp = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            logprob = tl.sum(tl.where(col[None, :] == action[:, None], logits, 0.0), axis=1) - logsumexp
            # The env step, the time limit and the same-step auto-reset, as Envs.step.
            n0, n1, n2, n3, reward, terminated = env_step(ENV, s0, s1, s2, s3, action, COPIES, SUBSTEPS)
            elapsed += 1
            episode_return += reward
            done = terminated | (elapsed >= MAX_EPISODE_STEPS)
            noise = per_copy(draw, COPIES) + N_ACT + copy  # the reset's draws in the state's order
            u0 = uniform(uniforms_ptr, seed, noise, tile, GIVEN_UNIFORMS)
            u1 = uniform(uniforms_ptr, seed, noise + COPIES, tile & (N_NOISE > COPIES), GIVEN_UNIFORMS)
            u2 = uniform(uniforms_ptr, seed, noise + 2 * COPIES, tile & (N_NOISE > 2 * COPIES), GIVEN_UNIFORMS)
            u3 = uniform(uniforms_ptr, seed, noise + 3 * COPIES, tile & (N_NOISE > 3 * COPIES), GIVEN_UNIFORMS)
            f0, f1, f2, f3 = env_initial(ENV, u0, u1, u2, u3)
            reset = per_copy(done, COPIES)
            s0, s1 = tl.where(reset, f0, n0), tl.where(reset, f1, n1)
            s2, s3 = tl.where(reset, f2, n2), tl.where(reset, f3, n3)
            ended_count += tl.where(done, 1.0, 0.0)
            ended_return += tl.where(done, episode_return, 0.0)
            ended_length += tl.where(done, elapsed.to(tl.float32), 0.0)
            elapsed = tl.where(done, 0, elapsed)
            episode_return = tl.where(done, 0.0, episode_return)
            obs = env_observe(ENV, s0, s1, s2, s3, col[None, :], COPIES)
            # Row t of the trajectory; the observation and done flag after the step are row t + 1 of theirs.
            tl.store(actions_ptr + row, action.to(tl.int64), mask=live)
            tl.store(logprobs_ptr + row, logprob, mask=live)
            tl.store(rewards_ptr + row, reward, mask=live)
            tl.store(dones_ptr + row + num_envs, done.to(tl.float32), mask=live)
            tl.store(obs_ptr + (row + num_envs)[:, None] * N_OBS + col[None, :], obs, mask=obs_mask)
        tl.store(state_ptr + at, s0, mask=tile)
        tl.store(state_ptr + at + COPIES, s1, mask=tile)
        tl.store(state_ptr + at + 2 * COPIES, s2, mask=tile & (N_STATE > 2 * COPIES))
        tl.store(state_ptr + at + 3 * COPIES, s3, mask=tile & (N_STATE > 3 * COPIES))
        tl.store(elapsed_ptr + env, elapsed, mask=live)
        tl.store(episode_return_ptr + env, episode_return, mask=live)
        tl.store(ended_ptr + env, ended_count, mask=live)
        tl.store(ended_ptr + num_envs + env, ended_return, mask=live)
        tl.store(ended_ptr + 2 * num_envs + env, ended_length, mask=live)


def make_fused_collect(agent, envs, rollout, args):
    """collect() as make_collect's, the rollout one Triton kernel launch (--fused-rollout), then one batched critic
    call for the values. Neither --compile nor --cudagraphs applies: the kernel is one launch already, and its seed
    changes at every call, which a captured launch would replay unchanged. The kernel's Philox draws are numbered
    as the torch rollout's (docs/gpu_collection.md), seeded by collect.seed, counted up from a draw of --seed's CPU
    generator (no device sync) and kept by a checkpoint. collect(uniforms) reads a [num_steps, num_envs, n_act +
    n_noise] tensor of uniforms instead (the tests)."""
    # Here, not in check_args, which the twin shares word for word with the baseline: before any training still.
    if unavailable := fused_rollout_unavailable(rollout.obs.device.type == "cuda"):
        fail(unavailable)
    physics, net = envs.physics, agent.net
    layers = [net.actor[i] for i in (0, 2, 4)]
    # A subclass (CartPole's heavier variants) runs its base's physics, with its copies and substeps.
    env_number = [issubclass(physics, base) for base in ENVS.values()].index(True)
    copies, substeps = getattr(physics, "copies", 1), getattr(physics, "substeps", 1)
    # 64 envs a program from 2^14 envs on: the weights loaded once for more of them; but with several copies per env
    # their state no longer fits in registers at 64 (both measured, docs/gpu_collection.md).
    block = 64 if args.num_envs >= 2**14 and copies == 1 else 16

    def collect(uniforms=None):
        # The observation the last rollout ended in is the first of this one.
        rollout.obs[0] = rollout.obs[-1]
        rollout.dones[0] = rollout.dones[-1]
        fused_rollout_kernel[(triton.cdiv(args.num_envs, block),)](
            envs.state, envs.elapsed, envs.episode_return, envs.ended,
            *(p.detach() for layer in layers for p in (layer.weight, layer.bias)),
            rollout.obs, rollout.actions, rollout.logprobs, rollout.rewards, rollout.dones,
            rollout.rewards if uniforms is None else uniforms,  # unread when Philox draws
            int(collect.seed), args.num_envs, args.num_steps,
            ENV=env_number, N_STATE=envs.state.shape[1], N_OBS=physics.n_obs, N_ACT=physics.n_act,
            N_NOISE=physics.n_noise, MAX_EPISODE_STEPS=physics.max_episode_steps, HIDDEN=layers[0].out_features,
            PAD=FUSED_PAD, BLOCK=block, GIVEN_UNIFORMS=uniforms is not None, COPIES=copies, SUBSTEPS=substeps,
            num_warps=4,
        )  # fmt: skip
        collect.seed += 1
        with torch.no_grad():
            rollout.values.copy_(net.critic(rollout.obs[:-1]).squeeze(-1))

    collect.seed = torch.randint(2**30, ())  # a tensor, which a checkpoint restores in place
    return collect


def train(args, run):
    rank, world_size = world()
    # Sizes are per rank; global_step counts the env steps of all ranks, as --total-timesteps does.
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    steps_per_iteration = batch_size * world_size
    num_iterations = args.total_timesteps // steps_per_iteration
    # Each rank seeds its envs and its sampling apart; the parameters come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    device, phase = run.device, run.phase
    envs = Envs(args.env_id, args.num_envs, device)
    agent = Agent(args, envs.physics.n_obs, envs.physics.n_act, device)
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.physics.n_obs, device)
    rollout.obs[-1] = envs.observe()
    state = {"net": agent.net, "optimizer": agent.optimizer}
    if args.fused_rollout:
        collect = make_fused_collect(agent, envs, rollout, args)
        state["fused_seed"] = collect.seed  # the kernel's random stream goes on where it was
    else:
        collect = make_collect(policy, envs, rollout, args)
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            profile_steps=PROFILE_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=steps_per_iteration)  # fmt: skip
    if world_size > 1:
        join_ranks(run, agent.net, args, global_step)
        if global_step and args.fused_rollout and rank:  # the kernel's stream apart too
            collect.seed.fill_(int(torch.randint(2**30, ())))
    first_step, t_loop = global_step, time.perf_counter()
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        run.unit(global_step)
        with phase("update"):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                agent.set_learning_rate(frac * args.learning_rate)
        global_step += steps_per_iteration
        with phase("env_step"):
            collect()
        with phase("other"):
            if rank == 0:  # rank 0 alone shows progress
                run.tick(global_step)
        with phase("update"):
            advantages, rets = gae(rollout.obs[-1], rollout.dones[-1], rollout.rewards, rollout.values,
                                   rollout.dones[:-1])  # fmt: skip
        batch = (rollout.obs[:-1], rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [b.flatten(0, 1) for b in batch]  # obs, actions, logprobs, advantages, returns, values
        # Optimizing the policy and value network
        for epoch in range(args.update_epochs):
            with phase("data"):
                b_inds = torch.randperm(batch_size, device=device)
                # One gather per epoch: the minibatches are then contiguous slices of the shuffled batch.
                shuffled = [b[b_inds] for b in batch]
            for start in range(0, batch_size, minibatch_size):
                with phase("data"):
                    minibatch = [b[start : start + minibatch_size] for b in shuffled]
                with phase("update"):
                    update(*minibatch)
            # Every rank stops its epochs at the same one, by the ranks' mean KL: the all-reduces must pair up.
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        with phase("other"):
            # The episodes that ended in this rollout count as one, by their mean: with many envs, thousands end.
            ended, return_sum, length_sum = envs.ended_episodes().tolist()
            if ended and rank == 0:  # rank 0 alone counts returns: of its own envs, as CleanRL does
                run.episode(global_step, return_sum / ended, length_sum / ended)
            # On the device, so that it is read back with the statistics, in one sync.
            var_y = batch[-2].var(correction=0)
            explained_var = torch.where(var_y == 0, torch.nan, 1 - (batch[-2] - batch[-1]).var(correction=0) / var_y)
            lr = agent.optimizer.param_groups[0]["lr"]
            scalars = {f"losses/{name}": stats[name] for name in STATS}
            scalars.update({"losses/explained_variance": explained_var, "charts/learning_rate": lr})
            run.log(global_step, scalars)
            if world_size > 1:
                agree_to_stop(run, device)
    if dist.is_initialized():
        rank_fps = (global_step - first_step) / world_size / (time.perf_counter() - t_loop)
        check_ranks_agree(agent.net, global_step, rank_fps)


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved actor's greedy action, on gymnasium's own env of the id (ours reproduce it)."""
    physics = ENVS[args.env_id]
    net = ActorCritic(physics.n_obs, physics.n_act, device=run.device)
    net.load_state_dict(saved["net"])
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            logits = net.actor(torch.as_tensor(obs, device=run.device, dtype=torch.float32))
        obs, _, terminated, truncated, info = env.step(int(logits.argmax()))
        if terminated or truncated:
            yield info["episode"]["r"]
            obs, _ = env.reset()


def main(argv=None):
    """Train, or with --eval-checkpoint evaluate, as the arguments say; returns the record printed last."""
    args, checkpoint = parse_args(Args, __file__, argv)
    setup_distributed(args)  # torchrun: join the process group before the checks that need the world
    check_args(args)
    run = Run(args, __file__, checkpoint)
    if args.eval_checkpoint:
        return run.evaluation(evaluate(args, run, checkpoint["state"]))
    with run.stoppable():
        train(args, run)
    return run.finish()


if __name__ == "__main__":
    sys.exit(exit_code(main()))
