"""FastTD3's replay buffer on the device, for the TD3 and SAC scripts on MuJoCo Warp, which import it as CleanRL's
import stable-baselines3's: per-env circular storage, rows [obs, action, reward, next_obs, terminated, truncated] of
size // num_envs steps of each env; a sample draws batch_size // num_envs of each env's rows, with replacement.
Observations are stored raw (the scripts normalise them when sampled).

    rb = ReplayBuffer(size, num_envs, n_obs, n_act, num_steps, gamma, device)  # the twins: CapturableReplayBuffer
    rb.add(obs, actions, rewards, final_obs, terminations, truncations)
    obs, actions, rewards, next_obs, discounts = rb.sample(batch_size)  # target: rewards + discounts * value
"""

from contextlib import contextmanager

import torch


class ReplayBuffer:
    def __init__(self, size, num_envs, n_obs, n_act, num_steps, gamma, device):
        """num_steps > 1: a sample is an n-step transition (FastTD3's --num-steps; see sample)."""
        self.widths = [n_obs, n_act, 1, n_obs, 1, 1]
        self.storage = torch.zeros(size // num_envs, num_envs, sum(self.widths), device=device)
        self.envs = torch.arange(num_envs, device=device)
        self.num_steps, self.gamma = num_steps, gamma
        self.ptr, self.size = 0, 0  # where the next rows go, how many rows each env holds

    def add(self, obs, actions, rewards, next_obs, terminations, truncations):
        self.storage[self.ptr] = self.rows(obs, actions, rewards, next_obs, terminations, truncations)
        self.ptr = (self.ptr + 1) % len(self.storage)
        self.size = min(self.size + 1, len(self.storage))

    def rows(self, obs, actions, rewards, next_obs, terminations, truncations):
        ends = terminations[:, None].float(), truncations[:, None].float()
        return torch.cat([obs, actions, rewards[:, None], next_obs, *ends], 1)

    def draw(self, shape):
        """Row indices, uniform over the rows held."""
        return torch.randint(0, self.size, shape, device=self.envs.device)

    def sample(self, batch_size):
        """batch_size transitions (obs, actions, rewards, next_obs, discounts), batch_size // num_envs of each env.
        From each drawn row, up to num_steps rows of its env: their rewards discounted, the last one's next_obs, and
        discounts gamma ** steps, 0 where the last one terminated. A window ends with its episode (a termination or a
        truncation) and at its env's newest row (the rows after it are older)."""
        idx = self.draw((batch_size // len(self.envs), len(self.envs)))
        obs, actions, rewards, next_obs, terminated, truncated = self.storage[idx, self.envs].split(self.widths, -1)
        discounts = torch.full_like(rewards, self.gamma)  # gamma ** the steps of the window so far
        if self.num_steps > 1:
            newer = (self.ptr - 1 - idx).remainder(len(self.storage))[..., None]  # its env's rows stored after it
            going, ended = torch.ones_like(rewards, dtype=torch.bool), terminated + truncated > 0
            for k in range(1, self.num_steps):
                going = going & ~ended & (newer >= k)  # the window takes the k-th row after idx
                later = self.storage[:, :, sum(self.widths[:2]) :][(idx + k) % len(self.storage), self.envs]
                reward, later_next_obs, later_terminated, later_truncated = later.split(self.widths[2:], -1)
                rewards = torch.where(going, rewards + discounts * reward, rewards)
                discounts = torch.where(going, discounts * self.gamma, discounts)
                next_obs = torch.where(going, later_next_obs, next_obs)
                terminated = torch.where(going, later_terminated, terminated)
                ended = later_terminated + later_truncated > 0
        discounts = (1 - terminated) * discounts
        return obs.flatten(0, 1), actions.flatten(0, 1), rewards.flatten(), next_obs.flatten(0, 1), discounts.flatten()

    def state_dict(self):
        """The filled rows, and where the next transitions go."""
        return {"storage": self.storage[: int(self.size)].to("cpu", copy=True), "ptr": self.ptr, "size": self.size}

    def load_state_dict(self, state):
        self.storage[: len(state["storage"])].copy_(state["storage"])  # in place: graphs hold these very tensors
        self.ptr, self.size = state["ptr"], state["size"]


class CapturableReplayBuffer(ReplayBuffer):  # trick 7: no host sync
    """The buffer whose add and sample a CUDA graph can capture: where the next rows go and how many are held are
    device tensors, which captured graphs read and advance."""

    def __init__(self, size, num_envs, n_obs, n_act, num_steps, gamma, device):
        super().__init__(size, num_envs, n_obs, n_act, num_steps, gamma, device)
        self.ptr = torch.zeros(1, dtype=torch.long, device=device)
        self.size = torch.zeros(1, dtype=torch.long, device=device)

    def add(self, obs, actions, rewards, next_obs, terminations, truncations):
        rows = self.rows(obs, actions, rewards, next_obs, terminations, truncations)
        self.storage.index_copy_(0, self.ptr, rows[None])
        self.ptr.add_(1).remainder_(len(self.storage))
        self.size.add_(1).clamp_(max=len(self.storage))

    @contextmanager
    def holding_one_row(self):
        """The buffer as if it held one row of each env, its first (zeros until the first add): a sample then has every
        sample's shapes and strides, for compiling ahead of the loop (the twins' trick 22). Its count put back after."""
        held = self.size.clone()
        self.size.fill_(1)
        try:
            yield
        finally:
            self.size.copy_(held)

    def draw(self, shape):
        # Uniform with the size on the device: 62-bit draws modulo the size (a relative bias below 2**-40).
        return torch.randint(0, 2**62, shape, device=self.envs.device).remainder_(self.size)

    def load_state_dict(self, state):
        self.storage[: len(state["storage"])].copy_(state["storage"])
        self.ptr.copy_(state["ptr"])
        self.size.copy_(state["size"])
