"""leanrl/tools/scaling_bench.py on the CPU: one process and two torchrun ranks over gloo, each stopped by SIGTERM
after its seconds, their records in one table and their returns in one plot, told as CPU processes, not GPUs; a run
that ends without a record; a run without a steady rate told by how it ended; the table and plot rendered again from
records alone; bad input."""

import json
import subprocess
import sys

import torch
from helpers import ROOT, SCRIPTS, assert_one_line_error, load_script

TOOL = SCRIPTS / "tools" / "scaling_bench.py"
SCRIPT = SCRIPTS / "ppo_classic_control_gpu.py"
SMALL = ["--no-cuda", "--no-tensorboard", "--num-envs", "8", "--num-steps", "16", "--num-minibatches", "2"]


def bench(tmp_path, *argv):
    return subprocess.run([sys.executable, TOOL, *map(str, argv)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_one_process_and_two_ranks_stopped_after_their_seconds(tmp_path):
    out = tmp_path / "out"
    # Runs far longer than 12 s unless stopped (the bench gives them 2^36 env steps); then a run whose bad flag ends
    # it without a record.
    done = bench(tmp_path, "--gpus", 1, 2, "--seconds", 12, "--target", 0, "--out", out, "--", SCRIPT, *SMALL)
    assert done.returncode == 0, done.stderr
    failed = bench(tmp_path, "--gpus", 1, "--seconds", 12, "--out", out, "--", SCRIPT, *SMALL, "--gamma", 2)
    assert failed.returncode == 1, failed.stderr  # the run left no record
    records = [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]
    assert [r["gpus"] for r in records] == [1, 2, 1]
    for r in records[:2]:  # stopped by SIGTERM, as Ctrl-C would: each has its steady window
        assert r["interrupted"] and r["steady"] and r["fps"] > 0 and r["total_timesteps"] < 2**36
        assert r["command"].startswith("ppo_classic_control_gpu.py --no-cuda")
        assert r["command"].endswith("--total-timesteps 68719476736")
    assert "exit code 2, no record" in records[2]["failed"]
    # The records say "cpu": every line and the table say CPU processes; the run without a record, CPU where the
    # machine has no CUDA (with CUDA, --no-cuda or not, nothing says where it ran).
    assert [line.split(":")[0] for line in done.stdout.splitlines()[:2]] == ["1 CPU process", "2 CPU ranks"]
    assert failed.stdout.startswith("1 process: " if torch.cuda.is_available() else "1 CPU process: ")
    assert "GPU" not in done.stdout + failed.stdout
    table = (out / "scaling.md").read_text().splitlines()
    assert table[0].startswith("| command | CPU processes | env steps/s | per process | speed-up | efficiency |")
    assert "GPU" not in "\n".join(table)
    one, two = (line for line in table if "--num-minibatches 2 --total-timesteps 68719476736 |" in line)
    assert "| 1 |" in one and "| 1.00x | 100% |" in one and "| 2 |" in two
    speedup = records[1]["fps"] / records[0]["fps"]
    assert f"| {speedup:.2f}x | {speedup / 2:.0%} |" in two
    assert any("--gamma 2 --total-timesteps 68719476736 | 1 | exit code 2, no record" in line for line in table)
    assert len(list((out / "logs").glob("*.log"))) == 3
    assert (out / "returns.png").read_bytes().startswith(b"\x89PNG")


def test_render_from_records_alone(tmp_path):
    """Records gathered elsewhere: --render writes their table (time to the target off each return curve) and
    plot, and runs nothing."""
    out = tmp_path / "out"
    out.mkdir()
    curve = [[100, 5.0, 1.0], [200, 15.0, 6.0], [300, 25.0, 9.0]]
    record = {"command": "x.py", "gpus": 1, "device": "cuda", "gpu": "NVIDIA H200", "fps": 100.0, "steady": True,
              "warmup_seconds": 5.0, "wall_seconds": 60.0, "episodic_return": 9.0, "return_curve": curve}  # fmt: skip
    two = {**record, "gpus": 2, "fps": 180.0}
    (out / "scaling.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(two) + "\n")
    done = bench(tmp_path, "--render", "--target", 5, "--out", out)
    assert done.returncode == 0, done.stderr
    table = (out / "scaling.md").read_text()
    assert table.startswith("| command | GPUs | env steps/s | per GPU | speed-up | efficiency |")
    assert "| x.py | 2 | 180 | 90 | 1.80x | 90% | 5.0 | 60.0 | 9.0 | 15 (10) |" in table
    assert (out / "returns.png").read_bytes().startswith(b"\x89PNG") and not (out / "logs").exists()


def test_render_gpus_and_cpu_processes_apart(tmp_path):
    """Records of GPUs and of CPU processes in one folder: each row says which, and each speed-up is over one
    process on the same device, never a GPU's over a CPU's."""
    out = tmp_path / "out"
    out.mkdir()
    record = {"command": "x.py", "gpus": 1, "device": "cuda", "gpu": "NVIDIA H200", "fps": 100.0, "steady": True,
              "warmup_seconds": 5.0, "wall_seconds": 60.0, "episodic_return": 9.0, "return_curve": []}  # fmt: skip
    records = [record, {**record, "gpus": 2, "fps": 180.0}, {**record, "device": "cpu", "gpu": None, "fps": 10.0},
               {**record, "gpus": 2, "device": "cpu", "gpu": None, "fps": 19.0}]  # fmt: skip
    (out / "scaling.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    done = bench(tmp_path, "--render", "--out", out)
    assert done.returncode == 0, done.stderr
    table = (out / "scaling.md").read_text()
    assert table.startswith("| command | processes | env steps/s | per process | speed-up | efficiency |")
    for row in ["1 CPU process | 10 | 10 | 1.00x | 100%", "2 CPU ranks | 19 | 10 | 1.90x | 95%",
                "1 GPU | 100 | 100 | 1.00x | 100%", "2 GPUs | 180 | 90 | 1.80x | 90%"]:  # fmt: skip
        assert f"| x.py | {row} |" in table


def test_no_steady_rate_says_how_the_run_ended(tmp_path):
    """A run whose fps window never opened: one the bench stopped in its warm-up needs more --seconds; one that
    ended on its own --total-timesteps first was not stopped, and needs more of those; one that diverged, neither."""
    out = tmp_path / "out"
    out.mkdir()
    unsteady = {"gpus": 2, "device": "cpu", "gpu": None, "fps": 50.0, "steady": False, "total_timesteps": 512,
                "warmup_seconds": 3.0, "wall_seconds": 40.2, "episodic_return": None, "return_curve": []}  # fmt: skip
    stopped = {**unsteady, "command": "stopped.py", "interrupted": True, "diverged": False}
    diverged = {**unsteady, "command": "diverged.py", "interrupted": True, "diverged": True}  # as torchrun's ranks say
    (out / "scaling.jsonl").write_text(json.dumps(stopped) + "\n" + json.dumps(diverged) + "\n")
    # Two iterations of 128 env steps, and the fps window opens at the third; a budget it never reaches.
    done = bench(tmp_path, "--gpus", 1, "--seconds", 250, "--out", out, "--", SCRIPT, *SMALL, "--total-timesteps", 256)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "scaling.jsonl").read_text().splitlines()[-1])
    assert not record["interrupted"] and not record["steady"] and record["total_timesteps"] == 256
    ended = "ended (its --total-timesteps, 256 env steps) after"
    assert done.stdout.startswith(f"1 CPU process: {ended}") and "warm-up" not in done.stdout
    assert "before its fps window opened: no steady rate; give it more --total-timesteps (" in done.stdout
    table = (out / "scaling.md").read_text()
    assert f"--total-timesteps 256 | 1 | {ended}" in table
    assert "| stopped.py | 2 | stopped in its warm-up after 40 s: no steady rate; give it more --seconds |" in table
    assert "| diverged.py | 2 | diverged after 40 s, before its fps window opened: no steady rate |" in table
    assert table.count("warm-up after") == 1


def test_plot_labels_keep_each_flag_with_its_value():
    """Runs that differ by a flag's value (seeds) are told apart by flag and value, not by a bare number; what every
    run shares is left out. Each says its GPUs, or its CPU processes."""
    records = [{"command": "ppo.py --compile --seed 1", "gpus": 1, "device": "cuda"},
               {"command": "ppo.py --compile --seed 2", "gpus": 2, "device": "cuda"},
               {"command": "td3.py --compile --amp --seed 1", "gpus": 2, "device": "cpu"},
               {"command": "td3.py --compile --amp --seed 1", "gpus": 1, "device": "cpu"}]  # fmt: skip
    assert load_script("tools/scaling_bench").run_labels(records) == [
        "ppo.py, --seed 1, 1 GPU", "ppo.py, --seed 2, 2 GPUs", "td3.py, --amp, --seed 1, 2 CPU ranks",
        "td3.py, --amp, --seed 1, 1 CPU process"]  # fmt: skip


def test_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "scaling.jsonl").touch()
    for argv, message in [
        (["--gpus", 0, "--", SCRIPT], "--gpus 0: every count must be 1 or more"),
        (["--seconds", 0, "--", SCRIPT], "--seconds 0.0 must be positive"),
        (["--", ROOT / "nothing.py"], "nothing.py: no such training script"),
        (["--", ROOT / "run.sh"], "run.sh: a training script is a .py file"),
        (["--gpus", 1, 2, "--", SCRIPTS / "dqn.py"], "dqn.py runs in one process, not under torchrun: --gpus 1 only"),
        (["--target", "nan", "--", SCRIPT], "--target nan must be a finite return"),
        (["--gpus", 1], "-- SCRIPT [ARGS]: the training script to run (or --render)"),
        (["--render", "--out", tmp_path / "none"], "--render: " + str(tmp_path / "none" / "scaling.jsonl")),
        (["--render", "--out", tmp_path / "empty"], "scaling.jsonl: no records to render"),
    ]:
        assert_one_line_error(bench(tmp_path, *argv), message)
