# DQN for discrete actions, as CleanRL defines it, in plain eager PyTorch.
# Docs: docs/dqn.md
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
    env_id: str = "CartPole-v1"
    """the id of the gymnasium environment"""
    total_timesteps: int = 500000
    """total timesteps of the experiment"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel game environments (one, as in CleanRL's dqn.py)"""
    buffer_size: int = 10000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 500
    """the timesteps it takes to update the target network"""
    batch_size: int = 128
    """the batch size of sample from the reply memory"""
    start_e: float = 1
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total-timesteps` it takes from start-e to go end-e"""
    learning_starts: int = 10000
    """timestep to start learning"""
    train_frequency: int = 10
    """the frequency of training"""
    capture_video: bool = False
    """record videos under videos/<run name>/ (env 0 in training; every episode of --eval-checkpoint)"""


# Steps after learning_starts that count as warm-up: the fps window starts after them. At the default
# frequencies they hold the twin's third call (the one --cudagraphs captures) of each kind of training step,
# the target update's (every 500 steps) included.
WARMUP_STEPS = 2000
# Steps profiled with --profile-dir, at the start of the steady window.
PROFILE_STEPS = 500
# The statistics of an update, in the order they are logged.
STATS = ("td_loss", "q_values")


def make_env(env_id, seed, video_folder=None, episode_trigger=None):
    """video_folder: record videos there, of the episodes episode_trigger says (None: CleanRL's schedule)."""

    def thunk():
        try:
            env = gym.make(env_id, render_mode="rgb_array" if video_folder else None)
        except (gym.error.Error, ImportError) as e:  # ImportError: ids whose envs moved out of gymnasium (-v2, -v3)
            fail(f"--env-id {env_id!r}: gymnasium cannot make it: {e}")
        if not isinstance(env.action_space, gym.spaces.Discrete):
            fail(f"--env-id {env_id} has a {type(env.action_space).__name__} action space; DQN needs a discrete one")
        if not isinstance(env.observation_space, gym.spaces.Box) or len(env.observation_space.shape) != 1:
            space = env.observation_space
            shape = f" of shape {space.shape}" if isinstance(space, gym.spaces.Box) else ""
            fail(f"--env-id {env_id} has a {type(space).__name__} observation space{shape}; DQN's MLP needs a flat Box")
        if video_folder:
            env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=episode_trigger, disable_logger=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env

    return thunk


def make_envs(env_id, seed, *video):
    """One env in a vector env that resets in the same step, so the true final observation comes in infos."""
    return gym.vector.SyncVectorEnv(
        [make_env(env_id, seed, *video)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


class QNetwork(nn.Module):
    def __init__(self, n_obs, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(n_obs, 120, device=device),
            nn.ReLU(),
            nn.Linear(120, 84, device=device),
            nn.ReLU(),
            nn.Linear(84, n_act, device=device),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e, end_e, duration, t):
    """Epsilon at step t: from start_e down to end_e over `duration` steps, then end_e."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


class Agent:
    """The Q network, its target and the optimizer DQN trains."""

    def __init__(self, args, n_obs, n_act, device):
        self.q_network = QNetwork(n_obs, n_act, device=device)
        self.optimizer = optim.Adam(self.q_network.parameters(), lr=args.learning_rate)
        self.target_network = QNetwork(n_obs, n_act, device=device)
        self.target_network.load_state_dict(self.q_network.state_dict())


def make_update_fns(agent, args):
    """The two steps of DQN: the TD update of the Q network, and the target network's update."""

    def update(obs, actions, rewards, next_obs, dones):
        with torch.no_grad():
            target_max, _ = agent.target_network(next_obs).max(dim=1)
            td_target = rewards.flatten() + args.gamma * target_max * (1 - dones.flatten())
        old_val = agent.q_network(obs).gather(1, actions.view(-1, 1)).squeeze(1)
        loss = F.mse_loss(td_target, old_val)

        agent.optimizer.zero_grad()
        loss.backward()
        agent.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    def update_target():
        for target_param, param in zip(agent.target_network.parameters(), agent.q_network.parameters()):
            target_param.data.copy_(args.tau * param.data + (1.0 - args.tau) * target_param.data)

    return update, update_target


def check_args(args):
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    if args.num_envs != 1:
        fail(f"--num-envs {args.num_envs}: DQN runs one env, as CleanRL's dqn.py does")
    if args.buffer_size < args.batch_size:
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size}")
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    for name in ("train_frequency", "target_network_frequency"):  # env steps past --learning-starts update
        check_due(args, name, args.learning_starts + 1, args.total_timesteps, "env steps")
    if not 0 < args.exploration_fraction <= 1:
        fail(f"--exploration-fraction {args.exploration_fraction} must be in (0, 1]")
    if max(args.start_e, args.end_e) > 1:
        fail(f"--start-e {args.start_e} and --end-e {args.end_e} must be in [0, 1]")


def train(args, run):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device, phase = run.device, run.phase

    envs = make_envs(args.env_id, args.seed, run.video_folder)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(args, n_obs, int(envs.single_action_space.n), device)
    update, update_target = make_update_fns(agent, args)
    # The replay buffer, uniform with replacement: a CPU tensor per field, written through numpy. One transition
    # per step (one env): step t writes row t % buffer_size.
    rb = {"obs": torch.zeros(args.buffer_size, n_obs), "actions": torch.zeros(args.buffer_size, dtype=torch.long),
          "rewards": torch.zeros(args.buffer_size), "next_obs": torch.zeros(args.buffer_size, n_obs),
          "dones": torch.zeros(args.buffer_size)}  # fmt: skip
    stats = {name: torch.zeros((), device=device) for name in STATS}  # the latest update's, logged every second
    state = {"q_network": agent.q_network, "target_network": agent.target_network, "optimizer": agent.optimizer,
             "rb": rb, "stats": stats}  # fmt: skip
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=1, warmup_from=args.learning_starts)
    # The first step that updates the Q network: its statistics are logged from there on.
    first_update = (args.learning_starts // args.train_frequency + 1) * args.train_frequency

    obs, _ = envs.reset(seed=args.seed)
    for global_step in range(first_step, args.total_timesteps):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("policy")
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps,
                                  global_step)  # fmt: skip
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample()])
        else:
            q_values = agent.q_network(torch.as_tensor(obs, device=device, dtype=torch.float32))
            actions = torch.argmax(q_values, dim=1).cpu().numpy()

        phase("env_step")
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        phase("data")
        # A finished episode's last transition keeps its true final observation.
        real_next_obs = next_obs.copy()
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                real_next_obs[i] = infos["final_obs"][i]
                episode = infos["final_info"]["episode"]
                run.episode(global_step, episode["r"][i], episode["l"][i])
        for field, value in zip(rb.values(), (obs[0], actions[0], rewards[0], real_next_obs[0], terminations[0])):
            field.numpy()[global_step % args.buffer_size] = value
        obs = next_obs

        if global_step > args.learning_starts:
            if global_step % args.train_frequency == 0:
                idx = np.random.randint(0, min(global_step + 1, args.buffer_size), size=args.batch_size)
                batch = [field[idx].to(device) for field in rb.values()]  # obs, actions, rewards, next_obs, dones
                phase("update")
                stats.update(update(*batch))
            if global_step % args.target_network_frequency == 0:
                phase("update")
                update_target()

        phase("other")
        if run.tick(global_step + 1) and global_step >= first_update:
            run.log(global_step, {f"losses/{name}": stats[name] for name in STATS})
    envs.close()


def evaluate(args, run, saved):
    """The saved Q network's greedy action (no exploration), episode after episode."""
    envs = make_envs(args.env_id, args.seed, run.video_folder, lambda episode: episode < args.eval_episodes)
    n_obs = int(np.prod(envs.single_observation_space.shape))
    q_network = QNetwork(n_obs, int(envs.single_action_space.n), device=run.device)
    q_network.load_state_dict(saved["q_network"])
    obs, _ = envs.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            actions = q_network(torch.as_tensor(obs, device=run.device, dtype=torch.float32)).argmax(dim=1)
        obs, _, _, _, infos = envs.step(actions.cpu().numpy())
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
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
