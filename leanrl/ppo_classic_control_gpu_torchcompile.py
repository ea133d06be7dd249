# PPO for discrete actions (CleanRL's ppo.py) on classic-control envs kept on the GPU as batched torch tensors, made
# fast (docs/tricks.md); data-parallel under torchrun. Docs: docs/gpu_collection.md, docs/multigpu.md
import random
import sys
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

from fused_rollout import make_fused_collect  # trick 20: the rollout as one Triton kernel
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
    compile: bool = False  # trick 2: torch.compile
    """compile the rollout step, GAE and the update with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the rollout, GAE and the update as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""
    fused_rollout: bool = False  # trick 20: the rollout as one Triton kernel
    """run the whole rollout (policy, sampling, env step, auto-reset, storage) as one Triton kernel per iteration"""


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
        # trick 1: CUDA graphs, no argument validation: checking the arguments would read them back to the host, a
        # sync, and not allowed in a CUDA graph
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            # Gumbel-max, in both scripts: probs.sample()'s distribution by pointwise operations a compiled step fuses
            action = torch.argmax(logits - torch.log(-torch.log(torch.rand_like(logits))), dim=-1)
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Rollout:  # trick 15: the rollout captured, with one more row
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
        # trick 7: no host sync, the learning rate a device tensor that annealing overwrites in place, so a compiled
        # or captured step reads the current value; Adam takes it without host syncs only when capturable, which it
        # can be on CUDA alone.
        lr = torch.tensor(args.learning_rate, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, capturable=device.type == "cuda")
        self.grads = None
        if dist.is_initialized():  # the gradients as views into one flat buffer, averaged in place
            self.grads = flat_gradients(self.net.parameters())

    def set_learning_rate(self, lr):
        self.optimizer.param_groups[0]["lr"].fill_(lr)  # trick 7: no host sync


def make_update_fns(agent, args):
    """GAE over a rollout, the PPO update on one minibatch (its STATS written into `stats`, fixed tensors), and the
    policy that acts. --compile and --cudagraphs apply to GAE and the update here, to the policy in make_collect."""
    # trick 10: nothing to copy in or out, the statistics written into fixed tensors
    stats = {name: torch.zeros((), device=next(agent.net.parameters()).device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            next_value = agent.net.critic(next_obs).reshape(1, -1)
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            # trick 17: GAE without a Python loop, advantages[t] = delta[t] + coef[t] * advantages[t + 1] by a doubling
            # scan: log2(num_steps) rounds, not num_steps (a short graph to compile). After shift s, advantages[t]
            # holds the terms of delta[t : t + 2s] and coef[t] the product of coef[t : t + 2s].
            advantages, shift = delta, 1
            while shift < args.num_steps:
                advantages = advantages + coef * F.pad(advantages[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
        return advantages, advantages + values

    # trick 19: one all-reduce of a flat buffer, between the captured backward and the captured step
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
        with torch.no_grad():  # trick 3: act without autograd
            action, logprob, _, value = agent.net.get_action_and_value(obs)
        return action, logprob, value.flatten()

    functions = (gae, update, backward, step)
    if args.compile:  # trick 2: torch.compile
        functions = map(torch.compile, functions)
    if args.cudagraphs:  # trick 1: CUDA graphs
        functions = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in functions)
    # Other names for the wrapped backward and step: update calls the plain ones.
    gae, update, fast_backward, fast_step = functions

    def update_distributed(*minibatch):  # trick 19: one all-reduce of a flat buffer
        # The all-reduce runs between two graphs: inside the update's one graph it measured 2% slower here, for
        # this small network (docs/multigpu.md). Alone, one graph does the whole update.
        fast_backward(*minibatch)
        average(agent.grads)
        fast_step()

    return gae, update_distributed if dist.is_initialized() else update, policy, stats


def make_collect(policy, envs, rollout, args):  # trick 15: the rollout captured
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
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.physics.n_obs, device)
    rollout.obs[-1] = envs.observe()  # trick 15: the rollout captured, which starts from its last row
    state = {"net": agent.net, "optimizer": agent.optimizer}
    if args.fused_rollout:  # trick 20: the rollout as one Triton kernel
        collect = make_fused_collect(agent.net, envs, rollout)
        state["fused_seed"] = collect.seed  # the kernel's random stream goes on where it was
    else:
        collect = make_collect(policy, envs, rollout, args)
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            profile_steps=PROFILE_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=steps_per_iteration, replicated=agent.net)  # fmt: skip
    if global_step and args.fused_rollout and rank:  # a resumed run's other ranks: the kernel's stream apart too
        collect.seed.fill_(int(torch.randint(2**30, ())))
    # A resumed run goes on with the iteration after its checkpoint's, the learning rate annealed from there.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.set_learning_rate(frac * args.learning_rate)
        global_step += steps_per_iteration
        phase("env_step")
        collect()  # trick 15: the rollout captured
        phase("other")
        if rank == 0:  # rank 0 alone shows progress
            run.tick(global_step)
        phase("update")
        advantages, rets = gae(rollout.obs[-1], rollout.dones[-1], rollout.rewards, rollout.values,
                               rollout.dones[:-1])  # fmt: skip
        batch = (rollout.obs[:-1], rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [b.flatten(0, 1) for b in batch]  # obs, actions, logprobs, advantages, returns, values
        # Optimizing the policy and value network
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
