# PPO for discrete actions (CleanRL's ppo.py) on classic-control envs kept on the GPU as batched torch tensors, in eager
# PyTorch; data-parallel under torchrun. Docs: docs/gpu_collection.md, docs/multigpu.md
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

from harness import Run, agree, average, exit_code, fail, flat_gradients, parse_args, setup_distributed, world
from torch_classic_control import ENVS, Envs


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
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


WARMUP_ITERATIONS = 3  # before the fps window (the twin captures its rollout at the third)
PROFILE_ITERATIONS = 1  # iterations that --profile-dir profiles, as the window opens
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")


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
        self.grads = None
        if dist.is_initialized():  # the gradients as views into one flat buffer, averaged in place
            self.grads = flat_gradients(self.net.parameters())

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"] = lr


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
        agent.optimizer.zero_grad(set_to_none=agent.grads is None)  # the flat buffer's views stay
        loss.backward()
        if dist.is_initialized():
            average(agent.grads)
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    return gae, update


def check_args(args):
    _, world_size = world()
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {args.num_envs * args.num_steps}"
    if args.num_envs * args.num_steps % args.num_minibatches:
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.norm_adv and args.num_envs * args.num_steps // args.num_minibatches < 2:
        fail(f"--num-minibatches {args.num_minibatches} leaves minibatches of one sample; --norm-adv needs two")
    if args.total_timesteps < args.num_envs * args.num_steps * world_size:
        fail(f"--total-timesteps {args.total_timesteps} is below one rollout, {batch} on each of {world_size} ranks")


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
                            env_steps_per_call=args.num_envs * world_size, replicated=agent.net)  # fmt: skip
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.set_learning_rate(frac * args.learning_rate)
        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            phase("data")
            rollout.obs[step] = next_obs
            rollout.dones[step] = next_done
            phase("policy")
            with torch.no_grad():
                action, logprob, _, value = agent.net.get_action_and_value(next_obs)
            phase("env_step")
            next_obs, reward, next_done = envs.step(action)
            phase("data")
            rollout.values[step] = value.flatten()
            rollout.actions[step] = action
            rollout.logprobs[step] = logprob
            rollout.rewards[step] = reward
            next_done = next_done.float()
            phase("other")
            if rank == 0:  # rank 0 alone shows progress
                run.tick(global_step)
        phase("update")
        advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)
        batch = (rollout.obs, rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [b.flatten(0, 1) for b in batch]  # obs, actions, logprobs, advantages, returns, values
        # Optimizing the policy and value network
        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            phase("data")
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [b[b_inds[start : start + minibatch_size]] for b in batch]
                phase("update")
                stats = update(*minibatch)
            # Every rank stops its epochs at the same one, by the ranks' mean KL: the all-reduces must pair up.
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        phase("other")
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
    ranks = setup_distributed(args)  # torchrun: join the process group before the checks that need the world
    check_args(args)
    run = Run(args, __file__, checkpoint, ranks)
    if args.eval_checkpoint:
        return run.evaluation(evaluate(args, run, checkpoint["state"]))
    with run.stoppable():
        train(args, run)
    return run.finish()


if __name__ == "__main__":
    sys.exit(exit_code(main()))
