"""Speed records of the matrix that run.sh runs: the one reader of the record format, and the report.

    python leanrl/tools/speed_report.py DIR          render DIR/speed.md, DIR/fps.png and DIR/returns.png
    python leanrl/tools/speed_report.py render DIR   the same
    python leanrl/tools/speed_report.py done DIR     print the runs recorded ok in DIR, one name a line
    python leanrl/tools/speed_report.py append DIR --script S --mode M --seed N --log LOG --exit-code C [--side F]
                                                     append one run's record to DIR/records.jsonl

DIR/records.jsonl holds one speed record per run (see docs/contract.md), with the run's "mode", "log",
"status", "exit_code", "date" and "cpu_model" added by `append`. "status" is "ok", "failed" (the script exited
non-zero or wrote no record: the entry holds only script and seed) or "interrupted" (Ctrl-C: exit code 130; the
entry keeps the script's record, which covers the steps done). DIR/plan.txt, written by run.sh before it starts,
names every planned run as `<script>__<mode>__s<seed>`, one a line; `done` prints the same names. A record with
"steady": false (or, in old records, "fps": null) was too short to reach its steady fps window.
The other tools read records through read_records, is_ok and is_steady.
"""

import argparse
import glob
import json
import os
import re
import signal
import statistics
import sys
import time
from collections import defaultdict

from benchkit import Parser, cpu_model, fail, markdown_table, pyplot, save_figure, write_lines

# Column order and titles; "eager" is a compiled script run without flags.
MODES = {
    "baseline": "baseline",
    "eager": "no flags",
    "compile": "--compile",
    "cudagraphs": "--cudagraphs",
    "compile+cudagraphs": "both",
}
SUFFIX = "_torchcompile"
RECORDS, PLAN = "records.jsonl", "plan.txt"
NAME = re.compile(r"^(?P<script>.+)__(?P<mode>[a-z+]+)__s(?P<seed>[0-9]+)$")
# What a cell says of runs that give no steady fps, in the order the cell names them.
MARKS = ("short", "interrupted", "failed", "missing")


class RecordError(Exception):
    """Records that cannot be read; the command line turns it into one error line."""


# ---------------------------------------------------------------------------------------------------------------
# Reading records: the one place that knows the format.


def numbered_records(path):
    """(line number, record) for every record of a JSONL file of speed records, in file order; blank lines are
    skipped. RecordError names the first line that is not a JSON object."""
    records = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if not isinstance(record, dict):
                    raise RecordError(f"{path}:{n} is not a JSON record")
                records.append((n, record))
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return records


def read_records(path):
    """Every record of a JSONL file of speed records (a --speed-log file or DIR/records.jsonl), in file order."""
    return [record for _, record in numbered_records(path)]


def is_interrupted(record):
    return record.get("status") == "interrupted" or record.get("interrupted") is True


def is_ok(record):
    """The run finished: a script's own record (no "status") or a run.sh entry with status ok, not interrupted."""
    return record.get("status", "ok") == "ok" and not is_interrupted(record)


def is_steady(record):
    """Its fps is the steady window's: false for "steady": false and for old records with "fps": null."""
    return record.get("fps") is not None and record.get("steady", True) is not False


def run_name(script, mode, seed):
    """A run's name in run.sh: its log's name, a line of plan.txt and of `done`."""
    return f"{script}__{mode}__s{seed}"


def run_key(record):
    return record["script"], record["mode"], record.get("seed")


def read_runs(directory, required=True):
    """The run.sh entries of DIR/records.jsonl, checked, one per run: a run that was repeated (a failed run,
    retried on resume) counts by its latest entry. Without the file: [] unless required."""
    path = os.path.join(directory, RECORDS)
    if not os.path.isfile(path):
        if required:
            raise RecordError(f"no {RECORDS} in {directory}: run ./run.sh --out {directory} first")
        return []
    latest = {}
    for n, record in numbered_records(path):
        if not {"script", "mode", "status"} <= set(record):
            raise RecordError(f"{path}:{n} lacks script, mode or status")
        if record["mode"] not in MODES:
            raise RecordError(f"{path}:{n} has unknown mode {record['mode']!r}")
        latest[run_key(record)] = record
    return list(latest.values())


def read_plan(directory):
    """The runs that run.sh planned in DIR (DIR/plan.txt), as (script, mode, seed); [] without a plan."""
    path = os.path.join(directory, PLAN)
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    plan = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        match = NAME.match(line.strip())
        if not match or match["mode"] not in MODES:
            raise RecordError(f"{path}:{n} is not a run name <script>__<mode>__s<seed>: {line.strip()!r}")
        key = (match["script"], match["mode"], int(match["seed"]))
        if key not in plan:
            plan.append(key)
    return plan


