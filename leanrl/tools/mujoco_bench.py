"""HalfCheetah-v4 throughput of MuJoCo on the GPU (mujoco-torch, MJX ported to PyTorch) against MuJoCo on the
CPU (gymnasium, envpool): the go/no-go measurement of issue 18. Env steps per second, each env step five MuJoCo
steps of 0.01 s (HalfCheetah-v4's frame skip) under uniform random actions; no policy, no rewards.

    gymnasium             gymnasium's HalfCheetah-v4, one process per env (one env: in this process); at most
                          one env per CPU core
    envpool               envpool's HalfCheetah-v4, its threads on every core
    mujoco-torch-eager    torch.vmap of mujoco_torch.step over N envs, eager
    mujoco-torch-compile  the same, torch.compile'd
    mujoco-torch-graph-eager  the eager step, K env steps captured as one CUDA graph (CUDA only)
    mujoco-torch-graph    the compiled step, K env steps captured as one CUDA graph (CUDA only)

The mujoco-torch backends run in each of --dtypes (float64, MJX's precision, and float32). Their constraint
solver runs a fixed number of iterations (`fixed_iterations=True`): a data-dependent loop cannot be captured, and
torch 2.13's vmap cannot trace mujoco-torch's early-exit loop.

    # on the GPU machine: the paper-style sweep
    python leanrl/tools/mujoco_bench.py --envs 1 16 256 4096 32768 131072 --out runs/mujoco_bench
    # a quick look on a CPU (slow: the eager step runs thousands of small ops)
    python leanrl/tools/mujoco_bench.py --envs 1 4 --backends gymnasium mujoco-torch-eager --calls 1 --out OUT

Writes OUT/mujoco_bench.md (a table) and OUT/mujoco_bench.jsonl (one record per measurement).
"""

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch

BACKENDS = (
    "gymnasium", "envpool", "mujoco-torch-eager", "mujoco-torch-compile", "mujoco-torch-graph-eager",
    "mujoco-torch-graph",
)  # fmt: skip
DTYPES = {"float64": torch.float64, "float32": torch.float32}
FRAME_SKIP = 5  # HalfCheetah-v4: five MuJoCo steps of 0.01 s per env step
RESET_NOISE = 0.1  # HalfCheetah-v4's reset: qpos + U(-0.1, 0.1), qvel + 0.1 * N(0, 1)
WARMUP_CALLS = 2


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors as the one line too
        fail(message)


def positive(option):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            fail(f"{option} {text!r} is not a whole number")
        if value <= 0:
            fail(f"{option} {text} must be positive")
        return value

    return parse


def unavailable(backend, n, device):
    """Why a backend cannot run here at n envs, or None."""
    if backend == "gymnasium" and n > (os.cpu_count() or 1):
        return f"one process per env, and {n} envs are more than the {os.cpu_count()} cores"
    if backend.startswith("mujoco-torch-graph") and device.type != "cuda":
        return "CUDA graphs need CUDA"
    module = {"envpool": "envpool"}.get(backend, "mujoco_torch" if backend.startswith("mujoco-torch") else None)
    if module:
        try:
            __import__(module)
        except Exception as e:  # both fail to import in more ways than ImportError
            return f"`import {module}` failed: {type(e).__name__}: {e}".splitlines()[0]
    return None


def cpu_simulator(backend, n, seed):
    """call(): K env steps of n envs on the CPU, random actions."""
    rng = np.random.default_rng(seed)
    if backend == "envpool":
        import envpool

        envs = envpool.make_gymnasium("HalfCheetah-v4", num_envs=n, seed=seed)
        envs.reset()
    else:
        import gymnasium as gym

        envs = gym.make_vec("HalfCheetah-v4", num_envs=n, vectorization_mode="sync" if n == 1 else "async")
        envs.reset(seed=seed)
    low, high = envs.single_action_space.low, envs.single_action_space.high

    def call(k):
        for _ in range(k):
            envs.step(rng.uniform(low, high, size=(n, len(low))).astype(np.float32))

    return call, envs.close


