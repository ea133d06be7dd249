"""Throughput of batched MuJoCo envs: env steps per second over N envs, each env step the env's frame skip of MuJoCo
steps (HalfCheetah: five of 0.01 s), under uniform random actions; MuJoCo on the CPU against MuJoCo Warp on the
device, alone and inside the rollout of the training script (docs/gpu_mujoco.md, "The benchmark tool").

    gymnasium  gymnasium's env of --env-id, one process per env (one env: in this process); at most one env per CPU
               core. Physics, reward, observation; no policy
    envpool    envpool's v4 of that env (it has no v5; HalfCheetah's model file is v5's), its threads on every core
    warp       MuJoCo Warp's physics alone: the Envs of leanrl/mujoco_warp_envs.py, K calls of its simulate() (on
               CUDA: one Warp graph of the frame-skip MuJoCo steps, launched on torch's stream) with controls drawn
               once; no reward, observation, reset or policy
    rollout    ppo_continuous_action_gpu_mujoco_torchcompile.py's collect(): K steps of the policy (sampling),
               Warp's physics, reward, resets, normalisation and storage, as its train() builds them, in each of
               --modes: eager, compile, cudagraphs (one CUDA graph per call; CUDA only), compile+cudagraphs (the
               script's fastest)

A call is K env steps of N envs; env steps/s = N*K*calls/seconds over the timed calls (at least --calls, repeated
until --min-seconds), synchronised at the end; the warm-up calls (kernel loads, compilation, graph capture) before
them are timed apart. Each N of the compiled modes compiles afresh.

    # a look on a CPU (Warp's CPU device; its first kernel build takes minutes, then ~/.cache/warp has it)
    python leanrl/tools/mujoco_bench.py --envs 1 4 16 --backends gymnasium envpool warp rollout --modes eager \\
        --out runs/mujoco_bench --figure runs/mujoco_bench/mujoco_bench.png

    # on the GPU machine, HalfCheetah-v5 at N = 2^6 .. 2^16 (the default there), a command per part to keep each
    # well under 10 minutes (the first makes Warp build its kernels, about 80 s, unless ~/.cache/warp has them):
    # the simulators (gymnasium at N = 2^4 only: one process per core), then the rollout, compiled modes apart
    python leanrl/tools/mujoco_bench.py --backends warp envpool gymnasium --envs 2^4 2^6 2^7 2^8 2^9 2^10 2^11 \\
        2^12 2^13 2^14 2^15 2^16 --min-seconds 1 --out runs/mujoco_bench/physics
    python leanrl/tools/mujoco_bench.py --backends rollout --modes eager cudagraphs --min-seconds 1 \\
        --out runs/mujoco_bench/rollout
    python leanrl/tools/mujoco_bench.py --backends rollout --modes compile --min-seconds 1 \\
        --out runs/mujoco_bench/rollout_compile
    python leanrl/tools/mujoco_bench.py --backends rollout --modes compile+cudagraphs --min-seconds 1 \\
        --out runs/mujoco_bench/rollout_compile_cudagraphs
    # then one table and one figure of them all (no measuring)
    python leanrl/tools/mujoco_bench.py --from-records runs/mujoco_bench/*/mujoco_bench.jsonl \\
        --out runs/mujoco_bench --figure docs/img/mujoco_bench_h100.png

Writes OUT/mujoco_bench.md (a table; with warp and rollout both measured, physics alone over rollout at each N) and
OUT/mujoco_bench.jsonl (one record per measurement), and with --figure a PNG: env steps/s against N, log-log, one
line per backend (and mode). Bad input: one line on stderr, exit code 2.
"""

import argparse
import importlib.metadata
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch
from benchkit import (
    WARMUP_CALLS,
    Parser,
    check_measuring_options,
    collect_variant,
    collect_warmup_calls,
    count,
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
    writable_file,
    writable_folder,
    write_jsonl,
    write_lines,
)

