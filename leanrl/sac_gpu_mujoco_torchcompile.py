# SAC at GPU scale with the FastSAC recipe (FastTD3's repository, fast_sac/): thousands of batched MuJoCo envs simulated
# with MuJoCo Warp on the device that torch uses, the replay buffer there, large critics and batches, made fast: the
# critics one vmapped ensemble, the env step (Warp's physics included) and the updates CUDA graphs, compile;
# data-parallel under torchrun. Docs: docs/sac_gpu_mujoco.md
import functools
import math
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

from harness import Run, average, check_due, exit_code, fail, flat_gradients, parse_args, setup_distributed, world
from mujoco_warp_envs import ENVS, CapturableEnvs, gymnasium_env, saved_obs_rms
from replay_buffers import CapturableReplayBuffer


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5 or Humanoid-v5"""
    total_timesteps: int = 51200000
    """total timesteps of the experiment (env steps of all envs, of all ranks), a multiple of --num-envs x ranks"""
    num_envs: int = 1024
    """the number of parallel environments (MuJoCo Warp worlds), of each rank under torchrun"""
    buffer_size: int = 10485760
    """the replay memory buffer size, in transitions: --buffer-size // --num-envs of each env (each rank its own)"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 0.1
    """target smoothing coefficient, applied after every gradient update"""
    batch_size: int = 32768
    """the batch size of samples from the replay memory, --batch-size // --num-envs from each env; under torchrun
    the global batch: each rank draws --batch-size // ranks from its own buffer"""
    num_updates: int = 2
    """the gradient updates per env step (of all envs)"""
    num_steps: int = 1
    """the steps of the critics' n-step return (FastTD3's --num-steps): rewards of up to --num-steps steps of an env,
    discounted, cut where its episode ends, then the discounted value; 1: the one-step target"""
    learning_starts: int = 10240
    """timestep to start learning (env steps of all ranks under torchrun, as --total-timesteps)"""
    policy_lr: float = 3e-4
    """the learning rate of the policy network optimizer (AdamW)"""
    q_lr: float = 3e-4
    """the learning rate of the Q network optimizer (AdamW) and of the entropy coefficient's (Adam)"""
    weight_decay: float = 0.1
    """the weight decay of the policy and Q network optimizers (AdamW)"""
    policy_frequency: int = 2
    """the frequency of training policy (delayed), in gradient updates"""
    alpha: float = 0.001
    """entropy regularization coefficient: fixed without --autotune, the starting value with it"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient"""
    critic_hidden_dim: int = 1024
    """the width of the critics' first layer (then halved twice)"""
    actor_hidden_dim: int = 512
    """the width of the actor's first layer (then halved twice)"""
    amp: bool = False
    """bf16 autocast of the networks in the updates and the policy (FastTD3's --amp): faster, not fp32's result"""
    capture_video: bool = False
    """record --eval-checkpoint's episodes as videos under videos/<run name>/ (training's Warp worlds render none)"""
    compile: bool = False  # trick 2: torch.compile
    """compile the update and policy functions with torch.compile"""
    cudagraphs: bool = False  # trick 1: CUDA graphs
    """capture the env step (policy, Warp's physics, storage) and each vector step's updates as CUDA graphs"""
    compile_cache: str | None = None  # trick 21: a compile cache to carry
    """keep --compile's code and Warp's kernels in this folder and start warm from it, here or on a like GPU"""


# Vector steps (of all envs) after learning_starts before the fps window opens, and vector steps --profile-dir profiles.
WARMUP_STEPS, PROFILE_STEPS = 5, 20
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer and the envs.
# trick 4: vmapped ensemble: the critics and their targets stacked
AGENT_STATE = ("actor", "qnet_params", "qnet_target", "q_optimizer", "actor_optimizer", "a_optimizer", "log_alpha")
# The statistics of an update, logged as losses/<name>, with losses/alpha.
STATS = ("qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss", "actor_loss", "alpha_loss")


def layer_widths(hidden_dim):
    """FastSAC's layers: the first of hidden_dim, then halved twice."""
    return hidden_dim, hidden_dim // 2, hidden_dim // 4


