"""run.sh and speed_report.py: the report on a fixture JSONL, the matrix end to end on a copy of the
repository (the SAC baseline plus a fake compiled script that fails in one mode), resume, bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, assert_one_line_error, run_cli

REPORT = "tools/speed_report"
# Overrides --quick's horizons (they come after them) so that the SAC baseline finishes fast on a CPU.
SHORT = ["--", "--total-timesteps", "600", "--learning-starts", "100", "--batch-size", "32", "--buffer-size", "2000"]
# A stand-in for a compiled script: it records the arguments it got, and fails with --cudagraphs alone.
FAKE = """import json, sys
argv = sys.argv[1:]
if "--cudagraphs" in argv and "--compile" not in argv:
    print("error: fake failure", file=sys.stderr)
    sys.exit(3)
record = {"script": "fake_torchcompile", "seed": int(argv[argv.index("--seed") + 1]), "fps": 100.0 * len(argv),
          "compile": "--compile" in argv, "cudagraphs": "--cudagraphs" in argv, "argv": argv,
          "return_curve": [[10, 0.5, -3.0], [20, 1.0, -1.0]]}
with open(argv[argv.index("--speed-log") + 1], "a") as f:
    f.write(json.dumps(record) + "\\n")
print(json.dumps(record))
"""


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


def test_report_bad_input(tmp_path):
    assert_one_line_error(run_cli(REPORT, tmp_path), "no records.jsonl")
    (tmp_path / "records.jsonl").write_text(json.dumps(ok("a", "baseline", 1, 1.0)) + "\n{not json\n")
    assert_one_line_error(run_cli(REPORT, tmp_path), "records.jsonl:2")
    (tmp_path / "records.jsonl").write_text(json.dumps(ok("a", "turbo", 1, 1.0)) + "\n")
    assert_one_line_error(run_cli(REPORT, tmp_path), "turbo")


@pytest.fixture
def repo(tmp_path):
    """A copy of the repository's run.sh, tools and SAC baseline, plus the fake compiled script."""
    root = tmp_path / "repo"
    (root / "leanrl").mkdir(parents=True)
    shutil.copy(ROOT / "run.sh", root)
    shutil.copytree(ROOT / "leanrl" / "tools", root / "leanrl" / "tools")
    shutil.copy(ROOT / "leanrl" / "sac_continuous_action.py", root / "leanrl")
    (root / "leanrl" / "fake_torchcompile.py").write_text(FAKE)
    return root


def run_sh(root, *argv):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([str(root / "run.sh"), *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip


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

    rows = table_rows((out / "speed.md").read_text())
    assert rows["sac_continuous_action"][0] == f"{sac['fps']:.0f}"
    fps = [f"{r['fps']:.0f}" for r in (eager, compiled, both)]
    assert rows["fake"][:5] == ["–", fps[0], fps[1], "failed (1)", fps[2]]
    assert_png(out / "fps.png")
    assert_png(out / "returns.png")

    # Resume, this time discovering the scripts: the finished runs are skipped, the failed one runs again.
    sac_log = out / sac["log"]
    stamp = sac_log.stat().st_mtime_ns
    proc = run_sh(repo, "--quick", "--out", out, *SHORT)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("skipped") == 4 and "[3/5] fake_torchcompile__cudagraphs__s1: FAILED" in proc.stdout
    assert read_records(out)[:5] == records and len(read_records(out)) == 6
    assert sac_log.stat().st_mtime_ns == stamp


def test_run_sh_bad_options(repo):
    assert_one_line_error(run_sh(repo, "--scripts", "no_such_script"), "leanrl/no_such_script.py")
    assert_one_line_error(run_sh(repo, "--seeds", "1,x"), "--seeds")
    assert_one_line_error(run_sh(repo, "--frobnicate"), "--frobnicate")