BACKENDS = ("gymnasium", "envpool", "warp", "rollout")
# The rollout's modes: (--compile, --cudagraphs) of the script.
MODES = {"eager": (False, False), "compile": (True, False), "cudagraphs": (False, True),
         "compile+cudagraphs": (True, True)}  # fmt: skip
# The rollout's script and the MuJoCo Warp envs, in leanrl/: loaded where they import (they need warp).
SCRIPT_NAME, ENVS_MODULE = "ppo_continuous_action_gpu_mujoco_torchcompile", "mujoco_warp_envs"
DEFAULT_ENV_ID = "HalfCheetah-v5"
DEFAULT_ENVS = {"cuda": [2**i for i in range(6, 17)], "cpu": [1, 4, 16]}
VERSIONS = ("mujoco", "warp-lang", "mujoco-warp", "envpool", "gymnasium")


def envpool_id(env_id):
    return env_id.replace("-v5", "-v4")  # envpool's newest MuJoCo envs are v4


def unavailable(backend, n, device, env_id=DEFAULT_ENV_ID, mode=None):
    """Why a backend (in a mode) cannot run here at n envs, or None."""
    if backend == "gymnasium" and n > (os.cpu_count() or 1):
        return f"one process per env, and {n} envs are more than the {os.cpu_count()} cores"
    if backend == "envpool":
        envpool, import_failed = load("envpool")
        if import_failed:
            return import_failed
        if envpool_id(env_id) not in envpool.list_all_envs():
            return f"envpool has no {envpool_id(env_id)}"
        if n >= 2**31:  # its num_envs is a C int
            return f"envpool counts its envs in 32 bits: {n} are too many"
    if backend in ("warp", "rollout"):
        if MODES.get(mode, (False, False))[1] and device.type != "cuda":
            return "CUDA graphs need CUDA"
        if n >= 2**31:  # else the env module's refusal, which names its --num-envs
            return f"Warp counts a launch's threads in 32 bits: {n} worlds are too many"
        return load(ENVS_MODULE if backend == "warp" else SCRIPT_NAME)[1]
    return None


# --- one backend at one N: a namespace with collect() (one call of K env steps), sync(), close(), its warm-up ------


def cpu_simulator(backend, n, k, env_id, seed):
    """gymnasium's or envpool's envs of env_id on the CPU, stepped under uniform random actions."""
    rng = np.random.default_rng(seed)
    if backend == "envpool":
        import envpool

        envs = envpool.make_gymnasium(envpool_id(env_id), num_envs=n, seed=seed)
        envs.reset()
        variant = f"envpool {envpool.__version__} {envpool_id(env_id)}"
    else:
        import gymnasium as gym

        vectorization = "sync" if n == 1 else "async"
        envs = gym.make_vec(env_id, num_envs=n, vectorization_mode=vectorization)
        envs.reset(seed=seed)
        variant = f"gymnasium {gym.__version__} {env_id} {vectorization}"
    low, high = envs.single_action_space.low, envs.single_action_space.high

    def collect():
        for _ in range(k):
            envs.step(rng.uniform(low, high, size=(n, len(low))).astype(np.float32))

    return SimpleNamespace(collect=collect, sync=lambda: None, close=envs.close, warmup_calls=WARMUP_CALLS,
                           variant=variant, runs_on="cpu")  # fmt: skip


def warp_physics(n, k, env_id, device, seed):
    """Warp's physics alone, Envs.simulate, under fixed random controls."""
    torch.manual_seed(seed)
    envs = load(ENVS_MODULE)[0].Envs(env_id, n, 0.99, device)  # gamma: the reward's normalisation, not measured
    envs.ctrl.copy_(envs.low + (envs.high - envs.low) * torch.rand(envs.ctrl.shape, device=device))

    def collect():
        for _ in range(k):
            envs.simulate()

    return SimpleNamespace(collect=collect, sync=synchronizer(device), close=lambda: None, warmup_calls=WARMUP_CALLS,
                           variant=f"{ENVS_MODULE}.Envs.simulate", runs_on=device.type)  # fmt: skip


