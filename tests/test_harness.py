"""The harness (leanrl/harness/), tested once through tests/least_squares.py, a toy script around it: the speed
record, resume in place, checkpoints written atomically where the run was resumed from, Ctrl-C and SIGTERM, kill -9,
bad input, outputs checked at start."""
import ast
import copy
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    ROOT,
    SCRIPTS,
    assert_one_line_error,
    load_script,
    run_bad_input,
    run_cli,
    run_main,
    run_main_stderr,
    script_path,
    wait_for,
)

import harness

NAME = "least_squares"
CPU = torch.device("cpu")
IMPORTED = time.perf_counter()  # this process started earlier
pytestmark = pytest.mark.usefixtures("workdir")


def checkpoint_of(folder):
    return torch.load(Path(folder) / f"{NAME}.pt", weights_only=True)


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def start(*argv, cwd, ignore_sigint=False):
    """The toy as a user runs it, slowed down so that signals land in its loop. ignore_sigint: as a background job
    of a non-interactive shell starts, with SIGINT ignored."""
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen([sys.executable, str(script_path(NAME)), "--step-seconds", "0.01", *argv], cwd=cwd,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=preexec)  # fmt: skip


def test_record_tensorboard_and_speed_log(capsys):
    """The record as every script writes it, its fps from the steady window; the scalars in TensorBoard; the record
    appended to --speed-log, whose earlier lines stay."""
    Path("logs").mkdir()
    Path("logs/speed.jsonl").write_text('{"earlier": "line"}\n')
    record = run_main(NAME, ["--speed-log", "logs/speed.jsonl"], capsys)
    assert record["steady"] is True and record["total_timesteps"] == 2000 and record["resumed_from"] is None
    assert record["episodic_return"] is not None and record["return_curve"][-1][0] == 2000
    assert 0 < len(record["return_curve"]) <= 52
    lines = [json.loads(line) for line in Path("logs/speed.jsonl").read_text().splitlines()]
    assert lines == [{"earlier": "line"}, record]


def test_resume_restores_the_state_in_place(capsys, monkeypatch):
    """A resumed run goes on from the checkpoint's very tensors (model, Adam's moments, a counter) and generators,
    restored into the objects the loop already holds, and saves into the folder it was resumed from."""
    run_main(NAME, ["--total-timesteps", "400", "--save-dir", "run", "--no-tensorboard"], capsys)
    saved = checkpoint_of("run")
    seen = {}
    start_run = load_script(NAME).Run.start

    def recording_start(self, state, **plan):
        first_step = start_run(self, state, **plan)
        seen.update(first_step=first_step, state=copy.deepcopy(harness.state_dict(state)), rng=torch.get_rng_state())
        return first_step

    monkeypatch.setattr(load_script(NAME).Run, "start", recording_start)
    record, err = run_main_stderr(NAME, ["--resume", "run", "--total-timesteps", "800", "--no-tensorboard"], capsys)
    assert seen["first_step"] == 400 and record["resumed_from"] == 400 and record["total_timesteps"] == 800
    assert "resuming at env step 400" in err
    assert torch.equal(seen["rng"], saved["rng"]["torch"])
    assert torch.equal(seen["state"]["seen"], torch.tensor(400))
    for name in ("model", "optimizer"):
        assert str(seen["state"][name]) == str(saved["state"][name]), name
    assert checkpoint_of("run")["global_step"] == 800 and checkpoint_of("run")["returns"] != saved["returns"]
    # The return curve goes on: its seconds from the first run's start, counting the seconds of both runs.
    seconds = [t for _, t, _ in record["return_curve"]]
    assert record["return_curve"][: len(saved["curve"])] == saved["curve"] and seconds == sorted(seconds)
    assert seconds[-1] >= saved["seconds"] >= saved["curve"][-1][1] and checkpoint_of("run")["seconds"] >= seconds[-2]


