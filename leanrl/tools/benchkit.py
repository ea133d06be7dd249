"""What the tools in leanrl/tools share: the one-line error and the argparse parser whose own errors are that line,
the command line's checks (counts, the device, the folders written to), the training scripts and the modules beside
them imported from leanrl/, the measuring (warm-up calls, then timed calls; a size that runs out of memory left
out), the machine a record was measured on, and the markdown tables, JSONL files and figures the tools write.

The tools run as `python leanrl/tools/<tool>.py`, which puts this folder on sys.path for `from benchkit import ...`.
torch and matplotlib are imported inside the functions that use them: speed_report.py's done and append, which
run.sh calls between runs, start without them.
"""

import argparse
import datetime
import functools
import gc
import importlib
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import warnings

# leanrl/: the training scripts and the modules they import (the harness, the env modules), on sys.path for the tools
# that load them, as it is for a script run as leanrl/<script>.py.
LEANRL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if LEANRL not in sys.path:
    sys.path.insert(0, LEANRL)
# Calls before the timing: the first compiles (jit, torch.compile) and allocates, and torch.compile makes the step
# index symbolic at its second step, within the first call. A CUDA graph needs more: see collect_warmup_calls.
WARMUP_CALLS = 2
COUNT_MAX_BITS = 40  # a count (envs, steps, calls) over 2^40 is a typo, and measuring it would never end
MAX_MIN_SECONDS = 86400  # --min-seconds: each measurement lasts this long, so a mistyped exponent would never end


# --- the command line -------------------------------------------------------------------------------------------


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse whose own errors (an unknown option, a missing value) are one error line too."""

    def error(self, message):
        fail(f"{message} (see {self.prog} --help)")


def count(option):
    """An option's type: a count given as 4096 or 2^12, which must be positive."""

    def parse(text):
        try:
            base, _, power = text.partition("^")
            base, power = int(base), int(power or 1)
        except ValueError:
            fail(f"{option} {text!r} is not a whole number (like 4096 or 2^12)")
        if base <= 0 or power < 0:
            fail(f"{option} {text} must be positive (a power: not negative)")
        if power * math.log2(max(base, 2)) > COUNT_MAX_BITS:
            fail(f"{option} {text} is over 2^{COUNT_MAX_BITS}, more than any run can count to")
        return base**power

    return parse


def torch_device(text):
    """--device as a torch.device: cpu, or cuda where CUDA is available."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        fail(f"--device {text!r}: {str(e).splitlines()[0]}")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {device} is neither cpu nor cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")
    return device


def run_measuring_tool(measure):
    """A measuring tool's entry point: measure() returns the records, written as it goes. Exit code 1 when every
    point was skipped, 130 on Ctrl-C (the outputs hold what was measured before)."""
    try:
        records = measure()
    except KeyboardInterrupt:
        print("interrupted: the outputs hold what was measured before", file=sys.stderr)
        sys.exit(130)
    if not records:
        print("error: nothing was measured: every point was skipped (the lines above say why)", file=sys.stderr)
        sys.exit(1)


def check_measuring_options(args):
    """--min-seconds, --torch-threads, --seed and --device of a tool that measures; args.device becomes a
    torch.device."""
    if args.seed < 0:  # gymnasium's and numpy's seeds
        fail(f"--seed {args.seed} must be 0 or more")
    if not 0 <= args.min_seconds < math.inf:
        fail(f"--min-seconds {args.min_seconds} must be 0 or more, and finite")
    if args.min_seconds > MAX_MIN_SECONDS:
        fail(f"--min-seconds {args.min_seconds} must be at most {MAX_MIN_SECONDS} (a day for each measurement)")
    if args.torch_threads < 0:
        fail(f"--torch-threads {args.torch_threads} must be 0 (torch's default) or positive")
    args.device = torch_device(args.device)


def writable_folder(option, folder):
    """Make the folder an option writes to, and check that a file can be written there."""
    if not folder:
        fail(f"{option} '': an empty name")
    if os.path.isfile(folder):
        fail(f"{option} {folder} is a file: it names a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        fail(f"{option} {folder} cannot be written: {e.strerror or e}")


def writable_file(option, path):
    """Before any measuring: the file an option writes at the end can be written (its folder made)."""
    if not path:
        fail(f"{option} '': an empty name")
    if os.path.isdir(path):
        fail(f"{option} {path} is a folder: it names a file")
    writable_folder(option, os.path.dirname(path) or ".")


# --- the scripts and packages measured --------------------------------------------------------------------------


@functools.cache
def load(name):
    """(the module, None), or (None, why it does not import, in one line): a package (jax, envpool and warp fail to
    import in more ways than ImportError), or leanrl/<name>.py (a script's main() not run)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:
        return None, f"`import {name}` failed: {type(e).__name__}: {e}".splitlines()[0]


def quiet():
    """What the harness silences before a script's train(), for a tool that runs the script's collect: the notes
    that are not the user's concern."""
    from harness.run import QUIET_WARNINGS

    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message)
    logging.getLogger("tensordict").setLevel(logging.WARNING)  # its INFO lines on each graph capture
    logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)


