"""Helpers every test module shares: load a training script as a module, run it in this process or as a user
does, and check its speed record, its error lines, its TensorBoard scalars, its profiler trace and its videos."""

import functools
import importlib.util
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"
# The project's modules beside the scripts, which a script may import (the harness, the env modules), and the
# package's __init__ (which puts them on the path under `python -m`); every other leanrl/*.py is a training script.
MODULES = ("harness", "torch_classic_control", "mujoco_warp_envs", "replay_buffers", "fused_rollout", "envpool_atari",
           "__init__")
TESTS = ROOT / "tests"
RECORD_KEYS = {
    "script", "env_id", "seed", "compile", "cudagraphs", "device", "gpu", "cpu_count", "torch", "torch_threads",
    "total_timesteps", "fps", "steady", "interrupted", "diverged", "amp", "fps_overall", "resumed_from", "restarts",
    "checkpoint_seconds", "warmup_seconds", "warmup_split", "wall_seconds", "episodic_return", "return_curve",
}  # fmt: skip
# The four modes of a compiled script.
MODES = [[], ["--compile"], ["--cudagraphs"], ["--compile", "--cudagraphs"]]
# The phases every script's loop runs in (docs/contract.md).
PHASES = ("env_step", "policy", "data", "update", "other")
# A GPU twin whose policy runs inside its captured env step traces no "policy" phase of its own.
POLICY_IN_STEP_PHASES = tuple(p for p in PHASES if p != "policy")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def mode_id(mode):
    return "+".join(mode) or "eager"


def script_path(name):
    """leanrl/<name>.py, or the toy script tests/<name>.py."""
    return SCRIPTS / f"{name}.py" if (SCRIPTS / f"{name}.py").exists() else TESTS / f"{name}.py"


@functools.cache
def load_script(name):
    """Import leanrl/<name>.py as a module, without running its main(). Its folder goes on sys.path first, as Python
    does for a script it runs, for the modules beside it (a tool's benchkit; conftest.py puts leanrl/ there)."""
    path = script_path(name)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name.replace("/", "."), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flag_value(argv, option, default):
    """The value argv gives an option, or the default."""
    return type(default)(argv[argv.index(option) + 1]) if option in argv else default


def run_main(name, argv, capsys, interrupted=False):
    """Run a script's main() in this process, from a scratch working directory (the `workdir` fixture): check the
    speed-record contract and the TensorBoard folder (on unless --no-tensorboard), and return the record."""
    return run_main_stderr(name, argv, capsys, interrupted)[0]


def run_main_stderr(name, argv, capsys, interrupted=False):
    """run_main, and what the run wrote to stderr."""
    cwd = Path.cwd().resolve()
    assert not cwd.is_relative_to(ROOT), "in-process runs write runs/ into the working directory: use `workdir`"
    env_id = flag_value(argv, "--env-id", load_script(name).Args.env_id)
    pattern = f"runs/{env_id}__{name}__{flag_value(argv, '--seed', 1)}__*/events.out.tfevents.*"
    earlier_runs = set(cwd.glob(pattern))
    with compiled_whole("--compile" in argv):
        record = load_script(name).main(argv)
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == record, "the last stdout line must be the speed record"
    assert set(record) == RECORD_KEYS
    assert record["script"] == name and record["total_timesteps"] > 0
    assert record["interrupted"] is interrupted
    cuda = torch.cuda.is_available() and "--no-cuda" not in argv
    assert record["device"] == ("cuda" if cuda else "cpu")
    # fps is never null: the steady window's, or the whole loop's for a run too short to reach it.
    assert record["fps"] > 0 and record["fps_overall"] > 0
    # In ms: 0 for a toy script whose loop starts within its first ms; equal for a loop ended within its first ms.
    assert 0 <= record["warmup_seconds"] <= record["wall_seconds"]
    # the split covers the warm-up: "imports" and "start" before the loop, the loop's phases after (rounding aside)
    assert {"imports", "start"} <= set(record["warmup_split"]) <= {"imports", "start", *PHASES}
    assert sum(record["warmup_split"].values()) <= record["warmup_seconds"] + 0.01
    assert record["torch_threads"] == flag_value(argv, "--torch-threads", 1) == torch.get_num_threads()
    assert record["env_id"] == env_id and record["seed"] == flag_value(argv, "--seed", 1)
    runs = set(cwd.glob(pattern)) - earlier_runs
    assert len(runs) == ("--no-tensorboard" not in argv), runs
    return record, err


