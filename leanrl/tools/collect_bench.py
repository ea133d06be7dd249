"""Data-collection throughput, in the shape of Gleeson et al. 2022, "Optimizing Data Collection in Deep RL"
(Figures 4, 6, 8 and 9): env steps (samples) per second of policy forward, action sampling, env step and
auto-reset, with the trajectory written, over N envs and K steps per call, and over a heavier CartPole (state
factor S: S carts per env; compute factor C: C Euler substeps per env step), for each way of collecting:

    gymnasium      gymnasium's numpy-vectorized CartPole on the CPU, the torch policy on the device
    envpool        envpool's CartPole-v1 on the CPU, the same policy arrangement
    torch-eager    ppo_classic_control_gpu_torchcompile.py's make_collect, torch_classic_control's envs on the device
    torch-compile  the same with --compile: the env step compiled
    torch-graph-eager  the same with --cudagraphs: the K-step collect captured as one CUDA graph (CUDA only)
    torch-graph    the same with --compile --cudagraphs, the script's fastest mode (CUDA only)
    torch-fused    fused_rollout.make_fused_collect (the script's --fused-rollout): the K steps as one Triton
                   kernel (CUDA, or the CPU when started with TRITON_INTERPRET=1: Triton's interpreter, slow, for tests)
    jax            the same network and CartPole in JAX, K steps as one jit of lax.scan (where jax imports)

One call collects K steps of N envs (N*K samples). The heavier CartPole is torch_classic_control's CartPole with
`copies` S and `substeps` C (its docstring says how they work); the policy is the same, so S and C weigh on the
simulator alone: S on the state each step reads and writes (registers in the fused kernel, memory elsewhere),
C on the arithmetic. The CPU simulators have no heavier CartPole. Warm-up calls (compilation, capture) are timed apart;
then calls repeat until --min-seconds have passed, and samples/s = N*K*calls/seconds, synchronised at the
end. After the timing one more call is profiled: GPU kernels per env step (Figure 6; on the CPU, aten ops).

    # the paper-shaped sweeps on the GPU machine, every backend: the defaults are N = 2^0, 2^2 .. 2^20 at
    # K = 128 (Figure 4) and K = 2^0, 2^2 .. 2^10 at N = 4096 (Figure 8); each size of torch-compile and
    # torch-graph compiles afresh, so this takes a while: split it by --sweep or --backends to fit a time limit
    python leanrl/tools/collect_bench.py --out runs/collect_bench

    # every power of two for the device-resident backends, Figure 4 only
    python leanrl/tools/collect_bench.py --sweep n --backends torch-graph jax --out runs/collect_bench_n \\
        --envs 2^0 2^1 2^2 2^3 2^4 2^5 2^6 2^7 2^8 2^9 2^10 2^11 2^12 2^13 2^14 2^15 2^16 2^17 2^18 2^19 2^20

    # Figure 9: S = 1, 4, 16, 64 at C = 1 and C = 1, 4, 16, 64 at S = 1, at N = 4096 and K = 128
    python leanrl/tools/collect_bench.py --sweep sc --backends torch-graph torch-fused jax --out runs/collect_bench_sc

    # a quick look on a laptop (CPU: the torch-graph backends are skipped, and say why)
    python leanrl/tools/collect_bench.py --envs 1 16 256 --steps 1 16 128 --fixed-envs 256 \\
        --backends gymnasium envpool torch-eager torch-compile --min-seconds 0.3 --out runs/collect_bench

Writes OUT/collect_bench.md (a table per measurement, the torch/JAX ratios, what was skipped and why),
OUT/collect_bench.jsonl (one record per measurement) and OUT/figure4.png, OUT/figure8.png, OUT/figure9.png
(log-log, one line per backend) for the sweeps run.
"""

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
import tempfile
import warnings
from collections import deque
from types import SimpleNamespace

import torch
from benchkit import (
    WARMUP_CALLS,
    Parser,
    check_measuring_options,
    collect_variant,
    collect_warmup_calls,
    count,
    cpu_model,
    fail,
    load,
    log_log_panel,
    markdown_table,
    measure,
    pyplot,
    quiet,
    run_measuring_tool,
    save_figure,
    synchronizer,
    unless_out_of_memory,
    utc_date,
    writable_folder,
    write_jsonl,
    write_lines,
)
from torch.profiler import ProfilerActivity, profile

