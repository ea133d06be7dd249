"""PQN Atari: both scripts through full iterations in every mode, the same first rollout in both, policy, Q(lambda)
returns and update equivalence of the twin with the baseline, updates that move Q towards the returns, resume and
evaluation of a checkpoint, Ctrl-C, bad input. Learning itself is tested on CartPole (test_pqn_classic_control_gpu.py):
the algorithm is the same, and Atari learns too slowly for a CPU test."""


import functools

import pytest
import torch
from helpers import (
    MODES,
    agent_pair,
    assert_cudagraphs_fallback,
    assert_one_line_error,
    assert_same_update,
    assert_steady,
    load_script,
    mode_id,
    record_run,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_interrupted,
    run_main,
    run_mode,
)

BASE, FAST = "pqn_atari_envpool", "pqn_atari_envpool_torchcompile"
NUM_ENVS, NUM_STEPS, N_ACT = 2, 16, 4
# Four iterations of 32 steps: three of warm-up, one in the fps window. The equivalence tests use the same shapes, so
# torch.compile reuses the kernels it built for these runs.
SIZES = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2"]
TINY = SIZES + ["--update-epochs", "1", "--total-timesteps", "128"]
pytestmark = pytest.mark.usefixtures("workdir")


def test_baseline_iterations(capsys):
    record = run_main(BASE, TINY, capsys)
    assert record["compile"] is False and record["cudagraphs"] is False
    assert_steady(record, 128)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_compiled_iterations(mode, capsys):
    assert_steady(run_mode(FAST, TINY, mode, capsys), 128)


def test_first_rollout_matches_baseline(capsys, monkeypatch):
    """One seed gives both scripts the same first rollout: the same frames, epsilon-greedy actions, greedy values,
    rewards and done flags in the same slots, and the same returns. This checks the twin's staging (pinned buffers,
    send/recv, one copy per iteration) and its epsilon on the device against the baseline's plain loop."""
    argv = ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1",
            "--total-timesteps", "128", "--exploration-fraction", "0.5", "--no-tensorboard"]  # fmt: skip
    _, base = record_run(BASE, argv, capsys, monkeypatch)
    _, fast = record_run(FAST, argv, capsys, monkeypatch)
    rollout_b, rollout_f = base.rollouts[0], fast.rollouts[0]
    assert rollout_b.dones.any(), "lives were lost within the rollout"
    for key in ("obs", "actions", "values", "rewards", "dones"):
        torch.testing.assert_close(getattr(rollout_f, key).float(), getattr(rollout_b, key).float(), msg=key)
    # next_obs, next_done, rewards, values, dones, returns
    for inputs_f, inputs_b in zip(fast.returns[0], base.returns[0], strict=True):
        torch.testing.assert_close(inputs_f.float(), inputs_b)


make_pair = functools.partial(agent_pair, BASE, FAST, "q_network", (N_ACT,), num_envs=NUM_ENVS, num_steps=NUM_STEPS)


