"""The MuJoCo throughput tool (leanrl/tools/mujoco_bench.py) on the CPU: the CPU simulators, MuJoCo Warp's physics
alone and the twin's rollout (Warp's CPU device) measured and recorded, a backend that cannot run skipped with its
reason, the table and figure of earlier runs' records, bad input as one line.

The first Warp kernel build takes about a minute on the 2-core CPU (then ~/.cache/warp has it), inside the first
test that makes envs."""

import json
import os

import pytest
import torch
from helpers import assert_one_line_error, load_script, run_cli

TOOL = "tools/mujoco_bench"
RECORD_KEYS = {
    "backend", "mode", "variant", "env_id", "num_envs", "steps_per_call", "calls", "seconds", "env_steps_per_second",
    "runs_on", "warmup_calls", "warmup_seconds", "device", "cpu_count", "torch", "mujoco", "warp-lang", "mujoco-warp",
    "envpool", "gymnasium", "date",
}  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"


def records(out):
    return [json.loads(line) for line in (out / "mujoco_bench.jsonl").read_text().splitlines()]


def run_tool(*argv):
    proc = run_cli(TOOL, *argv)
    assert proc.returncode == 0, proc.stderr
    return proc


def assert_well_formed(record):
    assert set(record) == RECORD_KEYS
    assert record["env_steps_per_second"] > 0 and record["calls"] >= 1
    steps = record["num_envs"] * record["steps_per_call"] * record["calls"]
    assert record["env_steps_per_second"] == pytest.approx(steps / record["seconds"], rel=1e-6)


def test_cpu_simulators(tmp_path):
    """One record per (backend, N) that runs here, its rate the steps it counts over its seconds; gymnasium at more
    envs than cores is skipped, saying why."""
    too_many = str(os.cpu_count() + 1)
    proc = run_tool("--envs", "1", too_many, "--steps", "1", "--calls", "1", "--backends", "gymnasium", "envpool",
                    "--device", "cpu", "--out", tmp_path)  # fmt: skip
    got = records(tmp_path)
    assert [(r["backend"], r["num_envs"]) for r in got] == [
        ("gymnasium", 1), ("envpool", 1), ("envpool", int(too_many)),
    ]  # fmt: skip
    for r in got:
        assert_well_formed(r)
        assert r["env_id"] == "HalfCheetah-v5" and r["runs_on"] == "cpu" and r["mode"] is None
    assert got[0]["variant"].endswith("HalfCheetah-v5 sync") and got[1]["variant"].endswith("HalfCheetah-v4")
    table = (tmp_path / "mujoco_bench.md").read_text()
    assert "| gymnasium | 1 |" in table and "| envpool | 1 |" in table
    assert f"gymnasium (N={too_many}): one process per env" in table
    assert "Skipped" in table and "skipped" in proc.stderr


def test_warp_and_rollout(tmp_path):
    """MuJoCo Warp's physics alone and the twin's rollout on Warp's CPU device: a record per N, its rate N*K*calls
    over its seconds; the rollout's CUDA-graph mode skipped on the CPU, saying why; physics over rollout per N; the
    figure written."""
    figure = tmp_path / "img" / "bench.png"
    proc = run_tool("--envs", "4", "8", "--steps", "2", "--calls", "1", "--backends", "warp", "rollout", "--modes",
                    "eager", "cudagraphs", "--device", "cpu", "--out", tmp_path, "--figure", figure)  # fmt: skip
    got = records(tmp_path)
    assert [(r["backend"], r["mode"], r["num_envs"]) for r in got] == [
        ("warp", None, 4), ("warp", None, 8), ("rollout", "eager", 4), ("rollout", "eager", 8),
    ]  # fmt: skip
    for r in got:
        assert_well_formed(r)
        assert r["env_id"] == "HalfCheetah-v5" and r["runs_on"] == "cpu" and r["steps_per_call"] == 2
    assert got[0]["variant"].endswith(".Envs.simulate") and got[2]["variant"].endswith(".make_collect")
    table = (tmp_path / "mujoco_bench.md").read_text()
    assert "| warp | 4 |" in table and "| rollout (eager) | 8 |" in table
    assert "Physics alone (warp) over the rollout" in table and "| HalfCheetah-v5 | 8 |" in table
    assert "rollout (cudagraphs) (N=4): CUDA graphs need CUDA" in table
    assert "skipped rollout (cudagraphs) (N=8)" in proc.stderr
    assert figure.read_bytes().startswith(PNG)