def rollout_collect(n, k, env_id, mode, device, seed):
    """The script's collect() of k steps as its train() builds it, in the mode."""
    script = load(SCRIPT_NAME)[0]
    compile, cudagraphs = MODES[mode]
    # Each N compiles afresh, as the script would: dynamo would otherwise recompile the policy for a dynamic N.
    torch._dynamo.reset()
    torch.manual_seed(seed)
    args = script.Args(env_id=env_id, num_envs=n, num_steps=k, compile=compile, cudagraphs=cudagraphs)
    envs = script.CapturableEnvs(env_id, n, args.gamma, device)
    n_obs, n_act = envs.obs.shape[1], envs.n_act
    agent = script.Agent(args, n_obs, n_act, device)
    _, _, policy, _ = script.make_update_fns(agent, args)
    rollout = script.Rollout(k, n, n_obs, n_act, device)
    rollout.obs[-1], rollout.dones[-1] = envs.obs, envs.done
    collect = script.make_collect(agent, policy, envs, rollout, args)
    return SimpleNamespace(collect=collect, sync=synchronizer(device), close=lambda: None,
                           warmup_calls=collect_warmup_calls(collect, cudagraphs),
                           variant=collect_variant(SCRIPT_NAME, compile, cudagraphs), runs_on=device.type)  # fmt: skip


def build(backend, mode, n, device, args):
    """A backend (in a mode) at n envs, its calls of --steps env steps."""
    if backend in ("gymnasium", "envpool"):
        return cpu_simulator(backend, n, args.steps, args.env_id, args.seed)
    if backend == "warp":
        return warp_physics(n, args.steps, args.env_id, device, args.seed)
    return rollout_collect(n, args.steps, args.env_id, mode, device, args.seed)


def run_one(backend, mode, n, device, args, environment):
    """The record of one backend (in a mode) at n envs."""
    bench = build(backend, mode, n, device, args)
    try:
        warmup, calls, seconds = measure(bench.collect, bench.sync, bench.warmup_calls, args.calls, args.min_seconds)
    finally:
        bench.close()
    steps = n * args.steps * calls
    return {"backend": backend, "mode": mode, "variant": bench.variant, "env_id": args.env_id, "num_envs": n,
            "steps_per_call": args.steps, "calls": calls, "seconds": seconds, "env_steps_per_second": steps / seconds,
            "runs_on": bench.runs_on, "warmup_calls": bench.warmup_calls, "warmup_seconds": round(warmup, 3),
            **environment}  # fmt: skip


def environment_of(device):
    """What a record says about where it ran."""
    versions = {}
    for package in VERSIONS:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        **versions,
        "date": utc_date(),
    }


# --- reporting ------------------------------------------------------------------------------------------------


def label(record, env=False):
    """A record's line: its backend, its mode (the rollout's), and its env where `env`."""
    return record["backend"] + (f" ({record['mode']})" if record.get("mode") else "") + f" {record['env_id']}" * env


def line_key(record):
    """The figure's and the table's order: BACKENDS, then MODES."""
    return BACKENDS.index(record["backend"]), list(MODES).index(record["mode"]) if record.get("mode") else -1