def test_rolled_back_undoes_what_its_block_changed():
    """rolled_back puts back, into the same tensors, what its block changed of a module, a dict of tensors, a tensor
    and torch's random generator; a fresh optimizer's state, which its step in the block made, stays zeroed: the
    next step is a fresh optimizer's first, bit for bit. An optimizer that has stepped before is refused."""
    torch.manual_seed(0)
    net, targets, count = torch.nn.Linear(3, 2), {"w": torch.ones(2)}, torch.zeros(1, dtype=torch.long)
    fresh = copy.deepcopy(net)
    optimizer, fresh_optimizer = (torch.optim.AdamW(n.parameters(), lr=0.1) for n in (net, fresh))
    weight, generator, rolled_back = net.weight, torch.get_rng_state(), harness.checkpoints.rolled_back
    with rolled_back({"net": net, "targets": targets, "count": count, "optimizer": optimizer}, CPU):
        net(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        targets["w"].add_(1.0)
        count.add_(5)
    assert net.weight is weight and torch.equal(net.weight, fresh.weight) and torch.equal(net.bias, fresh.bias)
    assert torch.equal(targets["w"], torch.ones(2)) and count.item() == 0
    assert torch.equal(torch.get_rng_state(), generator)
    x = torch.randn(4, 3)
    for n, o in ((net, optimizer), (fresh, fresh_optimizer)):
        o.zero_grad()
        n(x).square().sum().backward()
        o.step()
    assert torch.equal(net.weight, fresh.weight) and torch.equal(net.bias, fresh.bias)
    with pytest.raises(AssertionError, match="stepped"):
        with rolled_back({"optimizer": optimizer}, CPU):
            pass


def test_a_copied_folder_resumes_into_the_copy(capsys):
    """--resume DIR writes the next checkpoints into DIR, the original folder untouched; --save-dir names another."""
    run_main(NAME, ["--total-timesteps", "400", "--save-dir", "first", "--no-tensorboard"], capsys)
    shutil.copytree("first", "copy")
    before = digest("first/least_squares.pt")
    run_main(NAME, ["--resume", "copy", "--total-timesteps", "800", "--no-tensorboard"], capsys)
    assert checkpoint_of("copy")["global_step"] == 800 and digest("first/least_squares.pt") == before
    run_main(NAME, ["--resume", "copy/least_squares.pt", "--total-timesteps", "1200", "--save-dir", "other",
                    "--no-tensorboard"], capsys)  # fmt: skip
    assert checkpoint_of("other")["global_step"] == 1200 and checkpoint_of("copy")["global_step"] == 800


def test_a_finished_run_resumed_says_so(capsys):
    run_main(NAME, ["--total-timesteps", "400", "--save-dir", "run", "--no-tensorboard"], capsys)
    before = digest("run/least_squares.pt")
    proc = run_bad_input(NAME, ["--resume", "run", "--no-tensorboard"], capsys)
    assert_one_line_error(proc, "--resume run: the checkpoint is at env step 400, at the end that --total-timesteps "
                          "400 sets")  # fmt: skip
    assert digest("run/least_squares.pt") == before


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--learning-rate", "-0.1"], "--learning-rate -0.1"),
        (["--learning-rate", "0"], "--learning-rate 0"),
        (["--learning-rate", "nan"], "--learning-rate nan must be a finite number"),
        (["--learning-rate", "inf"], "--learning-rate inf must be a finite number"),
        (["--seed", "4294967296"], "--seed 4294967296 must be at most 2147483647"),
        (["--seed", str(2**40)], f"--seed {2**40} must be at most"),
        (["--exp-name", "a" * 300], "--exp-name: the run's folder name"),
        (["--exp-name", "a\nb"], "--exp-name 'a\\nb': a name of printable characters"),
        (["--exp-name", ""], "--exp-name '': an empty name"),
        (["--save-dir", ""], "--save-dir '': an empty name"),
        (["--resume", ""], "--resume '': an empty name"),
        (["--speed-log", ""], "--speed-log '': an empty name"),
        (["--profile-dir", ""], "--profile-dir '': an empty name"),
        (["--learning-rat", "0.1"], "--learning-rat: not a flag of this script; did you mean --learning-rate?"),
        (["--lr", "0.1"], "--lr: not a flag of this script; did you mean --learning-rate?"),
        (["--seed", "-1"], "--seed -1"),
        (["--total-timesteps", "0"], "--total-timesteps 0"),
        (["--num-envs", "0"], "--num-envs 0"),
        (["--torch-threads", "-1"], "--torch-threads -1"),
        (["--torch-threads", str(os.cpu_count() + 1)], f"this machine has {os.cpu_count()} cores"),
        (["--eval-episodes", "0"], "--eval-episodes 0"),
        (["--save-every", "100"], "--save-every 100"),
        (["--track", "--no-tensorboard"], "--no-tensorboard"),
        (["--resume", "a", "--eval-checkpoint", "b"], "exclude each other"),
        (["--eval-checkpoint", "b", "--save-dir", "c"], "--save-dir is for training: --eval-checkpoint evaluates"),
        (["--eval-checkpoint", "b", "--speed-log", "c"], "--speed-log is for training"),
        (["--eval-checkpoint", "b", "--profile-dir", "c"], "--profile-dir is for training"),
        (["--speed-log", "pipe"], "--speed-log pipe is a pipe: it names a file"),  # opening it would wait for a reader
        (["--total-timesteps", "1001"], "--total-timesteps 1001"),  # the script's own check_args
        (["--learning-rate", "1e39"], "--learning-rate 1e+39 is beyond float32's range"),
        (["--env-id", "CartPole"], "--env-id CartPole: name its version (CartPole-v0, CartPole-v1)"),
        (["--save-dir", "loop"], "--save-dir loop is a symbolic link to nothing"),
        (["--save-dir", "run", "--speed-log", "run/least_squares.pt"], "is the checkpoint file of --save-dir run"),
        (["--save-dir", "run", "--speed-log", "link"], "--speed-log link is the checkpoint file of --save-dir run"),
    ],
)
def test_bad_flags(argv, flag, capsys):
    """Every numeric flag is range-checked by name, before anything runs: one line naming the flag, exit 2; nothing
    written."""
    os.mkfifo("pipe")
    os.symlink("loop", "loop")
    os.symlink("run/least_squares.pt", "link")  # a link to the checkpoint: appending to it would damage it
    assert_one_line_error(run_bad_input(NAME, argv, capsys), flag)
    assert not Path("runs").exists() and not Path("run").exists()


def test_a_learning_rate_that_overflows_the_optimizer_is_divergence(capsys):
    """Adam's step of --learning-rate / (1 - beta1) overflows float32 at 1e38: the run ends as diverged, with its
    record, not in a traceback."""
    record = load_script(NAME).main(["--learning-rate", "1e38", "--no-tensorboard"])  # diverged at its first step
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1]) == record and record["diverged"] is True and harness.exit_code(record) == 1
    assert "error: the run diverged: the optimizer's step overflowed float32 at env step 0" in err.splitlines()
    assert "Traceback" not in err


def test_a_path_from_home(capsys, monkeypatch):
    """--save-dir=~/x, which no shell expands after '=': the home folder's x, not a folder named ~."""
    monkeypatch.setenv("HOME", os.path.abspath("home"))
    run_main(NAME, ["--save-dir=~/x", "--total-timesteps", "40", "--no-tensorboard"], capsys)
    assert checkpoint_of("home/x")["global_step"] == 40 and not Path("~").exists()
    run_main(NAME, ["--resume=~/x", "--total-timesteps", "80", "--speed-log", "~/log", "--no-tensorboard"], capsys)
    assert checkpoint_of("home/x")["global_step"] == 80 and Path("home/log").is_file() and not Path("~").exists()


