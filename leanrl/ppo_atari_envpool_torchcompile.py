# PPO for Atari on envpool, as CleanRL defines it, made fast: uint8 frames moved once into on-device storage,
# GAE as one matrix product, torch.compile and CUDA graphs for the policy, GAE and update, env stepping
# overlapped with device work.
# Docs: docs/ppo_atari.md
import json
import os
import random
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import envpool
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
import tqdm
import tyro
from tensordict.nn import CudaGraphModule
from torch.distributions.categorical import Categorical
from torch.profiler import ProfilerActivity, profile, record_function


@dataclass
class Args:
    env_id: str = "Breakout-v5"
    """the id of the envpool Atari game"""
    seed: int = 1
    """seed of the experiment"""
    total_timesteps: int = 10000000
    """total timesteps of the experiment (rounded down to whole iterations of num_envs * num_steps)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """normalize the advantages of each minibatch"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """use a clipped loss for the value function, as per the paper"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """stop an iteration's epochs early once the approximate KL divergence exceeds this threshold"""
    cuda: bool = True
    """use CUDA when it is available"""
    track: bool = False
    """track the experiment with Weights and Biases (honours WANDB_MODE)"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    speed_log: str | None = None
    """append the final speed record (one JSON line) to this file"""
    profile_dir: str | None = None
    """profile a short steady window after warm-up and write the trace into this directory"""
    compile: bool = False
    """compile the policy, GAE and update functions with torch.compile"""
    cudagraphs: bool = False
    """capture the policy, GAE and update functions as CUDA graphs (tensordict's CudaGraphModule)"""


# Iterations that count as warm-up: the fps window starts after them.
WARMUP_ITERATIONS = 3
# Iterations profiled with --profile-dir, at the start of the steady window.
PROFILE_ITERATIONS = 1


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "learning_rate"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.target_kl is not None and args.target_kl <= 0:
        fail(f"--target-kl must be positive, got {args.target_kl}")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        fail(
            f"--num-minibatches {args.num_minibatches} does not split the batch of {batch_size} steps "
            f"(--num-envs * --num-steps) evenly"
        )
    if args.total_timesteps < batch_size:
        fail(f"--total-timesteps {args.total_timesteps} is less than one batch of {batch_size} steps")


def make_envs(env_id, num_envs, seed):
    """envpool's Atari preprocessing: 4 stacked 84x84 gray frames, a life loss ends an episode for the
    learner (episodic_life) and rewards are clipped to their sign (reward_clip)."""
    if env_id not in envpool.list_all_envs():
        fail(f"unknown env id {env_id!r}: not an envpool environment")
    if "episodic_life" not in envpool.make_spec(env_id).config._fields:
        fail(f"{env_id} is not an envpool Atari game")
    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, episodic_life=True, reward_clip=True, seed=seed
    )


class EpisodeReturns:
    """Returns of whole games, as a person would score them.

    envpool reports the unclipped reward in info["reward"]. A game ends when it is over (info["terminated"],
    no lives left) or at its time limit (truncated, after which envpool restarts the game); a lost life
    ends an episode for the learner only. The step after any end is envpool's reset step, with reward 0.
    """

    def __init__(self, num_envs):
        self.running = np.zeros(num_envs)
        self.finished = deque(maxlen=20)

    def add(self, info, truncations):
        """Count one env step; return the returns of the games that ended in it."""
        self.running += info["reward"]
        game_over = info["terminated"].astype(bool) | truncations
        ended = self.running[game_over].tolist()
        self.running[game_over] = 0.0
        self.finished.extend(ended)
        return ended


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ActorCritic(nn.Module):
    """The Nature CNN with a policy head and a value head; it takes uint8 frames and scales them itself."""

    def __init__(self, n_act, device=None):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2, device=device)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1, device=device)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512, device=device)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_act, device=device), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1, device=device), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        logits = self.actor(hidden)
        # No argument validation: its checks read values back to the host, which stalls the stream and
        # cannot be captured in a graph.
        probs = Categorical(logits=logits, validate_args=False)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


