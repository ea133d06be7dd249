# DQN for discrete actions, as CleanRL defines it, made fast: on-device buffer, one captured graph per env step.
# Docs: docs/dqn.md
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
from tensordict.nn import CudaGraphModule

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
    compile: bool = False  # trick 2: torch.compile
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture each kind of training step, acting included, as a CUDA graph (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


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


class ReplayBuffer:  # trick 6: on-device storage
    """Transitions as rows of one preallocated tensor on the device, sampled uniformly with replacement there
    into one fixed batch tensor, which the update reads: a captured update then has no inputs to copy.

    A row is [obs, action, reward, next_obs, done]. Adding a transition is two parts: `stage` writes the row into
    host memory (pinned on CUDA), `push` copies it to the device and stores it (device work only, so a captured
    training step does both). The write position and the size are device tensors, for the same reason. Between a
    push and the next stage its copy must have read the row: a caller that has not waited for the device since
    the push sets `in_flight`, and stage waits.
    """

    def __init__(self, size, batch_size, n_obs, device):
        widths = [n_obs, 1, 1, n_obs, 1]
        self.storage = torch.zeros(size, sum(widths), device=device)
        self.staged = torch.zeros(1, sum(widths), pin_memory=device.type == "cuda")
        self.staged_parts = np.split(self.staged.numpy()[0], np.cumsum(widths)[:-1])  # views: writing fills it
        self.row = torch.zeros(1, sum(widths), device=device)
        self.batch = torch.zeros(batch_size, sum(widths), device=device)  # trick 10: nothing to copy in or out
        obs, actions, rewards, next_obs, dones = self.batch.split(widths, dim=1)
        # Views into self.batch: each sample overwrites what they show. Actions as floats, like the whole row.
        self.fields = (obs, actions.squeeze(1), rewards.squeeze(1), next_obs, dones.squeeze(1))
        # trick 14: one graph per training step, the write position and size on the device
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)
        self.size = torch.zeros(1, dtype=torch.long, device=device)
        self.max_size, self.device = size, device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.in_flight = False

    def stage(self, obs, next_obs, action, reward, done):
        if self.in_flight:
            self.stream.synchronize()
            self.in_flight = False
        for part, value in zip(self.staged_parts, (obs, action, reward, next_obs, done)):
            part[:] = value

    def push(self):
        self.row.copy_(self.staged, non_blocking=True)
        self.storage.index_copy_(0, self.ptr, self.row)
        self.advance()

    def advance(self):
        """The write position and the size after a push (make_train_step compiles it with --compile: one kernel,
        not four)."""
        self.ptr.add_(1).remainder_(self.max_size)
        self.size.add_(1).clamp_(max=self.max_size)

    def sample(self):
        # Uniform over the stored rows with the size on the device: 62-bit draws reduced modulo the size
        # (a relative bias below 2**-40).
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device).remainder_(self.size)
        torch.index_select(self.storage, 0, idx, out=self.batch)


class Agent:
    """The Q network, its target and the optimizer DQN trains."""

    def __init__(self, args, n_obs, n_act, device):
        self.q_network = QNetwork(n_obs, n_act, device=device)
        # trick 1: CUDA graphs, capturable: Adam keeps its step count on the device, so a replayed graph advances it
        capturable = args.cudagraphs and device.type == "cuda"
        self.optimizer = optim.Adam(self.q_network.parameters(), lr=args.learning_rate, capturable=capturable)
        self.target_network = QNetwork(n_obs, n_act, device=device)
        self.target_network.load_state_dict(self.q_network.state_dict())


def make_update_fns(agent, args, batch):  # trick 10: nothing to copy in or out, the update reads `batch`
    """The two steps of DQN: the TD update of the Q network, and the target network's update; and the policy
    that acts. The update reads its batch from `batch` (obs, actions, rewards, next_obs, dones), fixed tensors
    that each sample overwrites. With --compile each is compiled; --cudagraphs captures them in make_train_step."""

    def update():
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            target_max, _ = agent.target_network(next_obs).max(dim=1)
            td_target = rewards.flatten() + args.gamma * target_max * (1 - dones.flatten())
        # trick 6: on-device storage, whose rows hold the actions as floats
        old_val = agent.q_network(obs).gather(1, actions.long().view(-1, 1)).squeeze(1)
        loss = F.mse_loss(td_target, old_val)

        agent.optimizer.zero_grad()
        loss.backward()
        agent.optimizer.step()
        return {"td_loss": loss.detach(), "q_values": old_val.detach().mean()}

    def update_target():
        # trick 5: one lerp for the targets, every target parameter at once
        sources = [p.detach() for p in agent.q_network.parameters()]
        torch._foreach_lerp_([p.detach() for p in agent.target_network.parameters()], sources, args.tau)

    def policy(obs):
        # trick 16: the host draws, the device acts greedily: whether to explore is the host's draw, as in the
        # baseline (train's explore)
        with torch.no_grad():  # trick 3: act without autograd
            return agent.q_network(obs).argmax(dim=1)

    if args.compile:  # trick 2: torch.compile
        update, update_target, policy = map(torch.compile, (update, update_target, policy))

    return update, update_target, policy