def render_markdown(records, skipped):
    environments = dict.fromkeys(
        f"{r['device']}, {r['cpu_count']} CPU cores, torch {r['torch']}, mujoco {r.get('mujoco')}, "
        f"warp-lang {r.get('warp-lang')}, mujoco-warp {r.get('mujoco-warp')}, {r['date']}"
        for r in records
    )  # fmt: skip
    env_ids = sorted({r["env_id"] for r in records})
    rows = [
        [label(r, len(env_ids) > 1), r["num_envs"], f"{r['env_steps_per_second']:,.0f}",
         f"{r['calls']} of {r['steps_per_call']}", f"{r['warmup_seconds']:.2f}", r.get("variant", "")]
        for r in sorted(records, key=lambda r: (line_key(r), r["env_id"], r["num_envs"]))
    ]  # fmt: skip
    lines = [
        f"# {', '.join(env_ids)}: env steps per second",
        "",
        *environments,
        "",
        "Each env step is the env's frame skip of MuJoCo steps; random actions; env steps/s = N*K*calls/seconds "
        "over the timed calls of K env steps, after the warm-up calls (their seconds apart).",
        "",
        *markdown_table(["backend", "N", "env steps/s", "calls of K", "warm-up s", "what runs"], rows),
    ]
    physics = {(r["env_id"], r["num_envs"]): r["env_steps_per_second"] for r in records if r["backend"] == "warp"}
    rollouts = [r for r in records if r["backend"] == "rollout" and (r["env_id"], r["num_envs"]) in physics]
    if rollouts:
        modes = [m for m in MODES if any(r["mode"] == m for r in rollouts)]
        rates = {(r["env_id"], r["num_envs"], r["mode"]): r["env_steps_per_second"] for r in rollouts}
        ratios = []
        for env_id, n in sorted({(r["env_id"], r["num_envs"]) for r in rollouts}):
            cells = [f"{physics[env_id, n] / rates[env_id, n, m]:.2f}" if (env_id, n, m) in rates else "—"
                     for m in modes]  # fmt: skip
            ratios.append([env_id, n, *cells])
        lines += ["", "Physics alone (warp) over the rollout, env steps/s: how much the rest of the rollout costs.", ""]
        lines += markdown_table(["env", "N", *modes], ratios)
    if skipped:
        lines += ["", "Skipped:", "", *(f"- {what}: {why}" for what, why in skipped)]
    return lines


def render_figure(records, path):
    """Env steps/s against N, log-log, one line per backend (and mode; and env, where there are several)."""
    env_ids = sorted({r["env_id"] for r in records})
    lines = {}
    for r in sorted(records, key=line_key):
        lines.setdefault(label(r, len(env_ids) > 1), []).append((r["num_envs"], r["env_steps_per_second"]))
    fig, ax = pyplot().subplots(figsize=(8, 5))
    devices = ", ".join(dict.fromkeys(r["device"] for r in records))
    log_log_panel(ax, [(name, f"C{i}", points) for i, (name, points) in enumerate(lines.items())], "envs N",
                  "env steps/s", f"{', '.join(env_ids)} env steps/s against N ({devices})")  # fmt: skip
    save_figure(fig, path)


def write_outputs(records, skipped, args, figure=True):
    """The table, the records and (slower to draw) the figure of what is measured so far."""
    write_lines(os.path.join(args.out, "mujoco_bench.md"), render_markdown(records, skipped))
    write_jsonl(os.path.join(args.out, "mujoco_bench.jsonl"), records)
    if figure and args.figure:
        render_figure(records, args.figure)


def read_records(paths):
    """The records of earlier runs' mujoco_bench.jsonl files, in order."""
    records = []
    for path in paths:
        try:
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        records.append(json.loads(line))
                        if not {"backend", "num_envs", "env_steps_per_second"} <= set(records[-1]):
                            raise ValueError("not a record of this tool")
        except OSError as e:
            fail(f"--from-records {path}: {e.strerror or e}")
        except ValueError as e:  # json's errors too
            fail(f"--from-records {path}, line {number}: {str(e).splitlines()[0]}")
    if not records:
        fail(f"--from-records {' '.join(paths)}: no records")
    return records


