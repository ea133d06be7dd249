# SAC for continuous actions, as CleanRL defines it, in plain eager PyTorch.
# Docs: docs/sac.md
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

from harness import Run, check_due, exit_code, fail, parse_args


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v4"
    """the id of the gymnasium environment"""
    total_timesteps: int = 1000000
    """total timesteps of the experiment"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 1000000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 256
    """the batch size of samples from the replay memory"""
    learning_starts: int = 5000
    """timestep to start learning"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 1e-3
    """the learning rate of the Q network optimizer"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed)"""
    target_network_frequency: int = 1
    """the frequency of updates for the target networks"""
    alpha: float = 0.2
    """entropy regularization coefficient (without --autotune)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    capture_video: bool = False
    """record videos under videos/<run name>/ (env 0 in training; every episode of --eval-checkpoint)"""


# Env steps after learning_starts before the fps window opens, and steps --profile-dir profiles at its start.
WARMUP_STEPS = 200
PROFILE_STEPS = 100
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer.
AGENT_STATE = ("actor", "qf1", "qf2", "qf1_target", "qf2_target", "q_optimizer", "actor_optimizer", "a_optimizer",
               "log_alpha")
# The statistics of an update, logged as losses/<name>, with losses/alpha.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha_loss")


def make_envs(env_id, seed, num_envs, video_folder=None, episode_trigger=None):
    """num_envs envs in a vector env that resets in the step that ends an episode, so the true final observation
    comes in infos; env 0 records the video, as in CleanRL."""

    def make_env(i):
        if i > 0 or video_folder is None:
            env = gym.make(env_id)
        else:
            env = gym.make(env_id, render_mode="rgb_array")
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=episode_trigger, disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed + i)
        return env

    try:
        thunks = [functools.partial(make_env, i) for i in range(num_envs)]
        envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except (gym.error.Error, ImportError) as e:  # ImportError: ids whose envs moved out of gymnasium (-v2, -v3)
        fail(f"--env-id {env_id}: {e}")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        space = type(envs.single_action_space).__name__
        fail(f"--env-id {env_id} has a {space} action space; SAC needs a continuous (Box) one")
    return envs


class SoftQNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs + n_act, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc3 = nn.Linear(256, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, action_low, action_high, device=None):
        super().__init__()
        self.fc1 = nn.Linear(n_obs, 256, device=device)
        self.fc2 = nn.Linear(256, 256, device=device)
        self.fc_mean = nn.Linear(256, n_act, device=device)
        self.fc_logstd = nn.Linear(256, n_act, device=device)
        low = torch.as_tensor(action_low, dtype=torch.float32, device=device)
        high = torch.as_tensor(action_high, dtype=torch.float32, device=device)
        self.register_buffer("action_scale", (high - low) / 2.0)
        self.register_buffer("action_bias", (high + low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        mean = self.fc_mean(x)
        log_std = torch.tanh(self.fc_logstd(x))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()  # reparameterization trick: mean + std * N(0,1)
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing action bounds
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class ReplayBuffer:
    """Rows [obs, action, reward, next_obs, done] of one array on the host, sampled uniformly with replacement."""

    def __init__(self, size, n_obs, n_act, device):
        self.widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = np.zeros((size, sum(self.widths)), dtype=np.float32)
        self.ptr, self.size, self.device = 0, 0, device

    def add(self, obs, next_obs, actions, rewards, dones):
        rows = (self.ptr + np.arange(len(obs))) % len(self.storage)
        self.storage[rows] = np.concatenate([obs, actions, rewards[:, None], next_obs, dones[:, None]], axis=1)
        self.ptr = (self.ptr + len(obs)) % len(self.storage)
        self.size = min(self.size + len(obs), len(self.storage))

    def sample(self, batch_size):
        idx = np.random.randint(0, self.size, size=batch_size)
        return torch.as_tensor(self.storage[idx], device=self.device).split(self.widths, dim=1)

    def state_dict(self):
        """The filled rows, and where the next transition goes."""
        return {"storage": torch.from_numpy(self.storage[: self.size]), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: state["size"]] = state["storage"].numpy()
        self.ptr, self.size = state["ptr"], state["size"]


class Agent:
    """The networks, optimizers and entropy coefficient SAC trains."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        self.qf1 = SoftQNetwork(n_obs, n_act, device=device)
        self.qf2 = SoftQNetwork(n_obs, n_act, device=device)
        self.qf1_target = SoftQNetwork(n_obs, n_act, device=device)
        self.qf2_target = SoftQNetwork(n_obs, n_act, device=device)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_optimizer = optim.Adam(list(self.qf1.parameters()) + list(self.qf2.parameters()), lr=args.q_lr)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.policy_lr)
        # Automatic entropy tuning
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr)
        self.alpha = self.log_alpha.exp().item() if args.autotune else args.alpha