def last_steady_record(directory, script):
    """The last record of `script` in DIR/*.jsonl that finished ok with a steady fps (the --speed-log of a
    profiled run), or None."""
    found = None
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        for record in read_records(path):
            if record.get("script") == script and is_ok(record) and is_steady(record):
                found = record
    return found


# ---------------------------------------------------------------------------------------------------------------
# done and append: what run.sh asks.


def print_done(directory):
    """The names of the runs whose latest entry is ok, once each, in the order they were recorded."""
    for record in read_runs(directory, required=False):
        if is_ok(record):
            print(run_name(*run_key(record)))


def append(directory, side, script, mode, seed, log, exit_code, stopped=False):
    """Append one run's entry to DIR/records.jsonl: the speed record the script appended to the side file
    (its --speed-log) with mode, log, status, exit code, date and CPU model added. A run that exited non-zero or
    wrote no record goes in as failed, with only its script and seed; a run stopped by Ctrl-C (exit code 130,
    a record that says "interrupted", or any non-zero exit where run.sh says Ctrl-C reached it: `stopped`) as
    interrupted, with the record of the steps done where there is one.
    Prints the outcome in a few words; returns 0 for ok, 1 otherwise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the matrix, not the writing of the record
    record = None
    if side and os.path.isfile(side):
        try:
            records = read_records(side)
        except RecordError:  # a script that died while writing: no record
            records = []
        record = records[-1] if records else None
    interrupted = exit_code == 130 or stopped and exit_code != 0 or bool(record and record.get("interrupted"))
    ok = exit_code == 0 and record is not None and not interrupted
    status = "ok" if ok else "interrupted" if interrupted else "failed"
    entry = dict(record) if record is not None and status != "failed" else {}
    entry.update(script=script, seed=seed, mode=mode, log=log, status=status, exit_code=exit_code,
                 cpu_model=cpu_model(), date=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
    if interrupted:
        entry["interrupted"] = True
    path = os.path.join(directory, RECORDS)
    try:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")  # one write of a whole line
    except OSError as e:
        fail(f"cannot append to {path}: {e.strerror or e}")
    if ok and entry.get("fps") is None:
        print("ok, no steady window (fps: null)")
    elif ok:
        short = "" if is_steady(entry) else " (short: no steady window, fps over the whole loop)"
        print(f"ok, {entry['fps']} fps{short}")
    elif interrupted:
        steps = f" after {entry['total_timesteps']} steps" if "total_timesteps" in entry else ""
        print(f"INTERRUPTED{steps} (exit code {exit_code}), see {log}")
    else:
        print(f"FAILED (exit code {exit_code}), see {log}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------------
# The report.


def algorithm(script):
    return script[: -len(SUFFIX)] if script.endswith(SUFFIX) else script


def new_cell():
    return {"fps": [], "short_fps": [], "no_window": 0, "curves": [], **dict.fromkeys(MARKS[1:], 0)}


def summarize(records, missing=()):
    """{algorithm: {mode: cell}} from the runs of each cell: "fps" the steady fps of the runs that finished,
    "short_fps" those of finished runs too short for the window (over the whole loop), "no_window" old records
    with fps null, counts of interrupted, failed and missing (planned, never recorded) runs, return curves."""
    table = defaultdict(lambda: defaultdict(new_cell))
    for r in records:
        cell = table[algorithm(r["script"])][r["mode"]]
        if is_interrupted(r):
            cell["interrupted"] += 1
            continue
        if r["status"] != "ok":
            cell["failed"] += 1
            continue
        if is_steady(r):
            cell["fps"].append(r["fps"])
        elif r.get("fps") is None:
            cell["no_window"] += 1
        else:
            cell["short_fps"].append(r["fps"])
        if r.get("return_curve"):
            cell["curves"].append(r["return_curve"])
    for script, mode, _ in missing:
        table[algorithm(script)][mode]["missing"] += 1
    return table


def distinct(records, key):
    values = sorted({str(r[key]) for r in records if r["status"] == "ok" and r.get(key) is not None})
    return ", ".join(values)


def fps_text(fps):
    """Median, and (min–max) where there are several."""
    return f"{statistics.median(fps):.0f}" + (f" ({min(fps):.0f}–{max(fps):.0f})" if len(fps) > 1 else "")


def cell_text(cell):
    """Steady fps; a cell of short runs only shows their fps, marked (short); then the runs that gave no fps."""
    parts = []
    if cell["fps"]:
        parts.append(fps_text(cell["fps"]))
        if cell["short_fps"]:
            parts.append(f"{len(cell['short_fps'])} short")
    elif cell["short_fps"]:
        text = fps_text(cell["short_fps"])
        parts.append(text[:-1] + ", short)" if text.endswith(")") else text + " (short)")
    for mark in MARKS[1:]:
        if cell[mark]:
            parts.append(f"{cell[mark]} {mark}" if parts else f"{mark} ({cell[mark]})")
    if cell["no_window"]:
        parts.append(f"{cell['no_window']} without steady window")
    return ", ".join(parts) or "–"


def speedup_text(modes):
    medians = {m: statistics.median(c["fps"]) for m, c in modes.items() if c["fps"]}
    if "baseline" not in medians or len(medians) < 2:
        return "–"
    best = max((m for m in medians if m != "baseline"), key=medians.get)
    return f"{medians[best] / medians['baseline']:.1f}x ({MODES[best]})"


def render_markdown(directory, records, table, missing):
    ok = [r for r in records if r["status"] == "ok"]
    interrupted = [r for r in records if is_interrupted(r)]
    failed = [r for r in records if r["status"] != "ok" and not is_interrupted(r)]
    dates = sorted(r["date"] for r in records if r.get("date"))
    seeds = sorted({r["seed"] for r in records if "seed" in r}, key=lambda s: (type(s).__name__, s))
    counts = f"{len(ok)} runs ok, {len(failed)} failed"
    counts += f", {len(interrupted)} interrupted" * bool(interrupted) + f", {len(missing)} missing" * bool(missing)
    lines = [
        "# Speed",
        "",
        f"- GPU: {distinct(records, 'gpu') or 'none (CPU only)'}",
        f"- CPU: {distinct(records, 'cpu_model') or 'unknown'}, {distinct(records, 'cpu_count') or '?'} cores",
        f"- torch: {distinct(records, 'torch') or '?'}",
        f"- runs: {dates[0] if dates else '?'} to {dates[-1] if dates else '?'}; rendered "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        f"- seeds: {', '.join(map(str, seeds))}; {counts}",
        "",
        "Steady-state fps (env steps per second after warm-up): median over seeds, (min–max) when there are "
        "several. Speed-up: the best mode over the baseline script.",
        "",
    ]
    rows = [[algo, *(cell_text(table[algo][m]) if m in table[algo] else "–" for m in MODES), speedup_text(table[algo])]
            for algo in sorted(table)]  # fmt: skip
    lines += markdown_table(["algorithm", *MODES.values(), "speed-up"], rows)
    cells = [c for modes in table.values() for c in modes.values()]
    notes = []
    if any(c["short_fps"] for c in cells):
        notes.append("short: the run ended before its steady window, so its fps is over the whole loop, warm-up "
                     "included; it does not count in the medians of steady runs or in the speed-up.")  # fmt: skip
    if interrupted:
        notes.append("interrupted: stopped by Ctrl-C (see Interrupted runs); its fps does not count.")
    if missing:
        notes.append("missing: planned by run.sh but never recorded (see Missing runs).")
    if any(r["mode"] in ("cudagraphs", "compile+cudagraphs") and r.get("cudagraphs") is False for r in ok):
        notes.append("Without CUDA, the --cudagraphs modes ran without CUDA graphs (their records say so).")
    for note in notes:
        lines += ["", note]
    if failed:
        rows = [[r.get(key, "?") for key in ("script", "mode", "seed", "exit_code", "log")] for r in failed]
        lines += ["", "## Failed runs", ""] + markdown_table(["script", "mode", "seed", "exit code", "log"], rows)
    if interrupted:
        lines += ["", "## Interrupted runs", "", "Stopped by Ctrl-C; each record covers the steps done. Rerun "
                  f"`./run.sh --out {directory}` with the same options to run them again.", ""]  # fmt: skip
        rows = []
        for r in interrupted:
            fps = "–" if r.get("fps") is None else f"{r['fps']:.0f}" + ("" if is_steady(r) else " (short)")
            rows.append([r["script"], r["mode"], r.get("seed", "?"), r.get("total_timesteps", "?"), fps,
                         r.get("log", "?")])  # fmt: skip
        lines += markdown_table(["script", "mode", "seed", "steps done", "fps", "log"], rows)
    if missing:
        lines += ["", "## Missing runs", "", f"Planned by run.sh ({PLAN}) but never recorded. Rerun "
                  f"`./run.sh --out {directory}` with the same options to run them.", ""]  # fmt: skip
        lines += markdown_table(["script", "mode", "seed"], missing)
    lines += ["", "![fps per mode](fps.png)", "", "![episodic return against wall-clock time](returns.png)"]
    write_lines(os.path.join(directory, "speed.md"), lines)


def render_fps(directory, table):
    """One panel per algorithm (their fps differ by orders of magnitude): a bar per mode, min–max as error bar;
    a mode with short runs only gets a hatched bar of their whole-loop fps."""
    plt = pyplot()
    algos = sorted(table)
    fig, axes = plt.subplots(1, len(algos), figsize=(0.5 + 3.2 * len(algos), 3.6), squeeze=False)
    for ax, algo in zip(axes[0], algos):
        runs = {}
        for m in MODES:
            cell = table[algo].get(m)
            if cell and (cell["fps"] or cell["short_fps"]):
                runs[m] = (cell["fps"], False) if cell["fps"] else (cell["short_fps"], True)
        for x, (m, (fps, short)) in enumerate(runs.items()):
            med = statistics.median(fps)
            ax.bar(x, med, yerr=[[med - min(fps)], [max(fps) - med]], capsize=3, color=f"C{list(MODES).index(m)}",
                   hatch="//" if short else None, alpha=0.5 if short else 1.0)  # fmt: skip
        ax.set_xticks(range(len(runs)), [MODES[m] + (" (short)" if short else "") for m, (_, short) in runs.items()],
                      rotation=30, ha="right")  # fmt: skip
        if not runs:
            ax.text(0.5, 0.5, "no successful run", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        ax.set_title(algo, fontsize=9)
    axes[0][0].set_ylabel("fps (median over seeds)")
    save_figure(fig, os.path.join(directory, "fps.png"))


def render_returns(directory, table):
    """One panel per algorithm: each run's episodic return against seconds since its start, coloured by mode."""
    plt = pyplot()
    algos = sorted(table)
    fig, axes = plt.subplots(1, len(algos), figsize=(0.5 + 3.6 * len(algos), 3.6), squeeze=False)
    for ax, algo in zip(axes[0], algos):
        for m in MODES:
            for i, curve in enumerate(table[algo][m]["curves"] if m in table[algo] else []):
                _, seconds, returns = zip(*curve)
                ax.plot(seconds, returns, color=f"C{list(MODES).index(m)}", label=MODES[m] if i == 0 else None)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no finished episodes", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(algo, fontsize=9)
        ax.set_xlabel("seconds since start")
    axes[0][0].set_ylabel("episodic return")
    save_figure(fig, os.path.join(directory, "returns.png"))


