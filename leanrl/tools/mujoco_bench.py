"""Throughput of batched MuJoCo envs: env steps per second over N envs, each env step the env's frame skip of MuJoCo
steps (HalfCheetah: five of 0.01 s), under uniform random actions; MuJoCo on the CPU against MuJoCo Warp on the
device, alone and inside the rollout of the training script (docs/gpu_mujoco.md, "The benchmark tool").

    gymnasium  gymnasium's env of --env-id, one process per env (one env: in this process); at most one env per CPU
               core. Physics, reward, observation; no policy
    envpool    envpool's v4 of that env (it has no v5; HalfCheetah's model file is v5's), its threads on every core
    warp       MuJoCo Warp's physics alone: the Envs of leanrl/mujoco_warp_envs.py, K calls of its simulate() (on
               CUDA: one Warp graph of the frame-skip MuJoCo steps, launched on torch's stream) with controls drawn
               once; no reward, observation, reset or policy
    rollout    ppo_continuous_action_gpu_mujoco_torchcompile.py's collect(): K steps of the policy (sampling), Warp's physics, reward, resets,
               normalisation and storage, as its train() builds them, in each of --modes: eager, compile,
               cudagraphs (one CUDA graph per call; CUDA only), compile+cudagraphs (the script's fastest)

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
import datetime
import functools
import gc
import importlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

BACKENDS = ("gymnasium", "envpool", "warp", "rollout")
# The rollout's modes: (--compile, --cudagraphs) of the script.
MODES = {"eager": (False, False), "compile": (True, False), "cudagraphs": (False, True),
         "compile+cudagraphs": (True, True)}  # fmt: skip
# The rollout's script and the MuJoCo Warp envs, imported from leanrl/ as the script imports the envs and harness.
SCRIPT_NAME, ENVS_MODULE = "ppo_continuous_action_gpu_mujoco_torchcompile", "mujoco_warp_envs"
LEANRL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if LEANRL not in sys.path:
    sys.path.insert(0, LEANRL)
DEFAULT_ENV_ID = "HalfCheetah-v5"
DEFAULT_ENVS = {"cuda": [2**i for i in range(6, 17)], "cpu": [1, 4, 16]}
WARMUP_CALLS = 2
VERSIONS = ("mujoco", "warp-lang", "mujoco-warp", "envpool", "gymnasium")


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors as the one line too
        fail(message)


def positive(option):
    """A count given as 4096 or 2^12, which must be positive."""

    def parse(text):
        try:
            base, _, power = text.partition("^")
            value = int(base) ** int(power) if power else int(base)
        except ValueError:
            fail(f"{option} {text!r} is not a whole number (like 4096 or 2^12)")
        if value <= 0:
            fail(f"{option} {text} must be positive")
        return value

    return parse


@functools.cache
def load(name):
    """(leanrl/<name>.py as a module, a script's main() not run; or None, and why it does not load)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # warp and mujoco_warp fail to import in more ways than ImportError
        return None, f"{name}.py does not load: {type(e).__name__}: {e}".splitlines()[0]


def envpool_id(env_id):
    return env_id.replace("-v5", "-v4")  # envpool's newest MuJoCo envs are v4


def unavailable(backend, n, device, env_id=DEFAULT_ENV_ID, mode=None):
    """Why a backend (in a mode) cannot run here at n envs, or None."""
    if backend == "gymnasium" and n > (os.cpu_count() or 1):
        return f"one process per env, and {n} envs are more than the {os.cpu_count()} cores"
    if backend == "envpool":
        try:
            import envpool
        except Exception as e:  # it fails to import in more ways than ImportError
            return f"`import envpool` failed: {type(e).__name__}: {e}".splitlines()[0]
        if envpool_id(env_id) not in envpool.list_all_envs():
            return f"envpool has no {envpool_id(env_id)}"
    if backend in ("warp", "rollout"):
        if MODES.get(mode, (False, False))[1] and device.type != "cuda":
            return "CUDA graphs need CUDA"
        return load(ENVS_MODULE if backend == "warp" else SCRIPT_NAME)[1]
    return None


def cpu_simulator(backend, n, env_id, seed):
    """(call(k): k env steps of n envs on the CPU under random actions, close, what runs)."""
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

    def call(k):
        for _ in range(k):
            envs.step(rng.uniform(low, high, size=(n, len(low))).astype(np.float32))

    return call, envs.close, variant


def warp_physics(n, env_id, device, seed):
    """(call(k): k env steps of Warp's physics alone, Envs.simulate, under fixed random controls)."""
    torch.manual_seed(seed)
    envs = load(ENVS_MODULE)[0].Envs(env_id, n, 0.99, device)  # gamma: the reward's normalisation, not measured
    envs.ctrl.copy_(envs.low + (envs.high - envs.low) * torch.rand(envs.ctrl.shape, device=device))

    def call(k):
        for _ in range(k):
            envs.simulate()

    return call


def rollout_collect(n, k, env_id, mode, device, seed):
    """(call(k): the script's collect() of k steps as its train() builds it in the mode, the warm-up calls it needs)."""
    script = load(SCRIPT_NAME)[0]
    compile, cudagraphs = MODES[mode]
    # Each N compiles afresh, as the script would: dynamo would otherwise recompile the policy for a dynamic N.
    torch._dynamo.reset()
    torch.manual_seed(seed)
    args = script.Args(env_id=env_id, num_envs=n, num_steps=k, compile=compile, cudagraphs=cudagraphs, seed=seed)
    envs = script.CapturableEnvs(env_id, n, args.gamma, device)
    n_obs, n_act = envs.obs.shape[1], envs.n_act
    agent = script.Agent(args, n_obs, n_act, device)
    _, _, policy, _ = script.make_update_fns(agent, args)
    rollout = script.Rollout(k, n, n_obs, n_act, device)
    rollout.obs[-1], rollout.dones[-1] = envs.obs, envs.done
    collect = script.make_collect(agent, policy, envs, rollout, args)
    # A captured collect: its eager calls and its capture (CudaGraphModule's warmup), then one replay, as the first
    # is slower.
    warmup_calls = collect._warmup + 2 if cudagraphs else WARMUP_CALLS
    return lambda k: collect(), warmup_calls


def measure(call, k, device, calls, min_seconds, warmup_calls=WARMUP_CALLS):
    """(warm-up seconds, timed calls, seconds): warmup_calls calls, then at least `calls` calls of K env steps,
    repeated until min_seconds have passed."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    for _ in range(warmup_calls):
        call(k)
    sync()
    warmup = time.perf_counter() - t
    done, t = 0, time.perf_counter()
    while done < calls or time.perf_counter() - t < min_seconds:
        call(k)
        done += 1
    sync()
    return warmup, done, time.perf_counter() - t


def run_one(backend, mode, n, device, args, environment):
    """The record of one backend (in a mode) at n envs."""
    close, warmup_calls, runs_on = (lambda: None), WARMUP_CALLS, device.type
    if backend in ("gymnasium", "envpool"):
        call, close, variant = cpu_simulator(backend, n, args.env_id, args.seed)
        runs_on = "cpu"
    elif backend == "warp":
        call, variant = warp_physics(n, args.env_id, device, args.seed), f"{ENVS_MODULE}.Envs.simulate"
    else:
        call, warmup_calls = rollout_collect(n, args.steps, args.env_id, mode, device, args.seed)
        flags = [flag for flag, on in zip(("--compile", "--cudagraphs"), MODES[mode]) if on]
        variant = " ".join([f"{SCRIPT_NAME}.make_collect", *flags])
    try:
        warmup, calls, seconds = measure(call, args.steps, device, args.calls, args.min_seconds, warmup_calls)
    finally:
        close()
    steps = n * args.steps * calls
    return {"backend": backend, "mode": mode, "variant": variant, "env_id": args.env_id, "num_envs": n,
            "steps_per_call": args.steps, "calls": calls, "seconds": seconds, "env_steps_per_second": steps / seconds,
            "runs_on": runs_on, "warmup_calls": warmup_calls, "warmup_seconds": round(warmup, 3),
            **environment}  # fmt: skip


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
        f"| {label(r, len(env_ids) > 1)} | {r['num_envs']} | {r['env_steps_per_second']:,.0f} | "
        f"{r['calls']} of {r['steps_per_call']} | {r['warmup_seconds']:.2f} | {r.get('variant', '')} |"
        for r in sorted(records, key=lambda r: (line_key(r), r["env_id"], r["num_envs"]))
    ]
    lines = [
        f"# {', '.join(env_ids)}: env steps per second",
        "",
        *environments,
        "",
        "Each env step is the env's frame skip of MuJoCo steps; random actions; env steps/s = N*K*calls/seconds "
        "over the timed calls of K env steps, after the warm-up calls (their seconds apart).",
        "",
        "| backend | N | env steps/s | calls of K | warm-up s | what runs |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    physics = {(r["env_id"], r["num_envs"]): r["env_steps_per_second"] for r in records if r["backend"] == "warp"}
    rollouts = [r for r in records if r["backend"] == "rollout" and (r["env_id"], r["num_envs"]) in physics]
    if rollouts:
        modes = [m for m in MODES if any(r["mode"] == m for r in rollouts)]
        rates = {(r["env_id"], r["num_envs"], r["mode"]): r["env_steps_per_second"] for r in rollouts}
        lines += ["", "Physics alone (warp) over the rollout, env steps/s: how much the rest of the rollout costs.", ""]
        lines += ["| env | N | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
        for env_id, n in sorted({(r["env_id"], r["num_envs"]) for r in rollouts}):
            cells = [f"{physics[env_id, n] / rates[env_id, n, m]:.2f}" if (env_id, n, m) in rates else "—"
                     for m in modes]  # fmt: skip
            lines.append(f"| {env_id} | {n} | " + " | ".join(cells) + " |")
    if skipped:
        lines += ["", "Skipped:", "", *(f"- {s}" for s in skipped)]
    return "\n".join(lines) + "\n"


def render_figure(records, path):
    """Env steps/s against N, log-log, one line per backend (and mode; and env, where there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env_ids = sorted({r["env_id"] for r in records})
    lines = {}
    for r in sorted(records, key=line_key):
        lines.setdefault(label(r, len(env_ids) > 1), []).append((r["num_envs"], r["env_steps_per_second"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, points) in enumerate(lines.items()):
        ax.plot(*zip(*sorted(points)), marker="o", label=name, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("envs N")
    ax.set_ylabel("env steps/s")
    devices = ", ".join(dict.fromkeys(r["device"] for r in records))
    ax.set_title(f"{', '.join(env_ids)} env steps/s against N ({devices})", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def write_outputs(records, skipped, args):
    with open(os.path.join(args.out, "mujoco_bench.md"), "w") as f:
        f.write(render_markdown(records, skipped))
    with open(os.path.join(args.out, "mujoco_bench.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if args.figure:
        render_figure(records, args.figure)
    written = ["mujoco_bench.md", "mujoco_bench.jsonl"] + [args.figure] * bool(args.figure)
    print(f"wrote {args.out}/{written[0]}, {', '.join(written[1:])}", file=sys.stderr)


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
    parser.add_argument("--envs", nargs="+", type=positive("--envs"),
                        help="N, as 4096 or 2^12 (default: 2^6 .. 2^16 on CUDA, 1 4 16 on the CPU)")  # fmt: skip
    parser.add_argument("--steps", type=positive("--steps"), default=16, help="env steps per call, K")
    parser.add_argument("--calls", type=positive("--calls"), default=5, help="timed calls after the warm-up, at least")
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
    if not args.min_seconds >= 0:
        fail(f"--min-seconds {args.min_seconds} must be 0 or more")
    if args.torch_threads < 0:
        fail(f"--torch-threads {args.torch_threads} must be 0 (torch's default) or positive")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as e:
        fail(f"--device {args.device!r}: {str(e).splitlines()[0]}")
    if args.device.type not in ("cpu", "cuda"):
        fail(f"--device {args.device} is neither cpu nor cuda")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")
    args.envs = args.envs or DEFAULT_ENVS[args.device.type]
    if args.figure and not args.figure.lower().endswith(".png"):
        fail(f"--figure {args.figure} is not a .png file")
    folders = [("--out", args.out)] + ([("--figure", os.path.dirname(args.figure) or ".")] if args.figure else [])
    for option, folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            fail(f"{option} {folder} cannot be written: {e.strerror or e}")
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def quiet():
    """What the harness sets before a script's train(): the notes that are not the user's concern silenced."""
    run = load("harness.run")[0]
    for message in run.QUIET_WARNINGS if run else ():
        warnings.filterwarnings("ignore", message)
    logging.getLogger("tensordict").setLevel(logging.WARNING)  # its INFO lines on each graph capture
    logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)


def main(argv=None):
    """Measure (or read) the records, write the outputs, and return the records."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_records:
        records = read_records(args.from_records)
        write_outputs(records, [], args)
        return records
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device, environment = args.device, environment_of(args.device)
    records, skipped = [], []
    open(os.path.join(args.out, "mujoco_bench.jsonl"), "w").close()
    try:
        for backend in args.backends:
            for mode in args.modes if backend == "rollout" else [None]:
                for n in args.envs:
                    what = f"{backend}{f' ({mode})' if mode else ''} (N={n})"
                    reason = unavailable(backend, n, device, args.env_id, mode)
                    if reason:
                        skipped.append(f"{what}: {reason}")
                        print(f"skipped {skipped[-1]}", file=sys.stderr, flush=True)
                        continue
                    if backend in ("warp", "rollout"):
                        quiet()
                    try:
                        records.append(run_one(backend, mode, n, device, args, environment))
                    except torch.OutOfMemoryError:
                        skipped.append(f"{what}: out of memory")
                        print(f"skipped {skipped[-1]}", file=sys.stderr, flush=True)
                        continue
                    finally:
                        gc.collect()  # this size's envs, graphs and buffers go before the next is built
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    r = records[-1]
                    print(f"{what}: {r['env_steps_per_second']:,.0f} env steps/s ({r['calls']} calls in "
                          f"{r['seconds']:.2f} s, warm-up {r['warmup_seconds']:.2f} s)", file=sys.stderr,
                          flush=True)  # fmt: skip
                    with open(os.path.join(args.out, "mujoco_bench.jsonl"), "a") as f:
                        f.write(json.dumps(r) + "\n")
    finally:  # what was measured is written, also when a size fails
        write_outputs(records, skipped, args)
    return records


if __name__ == "__main__":
    main()
