"""Checkpoints, resume, evaluation and videos in every script (docs/checkpoints.md): a resumed run ends where an
uninterrupted one does, a killed or interrupted run resumes, a failed write leaves the last checkpoint whole,
evaluation of a trained policy beats a random one, videos are MP4 files, and a bad checkpoint or save folder is
one error line that leaves the checkpoints there as they were."""

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import SCRIPTS, assert_one_line_error, load_script, run_bad_input, run_main, wait_for

OFF_POLICY = ["--env-id", "Pendulum-v1", "--learning-starts", "200", "--batch-size", "32", "--buffer-size", "1000"]
# A constant epsilon: the schedule follows --total-timesteps, which the stopped run has shorter.
DQN = ["--learning-starts", "200", "--batch-size", "32", "--buffer-size", "1000", "--train-frequency", "2",
       "--target-network-frequency", "50", "--start-e", "0.3", "--end-e", "0.3", "--no-tensorboard"]  # fmt: skip
# Without the annealed learning rate: its schedule follows --total-timesteps, which the stopped run has shorter.
PPO = ["--num-minibatches", "2", "--update-epochs", "1", "--no-anneal-lr", "--no-tensorboard"]
PPO_CONTINUOUS = ["--env-id", "Pendulum-v1", "--num-envs", "2", "--num-steps", "64", *PPO]
PPO_ATARI = ["--num-envs", "2", "--num-steps", "32", *PPO]
PPO_GPU = ["--num-envs", "8", "--num-steps", "16", *PPO]
# Per script: its tiny arguments, the env steps of the stopped run and of the whole one, and whether the resumed
# run ends exactly as the whole one (envpool's envs cannot be saved: their episodes restart on resume).
RUNS = {
    "dqn": (DQN, 400, 600, True),
    "dqn_torchcompile": (DQN, 400, 600, True),
    "sac_continuous_action": ([*OFF_POLICY, "--no-tensorboard"], 400, 600, True),
    "sac_continuous_action_torchcompile": ([*OFF_POLICY, "--no-tensorboard"], 400, 600, True),
    "td3_continuous_action": ([*OFF_POLICY, "--no-tensorboard"], 400, 600, True),
    "td3_continuous_action_torchcompile": ([*OFF_POLICY, "--no-tensorboard"], 400, 600, True),
    "ppo_continuous_action": (PPO_CONTINUOUS, 384, 640, True),
    "ppo_continuous_action_torchcompile": (PPO_CONTINUOUS, 384, 640, True),
    "ppo_atari_envpool": (PPO_ATARI, 128, 256, False),
    "ppo_atari_envpool_torchcompile": (PPO_ATARI, 128, 256, False),
    "ppo_atari_envpool_multigpu": (PPO_ATARI, 128, 256, False),
    "ppo_atari_envpool_multigpu_torchcompile": (PPO_ATARI, 128, 256, False),
    "ppo_classic_control_gpu": (PPO_GPU, 384, 640, True),
    "ppo_classic_control_gpu_torchcompile": (PPO_GPU, 384, 640, True),
}
SAC = "sac_continuous_action"


