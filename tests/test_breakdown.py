"""breakdown.py: on the traces of tiny profiled SAC runs (both scripts), on a hand-built CUDA trace whose
every number is known, the speed record it finds through speed_report.py's reader, and on bad input."""

import json

import pytest
from helpers import assert_one_line_error, load_script, run_cli

TOOL = "tools/breakdown"
TINY = ["--total-timesteps", "400", "--learning-starts", "50", "--batch-size", "16", "--buffer-size", "1000"]
# The loop's own bookkeeping between phases (the for statement, run.unit) may take this share of the profiled wall.
OUTSIDE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Profiled runs of the SAC baseline and its twin (no flags), each with its speed record beside the trace."""
    dirs = []
    for name in ("sac_continuous_action", "sac_continuous_action_torchcompile"):
        d = tmp_path_factory.mktemp("profiles") / name  # the DIR name labels its column
        d.mkdir()
        proc = run_cli(name, *TINY, "--profile-dir", d, "--speed-log", d / "record.jsonl")
        assert proc.returncode == 0, proc.stderr
        dirs.append(d)
    return dirs


def test_phases_add_up_to_profiled_wall(profiled):
    breakdown = load_script(TOOL)
    for d in profiled:
        entry = breakdown.analyze(str(d / f"{d.name}.trace.json"))
        assert entry["steps"] == load_script(d.name).PROFILE_STEPS
        assert {"env_step", "policy", "data", "update"} <= set(entry["phases"])
        assert not entry["cuda"] and entry["total"]["gpu"] == 0 and entry["total"]["launches"] == 0
        for name, row in entry["phases"].items():
            assert row["python"] >= 0 and row["framework"] >= 0
            assert row["python"] + row["framework"] + row["cuda_api"] == pytest.approx(row["wall"], rel=1e-9), name
        per_step = entry["wall"] / entry["steps"]
        in_phases = sum(row["wall"] for name, row in entry["phases"].items() if name != breakdown.OUTSIDE)
        assert (1 - OUTSIDE_TOLERANCE) * per_step <= in_phases <= per_step * (1 + 1e-9)
        assert entry["total"]["wall"] == pytest.approx(per_step)
        # The simulator makes no framework calls; every update does, many of them.
        assert entry["phases"]["env_step"]["ops"] == 0
        assert entry["phases"]["update"]["ops"] >= 5 and entry["phases"]["update"]["framework"] > 0


def test_cli_side_by_side(profiled, tmp_path):
    proc = run_cli(TOOL, *profiled, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "out" / "breakdown.md").read_text()
    for d in profiled:
        assert f"## {d.name}\n" in md
    assert md.count("| env_step | ") == 2 and md.count("| update | ") == 2
    assert "## Side by side" in md and f"| | {profiled[0].name} | {profiled[1].name} |" in md
    # Each run's speed record sits beside its trace: fps with and without the profiler, side by side.
    fps = [json.loads((d / "record.jsonl").read_text())["fps"] for d in profiled]
    assert f"| fps in the speed record | {fps[0]:.0f} | {fps[1]:.0f} |" in md
    png = (tmp_path / "out" / "breakdown.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def synthetic_trace():
    """One env step with a CUDA device: numbers chosen so that each layer can be computed by hand."""
    return {
        "deviceProperties": [{"name": "Fake GPU"}],
        "env_steps_per_call": 2,
        "traceEvents": [
            x("policy", "user_annotation", 0, 100),
            x("env_step", "user_annotation", 110, 90),  # the 10 µs before it are outside the phases
            x("update", "user_annotation", 200, 200),
            x("data", "user_annotation", 350, 50),  # nested: its time goes to data, not update
            x("update", "gpu_user_annotation", 220, 40, tid=7),  # the GPU-side copy of a scope is no phase
            # policy: a framework call launching a kernel from a nested op, then `.cpu()`: a copy into pageable
            # memory that returns once the kernel and the copy are done, and a stream synchronisation
            x("aten::linear", "cpu_op", 10, 30),
            x("aten::addmm", "cpu_op", 20, 10),
            x("cudaLaunchKernel", "cuda_runtime", 22, 5, correlation=1),
            x("gemm", "kernel", 25, 35, tid=7, correlation=1),
            x("aten::to", "cpu_op", 45, 50),
            x("cudaMemcpyAsync", "cuda_runtime", 50, 30, correlation=2),
            x("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 62, 4, tid=7, correlation=2),
            x("cudaStreamSynchronize", "cuda_runtime", 82, 8, correlation=5),
            # update: a graph launch on the main thread, backward on the autograd thread
            x("CompiledFunction", "cpu_op", 210, 100),
            x("cudaGraphLaunch", "cuda_runtime", 220, 30, correlation=3),
            x("autograd::engine::evaluate_function", "cpu_op", 300, 40, tid=2),
            x("cuLaunchKernel", "cuda_driver", 320, 5, tid=2, correlation=4),
            x("graph_kernel_a", "kernel", 230, 20, tid=7, correlation=3),
            x("graph_kernel_b", "kernel", 240, 20, tid=8, correlation=3),
            x("triton_kernel", "kernel", 330, 10, tid=7, correlation=4),
            x("aten::index", "cpu_op", 360, 20),
            x("cudaDeviceSynchronize", "cuda_runtime", 385, 5, correlation=6),
            # launched before the profiler started
            x("late_kernel", "kernel", 5, 5, tid=7, correlation=99),
        ],
    }


def test_synthetic_cuda_trace(tmp_path):
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "fake.trace.json").write_text(json.dumps(synthetic_trace()))
    entry = load_script(TOOL).analyze(str(tmp_path / "gpu" / "fake.trace.json"))
    assert entry["device"] == "Fake GPU" and entry["cuda"] and entry["steps"] == 1 and entry["wall"] == 400
    keys = ("wall", "python", "framework", "cuda_api", "gpu", "gpu_overlap", "ops", "launches", "syncs")
    expected = {
        # ops and API calls cover [10, 40] and [45, 95], 43 µs of it in the API; GPU: [25, 60] and [62, 66],
        # 14 µs of it while the CPU waits in the copy or the synchronisation; the copy and the
        # synchronisation of one `.cpu()` are one sync point
        "policy": (100, 20, 37, 43, 39, 25, 2, 1, 1),
        "outside phases": (10, 10, 0, 0, 5, 5, 0, 0, 0),
        "env_step": (90, 90, 0, 0, 0, 0, 0, 0, 0),
        # ops of both threads cover [210, 340]; the graph's two kernels overlap each other: 30 µs, plus 10
        "update": (150, 20, 95, 35, 40, 40, 2, 2, 0),
        # a synchronisation outside any framework call is a sync point of its own
        "data": (50, 25, 20, 5, 0, 0, 1, 0, 1),
    }
    assert set(entry["phases"]) == set(expected)
    for name, values in expected.items():
        assert {k: entry["phases"][name][k] for k in keys} == pytest.approx(dict(zip(keys, values))), name
    assert {k: entry["total"][k] for k in keys} == pytest.approx(
        dict(zip(keys, (400, 165, 152, 83, 84, 70, 5, 3, 2)))
    )

    # kernels by their time, each in the phase that launched it (a memcpy is no kernel)
    assert entry["kernels"] == [("gemm", "policy", 35, 1), ("graph_kernel_a", "update", 20, 1),
                                ("graph_kernel_b", "update", 20, 1), ("triton_kernel", "update", 10, 1),
                                ("late_kernel", "outside phases", 5, 1)]  # fmt: skip

    (tmp_path / "gpu" / "record.jsonl").write_text(json.dumps({"script": "fake", "fps": 10000.0, "compile": True,
                                                              "cudagraphs": True}) + "\n")  # fmt: skip
    proc = run_cli(TOOL, tmp_path / "gpu", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "out" / "breakdown.md").read_text()
    assert "Fake GPU" in md
    assert "| policy | 100 | 20 | 37 | 43 | 39 | 25 | 2.0 | 1.0 | 1.0 |" in md
    assert "Heaviest GPU kernels (of 5)" in md and "| `gemm` | policy | 35 | 1.0 |" in md
    # 2 env steps per env_step call in 400 µs: 5000 fps under the profiler, half the record's
    assert "| fps under the profiler | 5000 |" in md and "fps under the profiler / fps in the record: 0.50" in md


def test_record_through_the_shared_reader(tmp_path, monkeypatch):
    """The record beside a trace is the last one of its script that finished ok with a steady fps, as
    speed_report.py reads records; the tool finds it when run from any folder."""
    d = tmp_path / "gpu"
    d.mkdir()
    (d / "fake.trace.json").write_text(json.dumps(synthetic_trace()))
    flags = {"compile": True, "cudagraphs": True}
    records = [
        {"script": "fake", "fps": 8000.0, "steady": True, "interrupted": False, **flags},
        {"script": "other", "fps": 1.0, **flags},  # another script's
        {"script": "fake", "fps": 2.0, "steady": False, "interrupted": False, **flags},  # too short for the window
        {"script": "fake", "fps": 3.0, "steady": True, "interrupted": True, **flags},  # stopped by Ctrl-C
        {"script": "fake", "fps": None, **flags},  # an old record without a steady window
        {"script": "fake", "fps": 4.0, "status": "failed", **flags},
        {"script": "fake", "fps": 5.0, "status": "interrupted", **flags},
    ]
    (d / "a.jsonl").write_text(json.dumps({"script": "fake", "fps": 100.0, **flags}) + "\n")
    (d / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # read after a.jsonl
    breakdown = load_script(TOOL)
    assert breakdown.load_record(str(d), "fake")["fps"] == 8000.0
    assert breakdown.load_record(str(d), "missing") is None
    # it asks speed_report.py
    monkeypatch.setattr(breakdown.speed_report, "last_steady_record", lambda directory, script: {"fps": -1.0})
    assert breakdown.load_record(str(d), "fake") == {"fps": -1.0}
    monkeypatch.undo()

    proc = run_cli(TOOL, d, "--out", tmp_path / "out", cwd=tmp_path)  # from outside the repository
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "out" / "breakdown.md").read_text()
    assert "| fps in the speed record | 8000 |" in md and "fps under the profiler / fps in the record: 0.62" in md

    (d / "b.jsonl").write_text(json.dumps(records[0]) + "\n[1, 2]\n")
    assert_one_line_error(run_cli(TOOL, d, "--out", tmp_path / "out"), "b.jsonl:2", "not a JSON record")


def test_bad_input(tmp_path):
    empty, garbage, unannotated = (tmp_path / n for n in ("empty", "garbage", "unannotated"))
    for d in (empty, garbage, unannotated):
        d.mkdir()
    (garbage / "x.trace.json").write_text('{"traceEvents": [')
    (unannotated / "y.trace.json").write_text(json.dumps({"traceEvents": [x("aten::add", "cpu_op", 0, 5)]}))
    for d, fragment in ((empty, "no *.trace.json"), (garbage, "cannot read trace"), (unannotated, "no env_step")):
        proc = run_cli(TOOL, d, "--out", tmp_path / "out")
        assert proc.returncode == 2
        assert_one_line_error(proc, str(d), fragment)
    assert not (tmp_path / "out").exists()
    assert_one_line_error(run_cli(TOOL, empty), "--out")