def test_runs_started_in_the_same_second_have_folders_of_their_own(capsys, monkeypatch):
    """The run name holds the second it started (CleanRL's): a second run of the same script, env and seed in that
    second writes runs/<name>-2, not into the first one's folder."""
    import harness.options

    monkeypatch.setattr(harness.options, "time", SimpleNamespace(time=lambda: 1795961057.0))
    for _ in range(2):
        run_main(NAME, ["--total-timesteps", "40"], capsys)
    name = "runs/LeastSquares__least_squares__1__1795961057"
    assert sorted(str(p.parent) for p in Path("runs").glob("*/events.out.tfevents.*")) == [name, f"{name}-2"]


@pytest.mark.parametrize("redirect", ["> /dev/full", ">&-", "2>&-"])
def test_stdout_full_or_closed(redirect, tmp_path):
    """The record on a stdout that cannot take it (a full disk): one error line, exit code 2, no traceback; a closed
    stdout or stderr: the run goes on, and the other stream gets nothing of it."""
    proc = subprocess.run(["bash", "-c", f"{sys.executable} {ROOT / 'tests' / 'least_squares.py'} --total-timesteps 40 "
                           f"--no-tensorboard {redirect}"], capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    if redirect == "> /dev/full":
        assert_one_line_error(proc, "the speed record could not be printed: No space left on device")
    else:
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout.count("\n") == (1 if redirect == "2>&-" else 0), proc.stdout


@pytest.fixture
def saved(capsys):
    """A checkpoint of the toy in run/, and the digest of its bytes."""
    run_main(NAME, ["--total-timesteps", "400", "--save-dir", "run", "--no-tensorboard"], capsys)
    return digest("run/least_squares.pt")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--resume", "missing.pt"], "missing.pt: no such checkpoint file"),
        (["--eval-checkpoint", "empty"], "empty/least_squares.pt: no such checkpoint file"),
        (["--resume", "another"], "another/least_squares.pt: no such checkpoint file (the folder holds dqn.pt: "
         "another script's)"),
        (["--resume", "/dev/null"], "--resume /dev/null: not a checkpoint file (a pipe, a device?)"),
        (["--resume", "truncated.pt"], "truncated.pt: not a readable checkpoint, truncated or corrupt"),
        (["--eval-checkpoint", "text.pt"], "text.pt: not a readable checkpoint"),
        (["--resume", "plain.pt"], "plain.pt: not a checkpoint of this version"),
        (["--resume", "other_script.pt"], "other_script.pt: a checkpoint of sac_continuous_action, not of"),
        (["--save-dir", "run"], "--save-dir run holds another run's checkpoint"),
        (["--save-dir", "run/least_squares.pt/inside"], "--save-dir"),
        (["--save-dir", "run/least_squares.pt"], "--save-dir run/least_squares.pt is a file: it names a folder"),
        (["--resume", "run", "--learning-rate", "0.5"], "--learning-rate 0.5 (saved: 0.01) differ"),
        (["--resume", "run", "--env-id", "Other"], "--env-id changes the algorithm"),
        (["--resume", "run", "--env-id", "Other", "--learning-rate", "0.5"], "--env-id, --learning-rate change the"),
        (["--exp-name", "a/b"], "--exp-name 'a/b': a name of printable characters, not a path"),
        (["--resume", "other_env.pt", "--env-id", "LeastSquares", "--resume-anyway"],
         "the checkpoint's state.model does not fit this run on LeastSquares (the checkpoint's: Other): size mismatch "
         "for weight"),
    ],
)
def test_bad_checkpoints_and_folders(saved, argv, fragment, capsys):
    """One error line each, saying what is wrong, and the checkpoint already there untouched."""
    data = Path("run/least_squares.pt").read_bytes()
    Path("truncated.pt").write_bytes(data[:1000])
    Path("text.pt").write_text("not a checkpoint\n")
    torch.save({"weights": torch.zeros(2)}, "plain.pt")
    saved_toy = torch.load("run/least_squares.pt", weights_only=True)
    torch.save({**saved_toy, "script": "sac_continuous_action"}, "other_script.pt")
    other_model = {"weight": torch.zeros(1, 5), "bias": torch.zeros(1)}  # an env of 5 features
    torch.save({**saved_toy, "args": {**saved_toy["args"], "env_id": "Other"},
                "state": {**saved_toy["state"], "model": other_model}}, "other_env.pt")  # fmt: skip
    Path("empty").mkdir()
    Path("another").mkdir()
    torch.save({**saved_toy, "script": "dqn"}, "another/dqn.pt")
    assert_one_line_error(run_bad_input(NAME, argv, capsys), fragment)
    assert digest("run/least_squares.pt") == saved


@pytest.mark.parametrize("option, below", [("--speed-log", "speed.jsonl"), ("--profile-dir", "profile"),
                                           ("--save-dir", "run")])  # fmt: skip
def test_unwritable_output_fails_at_start(option, below, capsys):
    Path("plain-file").write_text("not a folder\n")
    proc = run_bad_input(NAME, [option, f"plain-file/{below}"], capsys)
    assert_one_line_error(proc, option, "cannot be written")
    assert Path("plain-file").read_text() == "not a folder\n"


