"""Checkpoints in every script (docs/checkpoints.md): a stopped run resumes with everything its loop goes on with
restored as saved, and ends; evaluation of a trained policy beats a random one; videos are MP4 files. The harness
behind them (atomic writes, kill -9, Ctrl-C, bad checkpoints and folders) is tested once, in test_harness.py."""

import copy
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import assert_equal, assert_one_line_error, is_mp4, load_script, run_bad_input, run_main, run_main_stderr

import harness

OFF_POLICY = ["--env-id", "Pendulum-v1", "--learning-starts", "200", "--batch-size", "32", "--buffer-size", "1000"]
DQN = ["--learning-starts", "200", "--batch-size", "32", "--buffer-size", "1000", "--train-frequency", "2",
       "--target-network-frequency", "50", "--no-tensorboard"]  # fmt: skip
PPO = ["--num-minibatches", "2", "--update-epochs", "1", "--no-tensorboard"]
PPO_CONTINUOUS = ["--env-id", "Pendulum-v1", "--num-envs", "2", "--num-steps", "64", *PPO]
PPO_ATARI = ["--num-envs", "2", "--num-steps", "32", *PPO]
PPO_GPU = ["--num-envs", "8", "--num-steps", "16", *PPO]
PPO_MUJOCO = ["--env-id", "Hopper-v5", "--num-envs", "4", "--num-steps", "8", *PPO]
# TD3 and SAC on MuJoCo Warp: the same flags.
OFF_POLICY_MUJOCO = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "200",
                     "--learning-starts", "40", "--critic-hidden-dim", "32", "--actor-hidden-dim", "16",
                     "--no-tensorboard"]  # fmt: skip
# Per script: its tiny arguments, the env steps of the stopped run and of the resumed one.
RUNS = {
    "dqn": (DQN, 400, 600),
    "dqn_torchcompile": (DQN, 400, 600),
    "sac_continuous_action": ([*OFF_POLICY, "--no-tensorboard"], 400, 600),
    "sac_continuous_action_torchcompile": ([*OFF_POLICY, "--no-tensorboard"], 400, 600),
    "td3_continuous_action": ([*OFF_POLICY, "--no-tensorboard"], 400, 600),
    "td3_continuous_action_torchcompile": ([*OFF_POLICY, "--no-tensorboard"], 400, 600),
    "ppo_continuous_action": (PPO_CONTINUOUS, 384, 640),
    "ppo_continuous_action_torchcompile": (PPO_CONTINUOUS, 384, 640),
    "ppo_atari_envpool": (PPO_ATARI, 128, 256),
    "ppo_atari_envpool_torchcompile": (PPO_ATARI, 128, 256),
    "ppo_classic_control_gpu": (PPO_GPU, 384, 640),
    "ppo_classic_control_gpu_torchcompile": (PPO_GPU, 384, 640),
    "ppo_continuous_action_gpu_mujoco": (PPO_MUJOCO, 96, 160),
    "ppo_continuous_action_gpu_mujoco_torchcompile": (PPO_MUJOCO, 96, 160),
    "td3_gpu_mujoco": (OFF_POLICY_MUJOCO, 80, 120),
    "td3_gpu_mujoco_torchcompile": (OFF_POLICY_MUJOCO, 80, 120),
    "sac_gpu_mujoco": (OFF_POLICY_MUJOCO, 80, 120),
    "sac_gpu_mujoco_torchcompile": (OFF_POLICY_MUJOCO, 80, 120),
}

SAC = "sac_continuous_action"


def checkpoint_of(name, folder):
    return torch.load(Path(folder) / f"{name}.pt", weights_only=True)


def train_tiny(name, capsys, total, *argv):
    tiny, *_ = RUNS[name]
    return run_main(name, [*tiny, "--total-timesteps", str(total), *argv], capsys)


