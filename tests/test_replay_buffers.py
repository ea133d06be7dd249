"""leanrl/replay_buffers.py, the TD3 and SAC scripts' buffer on MuJoCo Warp: the baseline's ReplayBuffer and the
twins' CapturableReplayBuffer (where the next rows go and how many are held: device tensors), each through the same
checks, on the CPU."""

import numpy as np
import pytest
import torch

from replay_buffers import CapturableReplayBuffer, ReplayBuffer

CPU = torch.device("cpu")
CLASSES = [ReplayBuffer, CapturableReplayBuffer]


@pytest.mark.parametrize("buffer_class", CLASSES)
def test_per_env_storage(buffer_class):
    """Each step writes one slot of every env, circularly (buffer_size // num_envs slots); a sample draws the same
    number of rows of each env, all of them stored ones, with one-step discounts gamma, 0 after a termination (not
    after a truncation); a resumed buffer holds the saved rows."""
    rb = buffer_class(12, 4, 2, 1, 1, 0.9, CPU)  # 3 slots of 4 envs
    for t in range(5):
        obs = torch.arange(4.0)[:, None] * 100 + t + torch.zeros(4, 2)  # env * 100 + step
        ends = torch.tensor([t == 3, False, False, False]), torch.tensor([False, t == 4, False, False])
        rb.add(obs, torch.full((4, 1), t), torch.full((4,), float(t)), obs + 0.5, *ends)
    assert int(rb.size) == 3 and int(rb.ptr) == 2
    torch.manual_seed(0)
    obs, _, rewards, next_obs, discounts = rb.sample(400)
    envs, steps = (obs[:, 0] // 100).long(), obs[:, 0] % 100
    assert torch.equal(envs.view(100, 4), torch.arange(4).expand(100, 4))  # 100 rows of each env
    assert set(steps.tolist()) == {2.0, 3.0, 4.0}  # the last three steps, the first two overwritten
    assert torch.equal(rewards, steps) and torch.equal(next_obs, obs + 0.5)
    assert rewards.shape == discounts.shape == (400,)
    terminated = (envs == 0) & (steps == 3)
    assert torch.equal(discounts, torch.where(terminated, 0.0, torch.tensor(0.9))) and terminated.any()
    copy = buffer_class(12, 4, 2, 1, 1, 0.9, CPU)
    copy.load_state_dict(rb.state_dict())
    assert torch.equal(copy.storage, rb.storage) and int(copy.ptr) == 2 and int(copy.size) == 3


@pytest.mark.parametrize("buffer_class", CLASSES)
def test_n_step_returns(buffer_class):
    """With 3-step returns a sample is the rewards of up to 3 steps of its env from the drawn row on, discounted, the
    last one's next observation, and gamma ** steps, 0 where that one terminated: a window ends with its episode (a
    termination or a truncation) and at its env's newest row, after the circular storage wrapped too. Every sampled
    row against a step-by-step reference from the transitions as they were added."""
    gamma, slots, n_envs, steps = 0.5, 6, 3, 9  # the first 3 steps overwritten
    rb = buffer_class(slots * n_envs, n_envs, 2, 1, 3, gamma, CPU)
    rng, added = np.random.default_rng(0), {}  # (env, step): (reward, terminated, truncated)
    for t in range(steps):
        obs = torch.arange(float(n_envs))[:, None] * 100 + t + torch.zeros(n_envs, 2)  # env * 100 + step
        rewards = torch.as_tensor(rng.normal(size=n_envs), dtype=torch.float32)
        terminated = torch.as_tensor(rng.random(n_envs) < 0.25)
        truncated = torch.as_tensor(rng.random(n_envs) < 0.25) & ~terminated
        rb.add(obs, torch.zeros(n_envs, 1), rewards, obs + 0.5, terminated, truncated)
        added.update({(env, t): (rewards[env].item(), bool(terminated[env]), bool(truncated[env])) for env in range(3)})
    torch.manual_seed(0)
    obs, _, rewards, next_obs, discounts = rb.sample(n_envs * 300)
    windows = set()
    for first, reward, last, discount in zip(obs[:, 0], rewards, next_obs[:, 0], discounts, strict=True):
        env, t = divmod(int(first), 100)
        expected, scale, steps_taken = 0.0, 1.0, 0
        while True:
            step_reward, terminated, truncated = added[env, t + steps_taken]
            expected, scale, steps_taken = expected + scale * step_reward, scale * gamma, steps_taken + 1
            if terminated or truncated or t + steps_taken == steps or steps_taken == 3:
                break
        assert reward.item() == pytest.approx(expected, abs=1e-6), (env, t)
        assert last.item() == env * 100 + t + steps_taken - 1 + 0.5, (env, t)
        assert discount.item() == (0.0 if terminated else scale), (env, t)
        windows.add((t, steps_taken, terminated))
    assert {t for t, _, _ in windows} == {3, 4, 5, 6, 7, 8}  # every stored step drawn, none overwritten
    assert {(n, terminated) for _, n, terminated in windows} >= {(1, True), (2, True), (3, False), (1, False)}


def test_holding_one_row_samples_the_first_rows_as_every_sample():
    """The twins' buffer held as if it had one row (to compile ahead of the loop): a sample of the empty buffer is
    its zeros, with the shapes, dtypes and strides of a sample of a filled one; its count is put back after."""
    empty, filled = (CapturableReplayBuffer(12, 4, 2, 1, 3, 0.9, CPU) for _ in range(2))
    for t in range(3):
        ends = torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
        filled.add(torch.ones(4, 2), torch.ones(4, 1), torch.ones(4), torch.ones(4, 2), *ends)
    with empty.holding_one_row():
        sample = empty.sample(8)
    assert int(empty.size) == 0 and int(empty.ptr) == 0
    for got, real in zip(sample, filled.sample(8), strict=True):
        assert (got.shape, got.dtype, got.stride()) == (real.shape, real.dtype, real.stride())
    assert not any(x.any() for x in sample[:4])  # obs, actions, rewards, next_obs: the storage's zeros
