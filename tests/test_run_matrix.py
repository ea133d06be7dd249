"""run.sh and speed_report.py: the report on fixture JSONLs (short, interrupted, failed and missing runs
included), the done and append commands run.sh uses, the matrix end to end on a copy of the repository (the
SAC baseline plus a fake compiled script that fails in one mode), Ctrl-C and resume, runs on several GPUs at a
time (--gpus), bad input."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, assert_one_line_error, run_cli

REPORT = "tools/speed_report"
# Overrides --quick's horizons (they come after them) so that the SAC baseline finishes fast on a CPU.
SHORT = ["--", "--total-timesteps", "600", "--learning-starts", "100", "--batch-size", "32", "--buffer-size", "2000"]
# A stand-in for a compiled script: it records the arguments and the CUDA_VISIBLE_DEVICES it got, and fails with
# --cudagraphs alone. Its seed-1 runs reach their steady window, the others are short. With FAKE_INTERRUPT=1,
# --compile alone prints a progress line, waits FAKE_HOLD seconds and presses Ctrl-C for its whole process group
# (run.sh's too), then ends as the scripts do: a record of the steps done, marked interrupted, and exit code 130.
# With FAKE_PEER=<file> too, the run without flags prints the same line, creates the file and waits for the
# Ctrl-C, which the --compile run sends once the file is there: two runs in flight get it; with FAKE_IMPORTING=1
# it ends as a script that gets Ctrl-C while Python imports: exit code 1, no record. With FAKE_TERM=<file>, the run
# without flags creates the file and waits for a SIGTERM, which ends it as Ctrl-C does.
FAKE_RUN = """import json, os, signal, sys, time
argv = sys.argv[1:]
if "--cudagraphs" in argv and "--compile" not in argv:
    print("error: fake failure", file=sys.stderr)
    sys.exit(3)
seed = int(argv[argv.index("--seed") + 1])
record = {"script": "fake_torchcompile", "seed": seed, "fps": 100.0 * len(argv), "steady": seed == 1,
          "interrupted": False, "total_timesteps": 10000, "torch_threads": 1,
          "compile": "--compile" in argv, "cudagraphs": "--cudagraphs" in argv, "argv": argv,
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "return_curve": [[10, 0.5, -3.0], [20, 1.0, -1.0]]}
peer = os.environ.get("FAKE_PEER")
presses = "--compile" in argv and "--cudagraphs" not in argv
waits = peer and "--compile" not in argv and "--cudagraphs" not in argv
term = os.environ.get("FAKE_TERM") if "--compile" not in argv and "--cudagraphs" not in argv else None
if term:
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    open(term, "w").close()
if os.environ.get("FAKE_INTERRUPT") == "1" and (presses or waits) or term:
    print("fake_torchcompile: 1200/10000 steps, fps 99, return -1.5, eta 0.1 min", file=sys.stderr, flush=True)
    try:
        if waits:
            open(peer, "w").close()
        elif presses:
            while peer and not os.path.exists(peer):
                time.sleep(0.01)
            time.sleep(float(os.environ.get("FAKE_HOLD", "0")))
            os.killpg(0, signal.SIGINT)
        time.sleep(60)
    except KeyboardInterrupt:
        if waits and os.environ.get("FAKE_IMPORTING") == "1":
            sys.exit(1)
        record.update(interrupted=True, steady=False, total_timesteps=1200)
with open(argv[argv.index("--speed-log") + 1], "a") as f:
    f.write(json.dumps(record) + "\\n")