class QNetwork(nn.Module):
    """A critic: the Q value of an observation and an action."""

    def __init__(self, n_obs, n_act, hidden_dim, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs + n_act, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc4 = nn.Linear(w3, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x).float()  # fp32 values under --amp too, for the target and the loss


class Actor(nn.Module):
    def __init__(self, n_obs, n_act, hidden_dim, action_low, action_high, device=None):
        super().__init__()
        w1, w2, w3 = layer_widths(hidden_dim)
        self.fc1 = nn.Linear(n_obs, w1, device=device)
        self.fc2 = nn.Linear(w1, w2, device=device)
        self.fc3 = nn.Linear(w2, w3, device=device)
        self.fc_mu = nn.Linear(w3, n_act, device=device)
        self.fc_logstd = nn.Linear(w3, n_act, device=device)
        nn.init.normal_(self.fc_mu.weight, 0.0, 0.01)  # FastSAC's init_scale: means near the middle at first
        nn.init.zeros_(self.fc_mu.bias)
        self.register_buffer("action_scale", (action_high - action_low) / 2.0)
        self.register_buffer("action_bias", (action_high + action_low) / 2.0)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        mean = self.fc_mu(x).float()  # fp32 under --amp too: the sample and its log-probability
        log_std = torch.tanh(self.fc_logstd(x).float())
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return mean, log_std

    def get_action(self, x):
        mean, log_std = self(x)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std, validate_args=False)  # trick 1: CUDA graphs, validation syncs
        x_t = normal.rsample()  # reparameterization trick: mean + std * N(0,1)
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        # Enforcing action bounds
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean


class Agent:
    """The networks, the critics' targets, the optimizers and the entropy coefficient (no target actor: FastSAC's)."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, args.actor_hidden_dim, action_low, action_high, device=device)
        # trick 4: vmapped ensemble: both critics as one stacked {name: tensor of both} (and its target copy),
        # evaluated by qvalues
        qf1 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        qf2 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qnet_params, _ = torch.func.stack_module_state([qf1, qf2])
        self.qnet_target = {name: p.detach().clone() for name, p in self.qnet_params.items()}
        self.qnet = QNetwork(n_obs, n_act, args.critic_hidden_dim, device="meta")  # no storage
        # trick 1: CUDA graphs: the optimizers' step counts on the device
        capturable = args.cudagraphs and device.type == "cuda"
        # trick 2: torch.compile: the optimizers' fused steps, one kernel each already: compiled, they were Dynamo's
        # to trace anew at every start
        adamw = dict(weight_decay=args.weight_decay, capturable=capturable, fused=True)
        self.q_optimizer = optim.AdamW(self.qnet_params.values(), lr=args.q_lr, **adamw)
        self.actor_optimizer = optim.AdamW(self.actor.parameters(), lr=args.policy_lr, **adamw)
        # The entropy coefficient alpha = exp(log_alpha), from --alpha; --autotune steps it towards the target entropy.
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.full((1,), math.log(args.alpha), device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr, capturable=capturable, fused=True)

    def qvalues(self, params, obs, actions):  # trick 4: vmapped ensemble
        """Both critics' Q values for the stacked parameters `params`: shape (2, batch, 1)."""
        return torch.vmap(lambda p: torch.func.functional_call(self.qnet, p, (obs, actions)))(params)

    def state_dict(self):
        """The trained tensors by name, which every rank holds alike under torchrun (run.start gives every rank rank
        0's at the start, run.finish compares them at the end); the optimizers' state follows from them."""
        parts = {name: getattr(self, name) for name in AGENT_STATE if "optimizer" not in name and name != "log_alpha"}
        parts = {name: part.state_dict() if isinstance(part, nn.Module) else part for name, part in parts.items()}
        tensors = {f"{name}.{key}": value.detach() for name, part in parts.items() for key, value in part.items()}
        return {**tensors, "log_alpha": self.log_alpha.detach()}


def averaged(backward, optimizer, args):  # trick 19: one all-reduce of a flat buffer, between two graphs
    """Under torchrun, an update from all ranks' gradients: backward(*inputs) (an update of make_update_fns, which
    there stops before its step and returns its statistics), the all-reduce of the gradients, the optimizer's
    step. The gradients are views into one flat buffer (flat_gradients) that backward fills in place. Backward
    and step are captured as --cudagraphs says; the all-reduce runs eagerly between their graphs (inside one graph,
    as the PPO Atari twin has it, was not measured for these)."""
    grads, step = flat_gradients(optimizer.param_groups[0]["params"]), optimizer.step
    if args.cudagraphs:
        backward, step = (CudaGraphModule(fn, warmup=3 if args.compile else 2) for fn in (backward, step))

    def update(*inputs):
        stats = backward(*inputs)
        average(grads)
        step()
        return stats

    return update


