"""What a new user hits with a real script (the harness itself is tested in test_harness.py): bad inputs, each one
line and exit 2; Ctrl-C from a terminal; --track without wandb credentials."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import SCRIPTS, assert_one_line_error, run_bad_input

pytestmark = pytest.mark.usefixtures("workdir")
NAME = "sac_continuous_action"
TINY = ["--total-timesteps", "120", "--learning-starts", "40", "--batch-size", "8", "--buffer-size", "200"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--policy-lr", "-0.1"], "--policy-lr -0.1"),
        (["--q-lr", "0"], "--q-lr 0"),
        (["--seed", "-1"], "--seed -1"),
        (["--tau", "-1"], "--tau -1"),
        (["--tau", "0"], "--tau 0"),
        (["--gamma", "2"], "--gamma 2"),
        (["--alpha", "-0.2"], "--alpha -0.2"),
        (["--buffer-size", "10", "--batch-size", "256"], "--buffer-size 10"),
        (["--total-timesteps", "-5"], "--total-timesteps -5"),
        (["--env-id", "NoSuchEnv-v0"], "NoSuchEnv-v0"),
    ],
)
def test_bad_input_is_one_line(argv, flag, capsys):
    assert_one_line_error(run_bad_input(NAME, TINY + argv, capsys), flag)


@pytest.fixture
def no_wandb_login(workdir, monkeypatch):
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NETRC", str(workdir / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(workdir))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(workdir / "wandb-config"))


def test_track_without_credentials_fails_at_start(no_wandb_login, capsys):
    proc = run_bad_input(NAME, TINY + ["--track"], capsys)
    assert_one_line_error(proc, "--track", "wandb", "WANDB_MODE=offline")


def test_ctrl_c_in_a_terminal_run(workdir):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, once the loop runs: exit code 130
    within seconds, no traceback, and the speed record on stdout marked interrupted."""
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