print(json.dumps(record))
sys.exit(130 if record["interrupted"] else 0)
"""
FAKE = 'if __name__ == "__main__":  # what tells run.sh a script from an env module\n' + textwrap.indent(FAKE_RUN, "    ")


def ok(script, mode, seed, fps, curve=()):
    return {"script": script, "mode": mode, "seed": seed, "status": "ok", "fps": fps, "gpu": "NVIDIA H100 80GB HBM3",
            "cpu_model": "Test CPU 9000", "cpu_count": 16, "torch": "2.13.0", "date": f"2026-11-2{seed} 10:00:00",
            "cudagraphs": "cudagraphs" in mode, "return_curve": list(curve)}  # fmt: skip


def failed(script, mode, seed):
    return {"script": script, "mode": mode, "seed": seed, "status": "failed", "exit_code": 1,
            "log": f"logs/{script}__{mode}__s{seed}.log"}  # fmt: skip


def table_rows(md):
    """{algorithm: [cells]} of the speed table."""
    table = md.split("| algorithm |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in (line.strip("| ").split(" | ") for line in table)}


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5_000, path


def test_report_on_fixture(tmp_path):
    sac, fast, td3 = "sac_continuous_action", "sac_continuous_action_torchcompile", "td3_continuous_action"
    records = [ok(sac, "baseline", s, fps, [[1000, 10.0 * s, -500.0], [2000, 20.0 * s, -300.0]])
               for s, fps in ((1, 100.0), (2, 120.0), (3, 110.0))]  # fmt: skip
    records += [ok(fast, "eager", 1, 130.0), ok(fast, "eager", 2, 150.0), ok(fast, "compile", 1, 300.0)]
    # a failed run retried on resume counts by its latest record
    records += [failed(fast, "compile", 2), ok(fast, "compile", 2, 320.0)]
    records += [ok(fast, "cudagraphs", 1, 500.0), failed(fast, "cudagraphs", 2)]
    records += [ok(fast, "compile+cudagraphs", s, fps, [[1000, 2.0, -400.0]]) for s, fps in ((1, 700.0), (2, 650.0))]
    records += [failed(td3, "baseline", 1), ok(f"{td3}_torchcompile", "eager", 1, None)]  # None: no steady window
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    proc = run_cli(REPORT, tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "speed.md").read_text()
    for fragment in ("GPU: NVIDIA H100 80GB HBM3", "CPU: Test CPU 9000, 16 cores", "torch: 2.13.0",
                     "2026-11-21 10:00:00 to 2026-11-23 10:00:00", "11 runs ok, 2 failed"):  # fmt: skip
        assert fragment in md
    rows = table_rows(md)
    assert "| algorithm | baseline | no flags | --compile | --cudagraphs | both | speed-up |" in md
    # median (min–max) per mode; the best mode (both, median 675) over the baseline (median 110)
    assert rows["sac_continuous_action"] == [
        "110 (100–120)", "140 (130–150)", "310 (300–320)", "500, 1 failed", "675 (650–700)", "6.1x (both)"
    ]  # fmt: skip
    assert rows["td3_continuous_action"] == ["failed (1)", "1 without steady window", "–", "–", "–", "–"]
    assert set(rows) == {"sac_continuous_action", "td3_continuous_action"}
    assert "| td3_continuous_action | baseline | 1 | 1 | logs/td3_continuous_action__baseline__s1.log |" in md
    assert f"| {fast} | cudagraphs | 2 | 1 | logs/{fast}__cudagraphs__s2.log |" in md
    assert_png(tmp_path / "fps.png")
    assert_png(tmp_path / "returns.png")


def interrupted(script, mode, seed, fps, steps, steady=True):
    """A run stopped by Ctrl-C, as append records it: the script's record of the steps done, marked."""
    return {**ok(script, mode, seed, fps), "status": "interrupted", "interrupted": True, "steady": steady,
            "total_timesteps": steps, "exit_code": 130, "log": f"logs/{script}__{mode}__s{seed}.log"}  # fmt: skip