def check_equivalence(compile, cudagraphs, device, calls=3):
    """Same parameters and data: the policy, the Q(lambda) returns and minibatch updates (with the learning rate
    changed in between, as annealing does) give the same outputs and parameters in both scripts. The baseline gets
    float frames, the twin uint8 ones. Enough calls that graphs are captured and replayed. The twin's update writes its
    statistics into the same fixed tensors each time, and its policy records no autograd graph."""
    (agent_b, (q_lambda_b, update_b)), (agent_f, (q_lambda_f, update_f, policy_f, stats_f)) = make_pair(
        compile, cudagraphs, device
    )
    assert load_script(FAST).STATS == load_script(BASE).STATS == tuple(stats_f)
    fixed = [value.data_ptr() for value in stats_f.values()]
    tol = dict(atol=1e-5, rtol=1e-4) if device == "cpu" else dict(atol=1e-4, rtol=1e-3)
    gen = torch.Generator().manual_seed(1)
    initial = [p.detach().clone() for p in agent_f.q_network.parameters()]
    batch_size = NUM_STEPS * NUM_ENVS
    for i in range(calls):
        obs = torch.randint(0, 256, (NUM_STEPS, NUM_ENVS, 4, 84, 84), dtype=torch.uint8, generator=gen).to(device)
        rewards = torch.randint(-1, 2, (NUM_STEPS, NUM_ENVS), generator=gen).float().to(device)
        dones = (torch.rand(NUM_STEPS, NUM_ENVS, generator=gen) < 0.2).float().to(device)
        values = torch.randn(NUM_STEPS, NUM_ENVS, generator=gen).to(device)
        next_obs = torch.randint(0, 256, (NUM_ENVS, 4, 84, 84), dtype=torch.uint8, generator=gen).to(device)
        next_done = torch.tensor([1.0, 0.0], device=device)

        torch.manual_seed(10 * i)
        with torch.no_grad():
            expected = agent_b.q_network.act(obs[0].float(), 0.5)
        torch.manual_seed(10 * i)
        outs_f = policy_f(obs[0], torch.tensor(0.5, device=device))
        assert not any(out.requires_grad for out in outs_f), "the policy acts without autograd"
        for out_f, out_b in zip(outs_f, expected, strict=True):
            torch.testing.assert_close(out_f, out_b, **tol)

        returns_b = q_lambda_b(next_obs.float(), next_done, rewards, values, dones)
        torch.testing.assert_close(q_lambda_f(next_obs, next_done, rewards, values, dones), returns_b, **tol)

        lr = 2.5e-4 * (1 - i / calls)
        agent_b.optimizer.param_groups[0]["lr"] = lr
        agent_f.optimizer.param_groups[0]["lr"].fill_(lr)
        mb = torch.randperm(batch_size, generator=gen)[: batch_size // 2].to(device)
        actions = torch.randint(0, N_ACT, (batch_size,), generator=gen).to(device)[mb]
        stats_b = update_b(obs.flatten(0, 1)[mb].float(), actions, returns_b.flatten()[mb])
        assert update_f(obs.flatten(0, 1)[mb], actions, returns_b.flatten()[mb]) is None
        for name in stats_b:
            torch.testing.assert_close(stats_f[name], stats_b[name], **tol, msg=name)
        for p0, (name, p_b), p_f in zip(initial, agent_b.q_network.named_parameters(), agent_f.q_network.parameters()):
            assert_same_update(p0, p_b.detach(), p_f.detach(), name=name)
    assert all(not torch.equal(p0, p) for p0, p in zip(initial, agent_f.q_network.parameters()))
    assert [value.data_ptr() for value in stats_f.values()] == fixed


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline(compile):
    check_equivalence(compile, cudagraphs=False, device="cpu")


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline_cuda(compile, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    check_equivalence(compile, cudagraphs=True, device="cuda")


def test_updates_move_q_towards_the_returns():
    """Updates on one batch move Q(obs, a) of the actions taken towards their returns, up for one action and down for
    another; a sign error in the TD loss would move them away."""
    base = load_script(BASE)
    args = base.Args(num_envs=NUM_ENVS, num_steps=NUM_STEPS, learning_rate=1e-3)
    torch.manual_seed(0)
    agent = base.Agent(args, N_ACT, "cpu")
    _, update = base.make_update_fns(agent, args)
    obs = (
        torch.randint(0, 256, (1, 4, 84, 84), generator=torch.Generator().manual_seed(2)).float().expand(8, -1, -1, -1)
    )
    actions = torch.arange(8) % 2
    with torch.no_grad():
        before = agent.q_network(obs[:2])
    returns = before[actions, actions] + torch.where(actions == 0, 1.0, -1.0)
    for _ in range(10):
        update(obs, actions, returns)
    with torch.no_grad():
        after = agent.q_network(obs[:2])
    assert after[0, 0] > before[0, 0] and after[1, 1] < before[1, 1]
    assert (after[[0, 1], [0, 1]] - returns[:2]).abs().max() < (before[[0, 1], [0, 1]] - returns[:2]).abs().min()


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    """Ctrl-C within the first rollout: the record covers the 20 env steps done and says it was cut short."""
    run_interrupted(name, TINY + ["--no-tensorboard"], 20, capsys, monkeypatch)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_resume_goes_on_from_the_checkpoint(name, capsys, monkeypatch):
    """A run of 2 iterations saved, then resumed to 4: the Q-network and RAdam (its step count going on from the saved
    one) restored before the first update, the iterations left run; --eval-checkpoint plays the saved policy for
    whole games. envpool's games cannot be saved, so a resumed run starts new ones."""
    run_main(name, TINY + ["--total-timesteps", "64", "--save-dir", "ck", "--no-tensorboard"], capsys)
    saved = torch.load(f"ck/{name}.pt", weights_only=True)["state"]
    assert set(saved) == {"q_network", "optimizer"}
    record, seen = record_run(name, TINY + ["--resume", "ck", "--no-tensorboard"], capsys, monkeypatch)
    assert record["resumed_from"] == 64 and record["total_timesteps"] == 128
    assert len(seen.updates) == 2 * 2  # two iterations left, of 2 minibatches
    steps = [float(s["step"]) for s in seen.agents[0].optimizer.state_dict()["state"].values()]
    assert steps and all(step == 8 for step in steps), steps  # 4 saved steps + 4 resumed ones
    evaluation = load_script(name).main(["--eval-checkpoint", "ck", "--eval-episodes", "1"])
    assert evaluation["episodes"] == 1 and evaluation["returns"][0] >= 0


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--env-id", "NoSuchGame-v5"], ["NoSuchGame-v5"]),
        (["--env-id", "CartPole-v1"], ["CartPole-v1", "Atari"]),
        (["--num-minibatches", "3"], ["--num-envs 8", "--num-steps 128", "--num-minibatches 3"]),
        (["--num-envs", "0"], ["--num-envs 0"]),
        (["--update-epochs", "0"], ["--update-epochs 0"]),
        (["--q-lambda", "1.5"], ["--q-lambda 1.5"]),
        (["--end-e", "2"], ["--end-e 2"]),
        (["--exploration-fraction", "0"], ["--exploration-fraction 0"]),
        (["--total-timesteps", "100"], ["--total-timesteps 100", "--num-envs 8", "--num-steps 128"]),
    ],
)
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


def test_bad_input_cli():
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(FAST, "--env-id", "NoSuchGame-v5"), "NoSuchGame-v5")


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *TINY)
