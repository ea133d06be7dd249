# PPO for Atari on envpool, as CleanRL defines it, made fast with torch.compile, CUDA graphs and docs/tricks.md;
# data-parallel under torchrun. Docs: docs/ppo_atari.md, docs/multigpu.md
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from tensordict.nn import CudaGraphModule
from torch.distributions.categorical import Categorical

from envpool_atari import EpisodeReturns, make_envs
from harness import Run, agree, average, exit_code, fail, flat_gradients, parse_args, setup_distributed, world


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    total_timesteps: int = 10000000
    """total timesteps of all ranks (rounded down to whole iterations of num_envs * num_steps on every rank)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments of each rank"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop an iteration's epochs early once the approximate KL divergence exceeds this threshold"""
    compile: bool = False  # trick 2: torch.compile
    """compile the policy, GAE and update functions with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the policy, GAE and update functions as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


WARMUP_ITERATIONS = 3  # iterations before the fps window opens; --profile-dir profiles the one after them
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac")  # logged in this order


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """The Nature CNN with a policy head and a value head; it takes uint8 frames and scales them itself."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        # trick 1: CUDA graphs, no argument validation: its checks read values back to the host, which a graph
        # cannot capture.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


class Rollout:  # trick 6: on-device storage, uint8 frames and pinned staging buffers
    """One iteration's transitions, num_steps x num_envs of each, on the device; frames stay uint8. The host stages
    what the envs return in pinned memory: frames go to the device each step, rewards and dones once an iteration."""

    def __init__(self, num_steps, num_envs, obs_shape, device):
        self.obs = torch.zeros((num_steps, num_envs) + obs_shape, dtype=torch.uint8, device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        # dones[t]: obs[t] ended its episode (it is the last observation before envpool's reset step)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)
        # The observation and done flag after the last step, which GAE bootstraps from.
        self.next_obs = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, device=device)
        self.next_done = torch.zeros(num_envs, device=device)
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
    """The actor-critic network PPO trains and its optimizer."""

    def __init__(self, args, n_act, device):
        self.network = ActorCritic(n_act, device=device)
        # trick 7: no host sync, the learning rate a device tensor, annealed in place: captured updates read its
        # current value, compiled code does not recompile for each.
        lr = torch.tensor(args.learning_rate, device=device)
        capturable = torch.device(device).type == "cuda"  # trick 1: CUDA graphs, Adam's step count on the device
        self.optimizer = optim.Adam(self.network.parameters(), lr=lr, eps=1e-5, capturable=capturable)
        self.grads = None
        if dist.is_initialized():  # the gradients as views into one flat buffer, averaged in place
            self.grads = flat_gradients(self.network.parameters())