# trick 14: one graph per training step, acting included
def make_train_step(rb, stats, update, update_target, act, act_on_device, args):
    """train_step(q_update, target_update, obs), after each env step: store the staged transition, as asked update
    the Q network on a sampled batch (its statistics into `stats`) and the target network, then act greedily on obs
    for the next step and return the action; with obs None (the next step explores) return None, without waiting
    for the device. With --cudagraphs each kind of step, acting included, is one captured graph: one replay."""
    if args.compile:
        rb.advance = torch.compile(rb.advance)

    def step(q_update, target_update, greedy):
        rb.push()
        if q_update:
            rb.sample()
            for name, value in update().items():
                stats[name].copy_(value)
        if target_update:
            update_target()
        if greedy:
            act_on_device()

    steps = {}

    def train_step(q_update, target_update, obs):
        kind = (q_update, target_update, obs is not None)
        if kind not in steps:
            steps[kind] = functools.partial(step, *kind)
            if args.cudagraphs:
                steps[kind] = CudaGraphModule(steps[kind], warmup=3 if args.compile else 2)
        if obs is None:
            steps[kind]()
            rb.in_flight = rb.stream is not None
            return None
        return act(obs, steps[kind])

    return train_step


def make_act(policy, n_obs, device):  # trick 10: nothing to copy in or out
    """(act, act_on_device): the greedy action for one env's numpy observation. act_on_device (device work only)
    copies the observation from pinned host memory to the device, runs the policy and copies the action back; a
    training step that acts ends with it, in its captured graph. act(obs, device_work) writes the observation, runs
    device_work, waits for the device and reads the action; alone (a run's first step, once) it is not captured."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(1, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(1, n_obs, device=device)
    action_host = torch.zeros(1, dtype=torch.long, pin_memory=pinned)
    obs_view, action = obs_host.numpy()[0], action_host.numpy()  # views: numpy reads and writes them for less
    stream = torch.cuda.current_stream(device) if pinned else None

    def act_on_device():
        obs_device.copy_(obs_host, non_blocking=True)
        action_host.copy_(policy(obs_device), non_blocking=True)

    def act(obs, device_work=act_on_device):
        # The previous act's copies are done: it waited for them.
        obs_view[:] = obs
        device_work()
        if pinned:
            stream.synchronize()
        return int(action[0])

    return act, act_on_device


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

    # trick 13: one env, no vector env: for one env it costs more than a step
    env = make_env(args.env_id, args.seed, run.video_folder)()
    n_obs = int(np.prod(env.observation_space.shape))
    agent = Agent(args, n_obs, int(env.action_space.n), device)
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_obs, device)
    update, update_target, policy = make_update_fns(agent, args, rb.fields)
    stats = {name: torch.zeros((), device=device) for name in STATS}  # the latest update's, logged every second
    act, act_on_device = make_act(policy, n_obs, device)
    train_step = make_train_step(rb, stats, update, update_target, act, act_on_device, args)
    state = {"q_network": agent.q_network, "target_network": agent.target_network, "optimizer": agent.optimizer,
             "rb": {"storage": rb.storage, "ptr": rb.ptr, "size": rb.size}, "stats": stats}  # fmt: skip
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=1, warmup_from=args.learning_starts)
    # The first step that updates the Q network: its statistics are logged from there on.
    first_update = (args.learning_starts // args.train_frequency + 1) * args.train_frequency

    obs, _ = env.reset(seed=args.seed)
    # trick 16: the host draws, the device acts greedily
    action = None  # the coming step's action: each training step ends by acting for the step after it

    def explore(step):
        """The baseline's draws for env step `step`, in its order: with probability epsilon a random action, else
        None (the Q network acts greedily)."""
        epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step)
        return int(env.action_space.sample()) if random.random() < epsilon else None

    for global_step in range(first_step, args.total_timesteps):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("policy")
        if action is None:  # the run's first step, which no training step acted for
            action = explore(global_step)
            action = act(obs) if action is None else action

        phase("env_step")
        next_obs, reward, termination, truncation, info = env.step(action)

        phase("data")
        # The transition keeps the true final observation; then the env resets in the same step.
        rb.stage(obs, next_obs, action, reward, termination)  # trick 6: on-device storage
        if termination or truncation:
            run.episode(global_step, info["episode"]["r"], info["episode"]["l"])
            next_obs, _ = env.reset()
        obs = next_obs

        learning = global_step > args.learning_starts
        q_update = learning and global_step % args.train_frequency == 0
        target_update = learning and global_step % args.target_network_frequency == 0
        # A step that only stores the transition is mostly the round trip of acting: under "policy".
        phase("update" if q_update or target_update else "policy")
        # The next step's draws, then the training step, which acts for it when the draw says greedy.
        random_action = explore(global_step + 1)
        # trick 14: one graph per training step, which acts greedily at its end (trick 16)
        action = train_step(q_update, target_update, obs if random_action is None else None)
        action = action if random_action is None else random_action

        phase("other")
        if run.tick(global_step + 1) and global_step >= first_update:
            run.log(global_step, {f"losses/{name}": stats[name] for name in STATS})
    env.close()


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