def autocast(args, device):
    """--amp: the networks' layers in bf16 (the critics' values and the actor's mean and log std leave them in fp32)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.amp)


def make_update_fns(agent, args):
    """The steps of an update on a batch of normalised observations: the critics; the delayed actor step, then the
    entropy coefficient's with --autotune; the soft update of the critics' targets, after every gradient update
    (FastSAC's); and the policy that acts. Under torchrun the critics', the actor's and the entropy coefficient's
    gradients are averaged before their steps."""

    def critic_loss(obs, actions, rewards, next_obs, discounts):
        alpha = agent.log_alpha.detach().exp()
        with torch.no_grad():
            # The next action sampled from the actor itself (FastSAC: no target actor).
            next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
            # trick 4: vmapped ensemble: both targets at once
            qf_next_target = agent.qvalues(agent.qnet_target, next_obs, next_state_actions)
            min_qf_next_target = qf_next_target.min(0).values - alpha * next_state_log_pi
            next_q_value = rewards + discounts * min_qf_next_target.view(-1)
        qf1_a_values, qf2_a_values = agent.qvalues(agent.qnet_params, obs, actions).view(2, -1)
        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
        qf_loss = qf1_loss + qf2_loss
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return qf_loss, {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL

    def update_critic(*batch):
        with autocast(args, batch[0].device):  # trick 2: torch.compile: autocast around the loss (below)
            qf_loss, stats = critic_loss(*batch)
        agent.q_optimizer.zero_grad(set_to_none=not dist.is_initialized())  # the flat buffer's views stay
        qf_loss.backward()
        if not dist.is_initialized():  # trick 19: one all-reduce of a flat buffer, else averaged steps after it
            agent.q_optimizer.step()
        return stats

    def actor_loss(obs):
        alpha = agent.log_alpha.detach().exp()
        # trick 4: vmapped ensemble: the smaller critic's value, through detached parameters: no gradient reaches
        # the critics.
        params = {name: p.detach() for name, p in agent.qnet_params.items()}
        pi, log_pi, _ = agent.actor.get_action(obs)
        min_qf_pi = agent.qvalues(params, obs, pi).min(0).values
        return (alpha * log_pi - min_qf_pi).mean()

    def update_actor(obs):
        with autocast(args, obs.device):
            loss = actor_loss(obs)
        agent.actor_optimizer.zero_grad(set_to_none=not dist.is_initialized())
        loss.backward()
        if dist.is_initialized():  # trick 19: one all-reduce of a flat buffer: averaged steps, then update_alpha
            return {"actor_loss": loss.detach()}
        agent.actor_optimizer.step()
        return {"actor_loss": loss.detach(), **update_alpha(obs)}

    def alpha_loss(obs):  # from a fresh sample of the stepped actor (FastSAC's)
        with torch.no_grad():
            _, log_pi, _ = agent.actor.get_action(obs)
        return -(agent.log_alpha.exp() * (log_pi + agent.target_entropy)).mean()

    def update_alpha(obs):
        if not args.autotune:
            return {"alpha_loss": torch.zeros((), device=obs.device)}
        with autocast(args, obs.device):
            loss = alpha_loss(obs)
        agent.a_optimizer.zero_grad(set_to_none=not dist.is_initialized())
        loss.backward()
        if not dist.is_initialized():
            agent.a_optimizer.step()
        return {"alpha_loss": loss.detach()}

    def update_targets():  # trick 5: one lerp for the targets, over every target parameter
        sources = [p.detach() for p in agent.qnet_params.values()]
        torch._foreach_lerp_(list(agent.qnet_target.values()), sources, args.tau)

    def policy(obs):  # trick 3: act without autograd
        with torch.no_grad():
            actions, _, _ = agent.actor.get_action(obs)
        return actions

    # trick 2: torch.compile: the losses and the policy, each its own graph that the updates call by these names; the
    # backward passes and the steps run between them, so no graph breaks at them (the code after a break is traced
    # again at every start). The steps (fused) and the targets' lerp are a kernel each: nothing to compile. --amp's
    # autocast is entered around a compiled function, not in it: AOTAutograd's cache keeps no graph that enters
    # autocast, and would trace it at every start.
    if args.compile:
        critic_loss, actor_loss, alpha_loss, policy = map(torch.compile, (critic_loss, actor_loss, alpha_loss, policy))
    if dist.is_initialized():  # the updates from all ranks' gradients: the critics', the actor's, then alpha's
        actor_update = averaged(update_actor, agent.actor_optimizer, args)
        alpha_update = averaged(update_alpha, agent.a_optimizer, args) if args.autotune else update_alpha
        return (averaged(update_critic, agent.q_optimizer, args),
                lambda obs: {**actor_update(obs), **alpha_update(obs)}, update_targets, policy)  # fmt: skip
    return update_critic, update_actor, update_targets, policy


def actor_updates(args, vector_step):
    """Which of a vector step's gradient updates step the actor: every --policy-frequency-th of the run."""
    return [(vector_step * args.num_updates + k) % args.policy_frequency == args.policy_frequency - 1
            for k in range(args.num_updates)]  # fmt: skip


def make_collect(policy, envs, rb, obs, args):  # trick 15: the rollout captured, here one act-and-env step
    """collect(): one env step of all envs from `obs` (raw, updated in place): act, step, store, update the
    observation statistics. With --cudagraphs one CUDA graph, Warp's physics included."""

    def collect():
        normalized = envs.obs_rms.normalize(obs)
        with autocast(args, obs.device):  # trick 2: torch.compile: autocast around the policy
            actions = policy(normalized)
        next_obs, final_obs, rewards, terminations, truncations = envs.step_raw(actions)
        # A finished episode's last transition keeps its true final observation: a truncated one bootstraps from it.
        rb.add(obs, actions, rewards, final_obs, terminations, truncations)
        envs.obs_rms.update(next_obs)
        obs.copy_(next_obs)

    return CudaGraphModule(collect, warmup=3 if args.compile else 2) if args.cudagraphs else collect


# trick 14: one graph per training step
def make_train_step(rb, obs_rms, update_critic, update_actor, update_targets, args):
    """train_step(pattern): a vector step's gradient updates, pattern[k] saying whether the k-th steps the actor:
    each samples, normalises, updates; with --cudagraphs one captured graph per pattern (under torchrun, graphs of
    the averaged updates' pieces). `stats`: fixed tensors."""
    stats = {name: torch.zeros((), device=rb.envs.device) for name in STATS}  # trick 10: nothing to copy in or out
    batch_size = args.batch_size // world()[1]  # under torchrun, this rank's share of the global batch

    def step(pattern):
        for actor_update in pattern:
            obs, actions, rewards, next_obs, discounts = rb.sample(batch_size)
            obs, next_obs = obs_rms.normalize(obs), obs_rms.normalize(next_obs)
            outputs = update_critic(obs, actions, rewards, next_obs, discounts)
            if actor_update:  # delayed policy updates
                outputs.update(update_actor(obs))
            update_targets()
            for name, value in outputs.items():
                stats[name].copy_(value)

    @functools.cache
    def step_of_kind(pattern):
        fn = functools.partial(step, pattern)
        captured = args.cudagraphs and not dist.is_initialized()
        return CudaGraphModule(fn, warmup=3 if args.compile else 2) if captured else fn

    def train_step(pattern):
        step_of_kind(tuple(pattern))()

    return train_step, stats


def check_args(args):
    _, world_size = world()  # under torchrun --total-timesteps counts the env steps of all ranks
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of this script's environments: {', '.join(ENVS)}")
    if args.eval_checkpoint:  # the checks below are of training's sizes: evaluation plays the saved policy
        return
    if args.capture_video:
        fail("--capture-video records the episodes of --eval-checkpoint: the MuJoCo Warp worlds render no frames")
    for name in ("total_timesteps", "batch_size"):  # each rank steps its share of the envs and draws its share
        if getattr(args, name) % (args.num_envs * world_size):
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of --num-envs {args.num_envs}"
                 + (f" x {world_size} ranks" if world_size > 1 else ""))  # fmt: skip
    if args.buffer_size < max(args.batch_size, args.num_envs):
        fail(f"--buffer-size {args.buffer_size} must be >= --batch-size {args.batch_size} and --num-envs "
             f"{args.num_envs}")  # fmt: skip
    if args.learning_starts >= args.total_timesteps:
        fail(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}")
    for name in ("num_updates", "num_steps", "critic_hidden_dim", "actor_hidden_dim"):
        if getattr(args, name) < {"num_updates": 1, "num_steps": 1}.get(name, 4):
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is too small")
    all_envs, k = args.num_envs * world_size, args.num_updates  # the actor takes every --policy-frequency-th update
    check_due(args, "policy_frequency", -(-args.learning_starts // all_envs) * k, args.total_timesteps // all_envs * k,
              "gradient updates", offset=args.policy_frequency - 1)  # fmt: skip
    if args.alpha <= 0:
        fail(f"--alpha {args.alpha} must be positive: the entropy coefficient is kept as its log")


def train(args, run):
    rank, world_size = world()
    # Each rank seeds its envs and its draws apart; the parameters come from rank 0.
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    device, phase, n_envs = run.device, run.phase, args.num_envs
    # Sizes are per rank, but for the global --batch-size; global_step counts the env steps of all ranks, as
    # --total-timesteps and --learning-starts do.
    all_envs = n_envs * world_size  # env steps of one vector step of all ranks
    # trick 15: the rollout captured: these envs' physics can join collect's graph
    envs = CapturableEnvs(args.env_id, n_envs, args.gamma, device)  # Warp's kernels build from here until start()
    n_obs, n_act = envs.n_obs, envs.n_act  # envs.obs_rms: statistics of the first observations
    agent = Agent(args, n_obs, n_act, envs.low, envs.high, device)
    update_critic, update_actor, update_targets, policy = make_update_fns(agent, args)
    # trick 7: no host sync: where the buffer's next rows go and how many it holds, on the device
    rb = CapturableReplayBuffer(args.buffer_size, n_envs, n_obs, n_act, args.num_steps, args.gamma, device)
    train_step, stats = make_train_step(rb, envs.obs_rms, update_critic, update_actor, update_targets, args)
    if args.compile:  # trick 22: compile while Warp builds: an update and an action on zeros, then rolled back
        with run.rolled_back({name: getattr(agent, name) for name in AGENT_STATE}), rb.holding_one_row():
            train_step([True])  # on a sample of the buffer's zeros, shaped as every sample
            with autocast(args, device):
                policy(envs.obs)
    envs.start()
    obs = envs.observe(fresh=torch.ones(n_envs, dtype=torch.bool, device=device))  # raw; updated in place
    collect = make_collect(policy, envs, rb, obs, args)
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one.
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb, "envs": envs.state, "obs": obs}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS * all_envs,
                           profile_steps=PROFILE_STEPS * all_envs, env_steps_per_call=all_envs,
                           warmup_from=args.learning_starts, replicated=agent)  # fmt: skip
    for global_step in range(first_step, args.total_timesteps, all_envs):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("env_step")
        collect()  # trick 15: the rollout captured
        if global_step >= args.learning_starts:
            phase("update")
            train_step(actor_updates(args, global_step // all_envs))  # trick 14: one graph per training step
        phase("other")
        # By then an actor update has run (in this run, if it was resumed): its statistics exist.
        logged = global_step >= max(args.learning_starts, first_step) + args.policy_frequency * all_envs
        # Rank 0 alone shows progress and counts returns: of its own envs, as CleanRL does.
        if rank == 0 and run.tick(global_step + all_envs):
            # The episodes ended since the last tick count as one, their mean; read back in one sync.
            ended, return_sum, length_sum = envs.ended_episodes().tolist()
            if ended:
                run.episode(global_step + all_envs, return_sum / ended, length_sum / ended)
            if logged:
                losses = {f"losses/{name}": stats[name] for name in STATS}
                run.log(global_step, {**losses, "losses/alpha": agent.log_alpha.detach().exp()})


def evaluate(args, run, saved):
    """--eval-checkpoint: the saved actor's deterministic action (its squashed mean), episode after episode on
    gymnasium's own env of the same id (MuJoCo's C simulator, which the batched envs reproduce), observations
    normalised with the saved statistics, frozen."""
    env = gymnasium_env(args.env_id, run.video_folder)
    n_obs, n_act = env.observation_space.shape[0], env.action_space.shape[0]
    low, high = (torch.as_tensor(bound, device=run.device) for bound in (env.action_space.low, env.action_space.high))
    actor = Actor(n_obs, n_act, args.actor_hidden_dim, low, high, device=run.device)
    actor.load_state_dict(saved["actor"])
    obs_rms = saved_obs_rms(saved["envs"], run.device)
    obs, _ = env.reset(seed=args.seed)
    while True:
        with torch.no_grad():
            _, _, action = actor.get_action(obs_rms.normalize(torch.as_tensor(obs, device=run.device)[None]))
        obs, _, terminated, truncated, info = env.step(action[0].cpu().numpy())
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