@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="Linux's /proc")
def test_a_speed_log_in_a_folder_that_takes_no_new_file_is_named_itself(capsys):
    """/proc/version cannot be appended to, and /proc takes no file of ours: the line names the file, not /proc."""
    assert_one_line_error(run_bad_input(NAME, ["--speed-log", "/proc/version"], capsys), "--speed-log /proc/version",
                          "cannot be written")  # fmt: skip


@pytest.mark.parametrize("in_the_way", ["runs", "speed.jsonl"])
def test_a_file_or_folder_in_the_way_is_named(in_the_way, capsys):
    """A file named runs where TensorBoard's folder goes, a folder named as --speed-log's file: one line naming it."""
    Path(in_the_way).mkdir() if in_the_way.endswith(".jsonl") else Path(in_the_way).write_text("mine\n")
    argv = ["--speed-log", "speed.jsonl"] if in_the_way.endswith(".jsonl") else []
    expected = "is a folder: it names a file" if in_the_way.endswith(".jsonl") else "a file named runs is in the way"
    assert_one_line_error(run_bad_input(NAME, argv, capsys), in_the_way, expected)
    assert Path(in_the_way).is_dir() or Path(in_the_way).read_text() == "mine\n"


def test_a_speed_log_that_cannot_be_written_comes_after_the_record(capsys, monkeypatch):
    """The record reaches stdout first; a --speed-log that fails as it is written (a full disk) is one error line."""

    def full_disk(path, mode="r"):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(harness.speed, "open", full_disk, raising=False)  # the check at start passes, the write fails
    with pytest.raises(SystemExit) as exit:
        load_script(NAME).main(["--speed-log", "speed.jsonl", "--no-tensorboard", "--total-timesteps", "40"])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and json.loads(out.strip().splitlines()[-1])["total_timesteps"] == 40
    assert err.strip().splitlines()[-1] == ("error: --speed-log speed.jsonl: the record was not appended: No space "
                                            "left on device")  # fmt: skip


@pytest.mark.parametrize("every, first, end, offset, refused", [
    (150, 50, 150, 0, True),  # vector steps 50-149: no multiple of 150
    (100, 50, 150, 0, False),  # 100 is one
    (50, 20, 40, 49, True),  # gradient updates 20-39, the actor on the 50th, 100th ...: none
    (21, 20, 40, 20, False),  # the 21st (index 20) is one
    (10, 5, 6, 0, False),  # the script's default: kept, as CleanRL keeps it, though never due
])
def test_a_changed_frequency_that_is_never_due_is_refused(every, first, end, offset, refused, capsys):
    """check_due: a frequency the user changed whose updates fall on none of the run's update steps is one error
    line naming the flag; the script's own default is left to CleanRL's behaviour."""

    @dataclasses.dataclass
    class Args:
        policy_frequency: int = 10
        learning_starts: int = 100
        total_timesteps: int = 300

    args = Args(policy_frequency=every)
    if not refused:
        harness.check_due(args, "policy_frequency", first, end, "vector steps", offset)
        return
    with pytest.raises(SystemExit) as exit:
        harness.check_due(args, "policy_frequency", first, end, "vector steps", offset)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"error: --policy-frequency {every} is never due:")
    assert f"vector steps {first} to {end - 1}" in err and len(err.strip().splitlines()) == 1


def test_resume_names_the_flags_that_differ(saved, capsys):
    """A resumed run with other flags than its checkpoint's names them; one that changes the algorithm goes on only
    with --resume-anyway."""
    argv = ["--resume", "run", "--total-timesteps", "800", "--learning-rate", "0.02", "--resume-anyway"]
    record, err = run_main_stderr(NAME, argv + ["--no-tensorboard"], capsys)
    assert "resuming with --total-timesteps 800 (saved: 400), --learning-rate 0.02 (saved: 0.01)" in err
    assert record["resumed_from"] == 400 and checkpoint_of("run")["args"]["learning_rate"] == 0.02


def test_a_diverged_run_ends_with_one_line_and_its_record(capsys, monkeypatch):
    """A loss that becomes NaN or infinite ends the run: one error line with the env step, the record (diverged), and
    exit code 1 from the script."""
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)  # the loop logs its loss every step
    record, err = run_main_stderr(NAME, ["--learning-rate", "1e30", "--no-tensorboard"], capsys)
    assert record["diverged"] is True and record["total_timesteps"] < 2000
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert re.fullmatch(r"error: the run diverged: losses/loss became (nan|inf) at env step \d+", line), line
    assert harness.exit_code(record) == 1 and harness.exit_code({**record, "diverged": False}) == 0


