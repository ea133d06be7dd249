# PPO for continuous actions, as CleanRL defines it, made fast: a pinned rollout, GAE as a scan, compile, CUDA graphs.
# Docs: docs/ppo_continuous.md
import functools
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from gymnasium.wrappers.utils import RunningMeanStd
from tensordict.nn import CudaGraphModule
from torch.distributions.normal import Normal

from harness import Run, exit_code, fail, parse_args


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment, rounded down to whole iterations of --num-envs * --num-steps"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    num_steps: int = 2048
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 32
    """the number of minibatches a rollout is split into"""
    update_epochs: int = 10
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
    """record videos under videos/<run name>/: of env 0 while training, of every episode of --eval-checkpoint"""
    compile: bool = False  # trick 2: torch.compile
    """compile the policy, GAE and update functions with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the policy, GAE and update functions as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


WARMUP_ITERATIONS = 2  # iterations before the fps window opens
PROFILE_ITERATIONS = 1  # iterations that --profile-dir profiles, as the window opens
# The statistics of a minibatch update, in the order they are logged.
STATS = ("policy_loss", "value_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac", "grad_norm")


def check_args(args):
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    batch = f"--num-envs {args.num_envs} * --num-steps {args.num_steps} = {args.num_envs * args.num_steps}"
    if args.num_envs * args.num_steps % args.num_minibatches:  # CUDA graphs need minibatches of one size
        fail(f"{batch} does not split evenly into --num-minibatches {args.num_minibatches}")
    if args.norm_adv and args.num_envs * args.num_steps // args.num_minibatches < 2:
        fail(f"--num-minibatches {args.num_minibatches} leaves minibatches of one sample; --norm-adv needs two")
    if args.total_timesteps < args.num_envs * args.num_steps:
        fail(f"--total-timesteps {args.total_timesteps} is below one rollout, {batch}")


class RunningMeanStdOfOne(RunningMeanStd):  # trick 12: a cheap env stack
    """gymnasium's update of one sample at a time with the terms that are exactly 0 or 1 dropped: the same numbers
    to the bit, without numpy's mean and var reductions, the largest costs of the wrapped env."""

    def update(self, x):
        delta = x[0] - self.mean
        total = self.count + 1
        self.mean = self.mean + delta / total
        self.var = (self.var * self.count + np.square(delta) * self.count / total) / total
        self.count = total


def make_envs(args, num_envs, video=None):
    """num_envs envs with CleanRL's wrappers, reset in the same step; env 0 records video: (folder, which episodes)."""

    def make_env(video):
        env = gym.make(args.env_id, render_mode="rgb_array" if video else None)
        if not isinstance(env.action_space, gym.spaces.Box):
            fail(f"--env-id {args.env_id} has {type(env.action_space).__name__} actions; PPO continuous needs a Box")
        if video:
            env = gym.wrappers.RecordVideo(env, video[0], episode_trigger=video[1], disable_logger=True)
        env = gym.wrappers.FlattenObservation(env)  # deal with dm_control's Dict observation space
        env = gym.wrappers.RecordEpisodeStatistics(env)  # before the reward wrappers: the env's own returns
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        # trick 12: a cheap env stack, the running statistics updated without numpy's reductions
        env.obs_rms = RunningMeanStdOfOne(shape=env.obs_rms.mean.shape, dtype=env.obs_rms.mean.dtype)
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=args.gamma)
        env.return_rms = RunningMeanStdOfOne(shape=())  # trick 12: a cheap env stack
        return gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))

    try:
        thunks = [functools.partial(make_env, video if i == 0 else None) for i in range(num_envs)]
        # trick 12: a cheap env stack, copy=False: step returns the env's own buffer; the loop copies it before the
        # next step overwrites it
        return gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, copy=False)
    except (gym.error.Error, ImportError) as e:  # ImportError: ids whose envs moved out of gymnasium (-v2, -v3)
        fail(f"--env-id {args.env_id}: {e}")