def collect_variant(script_name, compile, cudagraphs):
    """What a record says runs: a script's make_collect and the flags it is built with."""
    return " ".join([f"{script_name}.make_collect"] + ["--compile"] * compile + ["--cudagraphs"] * cudagraphs)


def collect_warmup_calls(collect, cudagraphs):
    """The calls before the timing of a script's collect: WARMUP_CALLS; captured as a CUDA graph, the graph
    module's eager calls and its capture (make_collect sets how many; tensordict versions differ by one in how they
    count them), then one replay, as the first is slower."""
    return getattr(collect, "_warmup", 3) + 2 if cudagraphs else WARMUP_CALLS


# --- measuring --------------------------------------------------------------------------------------------------


def synchronizer(device):
    """A function that waits until the device has done the work queued on it (on the CPU: nothing to wait for)."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure(call, sync, warmup_calls, min_calls=1, min_seconds=0.0):
    """(warm-up seconds, timed calls, seconds): warmup_calls calls of call(), then calls until there are at least
    min_calls and min_seconds have passed; sync() ends each part."""
    start = time.perf_counter()
    for _ in range(warmup_calls):
        call()
    sync()
    warmup_seconds = time.perf_counter() - start
    calls, start = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        call()
        calls += 1
    sync()
    return warmup_seconds, calls, time.perf_counter() - start


def out_of_memory(e):
    """Whether an exception says the device (torch's, JAX's) or the host ran out of memory."""
    import torch

    return (
        isinstance(e, (torch.OutOfMemoryError, MemoryError))
        or "RESOURCE_EXHAUSTED" in str(e)
        or "out of memory" in str(e).lower()
        or "can't allocate memory" in str(e)  # torch's CPU allocator: a plain RuntimeError
    )


def unless_out_of_memory(run, device):
    """run()'s result, or None where the device ran out of memory; its buffers and graphs are freed either way,
    before the next size is built."""
    import torch

    try:
        return run()
    except Exception as e:
        if not out_of_memory(e):
            raise
        return None
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- where a record was measured --------------------------------------------------------------------------------


def cpu_model():
    """The CPU's model name (/proc/cpuinfo's on Linux), else what platform knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def utc_date():
    """A record's date: now, in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --- outputs ----------------------------------------------------------------------------------------------------


def markdown_table(header, rows):
    """A markdown table's lines: the header, the rule under it, then a line per row of cells (an empty one: `| |`)."""

    def line(cells):
        return " ".join(["|", *(f"{cell} |" if cell != "" else "|" for cell in map(str, cells))])

    return [line(header), "|---" * len(header) + "|", *map(line, rows)]


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def pyplot():
    """matplotlib.pyplot, drawing into files (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_log_panel(ax, lines, xlabel, ylabel, title):
    """A panel of a rate against a size, both on log scales (the size's in powers of two): a line with markers per
    (label, color, [(x, y), ...]) that has points, a light grid, and a legend where there are lines."""
    for label, color, points in lines:
        if points:
            ax.plot(*zip(*sorted(points)), marker="o", label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)


def save_figure(fig, path, **layout):
    """The figure laid out tight (layout: tight_layout's options) and written as a PNG of 120 dpi, then closed."""
    plt = pyplot()
    fig.tight_layout(**layout)
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


if __name__ == "__main__":  # a user who runs it (or asks its --help) is told which files are the tools
    tools = sorted(name for name in os.listdir(os.path.dirname(os.path.abspath(__file__)))
                   if name.endswith(".py") and name != "benchkit.py")  # fmt: skip
    fail(f"benchkit.py is the module the tools share, not a tool: run one of {', '.join(tools)} (each has --help)")
