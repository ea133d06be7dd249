# SAC for continuous actions, as CleanRL defines it, made fast: on-device replay buffer, vmapped twin Q,
# functional parameters, torch.compile and CUDA graphs.
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
from tensordict.nn import CudaGraphModule

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
    compile: bool = False
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False
    """capture the update and policy functions as CUDA graphs (tensordict's CudaGraphModule)"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code in this folder and start warm from it, here or on a machine of the same GPU"""


# Env steps after learning_starts before the fps window opens, and steps --profile-dir profiles at its start.
WARMUP_STEPS = 200
PROFILE_STEPS = 100
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer.
AGENT_STATE = ("actor", "qnet_params", "qnet_target", "q_optimizer", "actor_optimizer", "a_optimizer", "log_alpha")
# The statistics of an update, logged as losses/<name>, with losses/alpha.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha_loss")


def make_envs(env_id, seed, num_envs, video_folder=None, episode_trigger=None):
    """num_envs envs in a vector env that resets in the step that ends an episode, so the true final observation
    comes in infos; env 0 records the video, as in CleanRL. One env steps as OneEnv."""

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
        if num_envs == 1:
            envs = OneEnv(make_env(0))
        else:
            envs = gym.vector.SyncVectorEnv(thunks, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    except (gym.error.Error, ImportError) as e:  # ImportError: ids whose envs moved out of gymnasium (-v2, -v3)
        fail(f"--env-id {env_id}: {e}")
    if not isinstance(envs.single_action_space, gym.spaces.Box):
        space = type(envs.single_action_space).__name__
        fail(f"--env-id {env_id} has a {space} action space; SAC needs a continuous (Box) one")
    return envs


class OneEnv:  # trick 13: one env, no vector env
    """One env stepped as make_envs' vector env steps it, without the vector env's batching and info merging (about
    as much host time as a MuJoCo step). Its batched action space draws as the vector env's: a copy of the env's."""

    def __init__(self, env):
        self.env, self.single_observation_space, self.single_action_space = env, env.observation_space, env.action_space
        self.action_space = gym.vector.utils.batch_space(env.action_space, 1)

    def reset(self, seed):
        obs, info = self.env.reset(seed=seed)
        return obs[None], info

    def step(self, actions):
        obs, reward, termination, truncation, info = self.env.step(actions[0])
        infos = {}
        if termination or truncation:
            episode = {key: np.array([value]) for key, value in info["episode"].items()}
            infos = {"final_obs": obs[None], "_final_obs": np.ones(1, bool), "final_info": {"episode": episode}}
            obs, _ = self.env.reset()
        return obs[None], np.array([reward]), np.array([termination]), np.array([truncation]), infos

    def close(self):
        self.env.close()


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
        normal = torch.distributions.Normal(mean, std, validate_args=False)  # trick 7: no host sync (no validation)
        x_t = normal.rsample()  # reparameterization trick: mean + std * N(0,1)
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing action bounds
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class ReplayBuffer:  # trick 6: on-device storage; trick 10: nothing to copy in or out, one fixed batch
    """Rows [obs, action, reward, next_obs, done] of one tensor on the device, sampled uniformly with replacement into
    one fixed batch that the updates read. `stage` copies a step's rows to the device; `push` stores them there."""

    def __init__(self, size, batch_size, num_envs, n_obs, n_act, device):
        widths = [n_obs, n_act, 1, n_obs, 1]
        self.storage = torch.zeros(size, sum(widths), device=device)
        self.rows = torch.zeros(num_envs, sum(widths), device=device)
        self.batch = torch.zeros(batch_size, sum(widths), device=device)
        obs, actions, rewards, next_obs, dones = self.batch.split(widths, dim=1)
        self.fields = (obs, actions, rewards.squeeze(1), next_obs, dones.squeeze(1))  # views: each sample rewrites
        self.ptr = torch.arange(num_envs, device=device)  # the row each env's next transition goes to
        self.size = torch.zeros(1, dtype=torch.long, device=device)
        self.max_size, self.device = size, device

    def stage(self, obs, next_obs, actions, rewards, dones):
        rows = np.concatenate([obs, actions, rewards[:, None], next_obs, dones[:, None]], axis=1, dtype=np.float32)
        self.rows.copy_(torch.from_numpy(rows), non_blocking=True)  # from pageable memory: `rows` is read on return

    def push(self):
        self.storage.index_copy_(0, self.ptr, self.rows)
        self.ptr.add_(len(self.rows)).remainder_(self.max_size)
        self.size.add_(len(self.rows)).clamp_(max=self.max_size)

    def sample(self):
        # Uniform with the size on the device: 62-bit draws modulo the size (a relative bias below 2**-40).
        idx = torch.randint(0, 2**62, (len(self.batch),), device=self.device).remainder_(self.size)
        torch.index_select(self.storage, 0, idx, out=self.batch)

    def state_dict(self):
        """The filled rows, and where the next transition goes."""
        return {"storage": self.storage[: int(self.size)].to("cpu", copy=True), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: len(state["storage"])].copy_(state["storage"])  # in place: graphs hold these very tensors
        self.ptr.copy_(state["ptr"])
        self.size.copy_(state["size"])


class Agent:
    """The networks, optimizers and entropy coefficient SAC trains."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, action_low, action_high, device=device)
        # trick 4: vmapped ensemble, both Q networks as one stacked {name: tensor of both} (and its target copy)
        qf1 = SoftQNetwork(n_obs, n_act, device=device)
        qf2 = SoftQNetwork(n_obs, n_act, device=device)
        self.qnet_params, _ = torch.func.stack_module_state([qf1, qf2])
        self.qnet_target = {name: p.detach().clone() for name, p in self.qnet_params.items()}
        self.qnet = SoftQNetwork(n_obs, n_act, device="meta")  # the structure, without storage
        capturable = args.cudagraphs and device.type == "cuda"  # trick 1: CUDA graphs, Adam's step count on the device
        self.q_optimizer = optim.Adam(self.qnet_params.values(), lr=args.q_lr, capturable=capturable)
        self.actor_optimizer = optim.Adam(list(self.actor.parameters()), lr=args.policy_lr, capturable=capturable)
        # Automatic entropy tuning; trick 7: no host sync, alpha stays a device tensor that no update reads back
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.zeros(1, device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr, capturable=capturable)
        self.alpha = self.log_alpha.detach().exp() if args.autotune else torch.tensor([args.alpha], device=device)

    def qvalues(self, params, obs, actions):
        """The Q values of both networks for the stacked parameters `params`: shape (2, batch, 1)."""
        return torch.vmap(lambda p: torch.func.functional_call(self.qnet, p, (obs, actions)))(params)


def make_update_fns(agent, args, batch):
    """The steps of a SAC update: critic, actor (with the entropy coefficient), target networks; and the policy.
    The updates read `batch` (obs, actions, rewards, next_obs, dones), fixed tensors that each sample rewrites."""

    def update_critic():
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
            qf_next_target = agent.qvalues(agent.qnet_target, next_obs, next_state_actions)
            min_qf_next_target = qf_next_target.min(0).values - agent.alpha * next_state_log_pi
            next_q_value = rewards.flatten() + (1 - dones.flatten()) * args.gamma * min_qf_next_target.view(-1)
        qf1_a_values, qf2_a_values = agent.qvalues(agent.qnet_params, obs, actions).view(2, -1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad()
        qf_loss.backward()
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def actor_step():
        obs = batch[0]
        pi, log_pi, _ = agent.actor.get_action(obs)
        qnet_params = {name: p.detach() for name, p in agent.qnet_params.items()}  # no gradient for the critic
        min_qf_pi = agent.qvalues(qnet_params, obs, pi).min(0).values
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
            agent.alpha.copy_(agent.log_alpha.detach().exp())
        return {"actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach()}

    def update_targets():  # trick 5: one lerp for the targets, fused over every target parameter
        sources = [p.detach() for p in agent.qnet_params.values()]
        torch._foreach_lerp_(list(agent.qnet_target.values()), sources, args.tau)

    def policy(obs):
        with torch.no_grad():  # trick 3: act without autograd
            actions, _, _ = agent.actor.get_action(obs)
        return actions

    if args.compile:  # trick 2: torch.compile; trick 11: compile the body, not the loop (one actor step a function)
        update_critic, actor_step, update_targets, policy = map(
            torch.compile, (update_critic, actor_step, update_targets, policy)
        )

    def update_actor():
        for _ in range(args.policy_frequency):  # policy_frequency updates on one batch, compensating for the delay
            stats = actor_step()
        return stats

    return update_critic, update_actor, update_targets, policy


def make_train_step(rb, update_critic, update_actor, update_targets, args):
    """train_step(actor_update, target_update) after a (vector) env step once learning has started: store the staged
    transitions, sample, update; with --cudagraphs one captured graph per kind of step. `stats`: fixed tensors."""
    stats = {name: torch.zeros((), device=rb.device) for name in STATS}

    def step(actor_update, target_update):
        rb.push()
        rb.sample()
        outputs = update_critic()
        if actor_update:  # TD3-style delayed update
            outputs.update(update_actor())
        if target_update:
            update_targets()
        for name, value in outputs.items():
            stats[name].copy_(value)

    @functools.cache
    def step_of_kind(actor_update, target_update):
        fn = functools.partial(step, actor_update, target_update)
        return CudaGraphModule(fn, warmup=3 if args.compile else 2) if args.cudagraphs else fn

    def train_step(actor_update, target_update):
        step_of_kind(actor_update, target_update)()

    return train_step, stats


def make_act(policy, args, n_obs, n_act, device):  # trick 10: nothing to copy in or out
    """act(obs) -> actions, numpy arrays, one row per env, through pinned host memory and fixed device tensors; with
    --cudagraphs both copies are in the captured graph: one replay and one wait for the device."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(args.num_envs, n_obs, pin_memory=pinned)
    obs_device = torch.zeros(args.num_envs, n_obs, device=device)
    action_host = torch.zeros(args.num_envs, n_act, pin_memory=pinned)

    def staged():
        obs_device.copy_(obs_host, non_blocking=True)
        action_host.copy_(policy(obs_device), non_blocking=True)

    if args.cudagraphs:
        staged = CudaGraphModule(staged, warmup=3 if args.compile else 2)  # trick 1: CUDA graphs

    def act(obs):
        obs_host.numpy()[:] = obs  # the previous act's copies are done: it waited for them
        staged()
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        return action_host.numpy().copy()

    return act


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
    rb = ReplayBuffer(args.buffer_size, args.batch_size, n_envs, n_obs, n_act, device)
    update_critic, update_actor, update_targets, policy = make_update_fns(agent, args, rb.fields)
    train_step, stats = make_train_step(rb, update_critic, update_actor, update_targets, args)
    act = make_act(policy, args, n_obs, n_act, device)
    next_actions = None  # chosen ahead, before a critic-only update

    obs, _ = envs.reset(seed=args.seed)
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS,
                           profile_steps=PROFILE_STEPS, env_steps_per_call=n_envs, warmup_from=args.learning_starts)
    agent.alpha.fill_(agent.log_alpha.exp().item() if args.autotune else args.alpha)  # a resumed run's
    # global_step counts env steps, n_envs per vector step; updates count vector steps, as CleanRL's global_step does.
    for global_step in range(first_step, args.total_timesteps, n_envs):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        vector_step = global_step // n_envs
        run.phase("policy")
        if global_step < args.learning_starts:
            actions = envs.action_space.sample()
        elif next_actions is not None:  # trick 9: act ahead of a critic-only update
            actions, next_actions = next_actions, None
        else:
            actions = act(obs)
        run.phase("env_step")
        next_obs, rewards, terminations, truncations, infos = envs.step(actions)
        run.phase("data")
        real_next_obs = next_obs.copy()  # a finished episode's last transition keeps its true final observation
        if "final_obs" in infos:
            for i in np.flatnonzero(infos["_final_obs"]):
                real_next_obs[i] = infos["final_obs"][i]
                episode = infos["final_info"]["episode"]
                run.episode(global_step, episode["r"][i], episode["l"][i])
        rb.stage(obs, real_next_obs, actions, rewards, terminations)  # trick 6: on-device storage
        obs = next_obs
        if global_step < args.learning_starts:
            rb.push()
        else:
            actor_update = vector_step % args.policy_frequency == 0
            if not actor_update:  # trick 9: act ahead of a critic-only update, while the device updates the critic
                run.phase("policy")
                next_actions = act(obs)
            run.phase("update")  # trick 14: one graph per training step
            train_step(actor_update, vector_step % args.target_network_frequency == 0)
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