class NormalizationStats:
    """Each env's running observation and return statistics, in checkpoints: they normalise the policy's inputs."""

    def __init__(self, envs):
        self.stats = [env.get_wrapper_attr(name) for env in envs.envs for name in ("obs_rms", "return_rms")]

    def state_dict(self):
        return [{key: torch.as_tensor(np.asarray(value)) for key, value in vars(rms).items()} for rms in self.stats]

    def load_state_dict(self, saved):
        for rms, values in zip(self.stats, saved, strict=True):  # arrays as arrays, the count as a float
            arrays = {key for key, value in vars(rms).items() if isinstance(value, np.ndarray)}
            vars(rms).update({key: value.numpy() if key in arrays else value.item() for key, value in values.items()})


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
        # trick 1: CUDA graphs, no argument validation: it would read them back to the host, a sync a graph refuses
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp(), validate_args=False)
        if action is None:
            # trick 1: CUDA graphs: sample() calls torch.normal, which checks std on the host; rsample draws the same
            # numbers without
            action = probs.rsample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class Rollout:  # trick 10: nothing to copy in or out, a pinned rollout moved to the device once an iteration
    """One rollout, written step by step into pinned host memory (`host`: numpy views of it), moved to the device by
    to_device. obs and dones have one more row: the observation the next rollout starts with, GAE's bootstrap."""

    def __init__(self, num_steps, num_envs, n_obs, n_act, device):
        shapes = {"obs": (num_steps + 1, num_envs, n_obs), "actions": (num_steps, num_envs, n_act),
                  "logprobs": (num_steps, num_envs), "rewards": (num_steps, num_envs),
                  "dones": (num_steps + 1, num_envs), "values": (num_steps, num_envs)}  # fmt: skip
        self.pinned = {key: torch.zeros(shape, pin_memory=device.type == "cuda") for key, shape in shapes.items()}
        self.host = {key: x.numpy() for key, x in self.pinned.items()}
        for key, shape in shapes.items():
            setattr(self, key, torch.zeros(shape, device=device))

    def to_device(self):  # trick 6: on-device storage, by blocking copies: the next rollout overwrites the host memory
        for key, x in self.pinned.items():
            getattr(self, key).copy_(x)


class Agent:
    """The network PPO trains and its optimizer."""

    def __init__(self, args, n_obs, n_act, device):
        self.net = ActorCritic(n_obs, n_act, device=device)
        # trick 7: no host sync, the learning rate a device tensor annealed in place, read by compiled and captured
        # optimizer steps; Adam takes it without host syncs when capturable (CUDA only).
        lr = torch.tensor(args.learning_rate, device=device)
        # trick 1: CUDA graphs, capturable: Adam's step count on the device, advanced by replays
        self.optimizer = optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, capturable=device.type == "cuda")


def bootstrap_truncated(agent, reward, terminations, truncations, infos, gamma, device):
    """The reward plus gamma * V(true final observation) where an episode was truncated, not terminated: GAE does not
    bootstrap across a done, but a time limit is not the end of the task (docs/ppo_continuous.md)."""
    truncated = truncations & ~terminations
    if not truncated.any():
        return reward
    final_obs = torch.as_tensor(np.stack(infos["final_obs"][truncated]), dtype=torch.float32, device=device)
    with torch.no_grad():
        final_value = agent.net.critic(final_obs).flatten().cpu().numpy()
    reward = reward.copy()
    reward[truncated] += gamma * final_value
    return reward


def make_update_fns(agent, args):
    """GAE over a rollout, the PPO update on one minibatch (its STATS into `stats`, fixed tensors), and the policy
    that acts. --compile compiles each; --cudagraphs captures GAE and the update (the policy: in make_act)."""
    # trick 10: nothing to copy in or out, the statistics written into fixed tensors
    stats = {name: torch.zeros((), device=agent.net.actor_logstd.device) for name in STATS}

    def gae(next_obs, next_done, rewards, values, dones):
        """Advantages and returns; dones[t] says whether obs[t] starts a new episode."""
        with torch.no_grad():
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], agent.net.critic(next_obs).reshape(1, -1)])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            coef = args.gamma * args.gae_lambda * nextnonterminal
            # trick 17: GAE without a Python loop: A[t] = delta[t] + coef[t] * A[t + 1] in log2(num_steps) rounds of
            # a doubling scan (a short graph to compile): after the round with shift s, A[t] holds the terms of
            # delta[t : t + 2s] and coef[t] the product of coef[t : t + 2s].
            advantages = delta
            shift = 1
            while shift < args.num_steps:
                advantages = advantages + coef * F.pad(advantages[shift:], (0, 0, 0, shift))
                coef = coef * F.pad(coef[shift:], (0, 0, 0, shift))
                shift *= 2
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
        agent.optimizer.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    def update_in_place(*minibatch):
        # trick 10: nothing to copy in or out: no outputs, a captured function would copy each one out of its graph.
        for name, value in update(*minibatch).items():
            stats[name].copy_(value)

    def policy(obs):
        with torch.no_grad():  # trick 3: act without autograd
            action, logprob, _, value = agent.net.get_action_and_value(obs)
        return action, logprob, value.flatten()

    if args.compile:  # trick 2: torch.compile
        gae, update_in_place, policy = map(torch.compile, (gae, update_in_place, policy))
    if args.cudagraphs:  # trick 1: CUDA graphs
        gae, update_in_place = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in (gae, update_in_place))
    return gae, update_in_place, policy, stats