@contextmanager
def compiled_whole(compile):
    """With --compile, torch.compile must compile all it is given: a frame it gave up on (a warning of
    torch._dynamo, such as a backend compiler's exception, after which the frame runs eagerly) fails the test.
    Dynamo's caches are emptied first, as a user's new process has them: runs of the same functions before, in this
    process, would count towards its recompile limit."""
    if not compile:
        yield
        return
    torch._dynamo.reset()
    given_up = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = given_up.append
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not given_up, [warning.getMessage().splitlines()[0] for warning in given_up]


def run_mode(name, argv, mode, capsys):
    """Run a compiled twin in one of MODES; its record says which flags took effect and return it."""
    record = run_main(name, argv + mode, capsys)
    assert record["compile"] == ("--compile" in mode)
    # Without CUDA, --cudagraphs falls back to running without graphs and says so in the record.
    assert record["cudagraphs"] == ("--cudagraphs" in mode and torch.cuda.is_available())
    return record


def assert_steady(record, total_timesteps):
    """A run that reached its fps window: whole length, fps measured over the window only."""
    assert record["total_timesteps"] == total_timesteps
    assert record["steady"] is True and record["interrupted"] is False


def assert_return_curve(record):
    """The return curve: up to about 50 points [global_step, seconds, mean return], in step and time order, the last
    one at the end of the run."""
    curve, total = record["return_curve"], record["total_timesteps"]
    assert 0 < len(curve) <= 52
    steps, seconds = [point[0] for point in curve], [point[1] for point in curve]
    assert steps == sorted(set(steps)) and seconds == sorted(seconds)
    assert steps[-1] == total