class Rollout:
    """One iteration's transitions, num_steps x num_envs of each, preallocated on the device; frames stay uint8.

    The host side stages what the envs return in pinned memory: each step's frames go to the device at once,
    straight into their slot of the storage; rewards and done flags go in one copy per iteration.
    """

    def __init__(self, num_steps, num_envs, obs_shape, device):
        self.obs = torch.zeros((num_steps, num_envs) + obs_shape, dtype=torch.uint8, device=device)
        self.actions = torch.zeros((num_steps, num_envs), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num_steps, num_envs), device=device)
        self.rewards = torch.zeros((num_steps, num_envs), device=device)
        # dones[t]: obs[t] ended its episode (it is the last observation before envpool's reset step)
        self.dones = torch.zeros((num_steps, num_envs), device=device)
        self.values = torch.zeros((num_steps, num_envs), device=device)
        # The observation and done flag after the last step, which GAE bootstraps from.
        self.next_obs = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, device=device)
        self.next_done = torch.zeros(num_envs, device=device)
        pin = torch.device(device).type == "cuda"
        self.next_obs_host = torch.zeros((num_envs,) + obs_shape, dtype=torch.uint8, pin_memory=pin)
        self.rewards_host = torch.zeros((num_steps, num_envs), pin_memory=pin)
        self.dones_host = torch.zeros((num_steps + 1, num_envs), pin_memory=pin)  # the last row is next_done

    def to_device(self):
        """Queue the copies of the staged rewards, done flags and last observation to the device."""
        self.rewards.copy_(self.rewards_host, non_blocking=True)
        self.dones.copy_(self.dones_host[:-1], non_blocking=True)
        self.next_done.copy_(self.dones_host[-1], non_blocking=True)
        self.next_obs.copy_(self.next_obs_host, non_blocking=True)


class Agent:
    """The actor-critic network PPO trains and its optimizer."""

    def __init__(self, args, n_act, device):
        self.network = ActorCritic(n_act, device=device)
        # The learning rate is a device tensor, annealed in place, so a captured update reads its current value
        # (and compiled code does not recompile for each new value). capturable: Adam keeps its step count on
        # the device too, so a replayed graph advances it; without it, a tensor lr disables the foreach kernels.
        lr = torch.tensor(args.learning_rate, device=device)
        capturable = torch.device(device).type == "cuda"
        self.optimizer = optim.Adam(self.network.parameters(), lr=lr, eps=1e-5, capturable=capturable)


def make_update_fns(agent, args):
    """The two steps of a PPO iteration's learning: advantages (GAE) and the update on one minibatch; and the
    policy that acts. With --compile and --cudagraphs, each is compiled and captured."""

    def gae(next_obs, next_done, rewards, values, dones):
        with torch.no_grad():
            # bootstrap value if not done
            next_value = agent.network.get_value(next_obs).reshape(1, -1)
            nextnonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
            nextvalues = torch.cat([values[1:], next_value])
            delta = rewards + args.gamma * nextvalues * nextnonterminal - values
            # The recursion advantages[t] = delta[t] + c[t] * advantages[t + 1], solved in closed form:
            # advantages[t] = sum over k >= t of c[t] * ... * c[k - 1] * delta[k]. One cumprod over a
            # num_steps x num_steps matrix gives the products, so the compiled graph is a few kernels instead
            # of num_steps unrolled steps. Memory: num_steps^2 * num_envs floats.
            c = args.gamma * args.gae_lambda * nextnonterminal
            upper = torch.ones(args.num_steps, args.num_steps, dtype=torch.bool, device=c.device).triu()[..., None]
            products = torch.cumprod(torch.where(upper, c, 1.0), dim=1)  # [t, k]: c[t] * ... * c[k] for k >= t
            discounts = torch.cat([torch.ones_like(products[:, :1]), products[:, :-1]], dim=1) * upper
            advantages = (discounts * delta).sum(1)
            returns = advantages + values
        return advantages, returns

    def update(obs, actions, logprobs, advantages, returns, values):
        _, newlogprob, entropy, newvalue = agent.network.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()

        with torch.no_grad():
            # calculate approx_kl http://joschu.net/blog/kl-approx.html
            old_approx_kl = (-logratio).mean()
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

        if args.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # Policy loss
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        # Value loss
        newvalue = newvalue.view(-1)
        if args.clip_vloss:
            v_loss_unclipped = (newvalue - returns) ** 2
            v_clipped = values + torch.clamp(newvalue - values, -args.clip_coef, args.clip_coef)
            v_loss_clipped = (v_clipped - returns) ** 2
            v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
            v_loss = 0.5 * v_loss_max.mean()
        else:
            v_loss = 0.5 * ((newvalue - returns) ** 2).mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

        agent.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.network.parameters(), args.max_grad_norm)
        agent.optimizer.step()
        return approx_kl, v_loss.detach(), pg_loss.detach(), entropy_loss.detach(), old_approx_kl, clipfrac

    def policy(obs):
        with torch.no_grad():
            action, logprob, _, value = agent.network.get_action_and_value(obs)
        return action, logprob, value.flatten()

    if args.compile:
        gae, update, policy = map(torch.compile, (gae, update, policy))
    if args.cudagraphs:
        gae, update, policy = (CudaGraphModule(f, warmup=3 if args.compile else 2) for f in (gae, update, policy))
    return gae, update, policy


