"""Where the time goes: an RL-Scope-style breakdown of the traces that --profile-dir writes.

    python leanrl/tools/breakdown.py DIR [DIR ...] --out OUT

For each DIR/*.trace.json: time per env step in each phase (env_step, policy, data, update, other, and the
loop outside them), split into layers: Python, framework C++, CUDA API, GPU kernels and the part of the GPU
time that overlaps CPU work; plus framework op calls, CUDA launches and synchronisations per env step, and the
heaviest GPU kernels by name.
Writes OUT/breakdown.md and OUT/breakdown.png. The method is in docs/profiling.md.
"""

import bisect
import glob
import json
import os
import time
from collections import defaultdict

import speed_report  # beside this file: the reader of the speed records
from benchkit import Parser, fail, markdown_table, pyplot, save_figure, writable_folder, write_lines

PHASES = ("env_step", "policy", "data", "update", "other")
OUTSIDE = "outside phases"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CUDA_API_CATEGORIES = ("cuda_runtime", "cuda_driver")
COLUMNS = ("wall", "python", "framework", "cuda_api", "gpu", "gpu_overlap", "ops", "launches", "syncs")
HEADERS = {
    "wall": "wall",
    "python": "Python",
    "framework": "framework C++",
    "cuda_api": "CUDA API",
    "gpu": "GPU kernels",
    "gpu_overlap": "GPU overlapped",
    "ops": "op calls",
    "launches": "CUDA launches",
    "syncs": "syncs",
}
HEAVIEST_KERNELS, KERNEL_NAME_CHARS = 12, 90
COLORS = {"python": "#4c72b0", "framework": "#dd8452", "cuda_api": "#c44e52", "gpu_overlap": "#55a868",
          "gpu_wait": "#8c8c8c"}  # fmt: skip


