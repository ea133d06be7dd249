"""Checks the PPO test modules share: the twin's GAE against the baseline's loop, and its updates against the
baseline's, on a pair of agents from helpers.agent_pair. Each module binds them to its pair with functools.partial."""

import torch
from helpers import assert_same_update, load_script


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


def set_learning_rates(agent_b, agent_f, lr):
    """The baseline's learning rate a float, the twin's a device tensor filled in place."""
    agent_b.optimizer.param_groups[0]["lr"] = lr
    agent_f.optimizer.param_groups[0]["lr"].fill_(lr)


def check_updates(make, n_obs, draw_actions, compile, cudagraphs, device, minibatch, updates,
                  set_learning_rate=set_learning_rates, **kwargs):  # fmt: skip
    """Same parameters and minibatches: each update gives the same statistics and parameters in both scripts, with the
    learning rate changed between updates (annealing), over several updates so that the optimizer's state and graph
    replays are covered; old log-probabilities off by up to 0.3 and old values by up to 0.5, so that some ratios and
    values are clipped. The twin's update writes its statistics into the same fixed tensors each time. make: the
    module's make_pair; draw_actions(gen, n): n actions. Returns (baseline agent, twin agent, twin policy, the last
    observations, the generator, the tolerance) for the module's checks of the acting policy."""
    (agent_b, (_, update_b)), (agent_f, (_, update_f, policy_f, stats_f)) = make(
        compile, cudagraphs, device, learning_rate=1e-2, **kwargs
    )
    stats_names = load_script(make.args[0]).STATS
    assert load_script(make.args[1]).STATS == stats_names and list(stats_f) == list(stats_names)
    fixed = [value.data_ptr() for value in stats_f.values()]
    tol = 1e-5 if device == "cpu" else 1e-3  # GPU kernels of compiled and eager code round differently
    initial = [p.detach().clone() for p in agent_f.net.parameters()]
    gen = torch.Generator().manual_seed(1)
    for i in range(updates):
        obs = torch.randn(minibatch, n_obs, generator=gen).to(device)
        actions = draw_actions(gen, minibatch).to(device)
        with torch.no_grad():
            _, logprobs, _, values = agent_b.net.get_action_and_value(obs, actions)
        logprobs = logprobs + (torch.rand(minibatch, generator=gen).to(device) - 0.5) * 0.6
        values = values.flatten() + (torch.rand(minibatch, generator=gen).to(device) - 0.5)
        advantages, returns = torch.randn(2, minibatch, generator=gen).to(device)
        batch = (obs, actions, logprobs, advantages, returns, values)
        set_learning_rate(agent_b, agent_f, 1e-2 / (i + 1))
        stats_b = update_b(*batch)
        assert update_f(*batch) is None and list(stats_b) == list(stats_names)
        for name in stats_names:
            torch.testing.assert_close(stats_f[name], stats_b[name], atol=tol, rtol=tol, msg=name)
        for p0, (name, p_b), p_f in zip(initial, agent_b.net.named_parameters(), agent_f.net.parameters()):
            assert_same_update(p0, p_b.detach(), p_f.detach(), name=name)
    assert 0 < stats_b["clipfrac"] < 1
    assert [value.data_ptr() for value in stats_f.values()] == fixed
    assert all(not torch.equal(p0, p) for p0, p in zip(initial, agent_f.net.parameters()))
    return agent_b, agent_f, policy_f, obs, gen, tol