def save_profile(profiler, profile_dir, script):
    profiler.stop()
    os.makedirs(profile_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(profile_dir, f"{script}.trace.json"))


def main(argv=None):
    args = tyro.cli(Args, args=argv)
    check_args(args)
    t_start = time.perf_counter()
    script = os.path.basename(__file__)[: -len(".py")]
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    run_name = f"{args.env_id}__{script}__{args.seed}__{int(time.time())}"
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=vars(args), name=run_name)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.cudagraphs and device.type != "cuda":
        print("warning: --cudagraphs needs CUDA; running without CUDA graphs", file=sys.stderr)
        args.cudagraphs = False
    # Every convolution has a fixed shape: let cuDNN pick the fastest algorithm for each once.
    torch.backends.cudnn.benchmark = device.type == "cuda"
    # Named scopes for the profiler (--profile-dir); free when not profiling.
    phase = record_function if args.profile_dir else lambda name: nullcontext()

    envs = make_envs(args.env_id, args.num_envs, args.seed)
    agent = Agent(args, envs.single_action_space.n, device)
    gae, update, policy = make_update_fns(agent, args)
    rollout = Rollout(args.num_steps, args.num_envs, envs.single_observation_space.shape, device)
    episodes = EpisodeReturns(args.num_envs)

    # The host writes the pinned staging buffers through numpy views of them.
    next_obs_host = rollout.next_obs_host.numpy()
    rewards_host = rollout.rewards_host.numpy()
    dones_host = rollout.dones_host.numpy()
    next_obs_host[:] = envs.reset()[0]
    next_done = np.zeros(args.num_envs, dtype=bool)
    global_step = 0
    curve = []  # [global_step, seconds since start, mean return], for return-vs-time plots
    curve_every = max(1, num_iterations // 50)
    window_start = WARMUP_ITERATIONS
    t_window = profiler = None
    pbar = tqdm.tqdm(range(num_iterations), mininterval=1.0)
    for iteration in pbar:
        if iteration == window_start:
            t_window, step_window = time.perf_counter(), global_step
            if args.profile_dir:
                profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA][: 1 + (device.type == "cuda")])
                profiler.start()
                # One env_step call steps every env: the breakdown tool counts env steps as the record does.
                profiler.add_metadata_json("env_steps_per_call", str(args.num_envs))
        elif profiler is not None and iteration == window_start + PROFILE_ITERATIONS:
            save_profile(profiler, args.profile_dir, script)
            profiler = None

        # Annealing the rate if instructed to do so.
        if args.anneal_lr:
            agent.optimizer.param_groups[0]["lr"].fill_((1.0 - iteration / num_iterations) * args.learning_rate)

        for step in range(args.num_steps):
            global_step += args.num_envs
            with phase("data"):
                # The frames go to the device once, as uint8, into their slot of the storage.
                rollout.obs[step].copy_(rollout.next_obs_host, non_blocking=True)

            with phase("policy"):
                action, logprob, value = policy(rollout.obs[step])
                # This wait for the device also means that every copy out of the pinned buffers has run, so
                # the host may write them again below.
                action_np = action.cpu().numpy()

            with phase("env_step"):
                # envpool's step, split in two: the writes between send and recv are done while the envs step.
                envs.send(action_np)
                with phase("data"):
                    rollout.values[step] = value
                    rollout.actions[step] = action
                    rollout.logprobs[step] = logprob
                    dones_host[step] = next_done
                next_obs, reward, terminations, truncations, info = envs.recv()

            with phase("data"):
                next_obs_host[:] = next_obs
                rewards_host[step] = reward
                next_done = terminations | truncations

            with phase("other"):
                for episodic_return in episodes.add(info, truncations):
                    if args.track:
                        wandb.log({"charts/episodic_return": episodic_return}, step=global_step)

        with phase("data"):
            dones_host[-1] = next_done
            rollout.to_device()
        with phase("update"):
            advantages, returns = gae(
                rollout.next_obs, rollout.next_done, rollout.rewards, rollout.values, rollout.dones
            )

        # flatten the batch
        b_obs = rollout.obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs = rollout.logprobs.reshape(-1)
        b_actions = rollout.actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = rollout.values.reshape(-1)

        # Optimizing the policy and value network
        for epoch in range(args.update_epochs):
            with phase("data"):
                # Shuffled on the device: no indices cross from the host.
                b_inds = torch.randperm(batch_size, device=device).split(minibatch_size)
            for mb_inds in b_inds:
                with phase("data"):
                    minibatch = (b_obs[mb_inds], b_actions[mb_inds], b_logprobs[mb_inds])
                    minibatch += (b_advantages[mb_inds], b_returns[mb_inds], b_values[mb_inds])
                with phase("update"):
                    approx_kl, v_loss, pg_loss, entropy_loss, old_approx_kl, clipfrac = update(*minibatch)

            if args.target_kl is not None and approx_kl > args.target_kl:
                break

        with phase("other"):
            fps = (global_step - step_window) / (time.perf_counter() - t_window) if t_window else None
            mean_return = float(np.mean(episodes.finished)) if episodes.finished else None
            if (iteration + 1) % curve_every == 0 and mean_return is not None:
                curve.append([global_step, round(time.perf_counter() - t_start, 3), round(mean_return, 2)])
            pbar.set_description(f"fps: {fps or 0:.0f}, return: {mean_return or float('nan'):.1f}")
            if args.track:
                y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
                var_y = np.var(y_true)
                explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
                wandb.log(
                    {
                        "charts/learning_rate": float(agent.optimizer.param_groups[0]["lr"]),
                        "losses/value_loss": v_loss.item(),
                        "losses/policy_loss": pg_loss.item(),
                        "losses/entropy": entropy_loss.item(),
                        "losses/old_approx_kl": old_approx_kl.item(),
                        "losses/approx_kl": approx_kl.item(),
                        "losses/clipfrac": clipfrac.item(),
                        "losses/explained_variance": explained_var,
                        "charts/SPS": fps or 0.0,
                    },
                    step=global_step,
                )
    if profiler is not None:
        save_profile(profiler, args.profile_dir, script)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    pbar.close()
    envs.close()
    steps_in_window = global_step - step_window if t_window else 0
    record = {
        "script": script,
        "env_id": args.env_id,
        "seed": args.seed,
        "compile": args.compile,
        "cudagraphs": args.cudagraphs,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "total_timesteps": global_step,
        "fps": round(steps_in_window / (t_end - t_window), 1) if steps_in_window > 0 else None,
        "fps_overall": round(global_step / (t_end - t_start), 1),
        "warmup_seconds": round(t_window - t_start, 3) if steps_in_window > 0 else None,
        "wall_seconds": round(t_end - t_start, 3),
        "episodic_return": round(float(np.mean(episodes.finished)), 2) if episodes.finished else None,
        "return_curve": curve,
    }
    if args.track:
        wandb.finish()
    line = json.dumps(record)
    if args.speed_log:
        # One write of a whole line in append mode, so concurrent runs never interleave.
        with open(args.speed_log, "a") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return record


if __name__ == "__main__":
    main()
