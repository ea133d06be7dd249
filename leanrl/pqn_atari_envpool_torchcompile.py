# PQN for Atari on envpool (CleanRL's pqn_atari_envpool.py: parallel Q-learning with LayerNorm and Q(lambda) returns),
# made fast with torch.compile, CUDA graphs and docs/tricks.md. Docs: docs/pqn.md
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tensordict.nn import CudaGraphModule

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
    compile: bool = False  # trick 2: torch.compile
    """compile the policy, the Q(lambda) returns and the update with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the policy, the Q(lambda) returns and the update as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


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


class Rollout:  # trick 6: on-device storage, uint8 frames and pinned staging buffers
    """One iteration's transitions, num_steps x num_envs of each, on the device; frames stay uint8. The host stages
    what the envs return in pinned memory: frames go to the device each step, rewards and dones once an iteration."""

    def __init__(self, num_steps, num_envs, obs_shape, device):
        self.obs = torch.zeros((num_steps, num_envs) + obs_shape, dtype=torch.uint8, device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        # dones[t]: obs[t] starts a new episode (the env step before it ended one, a lost life included)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)
        # The observation and done flag after the last step, which the returns bootstrap from.
        self.next_obs = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, device=device)
        self.next_done = torch.zeros(num_envs, device=device)
        # trick 7: no host sync, epsilon of the step filled in place: the captured policy reads it on the device.
        self.epsilon = torch.zeros((), device=device)
        pin = torch.device(device).type == "cuda"
        self.next_obs_host = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, pin_memory=pin)
        self.rewards_host = torch.zeros((num_steps, num_envs), pin_memory=pin)
        self.dones_host = torch.zeros((num_steps + 1, num_envs), pin_memory=pin)  # the last row is next_done

    def to_device(self):
        """Queue the copies of the staged rewards, done flags and last observation to the device."""
        self.rewards.copy_(self.rewards_host, non_blocking=True)
        self.dones.copy_(self.dones_host[:-1], non_blocking=True)
        self.next_done.copy_(self.dones_host[-1], non_blocking=True)
        self.next_obs.copy_(self.next_obs_host, non_blocking=True)


class Agent:
    """The Q-network PQN trains and its optimizer (RAdam, as CleanRL's)."""

    def __init__(self, args, n_act, device):
        self.q_network = QNetwork(n_act, device=device)
        # trick 7: no host sync, the learning rate a device tensor, annealed in place: captured updates read its
        # current value, compiled code does not recompile for each.
        lr = torch.tensor(args.learning_rate, device=device)
        capturable = torch.device(device).type == "cuda"  # trick 1: CUDA graphs, RAdam's step count on the device
        self.optimizer = optim.RAdam(self.q_network.parameters(), lr=lr, capturable=capturable)


def make_update_fns(agent, args):
    """The two steps of a PQN iteration's learning, the Q(lambda) returns and the update on one minibatch, and the
    policy that acts; compiled and captured with --compile and --cudagraphs. The update writes its STATS into
    `stats`."""
    # trick 10: nothing to copy in or out, the statistics written into fixed tensors
    stats = {name: torch.zeros((), device=agent.optimizer.param_groups[0]["lr"].device) for name in STATS}

    def q_lambda(next_obs, next_done, rewards, values, dones):
        """returns[t] = rewards[t] + gamma * (lambda * returns[t + 1] + (1 - lambda) * values[t + 1]), cut where
        obs[t + 1] starts a new episode (dones[t + 1]); the last step bootstraps from max_a Q(next_obs, a)."""
        with torch.no_grad():
            next_value = agent.q_network(next_obs).max(dim=-1).values
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value[None]])
            # trick 17: GAE without a Python loop, here the Q(lambda) returns: returns[t] = terms[t] + coef[t] *
            # returns[t + 1] by a doubling scan: log2(num_steps) rounds, not num_steps (a short graph to compile).
            # The last row is next_value, which the last step's lambda-share bootstraps from, with no coefficient.
            # After shift s, returns[t] holds the terms of t : t + 2s, coef[t] their product.
            coef = torch.cat([args.gamma * args.q_lambda * nextnonterminal, torch.zeros_like(next_value)[None]])
            terms = rewards + args.gamma * nextnonterminal * (1 - args.q_lambda) * nextvalues
            returns, shift = torch.cat([terms, next_value[None]]), 1
            while shift <= args.num_steps:
                returns = returns + coef * F.pad(returns[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
        return returns[:-1]

    def update(obs, actions, returns):
        old_val = agent.q_network(obs).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        loss = F.mse_loss(returns, old_val)
        agent.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.q_network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        # trick 10: nothing to copy in or out: not returned, a captured function copies its outputs out of its graph.
        stats["td_loss"].copy_(loss.detach())
        stats["q_values"].copy_(old_val.detach().mean())

    def policy(obs, epsilon):
        with torch.no_grad():  # trick 3: act without autograd
            return agent.q_network.act(obs, epsilon)

    functions = (q_lambda, update, policy)
    if args.compile:  # trick 2: torch.compile
        functions = map(torch.compile, functions)
    if args.cudagraphs:  # trick 1: CUDA graphs
        functions = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in functions)
    q_lambda, update, policy = functions
    return q_lambda, update, policy, stats


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
    # trick 18: cuDNN autotuning, the shapes are fixed: cuDNN picks the fastest algorithms once
    torch.backends.cudnn.benchmark = device.type == "cuda"

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    agent = Agent(args, envs.single_action_space.n, device)
    q_lambda, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.single_observation_space.shape, device)
    episodes = EpisodeReturns(args.num_envs)
    # trick 6: on-device storage, staged by the host in pinned buffers, written through numpy views of them
    next_obs_host, rewards_host = rollout.next_obs_host.numpy(), rollout.rewards_host.numpy()
    dones_host = rollout.dones_host.numpy()
    next_obs_host[:] = envs.reset()[0]
    next_done = np.zeros(args.num_envs, dtype=bool)
    duration = args.exploration_fraction * args.total_timesteps
    # What a checkpoint holds: the iteration follows from the env step, the learning rate and epsilon from it too.
    state = {"q_network": agent.q_network, "optimizer": agent.optimizer}
    global_step = run.start(state, total_steps=num_iterations * batch_size, profile_steps=batch_size,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, env_steps_per_call=args.num_envs)  # fmt: skip
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        if args.anneal_lr:
            # trick 7: no host sync, the device tensor filled in place
            agent.optimizer.param_groups[0]["lr"].fill_((1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate)
        for step in range(args.num_steps):
            global_step += args.num_envs
            phase("data")
            # trick 6: on-device storage, the frames as uint8, in place
            rollout.obs[step].copy_(rollout.next_obs_host, non_blocking=True)
            phase("policy")
            # trick 7: no host sync, epsilon a device tensor filled in place
            rollout.epsilon.fill_(linear_schedule(args.start_e, args.end_e, duration, global_step))
            action, value = policy(rollout.obs[step], rollout.epsilon)
            # This wait also means every copy out of the pinned buffers has run: the host may write them again.
            action_np = action.cpu().numpy()
            phase("env_step")
            # trick 8: overlap the envs and the GPU: envpool's step, split in two, the writes between send and recv
            # done while the envs step (their time counts as env_step's: one env_step phase a step).
            envs.send(action_np)
            rollout.values[step] = value
            rollout.actions[step] = action
            dones_host[step] = next_done
            next_obs, reward, terminations, truncations, info = envs.recv()
            phase("data")
            next_obs_host[:] = next_obs
            rewards_host[step] = reward
            next_done = terminations | truncations
            phase("other")
            for episodic_return, length in episodes.add(info, truncations):
                run.episode(global_step, episodic_return, length)
            run.tick(global_step)

        phase("data")
        dones_host[-1] = next_done
        rollout.to_device()
        phase("update")
        returns = q_lambda(rollout.next_obs, rollout.next_done, rollout.rewards, rollout.values, rollout.dones)
        # the batch, flattened, in the order update takes it
        batch = [tensor.flatten(0, 1) for tensor in (rollout.obs, rollout.actions, returns)]
        for epoch in range(args.update_epochs):
            phase("data")
            b_inds = torch.randperm(batch_size, device=device)  # trick 7: no host sync, shuffled on the device
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [tensor[b_inds[start : start + minibatch_size]] for tensor in batch]
                phase("update")
                update(*minibatch)

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