def checkpoint_of(name, folder):
    return torch.load(Path(folder) / f"{name}.pt", weights_only=True)


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def assert_same(a, b, where="state"):
    """Two checkpoint parts hold the same values: tensors bit for bit, everything else equal."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def is_mp4(path):
    data = Path(path).read_bytes()
    return len(data) > 1000 and data[4:8] == b"ftyp"


def train_tiny(name, capsys, total, *argv):
    tiny, *_ = RUNS[name]
    return run_main(name, [*tiny, "--total-timesteps", str(total), *argv], capsys)


@pytest.mark.parametrize("name", RUNS)
def test_resumed_run_ends_as_the_whole_run(name, workdir, capsys):
    """Stopped at S env steps and resumed to T, a run ends with the checkpoint an uninterrupted run of T steps ends
    with, every tensor bit for bit (exact scripts); its record says where it resumed from. Then the checkpoint's
    policy is evaluated."""
    tiny, stop, total, exact = RUNS[name]
    train_tiny(name, capsys, total, "--save-dir", "whole")
    train_tiny(name, capsys, stop, "--save-dir", "parts")
    assert checkpoint_of(name, "parts")["global_step"] == stop
    record = train_tiny(name, capsys, total, "--resume", "parts")
    assert record["resumed_from"] == stop and record["total_timesteps"] == total
    whole, parts = checkpoint_of(name, "whole"), checkpoint_of(name, "parts")
    assert whole["global_step"] == parts["global_step"] == total
    if exact:
        assert_same(whole["state"], parts["state"])
        assert whole["meter"]["returns"] == parts["meter"]["returns"]
    else:
        assert whole["state"].keys() == parts["state"].keys()
    evaluation = load_script(name).main(["--eval-checkpoint", "whole", "--eval-episodes", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == evaluation and evaluation["episodes"] == 2 and len(evaluation["returns"]) == 2
    assert [line for line in out if line.startswith("episode ")] == [
        f"episode {i + 1}: return {r:.2f}" for i, r in enumerate(evaluation["returns"])
    ]
    assert evaluation["mean"] == pytest.approx(np.mean(evaluation["returns"]), abs=0.01)


def start(*argv, cwd):
    return subprocess.Popen([sys.executable, str(SCRIPTS / f"{SAC}.py"), *argv], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_killed_run_resumes(tmp_path):
    """kill -9 after the first checkpoint: resumed from it, the run ends as an uninterrupted one does."""
    tiny, _, total, _ = RUNS[SAC]
    killed = start(*tiny, "--total-timesteps", "100000", "--save-every", "100", "--save-dir", "killed", cwd=tmp_path)
    wait_for(tmp_path / "killed" / f"{SAC}.pt", killed)
    killed.kill()
    killed.wait()
    assert checkpoint_of(SAC, tmp_path / "killed")["global_step"] < total
    for argv in (["--resume", "killed"], ["--save-dir", "whole"]):
        proc = start(*tiny, "--total-timesteps", str(total), *argv, cwd=tmp_path)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    assert_same(checkpoint_of(SAC, tmp_path / "whole")["state"], checkpoint_of(SAC, tmp_path / "killed")["state"])


def test_ctrl_c_saves_and_the_run_resumes(tmp_path):
    """Ctrl-C with --save-dir: a checkpoint at the end of the step, the interrupted record (exit 130), and a
    resumed run goes on from the steps done."""
    tiny, _, total, _ = RUNS[SAC]
    proc = start(*tiny, "--total-timesteps", "100000", "--save-every", "100", "--save-dir", "run", cwd=tmp_path)
    wait_for(tmp_path / "run" / f"{SAC}.pt", proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] is True
    assert checkpoint_of(SAC, tmp_path / "run")["global_step"] == record["total_timesteps"] < total
    proc = start(*tiny, "--total-timesteps", str(total), "--resume", "run", cwd=tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] == record["total_timesteps"]


def test_failed_write_keeps_the_last_checkpoint(workdir, capsys, monkeypatch):
    """A write that fails half-way (the disk full) is one error line; the checkpoint before it still loads, and no
    temporary file is left behind."""
    save = torch.save
    calls = []

    def failing_save(obj, f):
        calls.append(obj["global_step"])
        if len(calls) == 1:
            return save(obj, f)
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    tiny, _, total, _ = RUNS[SAC]
    argv = [*tiny, "--total-timesteps", str(total), "--save-every", "200", "--save-dir", "run"]
    assert_one_line_error(run_bad_input(SAC, argv, capsys), "the checkpoint of step 400 was not written")
    assert calls == [200, 400]
    assert checkpoint_of(SAC, "run")["global_step"] == 200
    assert [p.name for p in Path("run").iterdir()] == [f"{SAC}.pt"]


def test_evaluation_beats_a_random_policy(workdir, capsys):
    """CartPole: the greedy policy of a briefly trained run lasts far longer than random actions do (about 22)."""
    name = "ppo_classic_control_gpu"
    run_main(name, ["--num-envs", "16", "--num-steps", "64", "--learning-rate", "2.5e-3", "--total-timesteps",
                    "30720", "--no-tensorboard", "--save-dir", "run"], capsys)  # fmt: skip
    evaluation = load_script(name).main(["--eval-checkpoint", "run", "--eval-episodes", "5", "--seed", "7"])
    env = gym.make("CartPole-v1")
    env.action_space.seed(7)
    random_returns = []
    for episode in range(20):
        env.reset(seed=episode)
        done, steps = False, 0
        while not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            done, steps = terminated or truncated, steps + 1
        random_returns.append(steps)
    assert evaluation["mean"] > 3 * np.mean(random_returns), (evaluation, np.mean(random_returns))


@pytest.mark.parametrize("name", [SAC, "ppo_classic_control_gpu"])
def test_evaluation_videos(name, workdir, capsys):
    """--capture-video with --eval-checkpoint: an MP4 file per episode under videos/<run name>/."""
    train_tiny(name, capsys, RUNS[name][1], "--save-dir", "run")
    load_script(name).main(["--eval-checkpoint", "run", "--eval-episodes", "2", "--capture-video"])
    (folder,) = Path("videos").iterdir()
    videos = sorted(folder.glob("*.mp4"))
    assert len(videos) == 2 and all(is_mp4(video) for video in videos)


def test_training_video(workdir, capsys):
    """--capture-video while training: env 0's first episode is an MP4 file, as in CleanRL. A run resumed without
    videos goes on from the same env state (the recorder is no part of it)."""
    train_tiny(SAC, capsys, 300, "--capture-video", "--save-dir", "run")
    (folder,) = Path("videos").iterdir()
    assert is_mp4(folder / "rl-video-episode-0.mp4")
    elapsed = checkpoint_of(SAC, "run")["state"]["envs"]["envs"][0]["layers"]
    assert train_tiny(SAC, capsys, 400, "--resume", "run", "--no-capture-video")["resumed_from"] == 300
    assert checkpoint_of(SAC, "run")["state"]["envs"]["envs"][0]["layers"] != elapsed


@pytest.fixture
def saved(workdir, capsys):
    """A checkpoint of the SAC baseline in run/, and the digest of its bytes."""
    train_tiny(SAC, capsys, 300, "--save-dir", "run")
    path = Path("run") / f"{SAC}.pt"
    return path, digest(path)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--resume", "missing.pt"], ["no such checkpoint file"]),
        (["--eval-checkpoint", "empty"], ["no such checkpoint file"]),
        (["--resume", "truncated.pt"], ["does not load as a checkpoint"]),
        (["--eval-checkpoint", "text.pt"], ["does not load as a checkpoint"]),
        (["--resume", "plain.pt"], ["is not a checkpoint of this collection"]),
        (["--resume", "run", "--gamma", "0.5"], ["--gamma 0.5 differs from the checkpoint's 0.99"]),
        (["--eval-checkpoint", "run", "--env-id", "HalfCheetah-v4"], ["--env-id HalfCheetah-v4 differs"]),
        (["--resume", "run", "--eval-checkpoint", "run"], ["exclude each other"]),
        (["--save-dir", "run"], ["already holds a checkpoint", "--resume run"]),
        (["--save-dir", "run/sac_continuous_action.pt/inside"], ["--save-dir", "cannot be written"]),
        (["--save-every", "100"], ["--save-every 100", "with --save-dir"]),
        (["--save-every", "-1", "--save-dir", "other"], ["--save-every -1"]),
        (["--eval-checkpoint", "run", "--eval-episodes", "0"], ["--eval-episodes 0 must be positive"]),
    ],
)
def test_bad_checkpoints_and_folders(saved, argv, fragments, capsys):
    """One error line each, and the checkpoint already there untouched."""
    path, before = saved
    Path("truncated.pt").write_bytes(path.read_bytes()[:1000])
    Path("text.pt").write_text("not a checkpoint\n")
    torch.save({"weights": torch.zeros(2)}, "plain.pt")
    Path("empty").mkdir()
    assert_one_line_error(run_bad_input(SAC, argv, capsys), *fragments)
    assert digest(path) == before


def test_checkpoint_of_another_script(saved, capsys):
    path, before = saved
    proc = run_bad_input(f"{SAC}_torchcompile", ["--eval-checkpoint", str(path)], capsys)
    assert_one_line_error(proc, f"is a checkpoint of {SAC}, not of {SAC}_torchcompile")
    assert digest(path) == before