def test_the_record_on_a_terminal_is_its_headline(capsys, monkeypatch):
    """On a terminal the last stdout line is the record's headline; --speed-log gets the whole record."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    record = load_script(NAME).main(["--speed-log", "speed.jsonl", "--no-tensorboard"])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline == {key: record[key] for key in harness.speed.HEADLINE} and len(headline) < len(record)
    assert json.loads(Path("speed.jsonl").read_text()) == record


def test_the_return_curve_gains_a_point_at_least_every_curve_seconds(capsys, monkeypatch):
    """Besides one point every 1/50 of the run, a point once CURVE_SECONDS pass without one: here every step."""
    monkeypatch.setattr(harness.progress, "CURVE_SECONDS", 0.0)
    record = run_main(NAME, ["--total-timesteps", "2000", "--no-tensorboard"], capsys)
    assert len(record["return_curve"]) > 50


def test_failed_write_keeps_the_last_checkpoint(capsys, monkeypatch):
    """A write that fails half-way (the disk full) is one error line; the checkpoint before it still loads, and no
    temporary file is left behind."""
    save, calls = torch.save, []

    def failing_save(obj, f):
        calls.append(obj["global_step"])
        if len(calls) == 1:
            return save(obj, f)
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    argv = ["--total-timesteps", "800", "--save-every", "200", "--save-dir", "run", "--no-tensorboard"]
    assert_one_line_error(run_bad_input(NAME, argv, capsys), "the checkpoint of step 400 was not written")
    assert calls == [200, 400] and checkpoint_of("run")["global_step"] == 200
    assert [p.name for p in Path("run").iterdir()] == [f"{NAME}.pt"]


def test_profile_window(capsys):
    """--profile-dir: a trace of the steady window's first units, with the loop's phases and env steps per call."""
    run_main(NAME, ["--profile-dir", "profile", "--no-tensorboard"], capsys)
    trace = json.loads(Path("profile/least_squares.trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"env_step", "update"} <= names and int(trace["env_steps_per_call"]) == 4


def test_a_run_ended_in_its_warm_up_says_there_is_no_trace_and_keeps_its_compile_cache(capsys, monkeypatch):
    """--profile-dir profiles the steady window: a run that ends before it says it wrote no trace. The compile cache,
    saved as the window opens, is saved at the end instead."""
    saved_at, start = [], harness.Run.start

    def start_with_a_cache(self, *args, **kwargs):
        self.compile_cache = SimpleNamespace(save=lambda: saved_at.append(self.steps))
        return start(self, *args, **kwargs)

    monkeypatch.setattr(harness.Run, "start", start_with_a_cache)
    argv = ["--profile-dir", "profile", "--total-timesteps", "16", "--no-tensorboard"]  # the window opens at 32
    record, err = run_main_stderr(NAME, argv, capsys)
    assert not record["steady"] and "--profile-dir profile: no trace: it profiles the steady window" in err
    assert not list(Path("profile").iterdir()) and saved_at == [16]


def test_evaluation(saved, capsys):
    record = load_script(NAME).main(["--eval-checkpoint", "run", "--eval-episodes", "3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == record and record["episodes"] == 3 and len(out) == 4 and not record["interrupted"]
    assert out[:3] == [f"episode {i + 1}: return {r:.2f}" for i, r in enumerate(record["returns"])]


def test_a_stop_during_evaluation_ends_it_with_the_episodes_done(saved, workdir):
    """Ctrl-C during --eval-checkpoint: the record of the episodes done, marked interrupted, exit 130, no traceback."""
    proc = start("--eval-checkpoint", "run", "--eval-episodes", "1000000", cwd=workdir)
    while not proc.stdout.readline().startswith("episode 2:"):
        assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)  # a hang guard, not a measure
    assert proc.returncode == 130 and "Traceback" not in err, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] and record["episodes"] >= 2 and len(record["returns"]) == record["episodes"]
    assert f"interrupted after {record['episodes']} episodes" in err


@pytest.mark.parametrize("signum, ignored", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)])
def test_signal_saves_and_the_run_resumes(signum, ignored, workdir):
    """Ctrl-C or SIGTERM with --save-dir, also where SIGINT came ignored (a background job of a script): a
    checkpoint at the end of the step, the interrupted record, exit 130; the resumed run goes on from there."""
    proc = start("--total-timesteps", "100000", "--save-every", "40", "--save-dir", "run", "--no-tensorboard",
                 cwd=workdir, ignore_sigint=ignored)  # fmt: skip
    wait_for(workdir / "run" / f"{NAME}.pt", proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] is True and f"interrupted after {record['total_timesteps']} env steps" in err
    assert checkpoint_of(workdir / "run")["global_step"] == record["total_timesteps"]
    resumed = start("--total-timesteps", str(record["total_timesteps"] + 40), "--resume", "run", "--no-tensorboard",
                    cwd=workdir)  # fmt: skip
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] == record["total_timesteps"]


def test_killed_run_resumes(workdir):
    """kill -9 after a checkpoint: the run resumes from it and ends."""
    killed = start("--total-timesteps", "100000", "--save-every", "40", "--save-dir", "run", "--no-tensorboard",
                   cwd=workdir)  # fmt: skip
    wait_for(workdir / "run" / f"{NAME}.pt", killed)
    killed.kill()
    killed.wait()
    step = checkpoint_of(workdir / "run")["global_step"]
    resumed = start("--total-timesteps", str(step + 80), "--resume", "run", "--no-tensorboard", cwd=workdir)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["resumed_from"] == step and record["total_timesteps"] == step + 80


def test_progress_lines_where_stderr_is_not_a_terminal(capsys, monkeypatch):
    """With no wait between lines: one line per env step, counting env steps; until the fps window opens (8 steps of
    4 envs) each says warm-up and gives neither fps nor eta, which would not mean anything yet."""
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(harness.progress, "CONSOLE_SECONDS", 0.0)
    record, err = run_main_stderr(NAME, ["--total-timesteps", "80", "--no-tensorboard"], capsys)
    assert f"{NAME}: warm-up for 32 env steps; fps and eta once the rate is steady" in err
    pattern = re.compile(rf"{NAME}: (\d+)/80 steps, (warm-up|fps \d+)(, return -?\d+\.\d+)?(, eta \d+\.\d min)?")
    lines = [m for m in map(pattern.fullmatch, err.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(4, 84, 4)), err[-500:]
    assert [m.group(2) == "warm-up" for m in lines] == [step <= 32 for step in range(4, 84, 4)]
    assert [m.group(4) is None for m in lines] == [step <= 32 for step in range(4, 84, 4)]
    assert record["steady"] is True


def test_progress_bar_on_a_terminal(monkeypatch):
    """On a terminal the bar shows no eta in the warm-up (tqdm's own, from the warm-up's rate, is left out), ours once
    the fps is steady; a stop's line goes above the bar, not glued to it."""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    progress = harness.progress.Progress("toy", 0, 1000, [], [], 0.0)
    progress.show(100, 1.0, 100.0, False)
    progress.bar.refresh()  # as tqdm does once its mininterval has passed
    warm_up = sys.stderr.getvalue().split("\r")[-1]
    assert "100/1.00k" in warm_up and "warm-up" in warm_up and "eta" not in warm_up and "<" not in warm_up
    progress.returns.append(5.0)
    progress.show(500, 2.0, 400.0, True)
    progress.bar.refresh()
    assert "fps 400, return 5.0, eta 0.0 min]" in sys.stderr.getvalue().split("\r")[-1]
    stops = harness.signals.StopSignals.__new__(harness.signals.StopSignals)  # no handlers put in
    stops.signal, stops.in_loop, stops.unit_seconds, stops.units = None, True, 0, 0
    stops.on_signal(signal.SIGINT, None)
    assert "\rstopping at the end of this step (again: at once)\n" in sys.stderr.getvalue()
    progress.close(500, 3.0)