def union(intervals):
    """Merge (start, end) intervals into a sorted list of disjoint ones."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def covered(segments, merged):
    """For each of the sorted disjoint segments, how much of it the sorted disjoint intervals cover."""
    out, j = [], 0
    for seg_start, seg_end in segments:
        while j < len(merged) and merged[j][1] <= seg_start:
            j += 1
        total, k = 0.0, j
        while k < len(merged) and merged[k][0] < seg_end:
            total += min(seg_end, merged[k][1]) - max(seg_start, merged[k][0])
            k += 1
        out.append(total)
    return out


def split(phases):
    """Cut the profiled loop into segments, each labelled by the innermost phase open in it, or OUTSIDE in the
    gaps between phases; together they cover the span from the first phase start to the last phase end."""
    segments, labels, open_phases = [], [], []  # open_phases: a stack of (end, name), innermost last
    cursor = min(e["ts"] for e in phases)

    def cut(until):
        nonlocal cursor
        if until > cursor:
            segments.append((cursor, until))
            labels.append(open_phases[-1][1] if open_phases else OUTSIDE)
            cursor = until

    for e in sorted(phases, key=lambda e: (e["ts"], -e["dur"])):
        while open_phases and open_phases[-1][0] <= e["ts"]:
            cut(open_phases[-1][0])
            open_phases.pop()
        cut(e["ts"])
        # a scope cannot outlive its parent; clip the rounding of the trace's timestamps
        end = min(e["ts"] + e["dur"], open_phases[-1][0]) if open_phases else e["ts"] + e["dur"]
        open_phases.append((end, e["name"]))
    while open_phases:
        cut(open_phases[-1][0])
        open_phases.pop()
    return segments, labels


def top_level(ops):
    """Per thread, the ops not nested inside another op of that thread (the calls into the framework), sorted."""
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[e.get("tid")].append(e)
    calls = {}
    for tid, events in by_thread.items():
        calls[tid], end = [], float("-inf")
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] >= end:
                calls[tid].append(e)
                end = e["ts"] + e["dur"]
    return calls


def is_sync(e, copies):
    """Whether a CUDA API call makes the CPU wait for the GPU: synchronisations, synchronous copies, and
    asynchronous copies into pageable host memory (`.cpu()`, `.item()`), which return only once done."""
    name = e["name"]
    if "Synchronize" in name:
        return True
    if name.startswith(("cudaMemcpy", "cuMemcpy")):
        copy = copies.get(e["args"].get("correlation"), "")
        return "Async" not in name or ("DtoH" in copy and "Pageable" in copy)
    return False


def load_trace(path):
    try:
        with open(path) as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
        for e in events:
            e["ts"], e["dur"], e["name"] = float(e["ts"]), float(e["dur"]), str(e["name"])
            if not isinstance(e.setdefault("args", {}), dict):
                raise TypeError(f"event {e['name']!r} has args that are not an object")
        steps_per_call = int(trace.get("env_steps_per_call", 1))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        fail(f"cannot read trace {path}: {type(e).__name__}: {e}")
    return trace, events, steps_per_call


def load_record(directory, script):
    """The last successful speed record of `script`, with a steady fps, in DIR/*.jsonl (the --speed-log of the
    profiled run), read by speed_report.py, the one reader of the record format; None if there is none."""
    try:
        return speed_report.last_steady_record(directory, script)
    except speed_report.RecordError as e:
        fail(str(e))


def analyze(path):
    """Per-phase, per-layer times and counts of one trace, in microseconds and counts per env step."""
    trace, events, steps_per_call = load_trace(path)
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in PHASES]
    n_steps = sum(e["name"] == "env_step" for e in phases)
    if n_steps == 0:
        fail(f"{path} has no env_step phase: was it written by a script's --profile-dir after warm-up?")
    segments, labels = split(phases)
    wall = segments[-1][1] - segments[0][0]

    ops = [e for e in events if e.get("cat") == "cpu_op"]
    api = [e for e in events if e.get("cat") in CUDA_API_CATEGORIES]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    api_time = union((e["ts"], e["ts"] + e["dur"]) for e in api)
    framework_or_api = union([(e["ts"], e["ts"] + e["dur"]) for e in ops + api])
    copies = {e["args"]["correlation"]: e["name"] for e in gpu if "correlation" in e["args"]}
    syncs = [e for e in api if is_sync(e, copies)]
    sync_time = union((e["ts"], e["ts"] + e["dur"]) for e in syncs)

    stats = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
    starts = [s for s, _ in segments]

    def label_at(ts):
        i = bisect.bisect_right(starts, ts) - 1
        return labels[i] if i >= 0 and ts < segments[i][1] else OUTSIDE

    for label, (start, end), api_t, fw_t in zip(
        labels, segments, covered(segments, api_time), covered(segments, framework_or_api)
    ):
        s = stats[label]
        s["wall"] += end - start
        s["python"] += end - start - fw_t
        s["framework"] += fw_t - api_t
        s["cuda_api"] += api_t
    calls = top_level(ops)
    for thread_calls in calls.values():
        for e in thread_calls:
            stats[label_at(e["ts"])]["ops"] += 1
    for e in api:
        if "Launch" in e["name"]:
            stats[label_at(e["ts"])]["launches"] += 1
    # A sync point is a framework call that waits (a `.cpu()` copies, then synchronises: one point), or a
    # synchronising API call made outside any framework call.
    sync_points, call_starts = {}, {tid: [c["ts"] for c in cs] for tid, cs in calls.items()}
    for e in syncs:
        thread_calls = calls.get(e.get("tid"), [])
        i = bisect.bisect_right(call_starts.get(e.get("tid"), []), e["ts"]) - 1
        inside = i >= 0 and e["ts"] < thread_calls[i]["ts"] + thread_calls[i]["dur"]
        sync_points[id(thread_calls[i] if inside else e)] = e["ts"]
    for ts in sync_points.values():
        stats[label_at(ts)]["syncs"] += 1
    # GPU work belongs to the phase whose CPU-side call launched it (matched by correlation id); work whose
    # launch is not in the trace (launched before the profiler started) counts as outside the phases.
    launched_at = {e["args"]["correlation"]: e["ts"] for e in api if "correlation" in e["args"]}
    gpu_by_label, kernels = defaultdict(list), defaultdict(lambda: [0.0, 0])
    for e in gpu:
        ts = launched_at.get(e["args"].get("correlation"))
        label = OUTSIDE if ts is None else label_at(ts)
        gpu_by_label[label].append((e["ts"], e["ts"] + e["dur"]))
        if e.get("cat") == "kernel":  # which kernels the GPU time is: a GEMM at a poor rate shows here
            kernel = kernels[(e["name"], label)]
            kernel[0], kernel[1] = kernel[0] + e["dur"], kernel[1] + 1
    for label, intervals in gpu_by_label.items():
        busy = union(intervals)
        # GPU time overlaps CPU work unless the CPU sits in a synchronising call waiting for it.
        waiting = length(busy) + length(sync_time) - length(union(busy + sync_time))
        stats[label]["gpu"] += length(busy)
        stats[label]["gpu_overlap"] += length(busy) - waiting

    order = [p for p in PHASES + (OUTSIDE,) if p in stats]
    devices = [d.get("name") for d in trace.get("deviceProperties", []) if d.get("name")]
    return {
        "path": path,
        "script": os.path.basename(path)[: -len(".trace.json")],
        "device": ", ".join(devices) or ("CUDA" if api or gpu else "CPU only"),
        "cuda": bool(api or gpu),
        "steps": n_steps,
        # One env_step call may step a vector of envs; scripts with several envs say so in the trace metadata.
        "env_steps_per_call": steps_per_call,
        "wall": wall,
        "phases": {p: {k: v / n_steps for k, v in stats[p].items()} for p in order},
        "total": {k: sum(stats[p][k] for p in order) / n_steps for k in COLUMNS},
        "kernels": [(name, label, total / n_steps, calls / n_steps)
                    for (name, label), (total, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])],
    }


def collect(directories):
    """One entry per trace, labelled by its DIR name (and script name when a DIR holds several)."""
    entries, names = [], [os.path.basename(os.path.normpath(d)) for d in directories]
    for directory, name in zip(directories, names):
        if not os.path.isdir(directory):
            fail(f"{directory} is not a directory")
        paths = sorted(glob.glob(os.path.join(directory, "*.trace.json")))
        if not paths:
            fail(f"no *.trace.json in {directory}: run a script with --profile-dir {directory}")
        label = name if names.count(name) == 1 else os.path.normpath(directory)
        for path in paths:
            entry = analyze(path)
            entry["label"] = label if len(paths) == 1 else f"{label}: {entry['script']}"
            entry["record"] = load_record(directory, entry["script"])
            entries.append(entry)
    return entries


def fmt(value, column, cuda):
    if column in ("gpu", "gpu_overlap", "cuda_api", "launches", "syncs") and not cuda:
        return "–"
    return f"{value:.1f}" if column in ("ops", "launches", "syncs") else f"{value:.0f}"


def profiled_fps(entry):
    return 1e6 * entry["env_steps_per_call"] * entry["steps"] / entry["wall"]


def speed_lines(entry):
    """Fps under the profiler and in the run's speed record, side by side."""
    per_step = entry["wall"] / entry["steps"]
    lines = [
        f"{entry['steps']} env steps profiled in {entry['wall'] / 1e3:.1f} ms: {per_step:.0f} µs per step, "
        f"{profiled_fps(entry):.0f} fps under the profiler."
    ]
    record = entry["record"]
    if record:
        lines.append(
            f"Speed record of the run: {record['fps']:.0f} fps in its steady window "
            f"(compile: {record['compile']}, cudagraphs: {record['cudagraphs']}); "
            f"fps under the profiler / fps in the record: {profiled_fps(entry) / record['fps']:.2f}."
        )
    else:
        lines.append("No speed record next to the trace (pass --speed-log DIR/record.jsonl with --profile-dir).")
    return lines


def render_markdown(entries, out):
    lines = [
        "# Where the time goes",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, `leanrl/tools/breakdown.py`. Times in µs per env step (one "
        "`env_step` call), counts per env step. Python + framework C++ + CUDA API = wall; GPU kernels run "
        "beside them, and *GPU overlapped* is the part of that GPU time during which the CPU was not waiting "
        "for the GPU in a synchronising call. Method: docs/profiling.md.",
    ]
    for entry in entries:
        lines += ["", f"## {entry['label']}", "", f"`{entry['path']}`, {entry['device']}.", ""]
        lines += speed_lines(entry)
        phases = [[name, *(fmt(row[c], c, entry["cuda"]) for c in COLUMNS)]
                  for name, row in [*entry["phases"].items(), ("**total**", entry["total"])]]  # fmt: skip
        lines += [""] + markdown_table(["phase", *(HEADERS[c] for c in COLUMNS)], phases)
        if entry["kernels"]:
            heaviest = [[f"`{name[:KERNEL_NAME_CHARS]}`", label, f"{us:.0f}", f"{calls:.1f}"]
                        for name, label, us, calls in entry["kernels"][:HEAVIEST_KERNELS]]  # fmt: skip
            lines += ["", f"Heaviest GPU kernels (of {len(entry['kernels'])}), µs and calls per env step:", ""]
            lines += markdown_table(["kernel", "phase", "GPU µs", "calls"], heaviest)
    rows = [["fps under the profiler", *(f"{profiled_fps(e):.0f}" for e in entries)]]
    rows.append(["fps in the speed record", *(f"{e['record']['fps']:.0f}" if e["record"] else "–" for e in entries)])
    for p in PHASES + (OUTSIDE,):
        if any(p in e["phases"] for e in entries):
            walls = [f"{e['phases'][p]['wall']:.0f}" if p in e["phases"] else "–" for e in entries]
            rows.append([f"{p}, wall", *walls])
    for c in COLUMNS:
        rows.append([f"total, {HEADERS[c]}", *(fmt(e["total"][c], c, e["cuda"]) for e in entries)])
    lines += ["", "## Side by side", ""] + markdown_table(["", *(e["label"] for e in entries)], rows)
    write_lines(os.path.join(out, "breakdown.md"), lines)


def render_figure(entries, out):
    """One panel per DIR: for each phase a bar of its CPU layers and, beside it, a bar of its GPU time."""
    phase_names = [p for p in PHASES + (OUTSIDE,) if any(p in e["phases"] for e in entries)]
    width = 3.4 + 0.6 * len(phase_names) * len(entries)  # 2.2 inches of it for the legend on the right
    plt = pyplot()
    fig, axes = plt.subplots(1, len(entries), figsize=(width, 4.5), sharey=True, squeeze=False)
    for ax, entry in zip(axes[0], entries):
        for x, p in enumerate(phase_names):
            row = entry["phases"].get(p, dict.fromkeys(COLUMNS, 0.0))
            bottom = 0.0
            for layer in ("python", "framework", "cuda_api"):
                ax.bar(x - 0.2, row[layer], 0.4, bottom=bottom, color=COLORS[layer])
                bottom += row[layer]
            if entry["cuda"]:
                ax.bar(x + 0.2, row["gpu_overlap"], 0.4, color=COLORS["gpu_overlap"], hatch="//")
                ax.bar(x + 0.2, row["gpu"] - row["gpu_overlap"], 0.4, bottom=row["gpu_overlap"],
                       color=COLORS["gpu_wait"], hatch="//")  # fmt: skip
        ax.set_xticks(range(len(phase_names)), phase_names, rotation=45, ha="right")
        ax.set_title(entry["label"], fontsize=10)
    axes[0][0].set_ylabel("µs per env step")
    names = ["Python", "framework C++", "CUDA API", "GPU, overlapping CPU work", "GPU, CPU waiting"]
    shown = len(names) if any(e["cuda"] for e in entries) else 2
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles[:shown], names[:shown], loc="center right", fontsize=8, frameon=False)
    save_figure(fig, os.path.join(out, "breakdown.png"), rect=(0, 0, 1 - 2.2 / width, 1))


def main(argv=None):
    parser = Parser(prog="breakdown.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="directories holding *.trace.json from --profile-dir")
    parser.add_argument("--out", required=True, help="directory for breakdown.md and breakdown.png")
    args = parser.parse_args(argv)
    entries = collect(args.dirs)
    writable_folder("--out", args.out)
    render_markdown(entries, args.out)
    render_figure(entries, args.out)
    print(os.path.join(args.out, "breakdown.md"))
    return entries


if __name__ == "__main__":
    main()
