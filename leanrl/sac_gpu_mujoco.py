# SAC at GPU scale with the FastSAC recipe (FastTD3's repository, fast_sac/): thousands of batched MuJoCo envs simulated
# with MuJoCo Warp on the device that torch uses, the replay buffer there, large critics and batches, in eager PyTorch;
# data-parallel under torchrun. Docs: docs/sac_gpu_mujoco.md
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

from harness import Run, average, check_due, exit_code, fail, flat_gradients, parse_args, setup_distributed, world
from mujoco_warp_envs import ENVS, Envs, gymnasium_env, saved_obs_rms
from replay_buffers import ReplayBuffer


@dataclass
class Args:  # the algorithm's flags; parse_args adds the run options every script shares (docs/contract.md)
    env_id: str = "HalfCheetah-v5"
    """the id of the environment: HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5 or Humanoid-v5"""
    total_timesteps: int = 51200000
    """total timesteps of the experiment (env steps of all envs, of all ranks), a multiple of --num-envs x ranks"""
    compile_cache: str | None = None
    """keep Warp's kernels in this folder and start warm from it, here or on a machine of the same GPU"""
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


# Vector steps (of all envs) after learning_starts before the fps window opens, and vector steps --profile-dir profiles.
WARMUP_STEPS, PROFILE_STEPS = 5, 20
LOG_STD_MAX = 2
LOG_STD_MIN = -5
# What a checkpoint keeps of the agent, with the replay buffer and the envs.
AGENT_STATE = ("actor", "qf1", "qf2", "qf1_target", "qf2_target", "q_optimizer", "actor_optimizer", "a_optimizer",
               "log_alpha")  # fmt: skip
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


class Agent:
    """The networks, the critics' targets, the optimizers and the entropy coefficient (no target actor: FastSAC's)."""

    def __init__(self, args, n_obs, n_act, action_low, action_high, device):
        self.actor = Actor(n_obs, n_act, args.actor_hidden_dim, action_low, action_high, device=device)
        self.qf1 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf2 = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf1_target = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf2_target = QNetwork(n_obs, n_act, args.critic_hidden_dim, device=device)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        q_params = list(self.qf1.parameters()) + list(self.qf2.parameters())
        self.q_optimizer = optim.AdamW(q_params, lr=args.q_lr, weight_decay=args.weight_decay)
        actor_params = list(self.actor.parameters())
        self.actor_optimizer = optim.AdamW(actor_params, lr=args.policy_lr, weight_decay=args.weight_decay)
        # The entropy coefficient alpha = exp(log_alpha), from --alpha; --autotune steps it towards the target entropy.
        self.target_entropy = -float(n_act)
        self.log_alpha = torch.full((1,), math.log(args.alpha), device=device, requires_grad=True)
        self.a_optimizer = optim.Adam([self.log_alpha], lr=args.q_lr)
        if dist.is_initialized():  # each optimizer's gradients as views into one flat buffer, averaged in place
            self.q_grads, self.actor_grads = flat_gradients(q_params), flat_gradients(actor_params)
            self.a_grads = flat_gradients([self.log_alpha])

    def state_dict(self):
        """The trained tensors by name, which every rank holds alike under torchrun (run.start gives every rank rank
        0's at the start, run.finish compares them at the end); the optimizers' state follows from them."""
        parts = {name: getattr(self, name) for name in AGENT_STATE if "optimizer" not in name and name != "log_alpha"}
        parts = {name: part.state_dict() if isinstance(part, nn.Module) else part for name, part in parts.items()}
        tensors = {f"{name}.{key}": value.detach() for name, part in parts.items() for key, value in part.items()}
        return {**tensors, "log_alpha": self.log_alpha.detach()}


