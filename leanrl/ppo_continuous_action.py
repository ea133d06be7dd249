# PPO for continuous actions, as CleanRL defines it, in plain eager PyTorch.
# Docs: docs/ppo_continuous.md
import functools
import random
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
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
        env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=args.gamma)
        return gym.wrappers.TransformReward(env, lambda reward: np.clip(reward, -10, 10))

    try:
        thunks = [functools.partial(make_env, video if i == 0 else None) for i in range(num_envs)]
        return gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
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
        agent.optimizer.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.net.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        outputs = (pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac, grad_norm)
        return {name: value.detach() for name, value in zip(STATS, outputs)}

    return gae, update


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
    gae, update = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, n_obs, n_act, device)
    state = {"net": agent.net, "optimizer": agent.optimizer, "normalization": NormalizationStats(envs)}
    global_step = run.start(state, total_steps=num_iterations * batch_size, env_steps_per_call=args.num_envs,
                            warmup_steps=WARMUP_ITERATIONS * batch_size, profile_steps=PROFILE_ITERATIONS * batch_size)

    # After run.start: a resumed run's first observations are normalised with its restored statistics.
    next_obs = torch.Tensor(envs.reset(seed=args.seed)[0]).to(device)
    next_done = torch.zeros(args.num_envs, device=device)
    # A checkpoint is written as an iteration begins: a resumed run goes on with the iteration after its steps.
    for iteration in range(global_step // batch_size + 1, num_iterations + 1):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("update")
        if args.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            agent.optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            phase("policy")
            with torch.no_grad():
                action, logprob, _, value = agent.net.get_action_and_value(next_obs)
            phase("data")
            rollout.obs[step] = next_obs
            rollout.dones[step] = next_done
            rollout.values[step] = value.flatten()
            rollout.actions[step] = action
            rollout.logprobs[step] = logprob
            action = action.cpu().numpy()
            phase("env_step")
            next_obs, reward, terminations, truncations, infos = envs.step(action)
            phase("data")
            reward = bootstrap_truncated(agent, reward, terminations, truncations, infos, args.gamma, device)
            next_done = np.logical_or(terminations, truncations)
            rollout.rewards[step] = torch.tensor(reward).to(device).view(-1)
            next_obs, next_done = torch.Tensor(next_obs).to(device), torch.Tensor(next_done).to(device)
            for i in np.flatnonzero(infos.get("_final_info", [])):
                episode = infos["final_info"]["episode"]
                run.episode(global_step, episode["r"][i], episode["l"][i])
            phase("other")
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
