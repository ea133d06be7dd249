"""What a user sees around a run, through the SAC baseline (the measurement block is the same text in every
script, test_contract.py): output paths checked before training, --track without credentials, a real Ctrl-C,
the progress line where stderr is not a terminal."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import SCRIPTS, assert_one_line_error, load_script, run_bad_input, run_main, run_main_stderr

pytestmark = pytest.mark.usefixtures("workdir")
NAME = "sac_continuous_action"
TINY = ["--total-timesteps", "120", "--learning-starts", "40", "--batch-size", "8", "--buffer-size", "200"]


@pytest.fixture
def blocker(workdir):
    """A plain file: any path below it can be neither a file nor a folder, even for root."""
    path = workdir / "plain-file"
    path.write_text("not a folder\n")
    return path


@pytest.mark.parametrize(
    "option, below, fragment",
    [("--speed-log", "speed.jsonl", "--speed-log"), ("--profile-dir", "profile", "--profile-dir")],
)
def test_unwritable_output_fails_at_start(option, below, fragment, blocker, capsys):
    proc = run_bad_input(NAME, TINY + [option, str(blocker / below)], capsys)
    assert_one_line_error(proc, fragment, str(blocker / below), "cannot be written")
    assert blocker.read_text() == "not a folder\n"


def test_negative_torch_threads_is_refused(capsys):
    assert_one_line_error(run_bad_input(NAME, TINY + ["--torch-threads", "-1"], capsys), "--torch-threads -1")


def test_unwritable_tensorboard_folder_fails_at_start(workdir, capsys):
    (workdir / "runs").write_text("a file where the TensorBoard folder goes\n")
    proc = run_bad_input(NAME, TINY, capsys)
    assert_one_line_error(proc, "TensorBoard folder", "--no-tensorboard")


def test_missing_folders_are_made_and_a_log_keeps_its_lines(workdir, capsys):
    log = workdir / "new" / "folders" / "speed.jsonl"
    record = run_main(NAME, TINY + ["--speed-log", str(log), "--no-tensorboard"], capsys)
    log.write_text('{"earlier": "line"}\n' + log.read_text())
    run_main(NAME, TINY + ["--speed-log", str(log), "--no-tensorboard"], capsys)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == {"earlier": "line"} and lines[1] == record and lines[2]["script"] == NAME


@pytest.fixture
def no_wandb_login(workdir, monkeypatch):
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NETRC", str(workdir / "no-netrc"))


def test_track_without_credentials_fails_at_start(no_wandb_login, capsys):
    imported = "wandb" in sys.modules
    proc = run_bad_input(NAME, TINY + ["--track"], capsys)
    assert_one_line_error(proc, "--track", "wandb login", "WANDB_MODE=offline")
    assert ("wandb" in sys.modules) == imported, "wandb was imported: nothing may reach the network"


@pytest.mark.parametrize(
    "variable, value, netrc_line",
    [("WANDB_MODE", "offline", None), ("WANDB_API_KEY", "k" * 40, None), (None, None, "machine api.wandb.ai")],
)
def test_wandb_credentials_found(variable, value, netrc_line, no_wandb_login, workdir, monkeypatch):
    module = load_script(NAME)
    assert not module.wandb_credentials()
    if variable:
        monkeypatch.setenv(variable, value)
    else:
        (workdir / "no-netrc").write_text(f"{netrc_line} login user password {'k' * 40}\n")
    assert module.wandb_credentials()


def test_progress_line_where_stderr_is_not_a_terminal(monkeypatch, capsys):
    """With no wait between lines: one line per env step, counting env steps, marked as warm-up until the fps
    window opens (step 240: learning starts at 40, then 200 warm-up steps)."""
    module = load_script(NAME)
    monkeypatch.setattr(module, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(module, "CONSOLE_SECONDS", 0.0)
    record, err = run_main_stderr(NAME, TINY[:1] + ["300"] + TINY[2:] + ["--no-tensorboard"], capsys)
    pattern = re.compile(rf"{NAME}: (\d+)/300 steps, fps \d+( \(warm-up\))?, return (nan|-?\d+\.\d), eta \d+\.\d min")
    lines = [m for m in map(pattern.fullmatch, err.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == list(range(1, 301)), err[-500:]
    assert [bool(m.group(2)) for m in lines] == [step <= 240 for step in range(1, 301)]
    assert record["steady"] is True


def test_ctrl_c_in_a_terminal_run(workdir):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, once the loop runs: exit code 130
    within seconds, one line on stderr, no traceback, and the speed record on stdout marked interrupted."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / f"{NAME}.py"), "--total-timesteps", "1000000", "--learning-starts", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(workdir.glob("runs/*/events.out.tfevents.*")):  # the writer starts as the loop does
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert time.monotonic() - sent < 10
    assert "Traceback" not in err and err.count("interrupted after") == 1, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] is True and 0 < record["total_timesteps"] < 1000000
    assert f"interrupted after {record['total_timesteps']} env steps" in err
