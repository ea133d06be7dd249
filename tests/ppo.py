"""Checks the PPO test modules share: a baseline and its twin built with the same parameters, and the twin's GAE
against the baseline's loop. Each module binds them to its pair with functools.partial."""

import torch
from helpers import load_script


def make_pair(base_name, fast_name, n_obs, n_act, compile, cudagraphs, device, **kwargs):
    """A baseline agent and a compiled-variant agent with identical parameters, and their functions."""
    base, fast = load_script(base_name), load_script(fast_name)
    device = torch.device(device)
    args_b = base.Args(**kwargs)
    args_f = fast.Args(compile=compile, cudagraphs=cudagraphs, **kwargs)
    torch.manual_seed(0)
    agent_b = base.Agent(args_b, n_obs, n_act, device)
    agent_f = fast.Agent(args_f, n_obs, n_act, device)
    agent_f.net.load_state_dict(agent_b.net.state_dict())
    return (agent_b, base.make_update_fns(agent_b, args_b)), (agent_f, fast.make_update_fns(agent_f, args_f))


def check_gae(make, n_obs, compile, cudagraphs, device, num_steps, num_envs, calls=1):
    """Same rewards, values, dones and next observation: the twin's GAE gives the baseline loop's advantages and
    returns. Several calls with new data each, so that graph replays are covered. make: the module's make_pair."""
    (_, (gae_b, _)), (_, (gae_f, *_)) = make(compile, cudagraphs, device, num_steps=num_steps)
    tol = 1e-5 if device == "cpu" else 1e-4  # GPU kernels of compiled and eager code round differently
    gen = torch.Generator().manual_seed(1)
    for _ in range(calls):
        next_obs = torch.randn(num_envs, n_obs, generator=gen)
        rewards, values = torch.randn(2, num_steps, num_envs, generator=gen)
        # Few dones, so that some sums run over dozens of steps: every round of a scan counts.
        dones = (torch.rand(num_steps, num_envs, generator=gen) < 0.03).float()
        dones[0, 0] = 1.0
        next_done = (torch.arange(num_envs) == 1).float()
        inputs = [x.to(device) for x in (next_obs, next_done, rewards, values, dones)]
        expected = gae_b(*inputs)
        for out, ref in zip(gae_f(*inputs), expected):
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    advantages = expected[0].cpu()
    # The dones cut the sums: the last advantage of an env whose next observation starts an episode is its delta.
    torch.testing.assert_close(advantages[-1, 1], (rewards[-1, 1] - values[-1, 1]).cpu())