from fused_rollout import fused_rollout_unavailable, make_fused_collect
from harness.options import with_run_options
from torch_classic_control import ENVS, CartPole, Envs

# JAX, imported where a backend needs it, grabs most of the GPU's memory when it starts unless told not to; torch
# shares the GPU in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SCRIPT_NAME = "ppo_classic_control_gpu_torchcompile"
# The training script (its main() not run): the networks and the collect being measured.
script = importlib.import_module(SCRIPT_NAME)
ScriptArgs = with_run_options(script.Args)  # the script's flags with the run options (--seed, --torch-threads)
# Torch backends: (compile, cudagraphs) of the script's make_collect.
TORCH_MODES = {
    "torch-eager": (False, False),
    "torch-compile": (True, False),
    "torch-graph-eager": (False, True),
    "torch-graph": (True, True),
}
# The script's rollouts: make_collect in each of TORCH_MODES, and fused_rollout's make_fused_collect.
TORCH_BACKENDS = (*TORCH_MODES, "torch-fused")
# In this order: JAX last, so the memory it keeps once it has run does not crowd the torch backends.
BACKENDS = ("gymnasium", "envpool", *TORCH_BACKENDS, "jax")
# Backends with a CartPole of their own (not torch_classic_control's Envs), each from a package of that name; the CPU
# simulators among them have no heavier CartPole (--sweep sc).
OWN_CARTPOLE = ("gymnasium", "envpool", "jax")
CPU_SIMULATORS = ("gymnasium", "envpool")
DEFAULT_ENVS = [4**i for i in range(11)]  # 2^0 .. 2^20
DEFAULT_STEPS = [4**i for i in range(6)]  # 2^0 .. 2^10
DEFAULT_FACTORS = [4**i for i in range(4)]  # 1 .. 64, for S and for C
# Calls in flight at once for JAX, whose dispatch is asynchronous and allocates a new trajectory per call.
JAX_IN_FLIGHT = 2


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows this module's docstring as written, and each option's default (a switch's says nothing)."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def heavier_cartpole(copies, substeps):
    """The env id of CartPole with `copies` carts per env and `substeps` Euler steps per env step, registered in
    torch_classic_control's ENVS (where Envs finds it; the fused kernel runs it as CartPole); CartPole-v1 itself for
    one each."""
    if (copies, substeps) == (1, 1):
        return "CartPole-v1"
    env_id = f"CartPole-v1-S{copies}-C{substeps}"
    attributes = {"copies": copies, "substeps": substeps, "n_noise": CartPole.n_noise * copies}
    ENVS.setdefault(env_id, type(env_id, (CartPole,), attributes))
    return env_id


# --- which backends can run here ------------------------------------------------------------------------------


def unavailable(backend, env_id, device):
    """Why a backend cannot run here, or None when it can."""
    if backend in OWN_CARTPOLE and env_id != "CartPole-v1":
        return f"CartPole-v1 only, not {env_id}"
    if TORCH_MODES.get(backend, (False, False))[1] and device.type != "cuda":
        return "CUDA graphs need CUDA"
    if backend == "torch-fused":
        return fused_rollout_unavailable(device.type == "cuda")
    if backend in OWN_CARTPOLE and (import_failed := load(backend)[1]):
        return import_failed
    if backend == "jax":
        import jax

        try:
            jax.devices(jax_platform(device))
        except RuntimeError:
            return f"jax has no {jax_platform(device)} backend here (JAX devices: {jax.devices()})"
    return None


def jax_platform(device):
    return "gpu" if device.type == "cuda" else "cpu"


# --- one backend at one (N, K): a namespace with collect() (one call of K steps), sync(), the trajectory --------


def seeded(env_id, n, k, device, seed, compile=False, cudagraphs=False):
    """(args, envs, agent, acting policy) as the script's train() builds them from the seed, so that every
    backend acts with the same weights. args is the script's own Args with the bench's sizes and modes, the rest
    at the script's defaults."""
    args = dataclasses.replace(
        ScriptArgs(), env_id=env_id, num_envs=n, num_steps=k, seed=seed, compile=compile, cudagraphs=cudagraphs
    )
    torch.manual_seed(seed)
    envs = Envs(env_id, n, device)
    agent = script.Agent(args, envs.physics.n_obs, envs.physics.n_act, device)
    _, _, policy, _ = script.make_update_fns(agent, args)
    return args, envs, agent, policy


def build_torch(backend, env_id, n, k, device, seed):
    """The script's collect as its train() sets it up, in the mode the backend names."""
    compile, cudagraphs = TORCH_MODES.get(backend, (False, False))
    # Each (N, K) compiles afresh: dynamo would otherwise pile up recompiles of the one step function across the
    # sizes until it hits its cache limit and falls back to eager.
    torch._dynamo.reset()
    args, envs, agent, policy = seeded(env_id, n, k, device, seed, compile, cudagraphs)
    rollout = script.Rollout(k, n, envs.physics.n_obs, device)
    rollout.obs[-1] = envs.observe()
    if backend == "torch-fused":  # the first call compiles the Triton kernel
        collect = make_fused_collect(agent.net, envs, rollout)
        variant = "fused_rollout.make_fused_collect"
    else:
        collect = script.make_collect(policy, envs, rollout, args)
        variant = collect_variant(SCRIPT_NAME, compile, cudagraphs)
    return SimpleNamespace(collect=collect, sync=synchronizer(device), rollout=rollout, net=agent.net,
                           warmup_calls=collect_warmup_calls(collect, cudagraphs), profiled=True,
                           variant=variant)  # fmt: skip


def make_simulator(backend, n, seed):
    """(vector env, its first observation, what it is): gymnasium's numpy-vectorized CartPole, or envpool's. Both
    auto-reset on the step after an episode ends, not on the same step as the script's Envs."""
    with warnings.catch_warnings():
        # CartPole's observation bounds are float64 numbers in a float32 space, and gymnasium's Box says so.
        warnings.filterwarnings("ignore", r".*precision lowered by casting to float32", UserWarning)
        if backend == "gymnasium":
            import gymnasium as gym

            envs = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="vector_entry_point")
            return envs, envs.reset(seed=seed)[0], f"gymnasium {gym.__version__} vector_entry_point"
        import envpool

        envs = envpool.make_gymnasium("CartPole-v1", num_envs=n, seed=seed)
        return envs, envs.reset()[0], f"envpool {envpool.__version__}"


