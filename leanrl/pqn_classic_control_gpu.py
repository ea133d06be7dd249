# PQN (CleanRL's pqn.py: parallel Q-learning with LayerNorm and Q(lambda) returns) on classic-control envs kept on the
# GPU as batched torch tensors, in eager PyTorch. Docs: docs/pqn.md
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from harness import Run, exit_code, fail, parse_args
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
    """the number of steps to run in each environment per rollout"""
    num_minibatches: int = 4
    """the number of minibatches a rollout is split into"""
    update_epochs: int = 4
    """the number of epochs over each rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""


WARMUP_ITERATIONS = 3  # before the fps window (the twin captures its rollout at the third)
PROFILE_ITERATIONS = 1  # iterations that --profile-dir profiles, as the window opens
STATS = ("td_loss", "q_values")


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """CleanRL's 120-84 ReLU MLP with a LayerNorm after each hidden layer: what lets PQN learn without a target net."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.n_act = n_act
        self.network = nn.Sequential(
            layer_init(nn.Linear(n_obs, 120, device=device)),
            nn.LayerNorm(120, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(120, 84, device=device)),
            nn.LayerNorm(84, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(84, n_act, device=device)),
        )

    def forward(self, x):
        return self.network(x)

    def act(self, x, epsilon):
        """Epsilon-greedy actions, and the greedy values max_a Q(x, a) that the Q(lambda) returns bootstrap from."""
        random_actions = torch.randint(0, self.n_act, (x.shape[0],), device=x.device)
        values, max_actions = self(x).max(dim=1)
        explore = torch.rand(x.shape[0], device=x.device) < epsilon
        return torch.where(explore, random_actions, max_actions), values


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at env step t: from start_e down to end_e over `duration` steps, then end_e. In torch operations, so that
    t may be a device tensor (the twin's captured rollout reads no number from the host)."""
    slope = (end_e - start_e) / duration
    return torch.clamp(torch.as_tensor(slope * t + start_e), min=end_e)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device."""

    def __init__(self, num_steps, num_envs, n_obs, device):
        self.obs = torch.zeros((num_steps, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.rewards, self.dones, self.values = torch.zeros((3, num_steps, num_envs), device=device)


class Agent:
    """The Q-network PQN trains and its optimizer (RAdam, as CleanRL's)."""

    def __init__(self, args, n_obs, n_act, device):
        self.q_network = QNetwork(n_obs, n_act, device=device)
        self.optimizer = optim.RAdam(self.q_network.parameters(), lr=args.learning_rate)

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"] = lr


def make_update_fns(agent, args):
    """The Q(lambda) returns of a rollout, and the update on one minibatch."""

    def q_lambda(next_obs, next_done, rewards, values, dones):
        """returns[t] = rewards[t] + gamma * (lambda * returns[t + 1] + (1 - lambda) * values[t + 1]), cut where
        obs[t + 1] starts a new episode (dones[t + 1]); the last step bootstraps from max_a Q(next_obs, a)."""
        with torch.no_grad():
            next_value = agent.q_network(next_obs).max(dim=-1).values
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value[None]])
            # lastreturn starts at next_value: lambda * next_value + (1 - lambda) * next_value is CleanRL's last step.
            returns, lastreturn = torch.zeros_like(rewards), next_value
            for t in reversed(range(args.num_steps)):
                returns[t] = lastreturn = rewards[t] + args.gamma * nextnonterminal[t] * (
                    args.q_lambda * lastreturn + (1 - args.q_lambda) * nextvalues[t]
                )
        return returns

    def update(obs, actions, returns):
        """One gradient step on one minibatch; returns its STATS."""
        old_val = agent.q_network(obs).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(returns, old_val)
        agent.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.q_network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    return q_lambda, update


def check_args(args):
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {args.num_envs * args.num_steps}"
    if args.num_envs * args.num_steps % args.num_minibatches:
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.total_timesteps < args.num_envs * args.num_steps:
        fail(f"--total-timesteps {args.total_timesteps} is below one rollout, {batch}")
    if args.q_lambda > 1:
        fail(f"--q-lambda {args.q_lambda} must be in [0, 1]")
    if not 0 < args.exploration_fraction <= 1:
        fail(f"--exploration-fraction {args.exploration_fraction} must be in (0, 1]")
    if max(args.start_e, args.end_e) > 1:
        fail(f"--start-e {args.start_e} and --end-e {args.end_e} must be in [0, 1]")


def train(args, run):
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = run.device, run.phase
    envs = Envs(args.env_id, args.num_envs, device)
    agent = Agent(args, envs.physics.n_obs, envs.physics.n_act, device)
    q_lambda, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.physics.n_obs, device)
    # The envs are tensors, so a checkpoint holds them too: a resumed run goes on with the episodes in flight.
    envs_state = {"state": envs.state, "elapsed": envs.elapsed, "episode_return": envs.episode_return}
    state = {"q_network": agent.q_network, "optimizer": agent.optimizer, "envs": envs_state}
    global_step = run.start(state, total_steps=num_iterations * batch_size,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, profile_steps=PROFILE_ITERATIONS * batch_size,
                            env_steps_per_call=args.num_envs)  # fmt: skip
    next_obs = envs.observe()
    next_done = torch.zeros(args.num_envs, device=device)
    duration = args.exploration_fraction * args.total_timesteps
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.set_learning_rate(frac * args.learning_rate)
        for step in range(args.num_steps):
            global_step += args.num_envs
            phase("data")
            rollout.obs[step] = next_obs
            rollout.dones[step] = next_done
            phase("policy")
            with torch.no_grad():
                epsilon = linear_schedule(args.start_e, args.end_e, duration, global_step)
                action, value = agent.q_network.act(next_obs, epsilon)
            phase("env_step")
            next_obs, reward, next_done = envs.step(action)
            phase("data")
            rollout.values[step] = value
            rollout.actions[step] = action
            rollout.rewards[step] = reward
            next_done = next_done.float()
            phase("other")
            run.tick(global_step)
        phase("update")
        returns = q_lambda(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)
        batch = [b.flatten(0, 1) for b in (rollout.obs, rollout.actions, returns)]
        # Optimizing the Q-network
        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            phase("data")
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [b[b_inds[start : start + minibatch_size]] for b in batch]
                phase("update")
                stats = update(*minibatch)
        phase("other")
        # The episodes that ended in this rollout count as one, by their mean: with many envs, thousands end.
        ended, return_sum, length_sum = envs.ended_episodes().tolist()
        if ended:
            run.episode(global_step, return_sum / ended, length_sum / ended)
        run.log(global_step, {f"losses/{name}": stats[name] for name in STATS})


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved Q-network's greedy action, on gymnasium's own env of the id (ours reproduce it)."""
    physics = ENVS[args.env_id]
    q_network = QNetwork(physics.n_obs, physics.n_act, device=run.device)
    q_network.load_state_dict(saved["q_network"])
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(obs, device=run.device, dtype=torch.float32))
        obs, _, terminated, truncated, info = env.step(int(q_values.argmax()))
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