def make_update_fns(agent, args):
    """The steps of a SAC update: critic, actor (with the entropy coefficient), target networks."""

    def update_critic(obs, actions, rewards, next_obs, dones):
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
            qf1_next_target = agent.qf1_target(next_obs, next_state_actions)
            qf2_next_target = agent.qf2_target(next_obs, next_state_actions)
            min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - agent.alpha * next_state_log_pi
            next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * min_qf_next_target.view(-1)
        qf1_a_values = agent.qf1(obs, actions).view(-1)
        qf2_a_values = agent.qf2(obs, actions).view(-1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def actor_step(obs):
        pi, log_pi, _ = agent.actor.get_action(obs)
        min_qf_pi = torch.min(agent.qf1(obs, pi), agent.qf2(obs, pi))
        actor_loss = ((agent.alpha * log_pi) - min_qf_pi).mean()
        agent.actor_optimizer.zero_grad()
        actor_loss.backward()
        agent.actor_optimizer.step()
        alpha_loss = torch.zeros((), device=obs.device)
        if args.autotune:
            with torch.no_grad():
                _, log_pi, _ = agent.actor.get_action(obs)
            alpha_loss = (-agent.log_alpha.exp() * (log_pi + agent.target_entropy)).mean()
            agent.a_optimizer.zero_grad()
            alpha_loss.backward()
            agent.a_optimizer.step()
            agent.alpha = agent.log_alpha.exp().item()
        return {"actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach()}

    def update_actor(obs):
        for _ in range(args.policy_frequency):  # policy_frequency updates on one batch, compensating for the delay
            stats = actor_step(obs)
        return stats

    def update_targets():
        for net, target in ((agent.qf1, agent.qf1_target), (agent.qf2, agent.qf2_target)):
            for param, target_param in zip(net.parameters(), target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

    return update_critic, update_actor, update_targets


def check_args(args):
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    if args.total_timesteps % args.num_envs:
        fail(f"--total-timesteps {args.total_timesteps} must be a multiple of --num-envs {args.num_envs}")
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size} and --num-envs "
             f"{args.num_envs}")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    vector_steps = (-(-args.learning_starts // args.num_envs), args.total_timesteps // args.num_envs)
    for name in ("policy_frequency", "target_network_frequency"):
        check_due(args, name, *vector_steps, "vector steps")
    if args.autotune and args.alpha != Args.alpha:  # CleanRL's --alpha is the coefficient of --no-autotune alone
        fail(f"--alpha {args.alpha} is the fixed coefficient of --no-autotune: with --autotune alpha is learned")


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, n_envs = run.device, args.num_envs
    envs = make_envs(args.env_id, args.seed, n_envs, run.video_folder)  # CleanRL's video schedule
    space = envs.single_action_space
    n_obs, n_act = int(np.prod(envs.single_observation_space.shape)), int(np.prod(space.shape))
    agent = Agent(args, n_obs, n_act, space.low, space.high, device)
    update_critic, update_actor, update_targets = make_update_fns(agent, args)
    rb = ReplayBuffer(args.buffer_size, n_obs, n_act, device)
    stats = {}  # the latest value of each of STATS

    obs, _ = envs.reset(seed=args.seed)
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=n_envs, warmup_from=args.learning_starts)
    agent.alpha = agent.log_alpha.exp().item() if args.autotune else args.alpha  # a resumed run's
    # global_step counts env steps, n_envs per vector step; updates count vector steps, as CleanRL's global_step does.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        vector_step = global_step // n_envs
        run.phase("policy")
        if global_step < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            actions, _, _ = agent.actor.get_action(torch.as_tensor(obs, device=device, dtype=torch.float32))
            actions = actions.detach().cpu().numpy()
        run.phase("env_step")
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        run.phase("data")
        real_next_obs = next_obs.copy()  # a finished episode's last transition keeps its true final observation
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                real_next_obs[i] = infos["final_obs"][i]
                episode = infos["final_info"]["episode"]
                run.episode(global_step, episode["r"][i], episode["l"][i])
        rb.add(obs, real_next_obs, actions, rewards, terminations)
        obs = next_obs
        if global_step >= args.learning_starts:
            batch = rb.sample(args.batch_size)
            run.phase("update")
            stats.update(update_critic(*batch))
            if vector_step % args.policy_frequency == 0:  # TD3-style delayed update
                stats.update(update_actor(batch[0]))
            if vector_step % args.target_network_frequency == 0:
                update_targets()
        run.phase("other")
        # By then an actor update has run (in this run, if it was resumed): its statistics exist.
        logged = global_step >= max(args.learning_starts, first_step) + args.policy_frequency * n_envs
        if run.tick(global_step + n_envs) and logged:
            losses = {f"losses/{name}": stats[name] for name in STATS}
            run.log(global_step, {**losses, "losses/alpha": agent.alpha})
    envs.close()


def evaluate(args, run, saved):
    """The saved actor's deterministic action (its mean), on one env: each episode's return."""
    envs = make_envs(args.env_id, args.seed, 1, run.video_folder, lambda episode: True)
    space = envs.single_action_space
    n_obs, n_act = int(np.prod(envs.single_observation_space.shape)), int(np.prod(space.shape))
    actor = Actor(n_obs, n_act, space.low, space.high, device=run.device)
    actor.load_state_dict(saved["actor"])
    obs, _ = envs.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            _, _, actions = actor.get_action(torch.as_tensor(obs, device=run.device, dtype=torch.float32))
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_obs" in infos:
            yield infos["final_info"]["episode"]["r"][0]


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