def build_simulator(backend, env_id, n, k, device, seed):
    """What a script with a CPU simulator does each step: the observation copied to the device, the policy
    there, the action copied back for the simulator, and the step's results copied into the rollout."""
    _, _, agent, policy = seeded(env_id, n, k, device, seed)
    envs, obs, variant = make_simulator(backend, n, seed)
    rollout = script.Rollout(k, n, CartPole.n_obs, device)
    rollout.obs[-1] = torch.as_tensor(obs, device=device)

    def collect():
        rollout.obs[0] = rollout.obs[-1]
        rollout.dones[0] = rollout.dones[-1]
        for t in range(k):
            action, logprob, value = policy(rollout.obs[t])
            next_obs, reward, terminated, truncated, _ = envs.step(action.cpu().numpy())
            rollout.actions[t] = action
            rollout.logprobs[t] = logprob
            rollout.values[t] = value
            rollout.rewards[t] = torch.as_tensor(reward, device=device)
            rollout.obs[t + 1] = torch.as_tensor(next_obs, device=device)
            rollout.dones[t + 1] = torch.as_tensor(terminated | truncated, device=device)

    return SimpleNamespace(collect=collect, sync=synchronizer(device), rollout=rollout, net=agent.net,
                           warmup_calls=WARMUP_CALLS, profiled=True, variant=variant)  # fmt: skip


