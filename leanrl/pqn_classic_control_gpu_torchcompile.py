# PQN (CleanRL's pqn.py: parallel Q-learning with LayerNorm and Q(lambda) returns) on classic-control envs kept on the
# GPU as batched torch tensors, made fast (docs/tricks.md). Docs: docs/pqn.md
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tensordict.nn import CudaGraphModule

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
    compile: bool = False  # trick 2: torch.compile
    """compile the rollout step, the Q(lambda) returns and the update with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the rollout, the Q(lambda) returns and the update as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


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


class Rollout:  # trick 15: the rollout captured, with one more row
    """One rollout of num_steps steps of num_envs envs, on the device. obs and dones have one more row: the
    observation after the last step, which the returns bootstrap from and the next rollout starts with."""

    def __init__(self, num_steps, num_envs, n_obs, device):
        self.obs = torch.zeros((num_steps + 1, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.rewards, self.values = torch.zeros((2, num_steps, num_envs), device=device)
        self.dones = torch.zeros((num_steps + 1, num_envs), device=device)
        # trick 7: no host sync, the env steps done before this rollout, which epsilon follows: filled in place, read
        # by the captured rollout.
        self.start_step = torch.zeros((), dtype=torch.float64, device=device)


class Agent:
    """The Q-network PQN trains and its optimizer (RAdam, as CleanRL's)."""

    def __init__(self, args, n_obs, n_act, device):
        self.q_network = QNetwork(n_obs, n_act, device=device)
        # trick 7: no host sync, the learning rate a device tensor that annealing overwrites in place, so a compiled
        # or captured step reads the current value; RAdam takes it without host syncs only when capturable, which it
        # can be on CUDA alone.
        lr = torch.tensor(args.learning_rate, device=device)
        self.optimizer = optim.RAdam(self.q_network.parameters(), lr=lr, capturable=device.type == "cuda")

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"].fill_(lr)  # trick 7: no host sync


def make_update_fns(agent, args):
    """The Q(lambda) returns of a rollout, the update on one minibatch (its STATS written into `stats`, fixed tensors),
    and the policy that acts. --compile and --cudagraphs apply to the returns and the update here, to the policy in
    make_collect."""
    # trick 10: nothing to copy in or out, the statistics written into fixed tensors
    stats = {name: torch.zeros((), device=next(agent.q_network.parameters()).device) for name in STATS}

    def q_lambda(next_obs, next_done, rewards, values, dones):
        """returns[t] = rewards[t] + gamma * (lambda * returns[t + 1] + (1 - lambda) * values[t + 1]), cut where
        obs[t + 1] starts a new episode (dones[t + 1]); the last step bootstraps from max_a Q(next_obs, a)."""
        with torch.no_grad():
            next_value = agent.q_network(next_obs).max(dim=-1).values
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value[None]])
            # trick 17: GAE without a Python loop (here the Q(lambda) returns): returns[t] = terms[t] + coef[t] *
            # returns[t + 1] by a doubling scan: log2(num_steps) rounds, not num_steps (a short graph to compile). The
            # last row is next_value, which the last step's lambda-share bootstraps from, with no coefficient. After
            # shift s, returns[t] holds the terms of t : t + 2s, coef[t] their product.
            coef = torch.cat([args.gamma * args.q_lambda * nextnonterminal, torch.zeros_like(next_value)[None]])
            terms = rewards + args.gamma * nextnonterminal * (1 - args.q_lambda) * nextvalues
            returns, shift = torch.cat([terms, next_value[None]]), 1
            while shift <= args.num_steps:
                returns = returns + coef * F.pad(returns[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
        return returns[:-1]

    def update(obs, actions, returns):
        """One gradient step on one minibatch; its STATS into `stats`."""
        old_val = agent.q_network(obs).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(returns, old_val)
        agent.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.q_network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        # trick 10: nothing to copy in or out: not returned, as a captured function copies its outputs out of its graph
        stats["td_loss"].copy_(loss.detach())
        stats["q_values"].copy_(old_val.detach().mean())

    def policy(obs, epsilon):
        with torch.no_grad():  # trick 3: act without autograd
            return agent.q_network.act(obs, epsilon)

    if args.compile:  # trick 2: torch.compile
        q_lambda, update = torch.compile(q_lambda), torch.compile(update)
    if args.cudagraphs:  # trick 1: CUDA graphs
        q_lambda, update = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in (q_lambda, update))
    return q_lambda, update, policy, stats


def make_collect(policy, envs, rollout, args):  # trick 15: the rollout captured
    """collect(): one rollout of num_steps steps of all envs into `rollout`, from the observation and done flags the
    last one ended in (its last rows). With --compile the env step (policy, env, auto-reset, storage) is compiled;
    with --cudagraphs the whole rollout is one CUDA graph: one replay per iteration, no Python per step."""
    duration = args.exploration_fraction * args.total_timesteps

    def step(t):
        # This step's global_step from the rollout's first, on the device: epsilon needs no number from the host.
        epsilon = linear_schedule(args.start_e, args.end_e, duration, rollout.start_step + (t + 1) * args.num_envs)
        action, value = policy(rollout.obs[t], epsilon)
        next_obs, reward, done = envs.step(action)
        rollout.actions[t] = action
        rollout.values[t] = value
        rollout.rewards[t] = reward
        rollout.obs[t + 1] = next_obs
        rollout.dones[t + 1] = done

    if args.compile:
        # trick 11: compile the body, not the loop: t becomes a symbolic integer at the second call (one recompile),
        # so every step runs the same kernels.
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
    q_lambda, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.physics.n_obs, device)
    collect = make_collect(policy, envs, rollout, args)
    # The envs are tensors, so a checkpoint holds them too: a resumed run goes on with the episodes in flight.
    envs_state = {"state": envs.state, "elapsed": envs.elapsed, "episode_return": envs.episode_return}
    state = {"q_network": agent.q_network, "optimizer": agent.optimizer, "envs": envs_state}
    global_step = run.start(state, total_steps=num_iterations * batch_size,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, profile_steps=PROFILE_ITERATIONS * batch_size,
                            env_steps_per_call=batch_size)  # fmt: skip
    rollout.obs[-1] = envs.observe()  # trick 15: the rollout captured, which starts from its last row
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.set_learning_rate(frac * args.learning_rate)
        phase("env_step")
        rollout.start_step.fill_(global_step)  # trick 7: no host sync, in place as the learning rate: for epsilon
        collect()  # trick 15: the rollout captured
        global_step += batch_size
        phase("other")
        run.tick(global_step)
        phase("update")
        returns = q_lambda(rollout.obs[-1], rollout.dones[-1], rollout.rewards, rollout.values, rollout.dones[:-1])
        batch = [b.flatten(0, 1) for b in (rollout.obs[:-1], rollout.actions, returns)]
        # Optimizing the Q-network
        for epoch in range(args.update_epochs):
            phase("data")
            b_inds = torch.randperm(batch_size, device=device)  # trick 7: no host sync, shuffled on the device
            # One gather per epoch: the minibatches are then contiguous slices of the shuffled batch.
            shuffled = [b[b_inds] for b in batch]
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [b[start : start + minibatch_size] for b in shuffled]
                phase("update")
                update(*minibatch)
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