def test_timeout_signals_twice_and_it_is_one_stop(workdir):
    """`timeout -s INT` signals its command, then the command's process group: the same stop, twice at once. Started
    in the background of a shell, as GPU runs often are: a checkpoint, the record, exit 130, no traceback."""
    command = (f"timeout -s INT 1000 {sys.executable} {script_path(NAME)} --step-seconds 0.01 --total-timesteps "
               "100000 --save-dir run --save-every 40 --no-tensorboard > out.txt 2> err.txt & echo $! > timeout.pid; "
               "wait $!")  # fmt: skip
    shell = subprocess.Popen(["bash", "-c", command], cwd=workdir)
    wait_for(workdir / "run" / f"{NAME}.pt", shell)  # its loop runs: however loaded the machine, it times out now
    os.kill(int((workdir / "timeout.pid").read_text()), signal.SIGALRM)  # timeout's own alarm
    assert shell.wait(timeout=600) == 124  # timeout's "timed out"
    out, err = (workdir / "out.txt").read_text(), (workdir / "err.txt").read_text()
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] is True and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert checkpoint_of(workdir / "run")["global_step"] == record["total_timesteps"] > 0


@pytest.mark.signals
def test_a_handler_put_in_by_a_library_is_replaced(workdir):
    """A library that puts its own SIGTERM handler in mid-run (Triton's LLVM does, as it compiles; here the default
    action, which ends the process at once) is undone as the next unit begins: SIGTERM still gives the record."""
    code = f"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("{NAME}", {str(script_path(NAME))!r})
toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(toy)
tick = toy.Run.tick
def tick_then(self, step):
    if step == 40:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if step == 80:
        os.kill(os.getpid(), signal.SIGTERM)
    return tick(self, step)
toy.Run.tick = tick_then
sys.exit(130 if toy.main(["--total-timesteps", "4000", "--no-tensorboard"])["interrupted"] else 0)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["interrupted"] is True and record["total_timesteps"] == 80, record


def test_one_stop_delivered_twice_is_one_stop(monkeypatch, capsys):
    """In the loop, a second signal within 3 s of the first (the same stop, delivered twice) leaves the run to stop
    at the end of its unit of work (the first says when, from the last unit's time); a later one stops it at once,
    as a second Ctrl-C should."""
    from harness import signals

    stops = signals.StopSignals.__new__(signals.StopSignals)
    stops.signal, stops.in_loop, stops.unit_seconds, stops.units = None, True, 53.2, 7  # the last unit took 53.2 s
    clock = iter([100.0, 102.0, 103.5])
    monkeypatch.setattr(signals.time, "monotonic", lambda: next(clock))
    stops.on_signal(signal.SIGINT, None)
    stops.on_signal(signal.SIGINT, None)
    err = capsys.readouterr().err
    assert stops.signal == signal.SIGINT and err == "stopping at the end of this step, in about 53 s (again: at once)\n"
    with pytest.raises(KeyboardInterrupt):
        stops.on_signal(signal.SIGINT, None)


def test_run_options_are_documented():
    """Every run option has its docstring, which tyro prints in each script's --help."""
    source = (Path(harness.__file__).parent / "options.py").read_text()
    options = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "RunOptions")
    body = options.body
    pairs = zip(body, body[1:] + [None])
    fields = [(node.target.id, after) for node, after in pairs if isinstance(node, ast.AnnAssign)]
    assert len(fields) == len(dataclasses.fields(harness.RunOptions))
    assert all(isinstance(after, ast.Expr) and isinstance(after.value.value, str) for _, after in fields), fields


# A rank's stop handler only notes the signal; its loop then waits for a collective that never completes (a rank
# died), or ends as a stop should.
STUCK_RANK = """
import signal, sys, time
from harness.torchrun import exit_if_stuck
stopped = []
signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
exit_if_stuck(3, seconds=1)
print("ready", flush=True)
while not (stopped and sys.argv[1] == "stops"):
    time.sleep(0.05)
time.sleep(0.2)
sys.exit(130)
"""


