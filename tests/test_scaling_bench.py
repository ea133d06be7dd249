"""leanrl/tools/scaling_bench.py on the CPU: one process and two torchrun ranks over gloo, each stopped by SIGTERM
after its seconds, their records in one table and their returns in one plot; a run that ends without a record;
the table and plot rendered again from records alone; bad input."""

import json
import subprocess
import sys

from helpers import ROOT, SCRIPTS, assert_one_line_error, load_script

TOOL = SCRIPTS / "tools" / "scaling_bench.py"
SCRIPT = SCRIPTS / "ppo_classic_control_gpu.py"
SMALL = ["--no-cuda", "--no-tensorboard", "--num-envs", "8", "--num-steps", "16", "--num-minibatches", "2"]


def bench(tmp_path, *argv):
    return subprocess.run([sys.executable, TOOL, *map(str, argv)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_one_process_and_two_ranks_stopped_after_their_seconds(tmp_path):
    out = tmp_path / "out"
    # Runs far longer than 12 s unless stopped; then a run whose bad flag ends it without a record.
    done = bench(tmp_path, "--gpus", 1, 2, "--seconds", 12, "--target", 0, "--out", out, "--", SCRIPT, *SMALL,
                 "--total-timesteps", 10**9)  # fmt: skip
    assert done.returncode == 0, done.stderr
    failed = bench(tmp_path, "--gpus", 1, "--seconds", 12, "--out", out, "--", SCRIPT, *SMALL, "--gamma", 2)
    assert failed.returncode == 1, failed.stderr  # the run left no record
    records = [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]
    assert [r["gpus"] for r in records] == [1, 2, 1]
    for r in records[:2]:  # stopped by SIGTERM, as Ctrl-C would: each has its steady window
        assert r["interrupted"] and r["steady"] and r["fps"] > 0 and r["total_timesteps"] < 10**9
        assert r["command"].startswith("ppo_classic_control_gpu.py --no-cuda")
    assert "exit code 2, no record" in records[2]["failed"]
    table = (out / "scaling.md").read_text().splitlines()
    assert table[0].startswith("| command | GPUs | env steps/s | per GPU | speed-up | efficiency |")
    one, two = (line for line in table if "--total-timesteps 1000000000 |" in line)
    assert "| 1 |" in one and "| 1.00x | 100% |" in one and "| 2 |" in two
    speedup = records[1]["fps"] / records[0]["fps"]
    assert f"| {speedup:.2f}x | {speedup / 2:.0%} |" in two
    assert any("--gamma 2 | 1 | exit code 2, no record" in line for line in table)
    assert len(list((out / "logs").glob("*.log"))) == 3
    assert (out / "returns.png").read_bytes().startswith(b"\x89PNG")


def test_render_from_records_alone(tmp_path):
    """Records gathered elsewhere: --render writes their table (time to the target off each return curve) and
    plot, and runs nothing."""
    out = tmp_path / "out"
    out.mkdir()
    curve = [[100, 5.0, 1.0], [200, 15.0, 6.0], [300, 25.0, 9.0]]
    record = {"command": "x.py", "gpus": 1, "fps": 100.0, "steady": True, "warmup_seconds": 5.0, "wall_seconds": 60.0,
              "episodic_return": 9.0, "return_curve": curve}  # fmt: skip
    two = {**record, "gpus": 2, "fps": 180.0}
    (out / "scaling.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(two) + "\n")
    done = bench(tmp_path, "--render", "--target", 5, "--out", out)
    assert done.returncode == 0, done.stderr
    table = (out / "scaling.md").read_text()
    assert "| x.py | 2 | 180 | 90 | 1.80x | 90% | 5.0 | 60.0 | 9.0 | 15 (10) |" in table
    assert (out / "returns.png").read_bytes().startswith(b"\x89PNG") and not (out / "logs").exists()


def test_plot_labels_keep_each_flag_with_its_value():
    """Runs that differ by a flag's value (seeds) are told apart by flag and value, not by a bare number; what every
    run shares is left out."""
    records = [{"command": "ppo.py --compile --seed 1", "gpus": 1}, {"command": "ppo.py --compile --seed 2", "gpus": 1},
               {"command": "td3.py --compile --amp --seed 1", "gpus": 2}]  # fmt: skip
    assert load_script("tools/scaling_bench").run_labels(records) == [
        "ppo.py, --seed 1, 1 GPU(s)", "ppo.py, --seed 2, 1 GPU(s)", "td3.py, --amp, --seed 1, 2 GPU(s)"]  # fmt: skip


def test_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "scaling.jsonl").touch()
    for argv, message in [
        (["--gpus", 0, "--", SCRIPT], "--gpus 0: every count must be 1 or more"),
        (["--seconds", 0, "--", SCRIPT], "--seconds 0.0 must be positive"),
        (["--", ROOT / "nothing.py"], "nothing.py: no such training script"),
        (["--gpus", 1], "-- SCRIPT [ARGS]: the training script to run (or --render)"),
        (["--render", "--out", tmp_path / "none"], "--render: " + str(tmp_path / "none" / "scaling.jsonl")),
        (["--render", "--out", tmp_path / "empty"], "scaling.jsonl: no records to render"),
    ]:
        assert_one_line_error(bench(tmp_path, *argv), message)
