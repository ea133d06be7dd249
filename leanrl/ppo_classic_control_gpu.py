# PPO for discrete actions (CleanRL's ppo.py) on classic-control envs kept on the GPU as batched torch tensors, in eager
# PyTorch; data-parallel under torchrun. Docs: docs/gpu_collection.md, docs/multigpu.md
import math
import os
import random
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical


@dataclass
class Args:
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


WARMUP_ITERATIONS = 3  # before the fps window (the twin captures its rollout at the third)
PROFILE_ITERATIONS = 1  # iterations that --profile-dir profiles, as the window opens
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")


def check_args(args):
    setup_distributed(args)
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
        probs = Categorical(logits=logits)
        if action is None:
            # Gumbel-max, in both scripts: probs.sample()'s distribution by pointwise operations a compiled step fuses
            action = torch.argmax(logits - torch.log(-torch.log(torch.rand_like(logits))), dim=-1)
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device."""

    def __init__(self, num_steps, num_envs, n_obs, device):
        self.obs = torch.zeros((num_steps, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs, self.rewards, self.dones, self.values = torch.zeros((4, num_steps, num_envs), device=device)


class Agent:
    """The networks PPO trains and their optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=args.learning_rate, eps=1e-5)

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"] = lr


def average_gradients(parameters):
    """Every rank's gradients replaced by their mean over the ranks, through one flat buffer: one all-reduce."""
    grads = [p.grad for p in parameters]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def make_update_fns(agent, args):
    """GAE over a rollout, and the PPO update on one minibatch."""

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            next_value = agent.net.critic(next_obs).reshape(1, -1)
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            advantages, lastgaelam = torch.zeros_like(rewards), 0
            for t in reversed(range(args.num_steps)):
                advantages[t] = lastgaelam = delta[t] + coef[t] * lastgaelam
        return advantages, advantages + values

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
        if dist.is_initialized():
            average_gradients(agent.net.parameters())
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    return gae, update


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
    gae, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.physics.n_obs, device)
    next_obs = envs.observe()
    next_done = torch.zeros(args.num_envs, device=device)
    state = {"net": agent.net, "optimizer": agent.optimizer}
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            profile_steps=PROFILE_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=args.num_envs * world_size)  # fmt: skip
    if world_size > 1:
        join_ranks(run, agent.net, args, global_step)
    first_step, t_loop = global_step, time.perf_counter()
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        run.unit(global_step)
        with phase("update"):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                agent.set_learning_rate(frac * args.learning_rate)
        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            with phase("data"):
                rollout.obs[step] = next_obs
                rollout.dones[step] = next_done
            with phase("policy"), torch.no_grad():
                action, logprob, _, value = agent.net.get_action_and_value(next_obs)
            with phase("env_step"):
                next_obs, reward, next_done = envs.step(action)
            with phase("data"):
                rollout.values[step] = value.flatten()
                rollout.actions[step] = action
                rollout.logprobs[step] = logprob
                rollout.rewards[step] = reward
                next_done = next_done.float()
            with phase("other"):
                if rank == 0:  # rank 0 alone shows progress
                    run.tick(global_step)
        with phase("update"):
            advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)
        batch = (rollout.obs, rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [b.flatten(0, 1) for b in batch]  # obs, actions, logprobs, advantages, returns, values
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


# ======== torchrun: the same in every script that runs data-parallel, stamped from leanrl/harness.py ========
import datetime, hashlib  # noqa: E401, E402

import torch.distributed as dist  # noqa: E402

DIST_TIMEOUT_SECONDS = 900  # a rank that died or hangs ends the job; long enough for compilation and capture


def world():
    """(rank, world size) of this process: (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def leave_process_group():
    time.sleep(0.1)  # a worker thread of the last collectives may still need the interpreter's lock to let go
    dist.destroy_process_group()


def fail_on_every_rank(message):
    rank = dist.get_rank()
    leave_process_group()
    if rank == 0:
        fail(message)
    sys.exit(2)


def digests_differ(digest):
    """The ranks whose digest (a string) differs from rank 0's."""
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return [rank for rank, other in enumerate(digests) if other != digests[0]]


def setup_distributed(args):
    """Under torchrun: this rank on cuda:LOCAL_RANK, the process group joined, every rank's arguments checked equal;
    ranks other than 0 write nothing (no TensorBoard, wandb, speed log, profile, checkpoint or stdout)."""
    if "WORLD_SIZE" not in os.environ:
        return
    cuda = torch.cuda.is_available() and args.cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=DIST_TIMEOUT_SECONDS))
    if differ := digests_differ(hashlib.sha256(json.dumps(asdict(args), sort_keys=True).encode()).hexdigest()):
        fail_on_every_rank(f"ranks {differ} were started with other arguments than rank 0: every rank needs the same")
    if dist.get_rank():
        args.tensorboard = args.track = False
        args.speed_log = args.profile_dir = args.save_dir = None
        args.save_every = 0
        sys.stdout = open(os.devnull, "w")


def agree(value, op, device):
    """A number every rank gives, reduced over the ranks by op (dist.ReduceOp), as every rank's float."""
    reduced = torch.tensor([float(value)], device=device)
    dist.all_reduce(reduced, op=op)
    return reduced.item()


def resumed_apart(args, rank, global_step):
    """After a resume every rank holds rank 0's generators: the others reseed theirs apart, from the step."""
    if rank:
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(args.seed + rank + global_step)


def join_ranks(run, network, args, global_step):
    """After run.start: rank 0's parameters on every rank; after a resume, the other ranks' generators reseeded
    apart; a signal only asks the ranks to stop together (torchrun passes Ctrl-C on to ranks that got it already)."""
    for tensor in network.state_dict().values():
        dist.broadcast(tensor, 0)
    if global_step:
        resumed_apart(args, dist.get_rank(), global_step)
    run.rank_signal, run.signal = run.signal, None
    run.stop_handler = lambda signum, frame: setattr(run, "rank_signal", signum)
    run.catch_stops()


def agree_to_stop(run, device):
    """At the end of each iteration: any rank's signal stops every rank as the next begins (rank 0 saves). Only
    this agreement sets run.signal: a rank that stopped on its own would leave the others waiting in a collective."""
    run.signal = int(agree(run.rank_signal or 0, dist.ReduceOp.MAX, device)) or None
    if run.signal and dist.get_rank():
        sys.stderr = open(os.devnull, "w")  # rank 0 tells where the run stopped


def check_ranks_agree(network, global_step, rank_fps):
    """The end: every rank holds rank 0's parameters bit for bit, else an error; rank 0 prints each rank's fps."""
    data = b"".join(t.detach().cpu().numpy().tobytes() for t in network.state_dict().values())
    if differ := digests_differ(hashlib.sha256(data).hexdigest()):
        fail_on_every_rank(f"after {global_step} env steps, the parameters of ranks {differ} differ from rank 0's")
    fps = [None] * dist.get_world_size()
    dist.all_gather_object(fps, round(rank_fps, 1))
    if dist.get_rank() == 0:
        print(f"env steps per second of each rank over its whole loop: {fps}", file=sys.stderr, flush=True)
    leave_process_group()
# ======== end of torchrun ========


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
