"""The MuJoCo throughput tool (leanrl/tools/mujoco_bench.py) on the CPU: the CPU simulators and mujoco-torch's
eager step measured and recorded, the graph backend skipped with its reason, bad input as one line."""

import json
import os

import pytest
import torch
from helpers import assert_one_line_error, load_script, run_cli

TOOL = "tools/mujoco_bench"


def records(out):
    return [json.loads(line) for line in (out / "mujoco_bench.jsonl").read_text().splitlines()]


def run_tool(*argv):
    proc = run_cli(TOOL, *argv)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_cpu_simulators_and_mujoco_torch(tmp_path):
    """One record per (backend, dtype, N) that runs here, its rate the steps it counts over its seconds; the
    graph backend, which needs CUDA, is skipped, saying why."""
    proc = run_tool("--envs", "1", "--steps", "1", "--calls", "1", "--backends", "gymnasium", "envpool",
                    "mujoco-torch-eager", "mujoco-torch-graph", "--dtypes", "float32", "--device", "cpu",
                    "--out", tmp_path)  # fmt: skip
    got = records(tmp_path)
    assert [(r["backend"], r["dtype"], r["num_envs"]) for r in got] == [
        ("gymnasium", "float64", 1), ("envpool", "float64", 1), ("mujoco-torch-eager", "float32", 1),
    ]  # fmt: skip
    for r in got:
        assert r["env_steps_per_second"] == pytest.approx(r["num_envs"] / r["seconds"], rel=1e-3)
    table = (tmp_path / "mujoco_bench.md").read_text()
    assert "| mujoco-torch-eager | float32 | 1 |" in table
    assert "mujoco-torch-graph (float32, N=1): CUDA graphs need CUDA" in table
    assert "Skipped" in table and "skipped" in proc.stderr


def test_gymnasium_keeps_to_one_process_per_core():
    unavailable = load_script(TOOL).unavailable
    cores, cpu = os.cpu_count(), torch.device("cpu")
    assert unavailable("gymnasium", cores, cpu) is None
    assert "more than the" in unavailable("gymnasium", cores + 1, cpu)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--envs", "0"], "--envs 0 must be positive"),
        (["--steps", "x"], "--steps 'x' is not a whole number"),
        (["--backends", "mjx"], "unknown backend 'mjx'"),
        (["--dtypes", "float16"], "unknown dtype 'float16'"),
    ],
)
def test_bad_input(argv, fragment, tmp_path):
    assert_one_line_error(run_cli(TOOL, *argv, "--out", tmp_path), fragment)