def test_report_marks_short_interrupted_and_missing(tmp_path):
    sac, fast, td3 = "sac_continuous_action", "sac_continuous_action_torchcompile", "td3_continuous_action"
    records = [ok(sac, "baseline", 1, 100.0), {**ok(sac, "baseline", 2, 40.0), "steady": False}]
    # short runs only: their whole-loop fps, marked; they beat --compile here but never count in the speed-up
    records += [{**ok(fast, "eager", s, fps), "steady": False} for s, fps in ((1, 500.0), (2, 700.0))]
    records += [ok(fast, "compile", 1, 300.0), interrupted(fast, "compile", 2, 250.0, 1234)]
    # interrupted, then done on resume: the latest record counts
    records += [interrupted(fast, "cudagraphs", 1, 5.0, 10), ok(fast, "cudagraphs", 1, 400.0)]
    records += [interrupted(fast, "compile+cudagraphs", 1, 20.0, 50, steady=False)]
    records += [failed(fast, "compile+cudagraphs", 2)]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    modes = ("eager", "compile", "cudagraphs", "compile+cudagraphs")
    plan = [f"{sac}__baseline__s{s}" for s in (1, 2)] + [f"{fast}__{m}__s{s}" for s in (1, 2) for m in modes]
    plan += [f"{td3}__baseline__s1"]
    (tmp_path / "plan.txt").write_text("\n".join(plan) + "\n")

    proc = run_cli(REPORT, "render", tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "speed.md").read_text()
    assert "6 runs ok, 1 failed, 2 interrupted, 2 missing" in md
    rows = table_rows(md)
    assert rows["sac_continuous_action"] == [
        "100, 1 short", "600 (500–700, short)", "300, 1 interrupted", "400, 1 missing",
        "interrupted (1), 1 failed", "4.0x (--cudagraphs)",
    ]  # fmt: skip
    assert rows["td3_continuous_action"] == ["missing (1)", "–", "–", "–", "–", "–"]
    assert "short: the run ended before its steady window" in md
    assert "interrupted: stopped by Ctrl-C" in md and "missing: planned by run.sh but never recorded" in md
    assert f"| {fast} | compile+cudagraphs | 2 | 1 | logs/{fast}__compile+cudagraphs__s2.log |" in md
    interrupted_runs = md.split("## Interrupted runs", 1)[1].split("##", 1)[0]
    assert f"| {fast} | compile | 2 | 1234 | 250 | logs/{fast}__compile__s2.log |" in interrupted_runs
    assert f"| {fast} | compile+cudagraphs | 1 | 50 | 20 (short) |" in interrupted_runs
    assert f"| {fast} | cudagraphs | 1 |" not in interrupted_runs  # done on resume
    missing = md.split("## Missing runs", 1)[1].split("![", 1)[0]
    assert re.findall(r"^\| (\S+) \| (\S+) \| (\d+) \|$", missing, re.M) == [
        (fast, "cudagraphs", "2"), (td3, "baseline", "1")
    ]  # fmt: skip
    assert f"./run.sh --out {tmp_path}" in missing
    assert_png(tmp_path / "fps.png")
    assert_png(tmp_path / "returns.png")

    # done: the runs whose latest record is ok, once each
    proc = run_cli(REPORT, "done", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{sac}__baseline__s1", f"{sac}__baseline__s2", f"{fast}__eager__s1", f"{fast}__eager__s2",
        f"{fast}__compile__s1", f"{fast}__cudagraphs__s1",
    ]  # fmt: skip

    # A plan and no record yet (interrupted in its first run): every planned run is missing.
    (tmp_path / "records.jsonl").unlink()
    assert run_cli(REPORT, tmp_path).returncode == 0
    md = (tmp_path / "speed.md").read_text()
    assert "0 runs ok, 0 failed, 11 missing" in md and md.count(f"| {fast} | ") == 8


def append(out, side, code, mode="compile", seed=1, *stopped):
    return run_cli(REPORT, "append", out, "--side", side, "--script", "fake_torchcompile", "--mode", mode,
                   "--seed", seed, "--log", f"logs/{mode}__s{seed}.log", "--exit-code", code, *stopped)  # fmt: skip