def run_cli(name, *argv, cwd=None):
    """Run a script as a user does, in a subprocess, from `cwd` (a scratch directory when not given, so that
    nothing lands in the repository)."""
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run(
            [sys.executable, str(script_path(name)), *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=cwd or scratch,
        )


def run_bad_input(name, argv, capsys):
    """Run main() in this process (far quicker than a new one) on input it must refuse: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        load_script(name).main(argv)
    return SimpleNamespace(returncode=exit_info.value.code, stderr=capsys.readouterr().err)


def is_mp4(path):
    data = Path(path).read_bytes()
    return len(data) > 1000 and data[4:8] == b"ftyp"


def assert_evaluation_video(name, checkpoint):
    """--eval-checkpoint with --capture-video, one episode: one MP4 file, rl-video-episode-0.mp4, under
    videos/<run name>/, as gymnasium's RecordVideo names it."""
    record = load_script(name).main(["--eval-checkpoint", checkpoint, "--eval-episodes", "1", "--capture-video"])
    (folder,) = Path("videos").iterdir()
    assert folder.name.startswith(f"{record['env_id']}__{name}__"), folder.name
    assert [video.name for video in folder.iterdir()] == ["rl-video-episode-0.mp4"]
    assert is_mp4(folder / "rl-video-episode-0.mp4")


def wait_for(path, proc, seconds=120):
    """Until path exists, while the process started as proc runs (its failure, or the time running out, fails)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)


def assert_one_line_error(proc, *fragments):
    """Bad input: exit code 2 and one 'error:' line naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def assert_same_update(before, expected, actual, rtol=5e-2, name=""):
    """The compiled twin moved a tensor as the baseline did: the gap between the two results is at most
    rtol (5%) of the baseline's own change. Element-wise tolerances do not fit after Adam steps: Adam divides by
    the gradient's running scale, so float rounding in a near-zero gradient can move one element by a good
    part of the learning rate, while a real difference in the algorithm moves the whole update."""
    change = (expected.double() - before.double()).norm()
    gap = (actual.double().to(expected.device) - expected.double()).norm()
    assert gap <= rtol * change + 1e-7, f"{name}: gap {gap:.3g} against a change of {change:.3g}"


def assert_cudagraphs_fallback(name, *argv):
    """--cudagraphs without CUDA: one warning line, a normal run, and a record that says no graphs were used."""
    proc = run_cli(name, *argv, "--cudagraphs", "--no-cuda", "--no-tensorboard")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("--cudagraphs needs CUDA") == 1
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["cudagraphs"] is False and record["device"] == "cpu" and record["script"] == name


def assert_trace_phases(profile_dir, name, env_steps_per_call, phases=PHASES):
    """--profile-dir wrote the script's trace, with every phase (of `phases`: a twin whose policy runs inside its
    env step has none of its own) and the env steps one env_step call takes."""
    trace = json.loads((Path(profile_dir) / f"{name}.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert set(phases) <= names, set(phases) - names
    assert int(trace["env_steps_per_call"]) == env_steps_per_call


def tensorboard_scalars(name, env_id="HalfCheetah-v4"):
    """The scalars of a script's TensorBoard run in the working directory: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = Path.cwd().glob(f"runs/{env_id}__{name}__*")
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_interrupted(name, argv, at_step, capsys, monkeypatch):
    """Ctrl-C once the loop has done at_step env steps (before its fps window opens): main() still returns the speed
    record, which says it was interrupted and covers the steps done, and a second Ctrl-C is ignored until the
    record is out. This process's SIGINT and SIGTERM handlers, which the script leaves ignoring, are put back."""
    run = load_script(name).Run
    tick = run.tick

    def interrupting_tick(self, global_step):
        shown = tick(self, global_step)
        if global_step >= at_step:
            raise KeyboardInterrupt
        return shown

    monkeypatch.setattr(run, "tick", interrupting_tick)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        record, err = run_main_stderr(name, argv, capsys, interrupted=True)
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert record["total_timesteps"] == at_step and record["steady"] is False
    assert f"interrupted after {at_step} env steps" in err
    return record


def assert_equal(a, b, where="state"):
    """Nested dicts, lists and tuples of tensors and plain values, of the same types, equal bit for bit (tensors of
    the same dtype and shape); `where` names a difference."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def free_port():
    """A free TCP port on the loopback, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_for(shared, key, rank):
    """The rendezvous port of one process group of spawned ranks, picked by rank 0 just before the group meets and
    handed to the others through `shared` (a Manager dict) under `key`: a port picked minutes ahead can be taken by
    another process by then."""
    if rank == 0:
        shared["port", key] = free_port()
    while ("port", key) not in shared:
        time.sleep(0.01)
    return shared["port", key]


def agent_pair(base_name, fast_name, network, sizes, compile, cudagraphs, device, **kwargs):
    """A baseline agent and a twin agent, each Agent(args, *sizes, device), with the same parameters (their `network`
    module's), and each one's make_update_fns: ((agent, fns), (agent, fns)). kwargs: Args fields of both."""
    base, fast = load_script(base_name), load_script(fast_name)
    device = torch.device(device)
    args_b = base.Args(**kwargs)
    args_f = fast.Args(compile=compile, cudagraphs=cudagraphs, **kwargs)
    torch.manual_seed(0)
    agent_b = base.Agent(args_b, *sizes, device)
    agent_f = fast.Agent(args_f, *sizes, device)
    getattr(agent_f, network).load_state_dict(getattr(agent_b, network).state_dict())
    return (agent_b, base.make_update_fns(agent_b, args_b)), (agent_f, fast.make_update_fns(agent_f, args_f))


def record_run(name, argv, capsys, monkeypatch):
    """Run main() of a PPO or PQN script with argv, recording its rollout storages, its agents, the calls of its
    returns function (make_update_fns' first: GAE or Q(lambda); inputs and outputs, cloned) and of its update:
    (record, seen)."""
    script = load_script(name)
    seen = SimpleNamespace(rollouts=[], agents=[], returns=[], updates=[])

    class Recording(script.Rollout):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.rollouts.append(self)

    def make_update_fns(agent, args, make=script.make_update_fns):
        returns_fn, update, *others = make(agent, args)
        seen.agents.append(agent)

        def recorded_returns(*inputs):
            outputs = returns_fn(*inputs)
            seen.returns.append([x.clone() for x in (*inputs, *(outputs if isinstance(outputs, tuple) else [outputs]))])
            return outputs

        def recorded_update(*minibatch):
            seen.updates.append(minibatch)
            return update(*minibatch)

        return recorded_returns, recorded_update, *others

    monkeypatch.setattr(script, "Rollout", Recording)
    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    return run_main(name, argv, capsys), seen


def first_rollout(name, argv, capsys, monkeypatch):
    """One run of a PPO or PQN script: its first rollout storage, and its first returns call's inputs and outputs."""
    _, seen = record_run(name, argv, capsys, monkeypatch)
    return seen.rollouts[0], seen.returns[0]
