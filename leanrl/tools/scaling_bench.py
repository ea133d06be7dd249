"""Data-parallel scaling of a training script on this machine's GPUs: the script alone (one process, no torchrun:
what a user of one GPU runs) and under torchrun on N GPUs (one rank each), every run stopped by SIGTERM after
--seconds, as Ctrl-C would stop it, or ended by its own --total-timesteps (a command without one is given 2^36 env
steps, so that --seconds ends its runs at any GPU count; a schedule over --total-timesteps, as PPO's learning-rate
annealing, then barely moves: pass your own to keep one). The numbers are the runs' speed records
(docs/contract.md): fps is the steady rate after warm-up, summed over the ranks. Without CUDA (the runs' records say
device "cpu") the counts are CPU processes, N ranks over gloo, and the lines, the table and the plot say so.

    # the PPO-on-Warp twin at 1, 2 and 4 GPUs, 16,384 worlds per rank, 60 s each
    python leanrl/tools/scaling_bench.py --gpus 1 2 4 --seconds 60 --out runs/scaling -- \\
        leanrl/ppo_continuous_action_gpu_mujoco_torchcompile.py --compile --cudagraphs --no-tensorboard

    # learning at a fixed budget: the return when the run stops, and when the mean return first reached 1443
    python leanrl/tools/scaling_bench.py --gpus 1 4 --seconds 120 --target 1443 --out runs/learning -- \\
        leanrl/ppo_continuous_action_gpu_mujoco_torchcompile.py --compile --cudagraphs --no-tensorboard

Appends each run's record, with its `gpus` and the command's arguments, to OUT/scaling.jsonl, and rewrites
OUT/scaling.md from all of that file's records: a row per script, arguments and GPU count, with the env steps/s,
the rate per GPU, the speed-up over one GPU and the efficiency (speed-up / GPUs), the warm-up and the return (a run
without a steady rate, stopped or ended in its warm-up, says which instead); and
OUT/returns.png: each run's mean return against seconds from its start (its record's return curve). Each run's
stdout and stderr go to OUT/logs/. A run that ends without a record is a row that says how it ended, and the
bench's exit code is then 1.
`--render` rewrites scaling.md and returns.png from OUT/scaling.jsonl alone (records gathered from several
machines or calls), running nothing.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

from benchkit import Parser, fail, markdown_table, pyplot, save_figure, utc_date, writable_folder, write_lines

GRACE_SECONDS = 120  # after SIGTERM: the current unit of work, the checkpoint, torchrun's teardown
HORIZON = 2**36  # env steps: no GPU count ends it within any --seconds measured so far


def parse_args():
    parser = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2],
                        help="GPU counts to run (1: no torchrun);\nwithout CUDA, CPU ranks over gloo")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0, help="stop each run after this many seconds")
    parser.add_argument("--target", type=float, help="also report when the mean return first reached this")
    parser.add_argument("--out", default="runs/scaling", help="folder of scaling.jsonl, scaling.md and logs/")
    parser.add_argument("--render", action="store_true", help="only rewrite the table and plot of OUT's records")
    parser.add_argument("command", nargs="*", help="-- SCRIPT [ARGS]: the training script and its arguments")
    args = parser.parse_args()
    if args.render:
        records = os.path.join(args.out, "scaling.jsonl")
        if not (os.path.isfile(records) and os.path.getsize(records)):
            fail(f"--render: {records}: no records to render")
        return args
    if not args.command:
        fail("-- SCRIPT [ARGS]: the training script to run (or --render)")
    if any(n < 1 for n in args.gpus):
        fail(f"--gpus {' '.join(map(str, args.gpus))}: every count must be 1 or more")
    if not args.seconds > 0:
        fail(f"--seconds {args.seconds} must be positive")
    if args.target is not None and not math.isfinite(args.target):
        fail(f"--target {args.target} must be a finite return")
    if not os.path.isfile(args.command[0]):
        fail(f"{args.command[0]}: no such training script")
    if not args.command[0].endswith(".py"):
        fail(f"{args.command[0]}: a training script is a .py file")
    with open(args.command[0], errors="replace") as f:
        one_process = "setup_distributed" not in f.read()  # a script for torchrun sets its ranks up
    if one_process and max(args.gpus) > 1:
        fail(f"{args.command[0]} runs in one process, not under torchrun: --gpus 1 only")
    writable_folder("--out", os.path.join(args.out, "logs"))
    return args


def run(command, gpus, seconds, out):
    """One run: its speed record with `gpus`, or {"failed": how it ended} (and "device": "cpu" without CUDA)."""
    script, script_args = command[0], command[1:]
    if not any(arg.split("=")[0] == "--total-timesteps" for arg in script_args):
        script_args = [*script_args, "--total-timesteps", str(HORIZON)]
    name = f"{os.path.basename(script).removesuffix('.py')}-{gpus}proc-{int(time.time())}"  # GPUs or CPU ranks
    speed_log = os.path.join(out, "logs", f"{name}.jsonl")
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={gpus}"]  # fmt: skip
    with open(os.path.join(out, "logs", f"{name}.log"), "w") as log:
        process = subprocess.Popen([*launcher, script, *script_args, "--speed-log", speed_log], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank
            try:
                process.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    record = {"failed": f"exit code {process.returncode}, no record (see {os.path.join(out, 'logs', name)}.log)"}
    if os.path.exists(speed_log) and os.path.getsize(speed_log):
        with open(speed_log) as f:
            record = json.loads(f.read().splitlines()[-1])
    else:
        import torch  # here only: the bench itself needs no torch

        if not torch.cuda.is_available():  # no record says where it ran, but without CUDA it was on the CPU
            record["device"] = "cpu"
    return {**record, "gpus": gpus, "command": " ".join([os.path.basename(script), *script_args]), "date": utc_date()}


def seconds_to(curve, target):
    """(seconds from the start, env steps) of the first curve point at or past target, or None."""
    return next(((seconds, step) for step, seconds, mean in curve if mean is not None and mean >= target), None)


def processes(n, device):
    """n processes in words: GPUs under CUDA, CPU processes (torchrun's ranks over gloo) on the CPU, and neither for
    a run that left no record to say which."""
    if device == "cuda":
        return f"{n} GPU{'s' if n > 1 else ''}"
    return f"{n} {'CPU ' if device == 'cpu' else ''}{'ranks' if n > 1 else 'process'}"


def no_steady_rate(r):
    """Why a record's fps covers its whole loop, not the steady window: how the run ended before that opened."""
    if r.get("diverged"):  # first: under torchrun a diverged run is marked interrupted too
        return f"diverged after {r['wall_seconds']:.0f} s, before its fps window opened: no steady rate"
    if r.get("interrupted"):  # by the bench's SIGTERM after --seconds
        return f"stopped in its warm-up after {r['wall_seconds']:.0f} s: no steady rate; give it more --seconds"
    return (f"ended (its --total-timesteps, {r['total_timesteps']:,} env steps) after {r['wall_seconds']:.0f} s, "
            "before its fps window opened: no steady rate; give it more --total-timesteps")  # fmt: skip


def table(records, target):
    devices = {r["device"] for r in records if "device" in r}
    # One device: the column names it and each row has a bare count; records of both (or none), each row says.
    device = devices.pop() if len(devices) == 1 else None
    header = ["command", {"cuda": "GPUs", "cpu": "CPU processes"}.get(device, "processes"), "env steps/s",
              "per GPU" if device == "cuda" else "per process", "speed-up", "efficiency", "warm-up s", "seconds",
              "return"] + ([f"s to {target:g} (after warm-up)"] if target is not None else [])  # fmt: skip
    # speed-up over the same command's one process on the same device: never a GPU's over a CPU's
    alone = {(r["command"], r.get("device")): r["fps"] for r in records if r["gpus"] == 1 and r.get("steady")}
    rows = []
    for r in sorted(records, key=lambda r: (r["command"], r.get("device", ""), r["gpus"])):
        count = r["gpus"] if device else processes(r["gpus"], r.get("device"))
        if "fps" in r and not r["steady"]:  # no steady rate to compare
            r = {**r, "fps": None, "failed": no_steady_rate(r)}
        if r.get("fps") is None:
            rows.append([r["command"], count, r["failed"]] + [""] * (len(header) - 3))
            continue
        one = alone.get((r["command"], r.get("device")))
        speedup = r["fps"] / one if one else None
        row = [r["command"], count, f"{r['fps']:,.0f}", f"{r['fps'] / r['gpus']:,.0f}",
               f"{speedup:.2f}x" if speedup else "", f"{speedup / r['gpus']:.0%}" if speedup else "",
               r["warmup_seconds"], r["wall_seconds"], r["episodic_return"]]  # fmt: skip
        if target is not None:
            reached = seconds_to(r["return_curve"], target)
            row.append(f"{reached[0]:.0f} ({reached[0] - r['warmup_seconds']:.0f})" if reached else "not reached")
        rows.append(row)
    return markdown_table(header, rows)


def command_parts(command):
    """The script, then each flag with its values: "--seed 2" is one part, so it is told from "--seed 1"."""
    parts = []
    for word in command.split():
        if word.startswith("--") or not parts:
            parts.append(word)
        else:
            parts[-1] += " " + word
    return parts


def run_labels(records):
    """Each run's label: the parts of its command that not every run shares, and its GPUs or CPU processes."""
    shared = set.intersection(*[set(command_parts(r["command"])) for r in records])
    return [", ".join([part for part in command_parts(r["command"]) if part not in shared]
                      + [processes(r["gpus"], r.get("device"))]) for r in records]  # fmt: skip


def plot_returns(records, path):
    """Mean return against seconds from the start, a line per run that has a return curve."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r, label in zip(records, run_labels(records)):
        if r.get("return_curve"):
            seconds, returns = zip(*[(t, mean) for _, t, mean in r["return_curve"] if mean is not None])
            ax.plot(seconds, returns, marker="o", markersize=3, label=label)
    ax.set_xlabel("seconds from the start (warm-up included)")
    ax.set_ylabel("mean episodic return")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=6)
    save_figure(fig, path)


def main():
    args = parse_args()
    path, failed = os.path.join(args.out, "scaling.jsonl"), 0
    for gpus in [] if args.render else args.gpus:
        record = run(args.command, gpus, args.seconds, args.out)
        failed += "failed" in record
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "fps" not in record:
            result = record["failed"]
        elif record["steady"]:
            result = f"{record['fps']:,.0f} env steps/s"
        else:
            result = f"{no_steady_rate(record)} ({record['fps']:,.0f} env steps/s over its whole loop)"
        print(f"{processes(gpus, record.get('device'))}: {result}")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    write_lines(os.path.join(args.out, "scaling.md"), table(records, args.target))
    plot_returns(records, os.path.join(args.out, "returns.png"))
    print(f"wrote {os.path.join(args.out, 'scaling.md')} and returns.png")
    return 1 if failed else 0  # a run that left no record fails the bench, as run.sh's failed runs fail it


if __name__ == "__main__":
    sys.exit(main())
