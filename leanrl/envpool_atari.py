"""envpool's Atari games as the Atari scripts (PPO, PQN) play them: made with CleanRL's preprocessing, and whole games'
returns counted apart from the learner's episodes, which end at a lost life.

    envs = make_envs(env_id, num_envs, seed)  # gymnasium's API: reset, step, and send/recv for the twins' overlap
    episodes = EpisodeReturns(num_envs)
    for episodic_return, length in episodes.add(info, truncations): ...  # after each step
"""

import envpool
import numpy as np

from harness import fail


def make_envs(env_id, num_envs, seed):
    """envpool's Atari preprocessing: 4 stacked 84x84 gray frames, episodic life, rewards clipped to their sign."""
    if env_id not in envpool.list_all_envs():
        fail(f"--env-id {env_id!r}: not an envpool environment (its Atari ids look like Breakout-v5)")
    if "episodic_life" not in envpool.make_spec(env_id).config._fields:
        fail(f"--env-id {env_id}: not an envpool Atari game (those look like Breakout-v5)")
    return envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, episodic_life=True,
                        reward_clip=True)


class EpisodeReturns:
    """Whole games' unclipped returns (info["reward"]): a lost life ends an episode for the learner only; a game ends
    at game over (info["terminated"]) or its time limit (truncated), and envpool's reset step then has reward 0."""

    def __init__(self, num_envs):
        self.running = np.zeros(num_envs)
        self.lengths = np.zeros(num_envs, dtype=np.int64)

    def add(self, info, truncations):
        """Count one env step; return (return, length) of each game that ended in it."""
        self.running += info["reward"]
        self.lengths += 1
        game_over = info["terminated"].astype(bool) | truncations
        ended = list(zip(self.running[game_over].tolist(), self.lengths[game_over].tolist()))
        self.running[game_over] = 0.0
        self.lengths[game_over] = 0
        return ended
