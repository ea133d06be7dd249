# PPO for continuous actions (CleanRL's ppo_continuous_action.py) on batched MuJoCo envs simulated with MuJoCo Warp on
# the device that torch uses, in eager PyTorch; data-parallel under torchrun. Docs: docs/gpu_mujoco.md
import copy
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributions.normal import Normal

from harness import Run, agree, average, exit_code, fail, flat_gradients, parse_args, setup_distributed, world
from mujoco_warp_envs import ENVS, Envs, RunningMeanStd, gymnasium_env, saved_obs_rms


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5 or Humanoid-v5"""
    total_timesteps: int = 100000000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    compile_cache: str | None = None
    """keep Warp's kernels in this folder and start warm from it, here or on a machine of the same GPU"""
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
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class Rollout:
    """One rollout of num_steps steps of num_envs envs, on the device."""

    def __init__(self, num_steps, num_envs, n_obs, n_act, device):
        self.obs = torch.zeros((num_steps, num_envs, n_obs), device=device)
        self.actions = torch.zeros((num_steps, num_envs, n_act), device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)


class Agent:
    """The network PPO trains and its optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        self.optimizer = optim.Adam(self.net.parameters(), lr=args.learning_rate, eps=1e-5)
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
    """GAE over a rollout, and the PPO update on one minibatch."""

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], agent.net.critic(next_obs).reshape(1, -1)])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                advantages[t] = lastgaelam = delta[t] + coef[t] * lastgaelam
            returns = advantages + values
        return advantages, returns

    def update(obs, actions, logprobs, advantages, returns, values):
        """One gradient step on one minibatch; returns its STATS."""
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
    envs = Envs(args.env_id, args.num_envs, args.gamma, device)  # Warp's kernels build from here until start()
    n_obs, n_act = envs.n_obs, envs.n_act
    agent = Agent(args, n_obs, n_act, device)
    gae, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, n_act, device)
    envs.start()
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one (under
    # torchrun: rank 0's envs, which every rank resumes from).
    state = {"net": agent.net, "optimizer": agent.optimizer, "envs": envs.state}
    # One env_step call on rank 0 stands for the same call on every rank, as global_step counts them all.
    global_step = run.start(state, total_steps=num_iterations * steps_per_iteration,
                            warmup_steps=WARMUP_ITERATIONS * steps_per_iteration,
                            profile_steps=PROFILE_ITERATIONS * steps_per_iteration,
                            env_steps_per_call=args.num_envs * world_size, replicated=agent.net)  # fmt: skip
    if world_size > 1:
        # The normalisation statistics as the ranks last agreed on them: a fresh RunningMeanStd's at the start, the
        # checkpoint's on resume; each rank's envs update their own until the iteration's end pools them.
        running = (envs.obs_rms, envs.return_rms)
        agreed = copy.deepcopy(running) if global_step else [RunningMeanStd(r.mean.shape, device) for r in running]
    next_obs, next_done = envs.obs, envs.done  # the envs' own tensors, which each step updates in place
    # A checkpoint is written as an iteration begins: a resumed run goes on with the iteration after its steps.
    for iteration in range(global_step // steps_per_iteration + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            phase("data")
            rollout.obs[step] = next_obs
            rollout.dones[step] = next_done
            phase("policy")
            with torch.no_grad():
                action, logprob, _, value = agent.net.get_action_and_value(next_obs)
            phase("data")
            rollout.values[step] = value.flatten()
            rollout.actions[step] = action
            rollout.logprobs[step] = logprob
            phase("env_step")
            next_obs, reward, next_done, final_obs, truncated = envs.step(action)
            phase("policy")
            with torch.no_grad():  # a time limit: bootstrapped with V(final observation)
                reward = reward + args.gamma * agent.net.critic(final_obs).flatten() * truncated
            phase("data")
            rollout.rewards[step] = reward
            phase("other")
            if rank == 0:  # rank 0 alone shows progress
                run.tick(global_step)

        phase("update")
        advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones)

        # the batch, each env's steps one after another: obs, actions, logprobs, advantages, returns, values
        batch = (rollout.obs, rollout.actions, rollout.logprobs, advantages, rets, rollout.values)
        batch = [x.flatten(0, 1) for x in batch]
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