def build_jax(backend, env_id, n, k, device, seed):
    """The script's network (its weights, from the same seed) and CartPole (or a heavier one) with the script's
    Envs semantics (same-step auto-reset with fresh noise drawn for every env every step, the time limit, the
    episode sums), K steps as one jitted lax.scan whose outputs are the trajectory."""
    import jax
    import jax.numpy as jnp

    jax_device = jax.devices(jax_platform(device))[0]
    net = seeded(env_id, n, k, device, seed)[2].net
    params = jax.device_put({name: p.detach().cpu().numpy() for name, p in net.state_dict().items()}, jax_device)
    c = ENVS[env_id]

    def mlp(params, prefix, x):
        # Linear layers 0, 2, 4 of the script's nn.Sequential, tanh between; full float32 matmuls, as torch's.
        for i in (0, 2, 4):
            x = jnp.dot(x, params[f"{prefix}.{i}.weight"].T, precision=jax.lax.Precision.HIGHEST)
            x = x + params[f"{prefix}.{i}.bias"]
            x = jnp.tanh(x) if i < 4 else x
        return x

    def physics(state, action):  # CartPole.step, its substeps unrolled as there, through its substep
        x, x_dot, theta, theta_dot = jnp.moveaxis(state.reshape(n, 4, c.copies), 1, 0)
        force = jnp.where(action == 1, c.force_mag, -c.force_mag).astype(jnp.float32)[:, None]
        for _ in range(c.substeps):
            x, x_dot, theta, theta_dot = c.substep(x, x_dot, theta, theta_dot, force, jnp.cos(theta), jnp.sin(theta))
        terminated = ((jnp.abs(x) > c.x_threshold) | (jnp.abs(theta) > c.theta_threshold)).any(-1)
        return jnp.concatenate((x, x_dot, theta, theta_dot), -1), jnp.ones(n, jnp.float32), terminated

    def initial(key):  # CartPole.initial of uniform noise
        return c.initial(jax.random.uniform(key, (n, c.n_noise), dtype=jnp.float32))

    def env_step(params, carry, _):
        state, elapsed, episode_return, ended, key = carry
        key, key_action, key_reset = jax.random.split(key, 3)
        obs = c.observe(state)
        logits, value = mlp(params, "actor", obs), mlp(params, "critic", obs)[:, 0]
        action = jax.random.categorical(key_action, logits)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], 1)[:, 0]
        state, reward, terminated = physics(state, action)
        elapsed = elapsed + 1
        episode_return = episode_return + reward
        done = terminated | (elapsed >= c.max_episode_steps)
        state = jnp.where(done[:, None], initial(key_reset), state)
        ended = ended + jnp.stack((done.astype(jnp.float32), episode_return, elapsed.astype(jnp.float32))) * done
        elapsed = jnp.where(done, 0, elapsed)
        episode_return = jnp.where(done, 0.0, episode_return)
        # Step t of the trajectory: the observation acted on, what the policy made of it, and what the step gave.
        step = {"obs": obs, "actions": action, "logprobs": logprob, "values": value, "rewards": reward,
                "dones": done.astype(jnp.float32)}  # fmt: skip
        return (state, elapsed, episode_return, ended, key), step

    @jax.jit
    def run(params, carry):
        # The weights are arguments, not constants folded into the program.
        return jax.lax.scan(functools.partial(env_step, params), carry, None, length=k)

    with jax.default_device(jax_device):
        key, key_initial = jax.random.split(jax.random.PRNGKey(seed))
        zeros = jnp.zeros(n, jnp.float32)
        carry = (initial(key_initial), jnp.zeros(n, jnp.int32), zeros, jnp.zeros((3, n), jnp.float32), key)
    bench = SimpleNamespace(carry=jax.device_put(carry, jax_device), rollout=None, net=net, warmup_calls=WARMUP_CALLS,
                            profiled=False, variant=f"jax {jax.__version__} {jax_device.platform}")  # fmt: skip
    in_flight = deque()

    def collect():
        # Dispatch is asynchronous: wait for the call before last, so the device stays busy while the host
        # dispatches, and at most JAX_IN_FLIGHT trajectories are alive.
        if len(in_flight) >= JAX_IN_FLIGHT:
            jax.block_until_ready(in_flight.popleft())
        bench.carry, bench.rollout = run(params, bench.carry)
        in_flight.append(bench.rollout)

    def sync():
        jax.block_until_ready((bench.carry, bench.rollout))
        in_flight.clear()

    bench.collect, bench.sync = collect, sync
    return bench


def build(backend, env_id, n, k, device, seed=1):
    builder = build_torch if backend in TORCH_BACKENDS else build_jax if backend == "jax" else build_simulator
    return builder(backend, env_id, n, k, device, seed)


# --- measuring ------------------------------------------------------------------------------------------------