def test_done_and_append(tmp_path):
    out, side = tmp_path / "out", tmp_path / "side.record"
    out.mkdir()
    proc = run_cli(REPORT, "done", out)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr  # nothing recorded yet
    record = {"script": "fake_torchcompile", "seed": 1, "fps": 123.4, "steady": True, "interrupted": False,
              "torch_threads": 4, "total_timesteps": 5000}  # fmt: skip
    side.write_text(json.dumps(record) + "\n")
    proc = append(out, side, 0)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok, 123.4 fps", proc.stderr
    entry = json.loads((out / "records.jsonl").read_text())
    assert {k: entry[k] for k in record} == record and entry["torch_threads"] == 4
    assert (entry["mode"], entry["status"], entry["exit_code"]) == ("compile", "ok", 0)
    assert entry["log"] == "logs/compile__s1.log"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", entry["date"]) and isinstance(entry["cpu_model"], str)

    side.write_text(json.dumps({**record, "steady": False}) + "\n")
    proc = append(out, side, 0, mode="eager")
    assert proc.returncode == 0 and "short" in proc.stdout
    # a non-zero exit is a failure even with a record; no record at all too
    proc = append(out, side, 3, mode="cudagraphs")
    assert proc.returncode == 1 and proc.stdout.strip() == "FAILED (exit code 3), see logs/cudagraphs__s1.log"
    proc = append(out, tmp_path / "no_such.record", 0, seed=2)
    assert proc.returncode == 1 and "FAILED (exit code 0)" in proc.stdout
    # a record cut short is no record
    side.write_text('{"script": "fake_torch')
    assert append(out, side, 0, mode="eager", seed=2).returncode == 1
    # Ctrl-C: exit code 130 and a record of the steps done; then the run done on resume
    side.write_text(json.dumps({**record, "interrupted": True, "total_timesteps": 700}) + "\n")
    proc = append(out, side, 130, mode="compile+cudagraphs")
    assert proc.returncode == 1 and proc.stdout.startswith("INTERRUPTED after 700 steps (exit code 130)")
    # Ctrl-C from run.sh while Python imported: exit code 1 and no record, an interruption all the same
    proc = append(out, tmp_path / "no_such.record", 1, "eager", 3, "--stopped")
    assert proc.returncode == 1 and proc.stdout.strip() == "INTERRUPTED (exit code 1), see logs/eager__s3.log"
    side.write_text(json.dumps(record) + "\n")
    assert append(out, side, 0, seed=2).returncode == 0

    entries = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [(e["mode"], e["seed"], e["status"]) for e in entries] == [
        ("compile", 1, "ok"), ("eager", 1, "ok"), ("cudagraphs", 1, "failed"), ("compile", 2, "failed"),
        ("eager", 2, "failed"), ("compile+cudagraphs", 1, "interrupted"), ("eager", 3, "interrupted"),
        ("compile", 2, "ok"),
    ]  # fmt: skip
    assert "fps" not in entries[2] and set(entries[2]) == {"script", "seed", "mode", "log", "status", "exit_code",
                                                           "cpu_model", "date"}  # fmt: skip
    assert entries[5]["interrupted"] is True and entries[5]["total_timesteps"] == 700 and entries[5]["exit_code"] == 130
    proc = run_cli(REPORT, "done", out)
    assert proc.stdout.splitlines() == ["fake_torchcompile__compile__s1", "fake_torchcompile__eager__s1",
                                        "fake_torchcompile__compile__s2"]  # fmt: skip


def test_report_bad_input(tmp_path):
    assert_one_line_error(run_cli(REPORT, tmp_path), "no records.jsonl")
    assert_one_line_error(run_cli(REPORT, tmp_path / "nowhere"), "nowhere", "not a directory")
    assert_one_line_error(run_cli(REPORT, "done", tmp_path / "nowhere"), "nowhere", "not a directory")  # not silence
    (tmp_path / "records.jsonl").write_text(json.dumps(ok("a", "baseline", 1, 1.0)) + "\n{not json\n")
    assert_one_line_error(run_cli(REPORT, tmp_path), "records.jsonl:2")
    assert_one_line_error(run_cli(REPORT, "done", tmp_path), "records.jsonl:2")
    (tmp_path / "records.jsonl").write_text(json.dumps(ok("a", "turbo", 1, 1.0)) + "\n")
    assert_one_line_error(run_cli(REPORT, tmp_path), "turbo")
    (tmp_path / "records.jsonl").write_text(json.dumps(ok("a", "baseline", 1, 1.0)) + "\n")
    (tmp_path / "plan.txt").write_text("a__baseline__s1\na__turbo__s1\n")
    assert_one_line_error(run_cli(REPORT, tmp_path), "plan.txt:2")
    assert_one_line_error(run_cli(REPORT), "DIR")
    assert_one_line_error(run_cli(REPORT, "done"), "DIR")
    side = tmp_path / "side.record"
    assert_one_line_error(run_cli(REPORT, "append", tmp_path, "--side", side, "--script", "a", "--mode", "turbo",
                                  "--seed", "1", "--log", "l", "--exit-code", "0"), "--mode", "turbo")  # fmt: skip
    assert_one_line_error(run_cli(REPORT, "append", tmp_path, "--script", "a", "--mode", "baseline"), "--seed")
    assert_one_line_error(append(tmp_path / "nowhere", side, 0), "nowhere")
    assert (tmp_path / "records.jsonl").read_text().count("\n") == 1  # nothing appended


@pytest.fixture
def repo(tmp_path):
    """A copy of the repository's run.sh, tools, harness and SAC baseline, plus the fake compiled script and an env
    module."""
    root = tmp_path / "repo"
    (root / "leanrl").mkdir(parents=True)
    shutil.copy(ROOT / "run.sh", root)
    shutil.copytree(ROOT / "leanrl" / "tools", root / "leanrl" / "tools")
    shutil.copytree(ROOT / "leanrl" / "harness", root / "leanrl" / "harness")
    shutil.copy(ROOT / "leanrl" / "sac_continuous_action.py", root / "leanrl")
    (root / "leanrl" / "fake_torchcompile.py").write_text(FAKE)
    # An env module beside the scripts (as envpool_atari.py): no entry point, so run.sh's discovery leaves it out.
    (root / "leanrl" / "fake_envs.py").write_text('"""Envs the scripts import."""\n\nNUM_ENVS = 4\n')
    return root