def autocast(args, device):
    """--amp: the networks' layers in bf16 (the critics' values and the actor's mean and log std leave them in fp32)."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.amp)


def make_update_fns(agent, args):
    """The steps of an update on a batch of normalised observations: the critics; the delayed actor step, then the
    entropy coefficient's with --autotune; the soft update of the critics' targets, after every gradient update
    (FastSAC's)."""

    def update_critic(obs, actions, rewards, next_obs, discounts):
        alpha = agent.log_alpha.detach().exp()
        with autocast(args, obs.device):
            with torch.no_grad():
                # The next action sampled from the actor itself (FastSAC: no target actor).
                next_state_actions, next_state_log_pi, _ = agent.actor.get_action(next_obs)
                qf1_next_target = agent.qf1_target(next_obs, next_state_actions)
                qf2_next_target = agent.qf2_target(next_obs, next_state_actions)
                min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
                next_q_value = rewards + discounts * min_qf_next_target.view(-1)
            qf1_a_values = agent.qf1(obs, actions).view(-1)
            qf2_a_values = agent.qf2(obs, actions).view(-1)
            qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
            qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
            qf_loss = qf1_loss + qf2_loss
        agent.q_optimizer.zero_grad(set_to_none=not dist.is_initialized())  # the flat buffer's views stay
        qf_loss.backward()
        if dist.is_initialized():
            average(agent.q_grads)
        agent.q_optimizer.step()
        qf1_values, qf2_values = qf1_a_values.detach().mean(), qf2_a_values.detach().mean()
        losses = {"qf1_loss": qf1_loss.detach(), "qf2_loss": qf2_loss.detach(), "qf_loss": qf_loss.detach() / 2.0}
        return {"qf1_values": qf1_values, "qf2_values": qf2_values, **losses}  # qf_loss halved, as CleanRL logs it

    def update_actor(obs):
        alpha = agent.log_alpha.detach().exp()
        # The smaller of the two critics' values. The gradients this leaves on the critics are discarded: the critic
        # step zeroes them before it steps.
        with autocast(args, obs.device):
            pi, log_pi, _ = agent.actor.get_action(obs)
            min_qf_pi = torch.min(agent.qf1(obs, pi), agent.qf2(obs, pi))
            actor_loss = (alpha * log_pi - min_qf_pi).mean()
        agent.actor_optimizer.zero_grad(set_to_none=not dist.is_initialized())
        actor_loss.backward()
        if dist.is_initialized():
            average(agent.actor_grads)
        agent.actor_optimizer.step()
        alpha_loss = torch.zeros((), device=obs.device)
        if args.autotune:  # from a fresh sample of the stepped actor (FastSAC's)
            with autocast(args, obs.device):
                with torch.no_grad():
                    _, log_pi, _ = agent.actor.get_action(obs)
                alpha_loss = -(agent.log_alpha.exp() * (log_pi + agent.target_entropy)).mean()
            agent.a_optimizer.zero_grad(set_to_none=not dist.is_initialized())
            alpha_loss.backward()
            if dist.is_initialized():
                average(agent.a_grads)
            agent.a_optimizer.step()
        return {"actor_loss": actor_loss.detach(), "alpha_loss": alpha_loss.detach()}

    def update_targets():
        for net, target in ((agent.qf1, agent.qf1_target), (agent.qf2, agent.qf2_target)):
            for param, target_param in zip(net.parameters(), target.parameters()):
                target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)

    return update_critic, update_actor, update_targets


def actor_updates(args, vector_step):
    """Which of a vector step's gradient updates step the actor: every --policy-frequency-th of the run."""
    return [(vector_step * args.num_updates + k) % args.policy_frequency == args.policy_frequency - 1
            for k in range(args.num_updates)]  # fmt: skip


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
    batch_size = args.batch_size // world_size  # this rank's share of the global batch
    envs = Envs(args.env_id, n_envs, args.gamma, device)  # Warp's kernels build from here until start()
    n_obs, n_act, obs_rms = envs.n_obs, envs.n_act, envs.obs_rms  # statistics of the first observations
    agent = Agent(args, n_obs, n_act, envs.low, envs.high, device)
    update_critic, update_actor, update_targets = make_update_fns(agent, args)
    rb = ReplayBuffer(args.buffer_size, n_envs, n_obs, n_act, args.num_steps, args.gamma, device)
    envs.start()
    obs = envs.observe(fresh=torch.ones(n_envs, dtype=torch.bool, device=device))  # raw; updated in place
    stats = {}  # the latest value of each of STATS
    # The envs are device tensors: a checkpoint holds them, and a resumed run goes on as the uninterrupted one.
    state = {**{name: getattr(agent, name) for name in AGENT_STATE}, "rb": rb, "envs": envs.state, "obs": obs}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=WARMUP_STEPS * all_envs,
                           profile_steps=PROFILE_STEPS * all_envs, env_steps_per_call=all_envs,
                           warmup_from=args.learning_starts, replicated=agent)  # fmt: skip
    for global_step in range(first_step, args.total_timesteps, all_envs):
        if not run.proceed(global_step):  # Ctrl-C, SIGTERM or a loss gone NaN: saved, the loop ends here
            break
        phase("policy")
        with torch.no_grad(), autocast(args, device):
            actions, _, _ = agent.actor.get_action(obs_rms.normalize(obs))
        phase("env_step")
        next_obs, final_obs, rewards, terminations, truncations = envs.step_raw(actions)
        phase("data")
        # A finished episode's last transition keeps its true final observation: a truncated one bootstraps from it.
        rb.add(obs, actions, rewards, final_obs, terminations, truncations)
        obs_rms.update(next_obs)
        obs.copy_(next_obs)
        if global_step >= args.learning_starts:
            for actor_update in actor_updates(args, global_step // all_envs):
                phase("data")
                b_obs, b_actions, b_rewards, b_next_obs, b_discounts = rb.sample(batch_size)
                b_obs, b_next_obs = obs_rms.normalize(b_obs), obs_rms.normalize(b_next_obs)
                phase("update")
                stats.update(update_critic(b_obs, b_actions, b_rewards, b_next_obs, b_discounts))
                if actor_update:  # delayed policy updates
                    stats.update(update_actor(b_obs))
                update_targets()
        phase("other")
        # Rank 0 alone shows progress and counts returns: of its own envs, as CleanRL does.
        if rank == 0 and run.tick(global_step + all_envs):
            # The episodes ended since the last tick count as one, their mean; read back in one sync.
            ended, return_sum, length_sum = envs.ended_episodes().tolist()
            if ended:
                run.episode(global_step + all_envs, return_sum / ended, length_sum / ended)
            if "actor_loss" in stats:
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