def count_events(events, steps):
    """Per env step, from a trace's complete events: GPU kernels run (a replayed CUDA graph's each count), CUDA
    API launch calls (a graph replay is one), and aten ops called from outside any other aten op."""
    kernels = sum(e.get("cat") == "kernel" for e in events)
    launches = sum(e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e["name"] for e in events)
    ops, ends = 0, {}
    aten = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")]
    for e in sorted(aten, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= ends.get(e.get("tid"), float("-inf")):  # not inside the last top-level op of its thread
            ops += 1
            ends[e.get("tid")] = e["ts"] + e["dur"]
    return {"kernels_per_step": kernels / steps, "launches_per_step": launches / steps,
            "aten_ops_per_step": ops / steps}  # fmt: skip


def profile_call(bench, k, device):
    """count_events over one more call, profiled with CPU and, on CUDA, GPU activities."""
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities) as prof:
        bench.collect()
        bench.sync()
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    for e in events:
        e["ts"], e["dur"], e["name"] = float(e["ts"]), float(e["dur"]), str(e["name"])
    counts = count_events(events, k)
    if device.type != "cuda":
        counts["kernels_per_step"] = counts["launches_per_step"] = None
    return counts


def run_one(backend, point, device, args, environment):
    """The record of one backend at one point (N, K, S, C)."""
    n, k, s, c = point
    env_id = heavier_cartpole(s, c) if (s, c) != (1, 1) else args.env_id
    bench = build(backend, env_id, n, k, device, args.seed)
    warmup_seconds, calls, seconds = measure(bench.collect, bench.sync, bench.warmup_calls,
                                             min_seconds=args.min_seconds)  # fmt: skip
    counts = profile_call(bench, k, device) if bench.profiled and args.kernels else {}
    return {
        "backend": backend,
        "variant": bench.variant,
        "env_id": env_id,
        "num_envs": n,
        "num_steps": k,
        "state_factor": s,
        "compute_factor": c,
        "calls": calls,
        "seconds": seconds,
        "samples_per_second": n * k * calls / seconds,
        "warmup_calls": bench.warmup_calls,
        "warmup_seconds": warmup_seconds,
        "kernels_per_step": counts.get("kernels_per_step"),
        "launches_per_step": counts.get("launches_per_step"),
        "aten_ops_per_step": counts.get("aten_ops_per_step"),
        **environment,
    }


def environment_of(device):
    """What a record says about where it ran."""
    jax = load("jax")[0]  # as in unavailable(): a broken jax install is no jax
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "torch": torch.__version__,
        "jax": jax.__version__ if jax else None,
        "torch_threads": torch.get_num_threads(),
        "date": utc_date(),
    }


# --- reporting ------------------------------------------------------------------------------------------------


# A record's point, and its names in tables and progress lines.
POINT_KEYS = ("num_envs", "num_steps", "state_factor", "compute_factor")
POINT_NAMES = ("N", "K", "S", "C")


def point_of(record):
    return tuple(record[key] for key in POINT_KEYS)


def point_text(point):
    return " ".join(f"{name}={value}" for name, value in zip(POINT_NAMES, point))


def progress_line(r):
    return (
        f"{r['backend']} {point_text(point_of(r))}: {r['samples_per_second']:,.0f} samples/s "
        f"({r['calls']} calls in {r['seconds']:.2f} s, warm-up {r['warmup_seconds']:.2f} s)"
    )


def per_step_cell(record):
    if record["kernels_per_step"] is not None:
        return f"{record['kernels_per_step']:.1f}"
    if record["aten_ops_per_step"] is not None:
        return f"{record['aten_ops_per_step']:.1f} aten ops"
    return "—"


def render_markdown(records, skipped, environment, args):
    lines = [
        "# Data-collection throughput",
        "",
        f"{args.env_id} on {environment['device_name']} ({environment['device']}), torch {environment['torch']}"
        + (f", jax {environment['jax']}" if environment["jax"] else "")
        + f", {environment['date']}. Samples/s = N*K*calls/seconds over at least {args.min_seconds} s of calls"
        " after the warm-up calls; kernels per step: GPU kernels per env step over one profiled call"
        " (on the CPU: aten ops per env step).",
        "",
        "(S, C: the heavier CartPole's state and compute factors; 1 and 1 is CartPole-v1.)",
        "",
    ]
    lines += markdown_table(
        ["backend", *POINT_NAMES, "samples/s", "calls", "warm-up s", "kernels per step"],
        [[r["backend"], *point_of(r), f"{r['samples_per_second']:,.0f}", r["calls"], f"{r['warmup_seconds']:.2f}",
          per_step_cell(r)] for r in sorted(records, key=lambda r: (BACKENDS.index(r["backend"]), point_of(r)))],
    )  # fmt: skip
    by_key = {(r["backend"], point_of(r)): r["samples_per_second"] for r in records}
    torch_backends = [b for b in TORCH_BACKENDS if any(r["backend"] == b for r in records)]
    points = sorted({p for b, p in by_key if b == "jax" and any((t, p) in by_key for t in torch_backends)})
    if points:
        rows = []
        for point in points:
            ratios = [by_key.get((b, point)) for b in torch_backends]
            rows.append([*point, *(f"{r / by_key['jax', point]:.2f}" if r else "—" for r in ratios)])
        lines += ["", "## Torch against JAX (ratio of samples/s)", ""]
        lines += markdown_table([*POINT_NAMES, *(f"{b} / jax" for b in torch_backends)], rows)
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- {what}: {why}" for what, why in skipped]
    return lines