def run_sh(root, *argv, **env):
    """run.sh in a session of its own: a Ctrl-C that the fake script sends its process group stays there. An env
    variable given as None is unset."""
    env = {k: v for k, v in {**os.environ, "PYTHON": sys.executable, **env}.items() if v is not None}
    return subprocess.run([str(root / "run.sh"), *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=600, start_new_session=True)  # fmt: skip


def read_records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_matrix_end_to_end_and_resume(repo, tmp_path):
    out = tmp_path / "out"
    proc = run_sh(repo, "--quick", "--scripts", "sac_continuous_action,fake_torchcompile", "--out", out, *SHORT)
    # One run failed: it is recorded, the matrix went on, and run.sh says so in its exit code.
    assert proc.returncode == 1, proc.stderr
    records = read_records(out)
    assert [(r["script"], r["mode"], r["status"]) for r in records] == [
        ("sac_continuous_action", "baseline", "ok"),
        ("fake_torchcompile", "eager", "ok"),
        ("fake_torchcompile", "compile", "ok"),
        ("fake_torchcompile", "cudagraphs", "failed"),
        ("fake_torchcompile", "compile+cudagraphs", "ok"),
    ]
    sac, eager, compiled, failing, both = records
    assert sac["fps"] > 0 and sac["total_timesteps"] == 600 and sac["seed"] == 1 and sac["exit_code"] == 0
    assert failing["exit_code"] == 3 and "fake failure" in (out / failing["log"]).read_text()
    for r in records:
        assert (out / r["log"]).is_file() and r["log"] == f"logs/{r['script']}__{r['mode']}__s1.log"
    # mode flags, then the seed, then the generic --quick horizon of an unknown script, then the pass-through
    assert both["argv"][:6] == ["--compile", "--cudagraphs", "--seed", "1", "--total-timesteps", "10000"]
    assert eager["argv"][2:4] == ["--total-timesteps", "10000"] and eager["argv"][4:-2] == SHORT[1:]
    assert compiled["argv"][0] == "--compile" and "--cudagraphs" not in compiled["argv"]
    # one run at a time (no --gpus): CUDA_VISIBLE_DEVICES as run.sh found it
    assert {r["cuda_visible_devices"] for r in (eager, compiled, both)} == {os.environ.get("CUDA_VISIBLE_DEVICES")}
    # The plan, written before the first run; each run's start, outcome and, while runs are left, the matrix's ETA.
    names = ["sac_continuous_action__baseline__s1"] + [f"fake_torchcompile__{r['mode']}__s1" for r in records[1:]]
    assert (out / "plan.txt").read_text().splitlines() == names
    assert "run.sh: 5 runs into" in proc.stdout and "0 done before, 5 to run" in proc.stdout
    assert f"[1/5] {names[0]}: running, log in logs/{names[0]}.log" in proc.stdout
    assert re.search(rf"^\[2/5\] {names[1]}: ok, {eager['fps']} fps, took \w+; 3 to run, at least about \w+ left$", proc.stdout,
                     re.M)  # fmt: skip
    assert re.search(rf"^\[5/5\] {re.escape(names[4])}: ok, {both['fps']} fps, took \w+$", proc.stdout, re.M)

    md = (out / "speed.md").read_text()
    rows = table_rows(md)
    assert rows["sac_continuous_action"][0] == f"{sac['fps']:.0f}"
    fps = [f"{r['fps']:.0f}" for r in (eager, compiled, both)]
    assert rows["fake"][:5] == ["–", fps[0], fps[1], "failed (1)", fps[2]]
    assert "## Missing runs" not in md and "## Interrupted runs" not in md
    assert_png(out / "fps.png")
    assert_png(out / "returns.png")

    # Resume, this time discovering the scripts: the finished runs are skipped, the failed one runs again.
    sac_log = out / sac["log"]
    stamp = sac_log.stat().st_mtime_ns
    proc = run_sh(repo, "--quick", "--out", out, *SHORT)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("skipped") == 4 and "[3/5] fake_torchcompile__cudagraphs__s1: FAILED" in proc.stdout
    assert "4 done before, 1 to run" in proc.stdout
    assert read_records(out)[:5] == records and len(read_records(out)) == 6
    assert sac_log.stat().st_mtime_ns == stamp


def test_interrupt_and_resume(repo, tmp_path):
    """Ctrl-C in the second of 8 runs (two seeds of the fake alone, no real script): the run is recorded as
    interrupted, no further run starts, speed.md names the 6 runs never started, and the resume runs them."""
    out = tmp_path / "out"
    argv = ["--scripts", "fake_torchcompile", "--seeds", "1,2", "--out", out]
    proc = run_sh(repo, *argv, FAKE_INTERRUPT="1", FAKE_HOLD="1", HEARTBEAT="0.1")
    assert proc.returncode == 130, proc.stderr
    resume = f"rerun with --out {out} to resume: {repo / 'run.sh'} --scripts fake_torchcompile --seeds 1,2 --out {out}"
    assert proc.stderr.strip().splitlines()[-1] == f"interrupted: {resume}"
    assert "Traceback" not in proc.stderr
    modes = ("eager", "compile", "cudagraphs", "compile+cudagraphs")
    names = [f"fake_torchcompile__{m}__s{s}" for s in (1, 2) for m in modes]
    assert (out / "plan.txt").read_text().splitlines() == names
    records = read_records(out)
    assert [(r["mode"], r["seed"], r["status"]) for r in records] == [("eager", 1, "ok"), ("compile", 1, "interrupted")]
    assert records[1]["interrupted"] is True and records[1]["exit_code"] == 130
    assert records[1]["total_timesteps"] == 1200
    assert sorted(p.name for p in (out / "logs").iterdir()) == [f"{n}.log" for n in sorted(names[:2])]
    # the heartbeat shows the run's position, time and latest progress line, and the matrix's ETA
    beat = re.compile(rf"^  \[2/8\] {names[1]}, \d+s: fake_torchcompile: 1200/10000 steps, fps 99, return -1\.5, "
                      r"eta 0\.1 min; matrix after it: at least about \d+\w+ left$", re.M)  # fmt: skip
    assert beat.search(proc.stdout), proc.stdout
    assert f"[2/8] {names[1]}: INTERRUPTED after 1200 steps (exit code 130), see logs/{names[1]}.log" in proc.stdout
    assert "[3/8]" not in proc.stdout

    md = (out / "speed.md").read_text()
    assert "1 runs ok, 0 failed, 1 interrupted, 6 missing" in md
    assert table_rows(md)["fake"] == [
        "–", "400, 1 missing", "interrupted (1), 1 missing", "missing (2)", "missing (2)", "–"
    ]  # fmt: skip
    missing = md.split("## Missing runs", 1)[1]
    assert [f"fake_torchcompile__{m}__s{s}" for m, s in re.findall(r"^\| fake_torchcompile \| (\S+) \| (\d) \|$",
                                                                     missing, re.M)] == names[2:]  # fmt: skip
    assert "| fake_torchcompile | compile | 1 | 1200 | 500 (short) |" in md.split("## Interrupted runs", 1)[1]

    # The resume: the run done is skipped, the interrupted and missing ones run; the plan stays as it was.
    proc = run_sh(repo, *argv)
    assert proc.returncode == 1, proc.stderr  # --cudagraphs alone fails in the fake
    assert proc.stdout.count("skipped") == 1 and "1 done before, 7 to run" in proc.stdout
    assert [(r["mode"], r["seed"], r["status"]) for r in read_records(out)[2:]] == [
        (m, s, "failed" if m == "cudagraphs" else "ok") for s in (1, 2) for m in modes if (m, s) != ("eager", 1)
    ]  # fmt: skip
    assert (out / "plan.txt").read_text().splitlines() == names
    md = (out / "speed.md").read_text()
    assert "## Missing runs" not in md and "## Interrupted runs" not in md and "6 runs ok, 2 failed" in md
    # seed 2 of the fake is short: its fps is marked and kept out of the median
    assert table_rows(md)["fake"] == ["–", "400, 1 short", "500, 1 short", "failed (2)", "600, 1 short", "–"]


MODES = ("eager", "compile", "cudagraphs", "compile+cudagraphs")


def gpu_runs(stdout, total):
    """{run name: GPU} from the lines that end the runs, each run once."""
    ends = re.findall(rf"^\[\d+/{total} gpu (\S+)\] (\S+): (?:ok|FAILED|INTERRUPTED)", stdout, re.M)
    assert len(ends) == len({name for _, name in ends}), stdout
    return {name: gpu for gpu, name in ends}


def test_gpus_slots_and_resume(repo, tmp_path):
    """--gpus 2: the first two runs start at once, one per slot; each run sees its slot's GPU alone and runs once;
    the report is rendered; a resume on two GPUs skips the runs done and runs the rest once."""
    out = tmp_path / "out"
    argv = ["--scripts", "fake_torchcompile", "--gpus", "2", "--out", out]
    proc = run_sh(repo, *argv, CUDA_VISIBLE_DEVICES=None)
    assert proc.returncode == 1, proc.stderr  # --cudagraphs alone fails in the fake
    names = [f"fake_torchcompile__{m}__s1" for m in MODES]
    assert "(0 done before, 4 to run, 2 at a time on GPUs 0,1; plan in plan.txt)" in proc.stdout
    assert f"[1/4 gpu 0] {names[0]}: running" in proc.stdout and f"[2/4 gpu 1] {names[1]}: running" in proc.stdout
    gpus = gpu_runs(proc.stdout, 4)
    assert sorted(gpus) == sorted(names) and set(gpus.values()) == {"0", "1"}
    records = read_records(out)
    assert sorted((r["mode"], r["status"]) for r in records) == sorted(
        (m, "failed" if m == "cudagraphs" else "ok") for m in MODES
    )  # fmt: skip
    for r in records:
        assert r["status"] == "failed" or r["cuda_visible_devices"] == gpus[f"fake_torchcompile__{r['mode']}__s1"]
    # the first run to end: 3 left, their time spread over the two GPUs
    assert re.search(r"^\[\d/4 gpu [01]\] \S+: .*, took \w+; 3 to run, (at least )?about \w+ left on 2 GPUs$",
                     proc.stdout, re.M), proc.stdout  # fmt: skip
    md = (out / "speed.md").read_text()
    assert "3 runs ok, 1 failed" in md and "## Missing runs" not in md
    assert proc.stderr.strip().splitlines()[-1] == "run.sh: 1 of 4 runs failed"

    # Resume with a second seed: the 3 runs done are skipped, the 5 others run once each on the two GPUs.
    proc = run_sh(repo, *argv, "--seeds", "1,2", CUDA_VISIBLE_DEVICES=None)
    assert proc.returncode == 1, proc.stderr
    assert "3 done before, 5 to run" in proc.stdout and proc.stdout.count("skipped") == 3
    rerun = [names[2]] + [f"fake_torchcompile__{m}__s2" for m in MODES]
    gpus = gpu_runs(proc.stdout, 8)
    assert sorted(gpus) == sorted(rerun) and set(gpus.values()) == {"0", "1"}
    assert sorted(f"fake_torchcompile__{r['mode']}__s{r['seed']}" for r in read_records(out)[4:]) == sorted(rerun)
    assert "6 runs ok, 2 failed" in (out / "speed.md").read_text()


def test_gpus_follow_cuda_visible_devices(repo, tmp_path):
    """A CUDA_VISIBLE_DEVICES set before run.sh: slot k takes its k-th GPU; more slots than it lists is bad input."""
    out = tmp_path / "out"
    proc = run_sh(repo, "--scripts", "fake_torchcompile", "--gpus", "2", "--out", out, CUDA_VISIBLE_DEVICES="3,5")
    assert proc.returncode == 1, proc.stderr
    assert "2 at a time on GPUs 3,5;" in proc.stdout
    names = [f"fake_torchcompile__{m}__s1" for m in MODES]
    assert f"[1/4 gpu 3] {names[0]}: running" in proc.stdout and f"[2/4 gpu 5] {names[1]}: running" in proc.stdout
    assert set(gpu_runs(proc.stdout, 4).values()) == {"3", "5"}
    devices = {r["mode"]: r.get("cuda_visible_devices") for r in read_records(out)}
    assert devices["eager"] == "3" and devices["compile"] == "5" and devices["compile+cudagraphs"] in ("3", "5")
    for visible in ("3,5", ""):
        proc = run_sh(repo, "--gpus", "3", "--out", tmp_path / "no", CUDA_VISIBLE_DEVICES=visible)
        assert_one_line_error(proc, "--gpus 3", f"CUDA_VISIBLE_DEVICES='{visible}'")
    assert not (tmp_path / "no").exists()


def test_gpus_interrupt(repo, tmp_path):
    """Ctrl-C with two runs in flight (--gpus 2): both scripts get it and are recorded as interrupted (the one that
    ends as Ctrl-C during Python's imports does, exit code 1 and no record, too), no further run starts, the report
    names the 6 runs never started, and the resume line keeps --gpus 2."""
    out = tmp_path / "out"
    argv = ["--scripts", "fake_torchcompile", "--seeds", "1,2", "--gpus", "2", "--out", out]
    proc = run_sh(repo, *argv, FAKE_INTERRUPT="1", FAKE_PEER=str(tmp_path / "peer"), FAKE_IMPORTING="1",
                  CUDA_VISIBLE_DEVICES=None)  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    resume = f"rerun with --out {out} to resume: {repo / 'run.sh'} {' '.join(map(str, argv))}"
    assert proc.stderr.strip().splitlines()[-1] == f"interrupted: {resume}"
    assert "Traceback" not in proc.stderr
    records = read_records(out)
    assert sorted((r["mode"], r["seed"], r["status"], r["exit_code"], r.get("total_timesteps")) for r in records) == [
        ("compile", 1, "interrupted", 130, 1200), ("eager", 1, "interrupted", 1, None)
    ]  # fmt: skip
    assert "[1/8 gpu 0] fake_torchcompile__eager__s1: INTERRUPTED (exit code 1)" in proc.stdout
    assert "[2/8 gpu 1] fake_torchcompile__compile__s1: INTERRUPTED after 1200 steps (exit code 130)" in proc.stdout
    assert "[3/8" not in proc.stdout
    assert "0 runs ok, 0 failed, 2 interrupted, 6 missing" in (out / "speed.md").read_text()


def test_sigterm_to_run_sh_alone_reaches_the_script(repo, tmp_path):
    """`kill <run.sh's pid>`, which no script in flight gets from the shell: run.sh passes it on, and the run ends at
    once with its record, interrupted; no further run starts."""
    out, started = tmp_path / "out", tmp_path / "started"
    env = {**os.environ, "PYTHON": sys.executable, "FAKE_TERM": str(started), "HEARTBEAT": "0.1"}
    proc = subprocess.Popen([str(repo / "run.sh"), "--scripts", "fake_torchcompile", "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert [(r["mode"], r["status"], r["total_timesteps"]) for r in read_records(out)] == [("eager", "interrupted", 1200)]
    assert "[2/4]" not in stdout


def test_run_sh_bad_options(repo, tmp_path):
    assert_one_line_error(run_sh(repo, "--scripts", "no_such_script"), "leanrl/no_such_script.py")
    assert_one_line_error(run_sh(repo, "--seeds", "1,x"), "--seeds")
    assert_one_line_error(run_sh(repo, "--seeds", "1,01"), "--seeds: seed 1 is given twice")  # one run, twice
    assert_one_line_error(run_sh(repo, "--seeds", "99999999999"), "--seeds: 99999999999 is over 2147483647")
    assert_one_line_error(run_sh(repo, "--scripts", ""), "--scripts '': no script named")  # not the whole matrix
    assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", "--", "--seed", "5"), "--seed after --")
    assert_one_line_error(run_sh(repo, "--frobnicate"), "--frobnicate")
    assert_one_line_error(run_sh(repo, "--out"), "--out")
    for gpus in ("0", "x", "-1", "1.5", ""):
        assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", "--gpus", gpus), "--gpus", f"'{gpus}'")
    assert_one_line_error(run_sh(repo, "--gpus"), "--gpus")
    for gpus in ("1025", "99999999999999999999"):  # a hang building that many slots
        assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", "--gpus", gpus), f"--gpus {gpus}: at most")
    assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile,fake_torchcompile"), "named twice")
    for module in ("harness/speed", "fake_envs"):  # a file of the package; a module the scripts import
        assert_one_line_error(run_sh(repo, "--scripts", module), f"leanrl/{module}.py is not a training script")
    assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", HEARTBEAT="0"), "HEARTBEAT")
    assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", PYTHON="no-such-python"), "no-such-python")
    # a records.jsonl that cannot be read stops run.sh before any run
    out = tmp_path / "out"
    out.mkdir()
    (out / "records.jsonl").write_text("{not json\n")
    assert_one_line_error(run_sh(repo, "--scripts", "fake_torchcompile", "--out", out), "records.jsonl:1")
    assert list((out / "logs").iterdir()) == []
