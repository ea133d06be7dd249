"""Render the speed matrix that run.sh records: DIR/speed.md, DIR/fps.png and DIR/returns.png.

    python leanrl/tools/speed_report.py DIR

DIR/records.jsonl holds one speed record per run (see docs/contract.md), with the run's "mode", "log",
"status", "date" and "cpu_model" added by run.sh; a failed run has "status": "failed" and its "exit_code".
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Column order and titles; "eager" is a compiled script run without flags.
MODES = {
    "baseline": "baseline",
    "eager": "no flags",
    "compile": "--compile",
    "cudagraphs": "--cudagraphs",
    "compile+cudagraphs": "both",
}
SUFFIX = "_torchcompile"


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_records(directory):
    path = os.path.join(directory, "records.jsonl")
    if not os.path.isfile(path):
        fail(f"no records.jsonl in {directory}: run ./run.sh --out {directory} first")
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                fail(f"{path}:{n} is not a JSON record")
            if not isinstance(record, dict) or not {"script", "mode", "status"} <= set(record):
                fail(f"{path}:{n} lacks script, mode or status")
            if record["mode"] not in MODES:
                fail(f"{path}:{n} has unknown mode {record['mode']!r}")
            records.append(record)
    if not records:
        fail(f"{path} holds no records")
    # A run that was repeated (a failed run, retried on resume) counts by its latest record.
    latest = {(r["script"], r["mode"], r.get("seed")): r for r in records}
    return list(latest.values())


def algorithm(script):
    return script[: -len(SUFFIX)] if script.endswith(SUFFIX) else script


def summarize(records):
    """{algorithm: {mode: {"fps": [...], "failed": n, "curves": [...]}}} from the runs of each cell."""
    table = defaultdict(lambda: defaultdict(lambda: {"fps": [], "failed": 0, "short": 0, "curves": []}))
    for r in records:
        cell = table[algorithm(r["script"])][r["mode"]]
        if r["status"] != "ok":
            cell["failed"] += 1
            continue
        if r.get("fps") is None:  # too short to reach the steady window
            cell["short"] += 1
        else:
            cell["fps"].append(r["fps"])
        if r.get("return_curve"):
            cell["curves"].append(r["return_curve"])
    return table


def distinct(records, key):
    values = sorted({str(r[key]) for r in records if r["status"] == "ok" and r.get(key) is not None})
    return ", ".join(values)


def cell_text(cell):
    fps, parts = cell["fps"], []
    if fps:
        parts.append(f"{statistics.median(fps):.0f}" + (f" ({min(fps):.0f}–{max(fps):.0f})" if len(fps) > 1 else ""))
    if cell["failed"]:
        parts.append(f"{cell['failed']} failed" if fps else f"failed ({cell['failed']})")
    if cell["short"]:
        parts.append(f"{cell['short']} without steady window")
    return ", ".join(parts) or "–"


def speedup_text(modes):
    medians = {m: statistics.median(c["fps"]) for m, c in modes.items() if c["fps"]}
    if "baseline" not in medians or len(medians) < 2:
        return "–"
    best = max((m for m in medians if m != "baseline"), key=medians.get)
    return f"{medians[best] / medians['baseline']:.1f}x ({MODES[best]})"


def render_markdown(directory, records, table):
    ok = [r for r in records if r["status"] == "ok"]
    dates = sorted(r["date"] for r in records if r.get("date"))
    seeds = sorted({r["seed"] for r in records if "seed" in r})
    lines = [
        "# Speed",
        "",
        f"- GPU: {distinct(records, 'gpu') or 'none (CPU only)'}",
        f"- CPU: {distinct(records, 'cpu_model') or 'unknown'}, {distinct(records, 'cpu_count') or '?'} cores",
        f"- torch: {distinct(records, 'torch') or '?'}",
        f"- runs: {dates[0] if dates else '?'} to {dates[-1] if dates else '?'}; rendered "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        f"- seeds: {', '.join(map(str, seeds))}; {len(ok)} runs ok, {len(records) - len(ok)} failed",
        "",
        "Steady-state fps (env steps per second after warm-up): median over seeds, (min–max) when there are "
        "several. Speed-up: the best mode over the baseline script.",
        "",
        "| algorithm | " + " | ".join(MODES.values()) + " | speed-up |",
        "|---" * (len(MODES) + 2) + "|",
    ]
    for algo in sorted(table):
        cells = [cell_text(table[algo][m]) if m in table[algo] else "–" for m in MODES]
        lines.append(f"| {algo} | " + " | ".join(cells) + f" | {speedup_text(table[algo])} |")
    if any(r["mode"] in ("cudagraphs", "compile+cudagraphs") and r.get("cudagraphs") is False for r in ok):
        lines += ["", "Without CUDA, the --cudagraphs modes ran without CUDA graphs (their records say so)."]
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed runs", "", "| script | mode | seed | exit code | log |", "|---|---|---|---|---|"]
        for r in failed:
            lines.append(f"| {r['script']} | {r['mode']} | {r.get('seed', '?')} | {r.get('exit_code', '?')} | "
                         f"{r.get('log', '?')} |")  # fmt: skip
    lines += ["", "![fps per mode](fps.png)", "", "![episodic return against wall-clock time](returns.png)"]
    with open(os.path.join(directory, "speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def render_fps(directory, table):
    """One panel per algorithm (their fps differ by orders of magnitude): a bar per mode, min–max as error bar."""
    algos = sorted(table)
    fig, axes = plt.subplots(1, len(algos), figsize=(0.5 + 3.2 * len(algos), 3.6), squeeze=False)
    for ax, algo in zip(axes[0], algos):
        runs = {m: table[algo][m]["fps"] for m in MODES if m in table[algo] and table[algo][m]["fps"]}
        medians = [statistics.median(fps) for fps in runs.values()]
        spread = [[med - min(fps) for med, fps in zip(medians, runs.values())],
                  [max(fps) - med for med, fps in zip(medians, runs.values())]]  # fmt: skip
        colors = [f"C{list(MODES).index(m)}" for m in runs]
        ax.bar(range(len(runs)), medians, yerr=spread, capsize=3, color=colors)
        ax.set_xticks(range(len(runs)), [MODES[m] for m in runs], rotation=30, ha="right")
        if not runs:
            ax.text(0.5, 0.5, "no successful run", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        ax.set_title(algo, fontsize=9)
    axes[0][0].set_ylabel("fps (median over seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "fps.png"), dpi=120)
    plt.close(fig)


def render_returns(directory, table):
    """One panel per algorithm: each run's episodic return against seconds since its start, coloured by mode."""
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
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "returns.png"), dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", metavar="DIR", help="a run.sh output directory holding records.jsonl")
    args = parser.parse_args(argv)
    records = load_records(args.dir)
    table = summarize(records)
    render_markdown(args.dir, records, table)
    render_fps(args.dir, table)
    render_returns(args.dir, table)
    print(os.path.join(args.dir, "speed.md"))


if __name__ == "__main__":
    main()