def make_act(policy, args, n_obs, n_act, device):  # trick 10: nothing to copy in or out
    """act(obs) -> (action, logprob, value), numpy arrays in and out, overwritten by the next call. The copies in and
    out go through pinned host memory; --cudagraphs captures them with the policy: one replay and one wait a step."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(args.num_envs, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(args.num_envs, n_obs, device=device)
    shapes = ((args.num_envs, n_act), args.num_envs, args.num_envs)  # action, logprob, value
    outs_host = [torch.zeros(shape, pin_memory=pinned) for shape in shapes]

    def staged():
        obs_device.copy_(obs_host, non_blocking=True)
        for out_host, out in zip(outs_host, policy(obs_device)):
            out_host.copy_(out, non_blocking=True)

    if args.cudagraphs:
        staged = CudaGraphModule(staged, warmup=3 if args.compile else 2)

    def act(obs):
        obs_host.numpy()[:] = obs  # the previous act's copies are done: it waited for them
        staged()
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        return [out_host.numpy() for out_host in outs_host]

    return act


def train(args, run):
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = run.device, run.phase

    envs = make_envs(args, args.num_envs, run.video_folder and (run.video_folder, None))  # CleanRL's video schedule
    n_obs = int(np.prod(envs.single_observation_space.shape))
    n_act = int(np.prod(envs.single_action_space.shape))
    agent = Agent(args, n_obs, n_act, device)
    gae, update, policy, stats = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, n_act, device)
    act = make_act(policy, args, n_obs, n_act, device)
    state = {"net": agent.net, "optimizer": agent.optimizer, "normalization": NormalizationStats(envs)}
    global_step = run.start(state, total_steps=num_iterations * batch_size, env_steps_per_call=args.num_envs,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, profile_steps=PROFILE_ITERATIONS * batch_size)

    # After run.start: a resumed run's first observations are normalised with its restored statistics.
    rollout.host["obs"][-1] = envs.reset(seed=args.seed)[0]  # trick 10: nothing to copy in or out, the pinned rollout
    # A checkpoint is written as an iteration begins: a resumed run goes on with the iteration after its steps.
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.optimizer.param_groups[0]["lr"].fill_(frac * args.learning_rate)  # trick 7: no host sync

        phase("data")
        # The observation the last rollout ended in is the first of this one.
        rollout.host["obs"][0] = rollout.host["obs"][-1]
        rollout.host["dones"][0] = rollout.host["dones"][-1]
        for step in range(args.num_steps):
            global_step += args.num_envs
            phase("policy")
            action, logprob, value = act(rollout.host["obs"][step])
            phase("data")
            rollout.host["values"][step] = value
            rollout.host["actions"][step] = action
            rollout.host["logprobs"][step] = logprob
            phase("env_step")
            next_obs, reward, terminations, truncations, infos = envs.step(rollout.host["actions"][step])
            phase("data")
            reward = bootstrap_truncated(agent, reward, terminations, truncations, infos, args.gamma, device)
            rollout.host["dones"][step + 1] = np.logical_or(terminations, truncations)
            rollout.host["rewards"][step] = reward
            rollout.host["obs"][step + 1] = next_obs
            for i in np.flatnonzero(infos.get("_final_info", [])):
                episode = infos["final_info"]["episode"]
                run.episode(global_step, episode["r"][i], episode["l"][i])
            phase("other")
            run.tick(global_step)

        phase("data")
        rollout.to_device()
        phase("update")
        next_obs, next_done = rollout.obs[-1], rollout.dones[-1]  # the last row: where the next rollout starts
        advantages, rets = gae(next_obs, next_done, rollout.rewards, rollout.values, rollout.dones[:-1])
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
                update(*minibatch)
            if args.target_kl is not None and stats["approx_kl"] > args.target_kl:
                break

        phase("other")  # explained variance on the device: read back with the statistics, in one sync
        var_y = batch[-2].var(correction=0)
        explained_var = torch.where(var_y == 0, torch.nan, 1 - (batch[-2] - batch[-1]).var(correction=0) / var_y)
        scalars = {f"losses/{name}": stats[name] for name in STATS}
        lr = agent.optimizer.param_groups[0]["lr"]
        run.log(global_step, {**scalars, "losses/explained_variance": explained_var, "charts/learning_rate": lr})
    envs.close()


def evaluate(args, run, saved):
    """The saved policy's mean action on a fresh env, observations normalised with env 0's saved statistics, frozen."""
    envs = make_envs(args, 1, run.video_folder and (run.video_folder, lambda episode: episode < args.eval_episodes))
    net = ActorCritic(envs.single_observation_space.shape[0], envs.single_action_space.shape[0], device=run.device)
    net.load_state_dict(saved["net"])
    NormalizationStats(envs).load_state_dict(saved["normalization"][:2])
    normalize = envs.envs[0]
    while not isinstance(normalize, gym.wrappers.NormalizeObservation):
        normalize = normalize.env
    normalize.update_running_mean = False
    obs, _ = envs.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            actions = net.actor_mean(torch.as_tensor(obs, device=run.device, dtype=torch.float32))
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        for i in np.flatnonzero(infos.get("_final_info", [])):
            yield infos["final_info"]["episode"]["r"][i]


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