AXIS_LABELS = {"num_envs": "envs N", "num_steps": "steps per call K", "state_factor": "state factor S",
               "compute_factor": "compute factor C"}  # fmt: skip


def render_figure(records, path, panels, environment):
    """One panel per (x_key, fixed): samples/s against x_key where the other point keys have the values in fixed,
    one line per backend (Figure 4: against num_envs; 8: num_steps; 9: state_factor, then compute_factor)."""
    fig, axes = pyplot().subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (x_key, fixed) in zip(axes[0], panels):
        lines = [(backend, f"C{i}", [(r[x_key], r["samples_per_second"]) for r in records if r["backend"] == backend
                                    and all(r[key] == value for key, value in fixed.items())])
                 for i, backend in enumerate(BACKENDS)]  # fmt: skip
        at = ", ".join(f"{name} = {fixed[key]}" for key, name in zip(POINT_KEYS, POINT_NAMES) if key in fixed)
        log_log_panel(ax, lines, AXIS_LABELS[x_key], "samples/s", f"samples/s against {AXIS_LABELS[x_key]} at {at}")
    fig.suptitle(environment["device_name"], fontsize=10)
    save_figure(fig, path)


# --- the command line -----------------------------------------------------------------------------------------


def parse_args(argv):
    parser = Parser(description=__doc__, formatter_class=Formatter)
    parser.add_argument("--envs", nargs="+", default=DEFAULT_ENVS, type=count("--envs"),
                        help="N, the envs of the N sweep (as 4096 or 2^12)")  # fmt: skip
    parser.add_argument("--steps", nargs="+", default=DEFAULT_STEPS, type=count("--steps"),
                        help="K, the steps per call of the K sweep")  # fmt: skip
    parser.add_argument("--state-factors", nargs="+", default=DEFAULT_FACTORS, type=count("--state-factors"),
                        help="S, the carts per env of the S/C sweep (powers of two)")  # fmt: skip
    parser.add_argument("--compute-factors", nargs="+", default=DEFAULT_FACTORS, type=count("--compute-factors"),
                        help="C, the Euler substeps per env step of the S/C sweep")  # fmt: skip
    parser.add_argument("--sweep", choices=("n", "k", "both", "sc"), default="both",
                        help="n: samples/s against N at K=--fixed-steps (Figure 4); k: against K at N=--fixed-envs "
                        "(Figure 8); both: n and k; sc: against S at C=1 and against C at S=1, at N=--fixed-envs and "
                        "K=--fixed-steps (Figure 9, CartPole-v1 only)")  # fmt: skip
    parser.add_argument("--fixed-steps", type=count("--fixed-steps"), default=128, help="K of the N and S/C sweeps")
    parser.add_argument("--fixed-envs", type=count("--fixed-envs"), default=4096, help="N of the K and S/C sweeps")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    parser.add_argument("--env-id", default="CartPole-v1", help=f"one of {', '.join(ENVS)}")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="timed calls repeat until this long")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the policy, the script's envs and the rollout live (JAX: the same kind)",
    )
    parser.add_argument("--seed", type=int, default=ScriptArgs.seed, help="the networks' and the envs' seed")
    parser.add_argument("--torch-threads", type=int, default=ScriptArgs.torch_threads,
                        help="torch's intra-op CPU threads, as the script's option (0: torch's default)")  # fmt: skip
    parser.add_argument("--no-kernels", dest="kernels", action="store_false",
                        help="skip the profiled call that counts kernels per step")  # fmt: skip
    parser.add_argument("--out", required=True, help="directory for collect_bench.md, .jsonl and the figures")
    args = parser.parse_args(argv)
    backends = [b for item in args.backends for b in item.split(",") if b]
    for backend in backends:
        if backend not in BACKENDS:
            fail(f"--backends {backend!r} is not one of {', '.join(BACKENDS)}")
    args.backends = [b for b in BACKENDS if b in backends]  # in BACKENDS' order, whatever the order given
    if args.env_id not in ENVS:
        fail(f"--env-id {args.env_id!r} is not one of the script's environments: {', '.join(ENVS)}")
    if args.sweep == "sc" and args.env_id != "CartPole-v1":
        fail(f"--sweep sc weighs CartPole-v1 down, not {args.env_id}")
    for factor in args.state_factors:
        if factor & (factor - 1):
            fail(f"--state-factors {factor} is not a power of two (the fused kernel holds the carts as a tile)")
    check_measuring_options(args)
    writable_folder("--out", args.out)
    return args