def parse_args(argv):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", type=count("--envs"),
                        help="N, as 4096 or 2^12 (default: 2^6 .. 2^16 on CUDA, 1 4 16 on the CPU)")  # fmt: skip
    parser.add_argument("--steps", type=count("--steps"), default=16, help="env steps per call, K")
    parser.add_argument("--calls", type=count("--calls"), default=5, help="timed calls after the warm-up, at least")
    parser.add_argument("--min-seconds", type=float, default=0.0, help="timed calls repeat until this long")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), help=f"any of {', '.join(BACKENDS)}")
    parser.add_argument("--modes", nargs="+", default=list(MODES), help=f"the rollout's: any of {', '.join(MODES)}")
    parser.add_argument("--env-id", default=DEFAULT_ENV_ID, help="one of the MuJoCo Warp envs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="Warp's and the rollout's (gymnasium and envpool run on the CPU)")  # fmt: skip
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op CPU threads, as the script's option (0: torch's default)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--figure", help="write a PNG of env steps/s against N here")
    parser.add_argument("--from-records", nargs="+", metavar="JSONL",
                        help="measure nothing: the table and figure of earlier runs' mujoco_bench.jsonl")  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for option, values, known in (("backend", args.backends, BACKENDS), ("mode", args.modes, MODES)):
        for value in values:
            if value not in known:
                fail(f"unknown {option} {value!r}: one of {', '.join(known)}")
    check_measuring_options(args)
    args.envs = args.envs or DEFAULT_ENVS[args.device.type]
    if args.figure and not args.figure.lower().endswith(".png"):
        fail(f"--figure {args.figure} is not a .png file")
    writable_folder("--out", args.out)
    if args.figure:
        writable_file("--figure", args.figure)
    if not args.from_records:
        # The MuJoCo Warp envs, where they load (they need warp); else gymnasium's MuJoCo envs, for its simulators.
        envs = load(ENVS_MODULE)[0]
        if envs is not None and args.env_id not in envs.ENVS:
            fail(f"--env-id {args.env_id!r} is not one of the MuJoCo Warp envs: {', '.join(envs.ENVS)}")
        if envs is None:
            import gymnasium as gym

            if args.env_id not in gym.envs.registry:
                fail(f"--env-id {args.env_id!r} is not a gymnasium environment")
    return args


def measure_all(args):
    """The records of every backend (and mode) at every N that runs here; the outputs are written after each and
    at the end."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device, environment = args.device, environment_of(args.device)
    records, skipped = [], []

    def skip(what, why):
        skipped.append((what, why))
        print(f"skipped {what}: {why}", file=sys.stderr, flush=True)

    runs = [(b, m, n) for b in args.backends for m in (args.modes if b == "rollout" else [None]) for n in args.envs]
    try:
        for backend, mode, n in runs:
            what = f"{backend}{f' ({mode})' if mode else ''} (N={n})"
            reason = unavailable(backend, n, device, args.env_id, mode)
            if reason:
                skip(what, reason)
                continue
            if backend in ("warp", "rollout"):
                quiet()
            record = unless_out_of_memory(lambda: run_one(backend, mode, n, device, args, environment), device)
            if record is None:
                skip(what, "out of memory")
            else:
                records.append(record)
                print(f"{what}: {record['env_steps_per_second']:,.0f} env steps/s ({record['calls']} calls in "
                      f"{record['seconds']:.2f} s, warm-up {record['warmup_seconds']:.2f} s)", file=sys.stderr,
                      flush=True)  # fmt: skip
            # A sweep cut short, even killed, keeps the table and the records of what it measured.
            write_outputs(records, skipped, args, figure=False)
    finally:
        write_outputs(records, skipped, args)
    return records


def main(argv=None):
    """Measure (or read) the records, write the outputs, and return the records."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_records:
        records = read_records(args.from_records)
        write_outputs(records, [], args)
    else:
        records = measure_all(args)
    written = ["mujoco_bench.md", "mujoco_bench.jsonl"] + [args.figure] * bool(args.figure)
    print(f"wrote {args.out}/{written[0]}, {', '.join(written[1:])}", file=sys.stderr)
    return records


if __name__ == "__main__":
    run_measuring_tool(main)
