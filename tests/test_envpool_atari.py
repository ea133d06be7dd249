"""leanrl/envpool_atari.py, which the Atari scripts (PPO, PQN) import: whole games' returns, and the env ids it
refuses. The scripts' tests run its envs."""

import numpy as np
import pytest

from envpool_atari import EpisodeReturns, make_envs


def test_episode_returns_are_whole_games_of_unclipped_reward():
    """Each game that ends gives its (return, length): unclipped rewards summed over every life."""
    episodes = EpisodeReturns(2)

    def step(reward, lives, terminated, truncated):
        info = {"reward": np.array(reward, dtype=np.float32), "lives": np.array(lives, dtype=np.int32),
                "terminated": np.array(terminated, dtype=np.int32)}  # fmt: skip
        return episodes.add(info, np.array(truncated))

    assert step([4.0, 1.0], [5, 5], [0, 0], [False, False]) == []
    assert step([0.0, 7.0], [4, 5], [0, 0], [False, False]) == []  # env 0 loses a life: its game goes on
    assert step([0.0, 0.0], [4, 5], [0, 0], [False, False]) == []  # envpool's reset step after a lost life
    assert step([1.0, 0.0], [0, 5], [1, 0], [False, False]) == [(5.0, 4)]  # game over: 4 + 1, unclipped
    assert step([0.0, 1.0], [5, 5], [0, 0], [False, True]) == [(9.0, 5)]  # env 1 hits the time limit: 1 + 7 + 1
    assert step([7.0, 0.0], [5, 5], [0, 0], [False, False]) == []  # env 0's new game starts from zero
    assert step([0.0, 0.0], [0, 0], [1, 1], [False, False]) == [(7.0, 3), (0.0, 2)]


@pytest.mark.parametrize(
    "env_id, message",
    [("Breakout-v9", "--env-id 'Breakout-v9': not an envpool environment (its Atari ids look like Breakout-v5)"),
     ("CartPole-v1", "--env-id CartPole-v1: not an envpool Atari game (those look like Breakout-v5)")],
)  # fmt: skip
def test_refused_env_ids(env_id, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_envs(env_id, 1, 0)
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