def make_update_fns(agent, args):
    """The two steps of a PPO iteration's learning, advantages (GAE) and the update on one minibatch, and the policy
    that acts; compiled and captured with --compile and --cudagraphs. The update writes its STATS into `stats`."""
    # trick 10: nothing to copy in or out, the statistics written into fixed tensors
    stats = {name: torch.zeros((), device=agent.optimizer.param_groups[0]["lr"].device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        with torch.no_grad():
            next_value = agent.network.get_value(next_obs).reshape(1, -1)  # bootstrap value if not done
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            # trick 17: GAE without a Python loop: advantages[t] = delta[t] + c[t] * advantages[t + 1], in closed
            # form: the sum over k >= t of c[t] * ... * c[k - 1] * delta[k], the products from one cumprod over a
            # num_steps x num_steps matrix (a few kernels, where the loop would compile to num_steps unrolled steps).
            c = args.gamma * args.gae_lambda * nextnonterminal
            upper = torch.ones(args.num_steps, args.num_steps, dtype=torch.bool, device=c.device).triu()[..., None]
            products = torch.cumprod(torch.where(upper, c, 1.0), dim=1)  # [t, k]: c[t] * ... * c[k] for k >= t
            discounts = torch.cat([torch.ones_like(products[:, :1]), products[:, :-1]], dim=1) * upper
            advantages = (discounts * delta).sum(1)
            returns = advantages + values
        return advantages, returns

    def update(obs, actions, logprobs, advantages, returns, values):
        _, newlogprob, entropy, newvalue = agent.network.get_action_and_value(obs, actions)
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
            v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
            v_loss = 0.5 * torch.max((newvalue - returns) ** 2, (v_clipped - returns) ** 2).mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        agent.optimizer.zero_grad(set_to_none=agent.grads is None)  # the flat buffer's views stay
        loss.backward()
        if dist.is_initialized():  # trick 19: one all-reduce of a flat buffer, in the update's captured graph
            average(agent.grads)
        nn.utils.clip_grad_norm_(agent.network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac)
        for name, value in zip(STATS, outputs):  # not returned: a captured function copies outputs out of its graph
            stats[name].copy_(value.detach())

    def policy(obs):
        with torch.no_grad():  # trick 3: act without autograd
            action, logprob, _, value = agent.network.get_action_and_value(obs)
        return action, logprob, value.flatten()

    functions = (gae, update, policy)
    if args.compile:  # trick 2: torch.compile
        functions = map(torch.compile, functions)
    if args.cudagraphs:  # trick 1: CUDA graphs
        functions = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in functions)
    gae, update, policy = functions
    return gae, update, policy, stats


def check_args(args):
    """What the harness's range checks leave: minibatches of one size, and at least one whole rollout of every rank."""
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    _, world_size = world()
    batch_size = args.num_envs * args.num_steps
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {batch_size}"
    if batch_size % args.num_minibatches:
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.norm_adv and batch_size // args.num_minibatches < 2:
        fail(f"--num-minibatches {args.num_minibatches} leaves minibatches of one sample; --norm-adv needs two")
    if args.total_timesteps < batch_size * world_size:
        fail(f"--total-timesteps {args.total_timesteps} is below one rollout, {batch} on each of {world_size} ranks")


def train(args, run):
    rank, world_size = world()
    # Sizes are per rank; global_step counts the env steps of all ranks, as --total-timesteps does.
    batch_size = args.num_envs * args.num_steps
    steps_per_iteration = batch_size * world_size
    num_iterations = args.total_timesteps // steps_per_iteration
    # Each rank seeds its envs and its sampling apart; the parameters come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    device, phase = run.device, run.phase
    # trick 18: cuDNN autotuning, the shapes are fixed: cuDNN picks the fastest algorithms once
    torch.backends.cudnn.benchmark = device.type == "cuda"

    envs = make_envs(args.env_id, args.num_envs, args.seed + rank)
    agent = Agent(args, envs.single_action_space.n, device)
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.single_observation_space.shape, device)
    episodes = EpisodeReturns(args.num_envs)
    # trick 6: on-device storage, staged by the host in pinned buffers, written through numpy views of them
    next_obs_host, rewards_host = rollout.next_obs_host.numpy(), rollout.rewards_host.numpy()
    dones_host = rollout.dones_host.numpy()
    next_obs_host[:] = envs.reset()[0]
    next_done = np.zeros(args.num_envs, dtype=bool)
    # What a checkpoint holds: the iteration follows from the env step, the learning rate from the iteration.
    state = {"network": agent.network, "optimizer": agent.optimizer}
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration, profile_steps=steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=args.num_envs * world_size, replicated=agent.network)
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        if args.anneal_lr:
            # trick 7: no host sync, the device tensor filled in place
            agent.optimizer.param_groups[0]["lr"].fill_((1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate)
        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            phase("data")
            rollout.obs[step].copy_(rollout.next_obs_host, non_blocking=True)  # the frames, as uint8, in place
            phase("policy")
            action, logprob, value = policy(rollout.obs[step])
            # This wait also means every copy out of the pinned buffers has run: the host may write them again.
            action_np = action.cpu().numpy()
            phase("env_step")
            # trick 8: overlap the envs and the GPU: envpool's step, split in two, the writes between send and recv
            # done while the envs step (their time counts as env_step's: one env_step phase a step).
            envs.send(action_np)
            rollout.values[step] = value
            rollout.actions[step] = action
            rollout.logprobs[step] = logprob
            dones_host[step] = next_done
            next_obs, reward, terminations, truncations, info = envs.recv()
            phase("data")
            next_obs_host[:] = next_obs
            rewards_host[step] = reward
            next_done = terminations | truncations
            phase("other")
            if rank == 0:  # rank 0 alone shows progress and counts returns, of its own envs, as CleanRL does
                for episodic_return, length in episodes.add(info, truncations):
                    run.episode(global_step, episodic_return, length)
                run.tick(global_step)

        phase("data")
        dones_host[-1] = next_done
        rollout.to_device()
        phase("update")
        advantages, returns = gae(rollout.next_obs, rollout.next_done, rollout.rewards, rollout.values, rollout.dones)
        # the batch, flattened, in the order update takes it
        batch = (rollout.obs, rollout.actions.long(), rollout.logprobs, advantages, returns, rollout.values)
        batch = [tensor.flatten(0, 1) for tensor in batch]
        for epoch in range(args.update_epochs):
            phase("data")
            b_inds = torch.randperm(batch_size, device=device)  # trick 7: no host sync, shuffled on the device
            for mb_inds in b_inds.chunk(args.num_minibatches):
                phase("data")
                minibatch = [tensor[mb_inds] for tensor in batch]
                phase("update")
                update(*minibatch)
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:  # by the ranks' mean KL, all stop at the same epoch
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        phase("other")
        # On the device, so that it is read back with the statistics, in one sync.
        var_y = returns.var(correction=0)
        explained_var = torch.where(var_y == 0, torch.nan, 1 - (returns - rollout.values).var(correction=0) / var_y)
        learning_rate = agent.optimizer.param_groups[0]["lr"]
        scalars = {"losses/explained_variance": explained_var, "charts/learning_rate": learning_rate}
        run.log(global_step, scalars | {f"losses/{name}": value for name, value in stats.items()})
    envs.close()


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved policy's most likely action on fresh envs, whole games counted as in training."""
    num_envs = min(args.num_envs, args.eval_episodes)
    envs = make_envs(args.env_id, num_envs, args.seed)
    network = ActorCritic(envs.single_action_space.n, device=run.device)
    network.load_state_dict(saved["network"])
    episodes = EpisodeReturns(num_envs)
    obs, _ = envs.reset()
    while True:
        with torch.no_grad():
            logits = network.actor(network.network(torch.as_tensor(obs, device=run.device) / 255.0))
        obs, _, _, truncations, info = envs.step(logits.argmax(1).cpu().numpy())
        for episodic_return, _ in episodes.add(info, truncations):
            yield episodic_return


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