def sweep_points(args):
    """{(N, K, S, C): the figures it belongs to}, each point measured once even where two sweeps have it."""
    points = {}
    if args.sweep in ("n", "both"):
        for n in args.envs:
            points.setdefault((n, args.fixed_steps, 1, 1), []).append("figure4")
    if args.sweep in ("k", "both"):
        for k in args.steps:
            points.setdefault((args.fixed_envs, k, 1, 1), []).append("figure8")
    if args.sweep == "sc":
        factors = [(s, 1) for s in args.state_factors] + [(1, c) for c in args.compute_factors]
        for s, c in dict.fromkeys(factors):  # S = C = 1 is on both panels of the one figure
            points.setdefault((args.fixed_envs, args.fixed_steps, s, c), []).append("figure9")
    return points


def write_outputs(records, skipped, environment, args, figures=True):
    """The table, the records and (slower to draw) the figures of what is measured so far."""
    write_lines(os.path.join(args.out, "collect_bench.md"), render_markdown(records, skipped, environment, args))
    write_jsonl(os.path.join(args.out, "collect_bench.jsonl"), records)
    if not figures:
        return
    plain = {"state_factor": 1, "compute_factor": 1}
    if args.sweep in ("n", "both"):
        panels = [("num_envs", {"num_steps": args.fixed_steps, **plain})]
        render_figure(records, os.path.join(args.out, "figure4.png"), panels, environment)
    if args.sweep in ("k", "both"):
        panels = [("num_steps", {"num_envs": args.fixed_envs, **plain})]
        render_figure(records, os.path.join(args.out, "figure8.png"), panels, environment)
    if args.sweep == "sc":
        fixed = {"num_envs": args.fixed_envs, "num_steps": args.fixed_steps}
        panels = [("state_factor", {**fixed, "compute_factor": 1}), ("compute_factor", {**fixed, "state_factor": 1})]
        render_figure(records, os.path.join(args.out, "figure9.png"), panels, environment)


def main(argv=None):
    """Measure, write the outputs, and return (records, skipped)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    quiet()
    device, environment = args.device, environment_of(args.device)
    records, skipped = [], []
    try:
        for backend in args.backends:
            reason = unavailable(backend, args.env_id, device)
            if reason:
                print(f"skipped {backend}: {reason}", flush=True)
                skipped.append((backend, reason))
                continue
            for point, figures in sweep_points(args).items():
                where = f"{backend} {point_text(point)}"
                if backend in CPU_SIMULATORS and point[2:] != (1, 1):
                    print(f"skipped {where}: no heavier CartPole", flush=True)
                    skipped.append((where, "no heavier CartPole"))
                    continue
                record = unless_out_of_memory(lambda: run_one(backend, point, device, args, environment), device)
                if record is None:
                    print(f"skipped {where}: out of memory", flush=True)
                    skipped.append((where, "out of memory"))
                else:
                    records.append({**record, "figures": figures})
                    print(progress_line(record), flush=True)
                # A sweep cut short, even killed, keeps the table and the records of what it measured.
                write_outputs(records, skipped, environment, args, figures=False)
    finally:
        write_outputs(records, skipped, environment, args)
    print(f"wrote {args.out}/collect_bench.md, collect_bench.jsonl and the figures", flush=True)
    return records, skipped


if __name__ == "__main__":
    run_measuring_tool(lambda: main()[0])
