# PQN for Atari on envpool (CleanRL's pqn_atari_envpool.py: parallel Q-learning with LayerNorm and Q(lambda) returns),
# in plain eager PyTorch. Docs: docs/pqn.md
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from envpool_atari import EpisodeReturns, make_envs
from harness import Run, exit_code, fail, parse_args


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10000000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the Q-network"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.01
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.10
    """the fraction of `total-timesteps` it takes from start-e to end-e"""
    q_lambda: float = 0.65
    """the lambda for Q(lambda)"""


WARMUP_ITERATIONS = 3  # iterations before the fps window opens; --profile-dir profiles the one after them
STATS = ("td_loss", "q_values")


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class QNetwork(nn.Module):
    """The Nature CNN with a LayerNorm after every hidden layer (what lets PQN learn without a target network); it
    takes uint8 frames and scales them itself."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.n_act = int(n_act)  # envpool gives a numpy int, which torch.compile would take for a tensor
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.LayerNorm([32, 20, 20], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.LayerNorm([64, 9, 9], device=device),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.LayerNorm([64, 7, 7], device=device),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(3136, 512, device=device)),
            nn.LayerNorm(512, device=device),
            nn.ReLU(),
            layer_init(nn.Linear(512, n_act, device=device)),
        )

    def forward(self, x):
        return self.network(x / 255.0)

    def act(self, x, epsilon):
        """Epsilon-greedy actions, and the greedy values max_a Q(x, a) that the Q(lambda) returns bootstrap from."""
        random_actions = torch.randint(0, self.n_act, (x.shape[0],), device=x.device)
        values, max_actions = self(x).max(dim=1)
        explore = torch.rand(x.shape[0], device=x.device) < epsilon
        return torch.where(explore, random_actions, max_actions), values


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at env step t: from start_e down to end_e over `duration` steps, then end_e."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


class Rollout:
    """One iteration's transitions, num_steps x num_envs of each, on the device."""

    def __init__(self, num_steps, num_envs, obs_shape, device):
        self.obs = torch.zeros((num_steps, num_envs) + obs_shape, device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        # dones[t]: obs[t] starts a new episode (the env step before it ended one, a lost life included)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)


class Agent:
    """The Q-network PQN trains and its optimizer (RAdam, as CleanRL's)."""

    def __init__(self, args, n_act, device):
        self.q_network = QNetwork(n_act, device=device)
        self.optimizer = optim.RAdam(self.q_network.parameters(), lr=args.learning_rate)


def make_update_fns(agent, args):
    """The two steps of a PQN iteration's learning: the Q(lambda) returns and the update on one minibatch."""

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
        old_val = agent.q_network(obs).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(returns, old_val)
        agent.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.q_network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    return q_lambda, update


def check_args(args):
    """What the harness's range checks leave: minibatches of one size, at least one whole rollout, the fractions."""
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    batch_size = args.num_envs * args.num_steps
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {batch_size}"
    if batch_size % args.num_minibatches:
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.total_timesteps < batch_size:
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

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    agent = Agent(args, envs.single_action_space.n, device)
    q_lambda, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.single_observation_space.shape, device)
    episodes = EpisodeReturns(args.num_envs)
    next_obs = torch.Tensor(envs.reset()[0]).to(device)
    next_done = torch.zeros(args.num_envs, device=device)
    duration = args.exploration_fraction * args.total_timesteps
    # What a checkpoint holds: the iteration follows from the env step, the learning rate and epsilon from it too.
    state = {"q_network": agent.q_network, "optimizer": agent.optimizer}
    global_step = run.start(state, total_steps=num_iterations * batch_size, profile_steps=batch_size,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, env_steps_per_call=args.num_envs)  # fmt: skip
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        if args.anneal_lr:
            agent.optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate
        for step in range(args.num_steps):
            global_step += args.num_envs
            phase("data")
            rollout.obs[step] = next_obs
            rollout.dones[step] = next_done
            phase("policy")
            epsilon = linear_schedule(args.start_e, args.end_e, duration, global_step)
            with torch.no_grad():
                action, value = agent.q_network.act(next_obs, epsilon)
            action_np = action.cpu().numpy()
            phase("data")
            rollout.values[step] = value
            rollout.actions[step] = action
            phase("env_step")
            next_obs, reward, terminations, truncations, info = envs.step(action_np)
            phase("data")
            rollout.rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs = torch.Tensor(next_obs).to(device)
            next_done = torch.Tensor(terminations | truncations).to(device)
            phase("other")
            for episodic_return, length in episodes.add(info, truncations):
                run.episode(global_step, episodic_return, length)
            run.tick(global_step)

        phase("update")
        returns = q_lambda(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)
        # the batch, flattened, in the order update takes it
        batch = [tensor.flatten(0, 1) for tensor in (rollout.obs, rollout.actions, returns)]
        b_inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [tensor[b_inds[start : start + minibatch_size]] for tensor in batch]
                phase("update")
                stats = update(*minibatch)

        phase("other")
        run.log(global_step, {f"losses/{name}": value for name, value in stats.items()})
    envs.close()


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved Q-network's greedy action on fresh envs, whole games counted as in training."""
    num_envs = min(args.num_envs, args.eval_episodes)
    envs = make_envs(args.env_id, num_envs, args.seed)
    q_network = QNetwork(envs.single_action_space.n, device=run.device)
    q_network.load_state_dict(saved["q_network"])
    episodes = EpisodeReturns(num_envs)
    obs, _ = envs.reset()
    while True:
        with torch.no_grad():
            q_values = q_network(torch.as_tensor(obs, device=run.device))
        obs, _, _, truncations, info = envs.step(q_values.argmax(1).cpu().numpy())
        for episodic_return, _ in episodes.add(info, truncations):
            yield episodic_return


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
