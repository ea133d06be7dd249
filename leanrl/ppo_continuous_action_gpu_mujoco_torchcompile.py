# PPO for continuous actions (CleanRL's ppo_continuous_action.py) on batched MuJoCo envs simulated with MuJoCo Warp on
# the device that torch uses, made fast: an env step, Warp's physics included, one CUDA graph; GAE as a scan;
# compile; data-parallel under torchrun. Docs: docs/gpu_mujoco.md
import copy
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from tensordict.nn import CudaGraphModule
from torch.distributions.normal import Normal

from harness import Run, agree, average, exit_code, fail, flat_gradients, parse_args, setup_distributed, world
from mujoco_warp_envs import ENVS, CapturableEnvs, RunningMeanStd, gymnasium_env, saved_obs_rms


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5 or Humanoid-v5"""
    total_timesteps: int = 100000000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 16384
    """the number of parallel environments (MuJoCo Warp worlds)"""
    num_steps: int = 32
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of minibatches a rollout is split into"""
    update_epochs: int = 4
    """the number of epochs over each rollout"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as in the PPO paper"""
    ent_coef: float = 0.0
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop the epochs of an update early once the approximate KL divergence exceeds this threshold"""
    capture_video: bool = False
    """record --eval-checkpoint's episodes as videos under videos/<run name>/ (training's Warp worlds render none)"""
    compile: bool = False  # trick 2: torch.compile
    """compile the policy, GAE and update functions with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the rollout (policy, Warp's physics, resets, storage), GAE and the update as CUDA graphs"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code and Warp's kernels in this folder and start warm from it, here or on a like GPU"""


# Iterations that count as warm-up: the fps window starts after them.
WARMUP_ITERATIONS = 3
# Iterations profiled with --profile-dir, at the start of the steady window.
PROFILE_ITERATIONS = 1
# The statistics of a minibatch update, in the order they are logged.
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """Separate 64-64 tanh actor and critic; a Gaussian policy with a state-independent log-std."""

    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)), nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)), nn.Tanh(),
            layer_init(nn.Linear(64, 1, device=device), std=1.0),
        )  # fmt: skip
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(n_obs, 64, device=device)), nn.Tanh(),
            layer_init(nn.Linear(64, 64, device=device)), nn.Tanh(),
            layer_init(nn.Linear(64, n_act, device=device), std=0.01),
        )  # fmt: skip
        self.actor_logstd = nn.Parameter(torch.zeros(1, n_act, device=device))

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        # trick 1: CUDA graphs: checking the arguments would read them back to the host, a sync a graph refuses
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp(), validate_args=False)
        if action is None:
            # sample() calls torch.normal, which checks std on the host; rsample draws the same numbers without
            action = probs.rsample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class Rollout:  # trick 15: the rollout captured, which writes the next rollout's first row too
    """One rollout of num_steps steps of num_envs envs, on the device. obs and dones have one more row: the observation
    the next rollout starts with, GAE's bootstrap."""

    def __init__(self, num_steps, num_envs, n_obs, n_act, device):
        self.obs = torch.zeros((num_steps + 1, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs, n_act), device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        self.dones = torch.zeros((num_steps + 1, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)


class Agent:
    """The network PPO trains and its optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        # trick 7: no host sync: the learning rate, a device tensor annealed in place, is read by compiled and
        # captured optimizer steps; Adam takes it without host syncs when capturable (CUDA only).
        lr = torch.tensor(args.learning_rate, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, capturable=device.type == "cuda")
        self.grads = None
        if dist.is_initialized():  # the gradients as views into one flat buffer, averaged in place
            self.grads = flat_gradients(self.net.parameters())


def pool_statistics(running, agreed):
    """The ranks' running statistics (RunningMeanStd) made one, in place: what each rank's envs added since `agreed`
    (their values when the ranks last pooled, the same on every rank), summed over the ranks and added to `agreed`,
    as one process would hold them after every rank's batches. Moments about the agreed mean, in float64, in one
    all-reduce; `agreed` then holds the pooled statistics too."""
    others = dist.get_world_size() - 1  # a sum over the ranks counts `agreed` this many times too often
    moments = []
    for rms, old in zip(running, agreed):  # count, and count times the first and second moments about old.mean
        shift = rms.mean - old.mean
        moments += [rms.count.reshape(1), (rms.count * shift).flatten(), (rms.count * (rms.var + shift**2)).flatten()]
    sums = torch.cat(moments)
    dist.all_reduce(sums)
    parts = sums.split([m.numel() for m in moments])
    for i, (rms, old) in enumerate(zip(running, agreed)):
        count, first, second = parts[3 * i : 3 * i + 3]
        count = count[0] - others * old.count
        shift = first.view_as(old.mean) / count
        rms.var.copy_((second.view_as(old.var) - others * old.count * old.var) / count - shift**2)
        rms.mean.copy_(old.mean + shift)
        rms.count.copy_(count)
        for key, value in vars(old).items():
            value.copy_(getattr(rms, key))


def make_update_fns(agent, args):
    """GAE over a rollout, the PPO update on one minibatch (its STATS into `stats`, fixed tensors), and the policy
    that acts. --compile compiles each; --cudagraphs captures GAE and the update (the policy: within make_collect's
    graph)."""
    # trick 10: nothing to copy in or out: the update writes its statistics into these fixed tensors
    stats = {name: torch.zeros((), device=agent.net.actor_logstd.device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], agent.net.critic(next_obs).reshape(1, -1)])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            # trick 17: GAE without a Python loop: A[t] = delta[t] + coef[t] * A[t + 1] in log2(num_steps) rounds of a
            # doubling scan (a short graph to compile): after the round with shift s, A[t] holds the terms of
            # delta[t : t + 2s] and coef[t] the product of coef[t : t + 2s].
            advantages = delta
            shift = 1
            while shift < args.num_steps:
                advantages = advantages + coef * F.pad(advantages[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
            returns = advantages + values
        return advantages, returns

    def minibatch_loss(obs, actions, logprobs, advantages, returns, values):
        """The loss of one minibatch; its STATS but the gradient norm into `stats`."""
        _, newlogprob, entropy, newvalue = agent.net.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()
        with torch.no_grad():  # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()
        if args.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
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
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac)
        for name, value in zip(STATS, outputs):  # not returned: a captured function copies outputs out of its graph
            stats[name].copy_(value.detach())
        return loss

    # trick 19: one all-reduce of a flat buffer: under torchrun it runs between backward and step
    def backward(*minibatch):
        """The loss of one minibatch and its gradients."""
        loss = minibatch_loss(*minibatch)
        agent.optimizer.zero_grad(set_to_none=agent.grads is None)  # the flat buffer's views stay
        loss.backward()

    def step():
        """The clipped gradients' optimizer step; the gradient norm into `stats`."""
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        stats["grad_norm"].copy_(grad_norm.detach())

    def update(*minibatch):
        backward(*minibatch)
        step()

    def policy(obs):  # trick 3: act without autograd
        with torch.no_grad():
            action, logprob, _, value = agent.net.get_action_and_value(obs)
        return action, logprob, value.flatten()

    # trick 2: torch.compile: GAE, the loss, the step and the policy, each its own graph that the others call by these
    # names; the backward pass runs between loss and step, so no graph breaks at it (the code after a break is traced
    # again at every start)
    if args.compile:
        gae, minibatch_loss, step, policy = map(torch.compile, (gae, minibatch_loss, step, policy))
    fast_backward, fast_step = backward, step
    if args.cudagraphs:  # trick 1: CUDA graphs
        graphs = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in (gae, update, fast_backward, fast_step))
        gae, update, fast_backward, fast_step = graphs

    def update_distributed(*minibatch):  # trick 19: one all-reduce of a flat buffer, between two graphs
        fast_backward(*minibatch)
        average(agent.grads)
        fast_step()

    return gae, update_distributed if dist.is_initialized() else update, policy, stats


def make_collect(agent, policy, envs, rollout, args):  # trick 15: the rollout captured, one env step's graph
    """collect(): one rollout of num_steps steps of all envs into `rollout`, from its last rows (where the last one
    ended). With --cudagraphs an env step (policy, Warp's physics, resets, storage) is one CUDA graph replayed num_steps
    times, its row a device index: capturing Warp's solver loops costs about 0.5 s of CPU per step on Humanoid."""
    t = torch.zeros(1, dtype=torch.long, device=rollout.obs.device)

    def step():
        action, logprob, value = policy(rollout.obs[t][0])
        next_obs, reward, next_done, final_obs, truncated = envs.step(action)
        with torch.no_grad():  # a time limit is bootstrapped with V(final observation) (docs/ppo_continuous.md)
            reward = reward + args.gamma * agent.net.critic(final_obs).flatten() * truncated
        rollout.actions[t] = action
        rollout.logprobs[t] = logprob
        rollout.values[t] = value
        rollout.rewards[t] = reward
        rollout.obs[t + 1] = next_obs
        rollout.dones[t + 1] = next_done
        t.add_(1)

    if args.cudagraphs:
        step = CudaGraphModule(step, warmup=3 if args.compile else 2)

    def collect():
        # The observation the last rollout ended in is the first of this one.
        rollout.obs[0] = rollout.obs[-1]
        rollout.dones[0] = rollout.dones[-1]
        t.zero_()
        for _ in range(args.num_steps):
            step()

    return collect


def check_args(args):
    _, world_size = world()
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    if args.capture_video:
        fail("--capture-video records the episodes of --eval-checkpoint: the MuJoCo Warp worlds render no frames")
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
    # Each rank seeds its worlds' resets and its sampling apart; the parameters come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    device, phase = run.device, run.phase
    # trick 15: the rollout captured: these envs' physics can join a step's graph
    envs = CapturableEnvs(args.env_id, args.num_envs, args.gamma, device)  # Warp's kernels build until start()
    n_obs, n_act = envs.n_obs, envs.n_act
    agent = Agent(args, n_obs, n_act, device)
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, n_act, device)
    if args.compile:  # trick 22: compile while Warp builds: GAE, an update and an action on zeros, then rolled back
        with run.rolled_back({"net": agent.net, "optimizer": agent.optimizer}):
            gae(rollout.obs[-1], rollout.dones[-1], rollout.rewards, rollout.values, rollout.dones[:-1])
            # a minibatch: obs, actions, logprobs, advantages, returns, values
            update(*[torch.zeros(minibatch_size, *row, device=device) for row in ((n_obs,), (n_act,), *[()] * 4)])
            policy(rollout.obs[0])
    envs.start()
    collect = make_collect(agent, policy, envs, rollout, args)
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one (under
    # torchrun: rank 0's envs, which every rank resumes from).
    state = {"net": agent.net, "optimizer": agent.optimizer, "envs": envs.state}
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            profile_steps=PROFILE_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=steps_per_iteration, replicated=agent.net)  # fmt: skip
    if world_size > 1:
        # The normalisation statistics as the ranks last agreed on them: a fresh RunningMeanStd's at the start, the
        # checkpoint's on resume; each rank's envs update their own until the iteration's end pools them.
        running = (envs.obs_rms, envs.return_rms)
        agreed = copy.deepcopy(running) if global_step else [RunningMeanStd(r.mean.shape, device) for r in running]
    rollout.obs[-1], rollout.dones[-1] = envs.obs, envs.done  # after run.start: a resumed run's envs
    # A checkpoint is written as an iteration begins: a resumed run goes on with the iteration after its steps.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)  # trick 7: no host sync

        global_step += steps_per_iteration
        phase("env_step")
        collect()  # trick 15: the rollout captured
        phase("other")
        if rank == 0:  # rank 0 alone shows progress
            run.tick(global_step)
        phase("update")
        advantages, rets = gae(rollout.obs[-1], rollout.dones[-1], rollout.rewards, rollout.values,
                               rollout.dones[:-1])  # fmt: skip

        # the batch, each env's steps one after another: obs, actions, logprobs, advantages, returns, values
        batch = (rollout.obs[:-1], rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [x.flatten(0, 1) for x in batch]
        for epoch in range(args.update_epochs):
            phase("data")
            b_inds = torch.randperm(batch_size, device=device)  # trick 7: no host sync, shuffled on the device
            # One gather per epoch: the minibatches are then contiguous slices of the shuffled batch.
            shuffled = [b[b_inds] for b in batch]
            for start in range(0, batch_size, minibatch_size):
                phase("data")
                minibatch = [b[start : start + minibatch_size] for b in shuffled]
                phase("update")
                update(*minibatch)  # trick 10: nothing to copy in or out, the statistics in `stats`
            # Every rank stops its epochs at the same one, by the ranks' mean KL: the all-reduces must pair up.
            approx_kl = stats["approx_kl"]
            if args.target_kl is not None and world_size > 1:
                approx_kl = agree(approx_kl, dist.ReduceOp.SUM, device) / world_size
            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        phase("other")
        # The episodes that ended in this rollout count as one, their mean: thousands end per rollout with
        # many envs. Read back in one sync.
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
            # What every rank's envs added to the statistics, pooled: the policy reads the same on every rank.
            pool_statistics(running, agreed)


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved policy's deterministic action (its mean), episode after episode on gymnasium's own
    env of the same id (MuJoCo's C simulator, which the batched envs reproduce), observations normalised with the
    saved statistics, frozen."""
    env = gymnasium_env(args.env_id, run.video_folder)
    n_obs, n_act = env.observation_space.shape[0], env.action_space.shape[0]
    net = ActorCritic(n_obs, n_act, device=run.device)
    net.load_state_dict(saved["net"])
    obs_rms = saved_obs_rms(saved["envs"], run.device)
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            action = net.actor_mean(obs_rms.normalize(torch.as_tensor(obs, device=run.device)[None]))[0]
        obs, _, terminated, truncated, info = env.step(action.clamp(-1, 1).cpu().numpy())
        if terminated or truncated:
            obs, _ = env.reset()  # first: RecordVideo writes an episode's video as the next one starts
            yield info["episode"]["r"]


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