@pytest.mark.parametrize("name", RUNS)
def test_resumed_run_goes_on_from_its_checkpoint(name, workdir, capsys, monkeypatch):
    """Stopped at S env steps and resumed to T: as the loop starts again, everything the script saves (networks,
    optimizers, buffers, counters) holds the checkpoint's values, the run ends at T and saves there, its record says
    where it resumed from; then the checkpoint's policy is evaluated."""
    tiny, stop, total = RUNS[name]
    train_tiny(name, capsys, stop, "--save-dir", "run")
    saved = checkpoint_of(name, "run")
    assert saved["global_step"] == stop
    script, restored = load_script(name), {}
    start = script.Run.start

    def recording_start(self, state, **plan):
        first_step = start(self, state, **plan)
        restored.update(state=copy.deepcopy(harness.state_dict(state)), first_step=first_step)
        return first_step

    monkeypatch.setattr(script.Run, "start", recording_start)
    record, err = run_main_stderr(name, [*tiny, "--total-timesteps", str(total), "--resume", "run"], capsys)
    assert restored["first_step"] == stop and f"resuming at env step {stop}" in err
    assert_equal(restored["state"], saved["state"])
    assert record["resumed_from"] == stop and record["total_timesteps"] == total
    assert checkpoint_of(name, "run")["global_step"] == total
    evaluation = script.main(["--eval-checkpoint", "run", "--eval-episodes", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == evaluation and evaluation["episodes"] == 2 and len(evaluation["returns"]) == 2


def test_resuming_a_finished_run_names_the_whole_iterations(workdir, capsys):
    """A PPO run resumed with a --total-timesteps that rounds down to the steps it has done: one line saying so."""
    name = "ppo_classic_control_gpu"
    run_main(name, [*PPO_GPU, "--total-timesteps", "128", "--save-dir", "run"], capsys)
    argv = [*PPO_GPU, "--total-timesteps", "130", "--resume", "run"]
    assert_one_line_error(run_bad_input(name, argv, capsys), "the checkpoint is at env step 128, at the end that "
                          "--total-timesteps 130 sets (128 in whole iterations)")  # fmt: skip


def test_evaluation_on_an_env_the_networks_do_not_fit(workdir, capsys):
    """--eval-checkpoint with an env of other sizes than the checkpoint's (an observation of 2, not Pendulum's 3): one
    line naming both envs and the first tensor that does not fit."""
    name = "sac_continuous_action"
    run_main(name, [*OFF_POLICY, "--total-timesteps", "210", "--no-tensorboard", "--save-dir", "run"], capsys)
    argv = ["--eval-checkpoint", "run", "--env-id", "MountainCarContinuous-v0"]
    assert_one_line_error(run_bad_input(name, argv, capsys), "--eval-checkpoint run: the saved networks (trained on "
                          "Pendulum-v1) do not fit MountainCarContinuous-v0: size mismatch")  # fmt: skip


def test_evaluation_takes_sizes_training_would_refuse(workdir, capsys):
    """--eval-checkpoint with another --num-envs (evaluated in parallel where the script reads it): the checks of
    training's sizes (here: one rollout of 9 x 16 steps would pass the checkpoint's --total-timesteps 128) do not
    apply."""
    name = "ppo_classic_control_gpu"
    run_main(name, [*PPO_GPU, "--total-timesteps", "128", "--save-dir", "run"], capsys)
    evaluation = load_script(name).main(["--eval-checkpoint", "run", "--eval-episodes", "1", "--num-envs", "9"])
    assert evaluation["episodes"] == 1


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


@pytest.mark.parametrize("name", [SAC, "dqn"])
def test_evaluation_videos(name, workdir, capsys):
    """--capture-video with --eval-checkpoint: an MP4 file per episode under videos/<run name>/."""
    train_tiny(name, capsys, RUNS[name][1], "--save-dir", "run")
    load_script(name).main(["--eval-checkpoint", "run", "--eval-episodes", "2", "--capture-video"])
    (folder,) = Path("videos").iterdir()
    videos = sorted(folder.glob("*.mp4"))
    assert len(videos) == 2 and all(is_mp4(video) for video in videos)


def test_training_video(workdir, capsys):
    """--capture-video while training: env 0's first episode is an MP4 file, as in CleanRL; a run resumed without
    videos goes on."""
    train_tiny(SAC, capsys, 300, "--capture-video", "--save-dir", "run")
    (folder,) = Path("videos").iterdir()
    assert is_mp4(folder / "rl-video-episode-0.mp4")
    assert train_tiny(SAC, capsys, 400, "--resume", "run", "--no-capture-video")["resumed_from"] == 300