def test_from_records(tmp_path):
    """The table and figure of earlier runs' records, measuring nothing; records from another env as lines of
    their own."""
    rates = {("warp", None): 2e6, ("rollout", "compile+cudagraphs"): 1e6, ("envpool", None): 2e5}
    environment = {"device": "NVIDIA H100 80GB HBM3", "cpu_count": 16, "torch": "2.13.0", "date": "2026-11-25"}
    for i, env_id in enumerate(("HalfCheetah-v5", "Hopper-v5")):
        lines = [{"backend": backend, "mode": mode, "env_id": env_id, "num_envs": n, "steps_per_call": 16, "calls": 5,
                  "seconds": n * 80 / rate, "env_steps_per_second": rate * n / 4096, "warmup_seconds": 1.0,
                  **environment} for (backend, mode), rate in rates.items() for n in (1024, 4096)]  # fmt: skip
        (tmp_path / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out, figure = tmp_path / "out", tmp_path / "all.png"
    run_tool("--from-records", tmp_path / "0.jsonl", tmp_path / "1.jsonl", "--out", out, "--figure", figure)
    assert len(records(out)) == 12
    table = (out / "mujoco_bench.md").read_text()
    assert "| rollout (compile+cudagraphs) Hopper-v5 | 4096 | 1,000,000 |" in table
    assert "| HalfCheetah-v5 | 1024 | 2.00 |" in table  # physics alone over the rollout
    assert figure.read_bytes().startswith(PNG)


def test_unavailable():
    unavailable = load_script(TOOL).unavailable
    cores, cpu = os.cpu_count(), torch.device("cpu")
    assert unavailable("gymnasium", cores, cpu) is None
    assert "more than the" in unavailable("gymnasium", cores + 1, cpu)
    assert unavailable("rollout", 4, cpu, mode="compile+cudagraphs") == "CUDA graphs need CUDA"
    assert unavailable("envpool", 4, cpu, "Hopper-v5") is None  # envpool's Hopper-v4
    assert "32 bits" in unavailable("envpool", 2**31, cpu, "Hopper-v5")  # not a TypeError from its constructor
    for backend in ("warp", "rollout"):  # not the env module's error, which names the scripts' --num-envs
        assert "32 bits" in unavailable(backend, 2**40, cpu, "Hopper-v5")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--envs", "0"], "--envs 0 must be positive"),
        (["--envs", "2^x"], "--envs '2^x' is not a whole number"),
        (["--steps", "x"], "--steps 'x' is not a whole number"),
        (["--backends", "mujoco-torch-eager"], "unknown backend 'mujoco-torch-eager'"),
        (["--modes", "graph"], "unknown mode 'graph'"),
        (["--env-id", "HumanoidStandup-v5"], "--env-id 'HumanoidStandup-v5' is not one of the MuJoCo Warp envs"),
        (["--figure", "bench.svg"], "--figure bench.svg is not a .png file"),
        (["--min-seconds", "-1"], "--min-seconds -1.0 must be 0 or more"),
        (["--min-seconds", "inf"], "--min-seconds inf must be 0 or more, and finite"),
        (["--min-seconds", "1e39"], "--min-seconds 1e+39 must be at most 86400 (a day for each measurement)"),
        (["--seed", "-5"], "--seed -5 must be 0 or more"),
        (["--device", "mps"], "--device mps is neither cpu nor cuda"),
        (["--from-records", "missing.jsonl"], "--from-records missing.jsonl: No such file"),
    ],
)
def test_bad_input(argv, fragment, tmp_path):
    assert_one_line_error(run_cli(TOOL, *argv, "--out", tmp_path), fragment)


def test_a_figure_that_names_a_folder_is_refused_before_measuring(tmp_path):
    (tmp_path / "figure.png").mkdir()
    argv = ["--figure", tmp_path / "figure.png", "--out", tmp_path]
    assert_one_line_error(run_cli(TOOL, *argv), "figure.png is a folder: it names a file")


def test_bad_records(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"backend": "warp"}\n')
    proc = run_cli(TOOL, "--from-records", tmp_path / "bad.jsonl", "--out", tmp_path)
    assert_one_line_error(proc, "bad.jsonl, line 1: not a record of this tool")