def gpu_simulator(backend, n, k, device, dtype, seed):
    """call(): K env steps of n batched HalfCheetahs with mujoco-torch, random actions drawn on the device."""
    import mujoco
    import mujoco_torch
    from etils import epath

    # The model file mujoco-torch ships for its HalfCheetah: gymnasium's half_cheetah.xml.
    xml = (epath.resource_path("mujoco_torch") / "test_data" / "halfcheetah.xml").read_text()
    model = mujoco.MjModel.from_xml_string(xml)
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    mx = mujoco_torch.device_put(model, dtype=dtype).to(device)
    dx = torch.stack([mujoco_torch.device_put(data, dtype=dtype).to(device)] * n)
    gen = torch.Generator(device=device).manual_seed(seed)
    qpos = dx.qpos + (torch.rand(dx.qpos.shape, generator=gen, device=device, dtype=dtype) * 2 - 1) * RESET_NOISE
    qvel = dx.qvel + torch.randn(dx.qvel.shape, generator=gen, device=device, dtype=dtype) * RESET_NOISE
    state = {"data": dx.replace(qpos=qpos, qvel=qvel)}

    # One MuJoCo step is what gets compiled, called FRAME_SKIP times: compiled as one function, the env step's five
    # steps made a graph five times as large, and no compile of it finished within 5.5 min on the H100.
    physics_step = torch.vmap(lambda d: mujoco_torch.step(mx, d, fixed_iterations=True))
    if backend in ("mujoco-torch-compile", "mujoco-torch-graph"):
        physics_step = torch.compile(physics_step)

    def env_step(d):
        d = d.replace(ctrl=torch.rand(d.ctrl.shape, device=device, dtype=dtype) * 2 - 1)
        for _ in range(FRAME_SKIP):
            d = physics_step(d)
        return d

    def call(k):
        for _ in range(k):
            state["data"] = env_step(state["data"])

    if not backend.startswith("mujoco-torch-graph"):
        return call, lambda: None
    # K steps into one graph, after warm-up steps: the data the graph reads is the data its
    # last step writes back.
    for _ in range(WARMUP_CALLS):
        call(1)
    static = state["data"]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph):
        out = static
        for _ in range(k):
            out = env_step(out)
        static.copy_(out)
    return lambda k: graph.replay(), lambda: None


def measure(call, k, device, calls):
    """(warm-up seconds, seconds) of WARMUP_CALLS calls, then of `calls` calls of K env steps."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    for _ in range(WARMUP_CALLS):
        call(k)
    sync()
    warmup = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(calls):
        call(k)
    sync()
    return warmup, time.perf_counter() - t


def parse_args(argv):
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", type=positive("--envs"), default=[1, 16, 256, 4096, 32768])
    parser.add_argument("--steps", type=positive("--steps"), default=16, help="env steps per call, K")
    parser.add_argument("--calls", type=positive("--calls"), default=5, help="timed calls after the warm-up")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for name, given, known in (("backend", args.backends, BACKENDS), ("dtype", args.dtypes, DTYPES)):
        for value in given:
            if value not in known:
                fail(f"unknown {name} {value!r}: one of {', '.join(known)}")
    try:
        os.makedirs(args.out, exist_ok=True)
        open(os.path.join(args.out, "mujoco_bench.jsonl"), "w").close()
    except OSError as e:
        fail(f"--out {args.out} cannot be written: {e.strerror or e}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    environment = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    records, skipped = [], []
    for backend in args.backends:
        dtypes = args.dtypes if backend.startswith("mujoco-torch") else ["float64"]  # MuJoCo's C code: float64
        for dtype in dtypes:
            for n in args.envs:
                reason = unavailable(backend, n, device)
                if reason:
                    skipped.append(f"{backend} ({dtype}, N={n}): {reason}")
                    print(f"skipped {skipped[-1]}", file=sys.stderr)
                    continue
                if backend in ("gymnasium", "envpool"):
                    call, close = cpu_simulator(backend, n, args.seed)
                else:
                    torch._dynamo.reset()  # each size compiles afresh, as a run of one size would
                    call, close = gpu_simulator(backend, n, args.steps, device, DTYPES[dtype], args.seed)
                warmup, seconds = measure(call, args.steps, device, args.calls)
                close()
                steps = n * args.steps * args.calls
                records.append({"backend": backend, "dtype": dtype, "num_envs": n, "steps_per_call": args.steps,
                                "calls": args.calls, "seconds": seconds,
                                "env_steps_per_second": steps / seconds,
                                "warmup_seconds": round(warmup, 3), **environment})  # fmt: skip
                print(f"{backend} {dtype} N={n}: {steps / seconds:.3g} env steps/s", file=sys.stderr, flush=True)
                with open(os.path.join(args.out, "mujoco_bench.jsonl"), "a") as f:
                    f.write(json.dumps(records[-1]) + "\n")
    lines = [
        "# HalfCheetah-v4 env steps per second",
        "",
        f"{environment['device']}, {environment['cpu_count']} CPU cores, torch {environment['torch']}, "
        f"{environment['date']}. Each env step is {FRAME_SKIP} MuJoCo steps; random actions; "
        f"{args.calls} timed calls of {args.steps} env steps after {WARMUP_CALLS} warm-up calls.",
        "",
        "| backend | dtype | N | env steps/s | warm-up s |",
        "|---|---|---|---|---|",
        *(f"| {r['backend']} | {r['dtype']} | {r['num_envs']} | {r['env_steps_per_second']:.3g} | "
          f"{r['warmup_seconds']:.2f} |" for r in records),  # fmt: skip
    ]
    if skipped:
        lines += ["", "Skipped:", "", *(f"- {s}" for s in skipped)]
    with open(os.path.join(args.out, "mujoco_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/mujoco_bench.md and mujoco_bench.jsonl", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