def render(directory):
    """speed.md, fps.png and returns.png from DIR/records.jsonl and DIR/plan.txt; returns speed.md's path."""
    if not os.path.isdir(directory):
        raise RecordError(f"{directory} is not a directory")
    plan = read_plan(directory)
    records = read_runs(directory, required=not plan)
    if not records and not plan:
        raise RecordError(f"{os.path.join(directory, RECORDS)} holds no records")
    recorded = {run_key(r) for r in records}
    missing = [key for key in plan if key not in recorded]
    table = summarize(records, missing)
    render_markdown(directory, records, table, missing)
    render_fps(directory, table)
    render_returns(directory, table)
    return os.path.join(directory, "speed.md")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    commands = ("render", "done", "append")
    if not argv or argv[0] not in commands + ("-h", "--help"):
        argv = ["render", *argv]  # the original form: speed_report.py DIR
    parser = Parser(prog="speed_report.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{render,done,append}")
    p = sub.add_parser("render", help="render DIR/speed.md, fps.png and returns.png (the default command)")
    p.add_argument("dir", metavar="DIR", help="a run.sh output directory holding records.jsonl")
    p = sub.add_parser("done", help="print the names of the runs recorded ok in DIR, one a line")
    p.add_argument("dir", metavar="DIR", help="a run.sh output directory (no records.jsonl yet: prints nothing)")
    p = sub.add_parser("append", help="append one run's record to DIR/records.jsonl (exit code 1: the run failed)")
    p.add_argument("dir", metavar="DIR", help="a run.sh output directory")
    p.add_argument("--script", required=True, help="the script's name, without .py")
    p.add_argument("--mode", required=True, choices=list(MODES))
    p.add_argument("--seed", required=True, type=int)
    p.add_argument("--log", required=True, help="the run's log, relative to DIR")
    p.add_argument("--exit-code", required=True, type=int, help="the script's exit code")
    p.add_argument("--side", help="the script's --speed-log file (its record; missing: the run failed)")
    # Ctrl-C while Python imports ends a script with a traceback and exit code 1, not 130.
    p.add_argument("--stopped", action="store_true", help="Ctrl-C reached the run: a non-zero exit is an interruption")
    args = parser.parse_args(argv)
    if args.command != "render" and not os.path.isdir(args.dir):
        fail(f"{args.dir} is not a directory")
    try:
        if args.command == "render":
            print(render(args.dir))
        elif args.command == "done":
            print_done(args.dir)
        else:
            return append(args.dir, args.side, args.script, args.mode, args.seed, args.log, args.exit_code,
                          args.stopped)
    except RecordError as e:
        fail(str(e))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