@pytest.mark.parametrize("ending", ["stuck", "stops"])
def test_a_rank_stuck_after_a_signal_ends_with_one_line(ending):
    rank = subprocess.Popen([sys.executable, "-c", STUCK_RANK, ending], cwd=SCRIPTS,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert rank.stdout.readline() == "ready\n"
    rank.send_signal(signal.SIGTERM)
    _, stderr = rank.communicate(timeout=60)
    if ending == "stuck":
        assert rank.returncode == 1
        assert stderr.splitlines() == [
            "error: rank 3 had not stopped 1 s after a stop signal: a rank has died or hangs, or the ranks were still "
            "compiling"
        ]
    else:
        assert rank.returncode == 130 and stderr == ""


@pytest.mark.signals
def test_a_deferred_signal_is_pending_until_the_ranks_agree(capsys):
    """Under torchrun a signal is only noted (stops.pending), never a stop of this rank alone: neither a message nor a
    KeyboardInterrupt, however often it comes; one noted before the loop's start carries over."""
    from harness import signals

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        stops = signals.StopSignals()
        stops.in_loop, stops.signal = True, signal.SIGINT  # before the ranks joined
        stops.defer()
        assert (stops.pending, stops.signal) == (signal.SIGINT, None)
        for _ in range(3):
            signal.raise_signal(signal.SIGTERM)
        assert (stops.pending, stops.signal) == (signal.SIGTERM, None) and capsys.readouterr().err == ""
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("weight, scale", [(float("nan"), 1.0), (1.0, 0.0), (1.0, 1.0)], ids=["nan", "zero-scale", "bug"])
def test_a_distribution_refusing_its_parameters_is_divergence(weight, scale, capsys, monkeypatch):
    """A baseline's distribution checks its parameters and raises ValueError on NaN, or on a scale of 0 from finite
    weights (exp of a log-std gone far negative): the run ends as diverged (one line, exit code 1). Any other
    ValueError, with finite weights, is a bug: raised."""
    script = load_script(NAME)

    def train(args, run):
        model = torch.nn.Linear(2, 1)
        run.start({"model": model}, total_steps=8, warmup_steps=4, profile_steps=4, env_steps_per_call=4)
        run.proceed(4)
        with torch.no_grad():
            model.weight.fill_(weight)
        torch.distributions.Normal(model(torch.ones(1, 2)), scale)  # validates its arguments
        raise ValueError("a bug of the script's")

    monkeypatch.setattr(script, "train", train)
    if scale and weight == 1.0:
        with pytest.raises(ValueError, match="a bug of the script's"):
            script.main(["--no-tensorboard"])
        return
    record, err = run_main_stderr(NAME, ["--no-tensorboard"], capsys)
    assert record["diverged"] is True and record["interrupted"] is False and harness.exit_code(record) == 1
    what = "NaN in the policy" if scale else "the policy's distribution out of range"
    assert f"error: the run diverged: {what} at env step 4" in err.splitlines()


@pytest.mark.parametrize("nan_at", [12, 24], ids=["before-a-periodic-save", "in-the-last-step"])
def test_weights_gone_nan_unlogged_are_divergence_and_never_saved(nan_at, capsys, monkeypatch):
    """A loss that went NaN but that the loop never logged (CleanRL's scripts log every 100 steps): no checkpoint of
    the NaN state, at a periodic save or at the end; the run ends as diverged, the last good checkpoint kept."""
    from harness.run import all_finite

    script = load_script(NAME)

    def train(args, run):
        model = torch.nn.Linear(2, 1)
        run.start({"model": model}, total_steps=28, warmup_steps=4, profile_steps=4, env_steps_per_call=4)
        for step in range(0, 28, 4):
            if not run.proceed(step):
                break
            if step == nan_at:
                with torch.no_grad():
                    model.weight.fill_(float("nan"))

    monkeypatch.setattr(script, "train", train)
    argv = ["--no-tensorboard", "--save-dir", "run", "--save-every", "8"]
    record, err = run_main_stderr(NAME, argv, capsys)
    assert record["diverged"] is True and harness.exit_code(record) == 1
    found_at, last_good = (16, 8) if nan_at == 12 else (24, 24)  # the periodic save at 16; the end's, after 24
    assert f"error: the run diverged: NaN in the trained tensors at env step {found_at}" in err.splitlines()
    assert checkpoint_of("run")["global_step"] == last_good
    assert all_finite(checkpoint_of("run")["state"])


def test_phases_are_markers_that_last_until_the_next(capsys):
    """run.phase(name) opens a profiler scope that the next phase() or unit of work closes: no scope is left open,
    and outside the profiled window a phase costs nothing (no scope at all)."""
    run_main(NAME, ["--profile-dir", "profile", "--no-tensorboard"], capsys)
    trace = json.loads(Path("profile/least_squares.trace.json").read_text())
    scopes = [e for e in trace["traceEvents"] if e.get("name") in ("env_step", "update") and e.get("ph") == "X"]
    steps = {e["name"]: 0 for e in scopes}
    for e in scopes:
        steps[e["name"]] += 1
    assert steps["env_step"] == steps["update"] == 4, steps  # profile_steps 16, 4 env steps per unit


def test_a_temporary_left_by_a_killed_write_goes_with_the_next_save(capsys):
    """kill -9 in the middle of a checkpoint write leaves `.<script>.<pid>.tmp`: the next run that saves into the
    folder removes it; one of a process still running (writing now) stays."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Path("run").mkdir()
        stale, writing = (Path(f"run/.{NAME}.{proc.pid}.tmp") for proc in (dead, alive))
        for path in (stale, writing):
            path.write_bytes(b"half a checkpoint")
        run_main(NAME, ["--total-timesteps", "40", "--save-dir", "run", "--no-tensorboard"], capsys)
        assert not stale.exists() and writing.exists() and (Path("run") / f"{NAME}.pt").exists()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("error, out_of_memory", [
    (MemoryError("Unable to allocate 32.7 TiB"), True), (torch.OutOfMemoryError("CUDA out of"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory"), True), (RuntimeError("a kernel failed"), False),
    (NotImplementedError("no such operator"), False)])  # fmt: skip
def test_out_of_memory_is_one_line(error, out_of_memory, capsys, monkeypatch):
    """A buffer too large for the machine (--buffer-size 1000000000000) is one line that names the sizes to lower.
    Another RuntimeError, or one of its kinds (NotImplementedError, a compiler's error), is raised as it is: a bug's
    traceback, not a hint to lower the sizes."""
    script = load_script(NAME)

    def train(args, run):
        raise error

    monkeypatch.setattr(script, "train", train)
    if out_of_memory:
        assert_one_line_error(run_bad_input(NAME, ["--no-tensorboard"], capsys), "out of memory", "--buffer-size")
    else:
        with pytest.raises(type(error)):
            run_main(NAME, ["--no-tensorboard"], capsys)
        assert "out of memory" not in capsys.readouterr().err


def test_a_stop_during_a_long_unit_cuts_it_short(workdir):
    """Ctrl-C in a unit of work that lasts (a compilation; here a step of 600 s) stops the run AT_ONCE_SECONDS
    later, in the middle of the unit: the record (interrupted, no step done), exit 130, no traceback, and no
    checkpoint of a step cut in half. The process does not wait for the worker threads the unit left running (a
    compiler's pool; here one of 600 s)."""
    proc = start("--step-seconds", "600", "--worker-seconds", "600", "--save-dir", "run", "--no-tensorboard",
                 cwd=workdir)  # fmt: skip
    while "running the env step" not in proc.stderr.readline():  # the warm-up's line: the loop is in its step
        assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)  # a hang guard, not a measure: 600 s is the unit's and the worker's
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "stopping in the middle of it" in err and "the checkpoint in run is the last one saved: none" in err
    assert json.loads(out.strip().splitlines()[-1])["total_timesteps"] == 0
    assert not (workdir / "run" / f"{NAME}.pt").exists()


def test_compile_cache_keeps_a_file_per_gpu_and_torch(monkeypatch, capsys):
    """--compile-cache: the warm-up's artifacts go into a file named for this device and torch version, which the
    next start loads; a folder holding only another version's file says so in one line and is not loaded from; an
    unreadable file is compiled over."""
    from harness.compile_cache import CompileCache

    loaded, version, cpu = [], torch.__version__, torch.device("cpu")
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts of " + version.encode(), None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    CompileCache("cache", cpu).save()
    assert "--compile-cache cache: nothing for torch" in capsys.readouterr().err and loaded == []
    (ours,) = Path("cache").glob("torch-*.bin")
    CompileCache("cache", cpu)
    assert loaded == [b"artifacts of " + version.encode()] and "loaded" in capsys.readouterr().err
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    CompileCache("cache", cpu)
    err = capsys.readouterr().err
    assert len(loaded) == 1 and f"nothing for torch 0.0.0 (CUDA" in err and f"(it holds torch {version} (CUDA" in err
    monkeypatch.setattr(torch, "__version__", version)

    def truncated(data):
        raise EOFError

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", truncated)
    CompileCache("cache", cpu).save()
    assert f"{ours.name} unreadable (EOFError): compiling" in capsys.readouterr().err
    assert ours.read_bytes() == b"artifacts of " + version.encode() and not list(Path("cache").glob("*.tmp"))
    # Compiled code names its device: a torchrun rank on cuda:1 keeps a file of its own; cuda:0's is a single GPU's.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    for index in (0, 1):
        monkeypatch.setattr(torch.cuda, "current_device", lambda: index)
        CompileCache("cache", torch.device("cuda")).save()
    made = f"torch {version} (CUDA {torch.version.cuda}) on "
    assert f"nothing for {made}NVIDIA H200 as cuda:1 yet" in capsys.readouterr().err
    texts = {path.read_text() for path in Path("cache").glob("torch-*.txt")}
    assert texts == {made + "cpu", made + "NVIDIA H200", made + "NVIDIA H200 as cuda:1"}


def test_compile_cache_holds_warps_kernels_and_the_drivers(monkeypatch):
    """--compile-cache DIR: Warp builds its kernels in DIR/warp, and the CUDA driver keeps there the machine code it
    compiles from Warp's PTX (DIR/cuda), both named as the options are read, before CUDA starts."""
    from harness.options import parse_args

    for name in ("WARP_CACHE_PATH", "CUDA_CACHE_PATH"):
        monkeypatch.setenv(name, "restored after the test")
    script = load_script("ppo_continuous_action_gpu_mujoco_torchcompile")
    parse_args(script.Args, script.__file__, ["--compile", "--compile-cache", "cache"])
    assert os.environ["WARP_CACHE_PATH"] == str(Path("cache").absolute() / "warp")
    assert os.environ["CUDA_CACHE_PATH"] == str(Path("cache").absolute() / "cuda")


def test_compile_cache_keeps_what_compile_builds(tmp_path):
    """--compile-cache in a twin run without --compile (and off MuJoCo Warp) would keep nothing: one line, and no
    folder made. In a process of its own, as a user runs it: this one has imported Warp for other tests."""
    proc = run_cli("ppo_continuous_action_torchcompile", "--compile-cache", "cache", cwd=tmp_path)
    assert_one_line_error(proc, "--compile-cache keeps what --compile builds: pass --compile too")
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc gives a process's start")
def test_a_run_counts_its_seconds_from_the_process_start(monkeypatch):
    """warmup_seconds and the curve's seconds count the imports before the harness when the script is the program:
    from its process's start. A script called from other code (a test, a notebook) counts from its Run."""
    from harness.run import age, is_program

    monkeypatch.setattr(sys.modules["__main__"], "__file__", __file__, raising=False)  # as if this were the script
    assert is_program(__file__) and not is_program(harness.run.__file__)
    assert age() > time.perf_counter() - IMPORTED
