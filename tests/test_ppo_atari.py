"""PPO Atari: both scripts through full iterations in every mode, the same first rollout in both, policy, GAE
and update equivalence of the compiled variant with the baseline, whole-game episode returns, updates that
improve a fixed batch, TensorBoard scalars, resume and evaluation of a checkpoint, Ctrl-C, bad input."""

import functools
import json

import numpy as np
import pytest
import torch
from helpers import (
    MODES,
    agent_pair,
    assert_cudagraphs_fallback,
    assert_one_line_error,
    assert_return_curve,
    assert_same_update,
    assert_steady,
    assert_trace_phases,
    load_script,
    mode_id,
    record_run,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_interrupted,
    run_main,
    run_mode,
    tensorboard_scalars,
)

BASE, FAST = "ppo_atari_envpool", "ppo_atari_envpool_torchcompile"
NUM_ENVS, NUM_STEPS, N_ACT = 2, 16, 4
# Four iterations of 32 steps: three of warm-up, one in the fps window. The equivalence tests use the same
# shapes, so torch.compile reuses the kernels it built for these runs.
SIZES = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2"]
TINY = SIZES + ["--update-epochs", "1", "--total-timesteps", "128"]
pytestmark = pytest.mark.usefixtures("workdir")


def test_baseline_iterations(capsys):
    record = run_main(BASE, TINY, capsys)
    assert record["compile"] is False and record["cudagraphs"] is False
    assert_steady(record, 128)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_compiled_iterations(mode, capsys):
    assert_steady(run_mode(FAST, TINY, mode, capsys), 128)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_early_stop_fixed_lr_profile_and_speed_log(name, tmp_path, capsys, monkeypatch):
    """--target-kl stops an iteration's epochs once the policy has moved; --no-anneal-lr keeps the learning
    rate; whole iterations only; --profile-dir writes a trace with the phases; --speed-log gets the record;
    TensorBoard gets the learning rate and every statistic at the end of each iteration."""
    log = tmp_path / "speed.jsonl"
    argv = SIZES + ["--total-timesteps", "150", "--update-epochs", "2", "--target-kl", "1e-9", "--no-anneal-lr",
                    "--learning-rate", "0.01", "--profile-dir", str(tmp_path), "--speed-log", str(log)]  # fmt: skip
    record, seen = record_run(name, argv, capsys, monkeypatch)
    assert record["total_timesteps"] == 128
    # 4 iterations of 2 minibatches; the first minibatch's step moves the policy past the tiny KL target,
    # so the second epoch never runs.
    assert len(seen.updates) == 4 * 2
    assert float(seen.agents[0].optimizer.param_groups[0]["lr"]) == pytest.approx(0.01)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [record]
    # One env_step call steps both envs: the breakdown tool counts env steps as the record does.
    assert_trace_phases(tmp_path, name, env_steps_per_call=NUM_ENVS)
    scalars = tensorboard_scalars(name, "Breakout-v5")
    assert {"charts/SPS", "charts/learning_rate"} <= set(scalars)
    iteration_ends = [32, 64, 96, 128]
    assert scalars["charts/learning_rate"] == [(step, pytest.approx(0.01)) for step in iteration_ends]
    for stat in (*load_script(name).STATS, "explained_variance"):
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == iteration_ends and np.isfinite(values).all(), stat


def test_first_rollout_matches_baseline(capsys, monkeypatch):
    """One seed gives both scripts the same first rollout: the same frames, actions, log-probabilities,
    values, rewards and done flags in the same slots, and the same advantages. This checks the compiled
    variant's staging (pinned buffers, send/recv, one copy per iteration) against the baseline's plain loop."""
    argv = ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1",
            "--total-timesteps", "128", "--no-tensorboard"]  # fmt: skip
    _, base = record_run(BASE, argv, capsys, monkeypatch)
    _, fast = record_run(FAST, argv, capsys, monkeypatch)
    rollout_b, rollout_f = base.rollouts[0], fast.rollouts[0]
    assert rollout_b.dones.any(), "lives were lost within the rollout"
    assert rollout_b.rewards.any(), "points were scored within the rollout"
    for key in ("obs", "actions", "logprobs", "values", "rewards", "dones"):
        torch.testing.assert_close(getattr(rollout_f, key).float(), getattr(rollout_b, key), msg=key)
    # next_obs, next_done, rewards, values, dones, advantages, returns
    for inputs_f, inputs_b in zip(fast.returns[0], base.returns[0]):
        torch.testing.assert_close(inputs_f.float(), inputs_b)


def test_finished_games_give_returns(capsys):
    """Random play loses Breakout's five lives in fewer than 256 steps: whole games end and are reported."""
    argv = ["--num-envs", "2", "--num-steps", "64", "--num-minibatches", "2", "--update-epochs", "1",
            "--total-timesteps", "512"]  # fmt: skip
    record = run_main(BASE, argv, capsys)
    assert record["episodic_return"] is not None and record["episodic_return"] >= 0
    assert_return_curve(record)


def random_rollout(gen):
    """A rollout's worth of made-up data, with episode ends inside it and at its end."""
    obs = torch.randint(0, 256, (NUM_STEPS, NUM_ENVS, 4, 84, 84), dtype=torch.uint8, generator=gen)
    rewards = torch.randint(-1, 2, (NUM_STEPS, NUM_ENVS), generator=gen).float()
    dones = (torch.rand(NUM_STEPS, NUM_ENVS, generator=gen) < 0.2).float()
    values = torch.randn(NUM_STEPS, NUM_ENVS, generator=gen)
    next_obs = torch.randint(0, 256, (NUM_ENVS, 4, 84, 84), dtype=torch.uint8, generator=gen)
    next_done = torch.tensor([1.0, 0.0])
    assert dones.any() and not dones.all()
    return obs, rewards, dones, values, next_obs, next_done


make_pair = functools.partial(agent_pair, BASE, FAST, "network", (N_ACT,), num_envs=NUM_ENVS, num_steps=NUM_STEPS)


def check_equivalence(compile, cudagraphs, device, calls=4):
    """Same parameters and data: the policy, GAE and several minibatch updates (with the learning rate changed
    in between, as annealing does) give the same outputs and parameters in both scripts. The baseline gets
    float frames, the compiled variant uint8 ones. Enough calls that graphs are captured and replayed. The compiled
    variant's update writes its statistics into the same fixed tensors each time, and its policy records no
    autograd graph."""
    (agent_b, (gae_b, update_b)), (agent_f, (gae_f, update_f, policy_f, stats_f)) = make_pair(
        compile, cudagraphs, device
    )
    stats_names = load_script(BASE).STATS
    assert load_script(FAST).STATS == stats_names and list(stats_f) == list(stats_names)
    fixed = [value.data_ptr() for value in stats_f.values()]
    # GPU kernels of compiled and eager code round differently
    tol = dict(atol=1e-5, rtol=1e-4) if device == "cpu" else dict(atol=1e-4, rtol=1e-3)
    gen = torch.Generator().manual_seed(1)
    initial = [p.detach().clone() for p in agent_f.network.parameters()]
    for i in range(calls):
        obs, rewards, dones, values, next_obs, next_done = (t.to(device) for t in random_rollout(gen))

        torch.manual_seed(10 * i)
        with torch.no_grad():
            action_b, logprob_b, _, value_b = agent_b.network.get_action_and_value(obs[0].float())
        torch.manual_seed(10 * i)
        outs_f = policy_f(obs[0])
        assert not any(out.requires_grad for out in outs_f), "the policy acts without autograd"
        for out_f, out_b in zip(outs_f, (action_b, logprob_b, value_b.flatten()), strict=True):
            torch.testing.assert_close(out_f, out_b, **tol)

        advantages_b, returns_b = gae_b(next_obs.float(), next_done, rewards, values, dones)
        advantages_f, returns_f = gae_f(next_obs, next_done, rewards, values, dones)
        torch.testing.assert_close(advantages_f, advantages_b, **tol)
        torch.testing.assert_close(returns_f, returns_b, **tol)

        lr = 2.5e-4 * (1 - i / calls)
        agent_b.optimizer.param_groups[0]["lr"] = lr
        agent_f.optimizer.param_groups[0]["lr"].fill_(lr)
        mb = torch.randperm(NUM_STEPS * NUM_ENVS, generator=gen)[: NUM_STEPS * NUM_ENVS // 2].to(device)
        actions = torch.randint(0, N_ACT, (NUM_STEPS * NUM_ENVS,), generator=gen).to(device)
        logprobs = (np.log(1 / N_ACT) + 0.05 * torch.randn(NUM_STEPS * NUM_ENVS, generator=gen)).to(device)
        minibatch = (actions[mb], logprobs[mb], advantages_b.flatten()[mb], returns_b.flatten()[mb])
        minibatch += (values.flatten()[mb],)
        stats_b = update_b(obs.flatten(0, 1)[mb].float(), *minibatch)
        assert update_f(obs.flatten(0, 1)[mb], *minibatch) is None and list(stats_b) == list(stats_names)
        for name in stats_names:
            torch.testing.assert_close(stats_f[name], stats_b[name], **tol, msg=name)
        for p0, (name, p_b), p_f in zip(initial, agent_b.network.named_parameters(), agent_f.network.parameters()):
            assert_same_update(p0, p_b.detach(), p_f.detach(), name=name)
    # The updates really moved the parameters.
    assert all(not torch.equal(p0, p) for p0, p in zip(initial, agent_f.network.parameters()))
    assert [value.data_ptr() for value in stats_f.values()] == fixed


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline(compile):
    check_equivalence(compile, cudagraphs=False, device="cpu")


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline_cuda(compile, monkeypatch):
    # Full float32 convolutions in both scripts (matmuls already are), so that the tolerance stays tight.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    check_equivalence(compile, cudagraphs=True, device="cuda")


def test_updates_improve_a_fixed_batch():
    """Updates on one batch make the action with a positive advantage more likely and the one with a negative
    advantage less likely, and move the value towards the returns; a sign error in a loss would undo one."""
    base = load_script(BASE)
    args = base.Args(num_envs=NUM_ENVS, num_steps=NUM_STEPS)
    torch.manual_seed(0)
    agent = base.Agent(args, N_ACT, "cpu")
    _, update = base.make_update_fns(agent, args)
    # One observation, every action taken 8 times: action 0 did better than expected, action 1 worse.
    obs = torch.randint(0, 256, (1, 4, 84, 84), generator=torch.Generator().manual_seed(2)).float()
    obs = obs.expand(32, -1, -1, -1)
    actions = torch.arange(32) % N_ACT
    advantages = (actions == 0).float() - (actions == 1).float()
    with torch.no_grad():
        _, logprobs, _, values = agent.network.get_action_and_value(obs, actions)
    values = values.flatten()
    returns = values + 1.0
    for _ in range(10):
        update(obs, actions, logprobs, advantages, returns, values)
    with torch.no_grad():
        _, new_logprobs, _, new_values = agent.network.get_action_and_value(obs, actions)
    change = new_logprobs - logprobs
    assert change[actions == 0].min() > 0 > change[actions == 1].max()
    assert (new_values.flatten() - returns).abs().max() < 1.0


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    """Ctrl-C within the first rollout: the record covers the 20 env steps done and says it was cut short."""
    run_interrupted(name, TINY + ["--no-tensorboard"], 20, capsys, monkeypatch)


def resume(name, argv, capsys, monkeypatch):
    """A run of 2 iterations saved in ck/, then resumed to 4 (with argv): the record, what the loop saw, and the
    network the first resumed GAE call used, against the one saved at 64 steps."""
    run_main(name, TINY + ["--total-timesteps", "64", "--save-dir", "ck"] + argv, capsys)
    saved = torch.load(f"ck/{name}.pt", weights_only=True)["state"]
    script, used = load_script(name), []
    make = script.make_update_fns

    def make_update_fns(agent, args):
        gae, *others = make(agent, args)

        def first_gae(*inputs):
            if not used:
                used.append({key: tensor.clone() for key, tensor in agent.network.state_dict().items()})
            return gae(*inputs)

        return first_gae, *others

    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    record, seen = record_run(name, TINY + ["--resume", "ck"] + argv, capsys, monkeypatch)
    return record, seen, saved, used[0]


@pytest.mark.parametrize("name", [BASE, FAST])
def test_resume_goes_on_from_the_checkpoint(name, capsys, monkeypatch):
    """--resume restores the network and the optimizer (Adam's step count goes on from the saved one) before the
    first update and runs the iterations left; --eval-checkpoint plays the saved policy for whole games."""
    record, seen, saved, first = resume(name, [], capsys, monkeypatch)
    assert record["resumed_from"] == 64 and record["total_timesteps"] == 128
    assert len(seen.updates) == 2 * 2  # two iterations left, of 2 minibatches
    # The first iteration after the resume starts from the saved network.
    assert first.keys() == saved["network"].keys()
    for key, tensor in saved["network"].items():
        torch.testing.assert_close(first[key], tensor, rtol=0, atol=0, msg=key)
    steps = [float(s["step"]) for s in seen.agents[0].optimizer.state_dict()["state"].values()]
    assert steps and all(step == 8 for step in steps), steps  # 4 saved steps + 4 resumed ones
    evaluation = load_script(name).main(["--eval-checkpoint", "ck", "--eval-episodes", "1"])
    assert evaluation["episodes"] == 1 and evaluation["returns"][0] >= 0


@requires_cuda
def test_resumed_learning_rate_stays_on_the_device(capsys, monkeypatch):
    """A resumed twin's Adam reads its learning rate from a device tensor that annealing fills, so that captured
    updates read the current value; the checkpoint loads it as a CPU tensor."""
    _, seen, _, _ = resume(FAST, ["--cudagraphs", "--no-tensorboard"], capsys, monkeypatch)
    lr = seen.agents[0].optimizer.param_groups[0]["lr"]
    assert lr.device.type == "cuda" and float(lr) == pytest.approx(2.5e-4 / 4)


def test_no_video_flag():
    """envpool renders no frames: --help offers no --capture-video."""
    for name in (BASE, FAST):
        assert "capture_video" not in vars(load_script(name).Args())


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--env-id", "NoSuchGame-v5"], ["NoSuchGame-v5"]),
        (["--env-id", "CartPole-v1"], ["CartPole-v1", "Atari"]),
        (["--num-minibatches", "3"], ["--num-envs 8", "--num-steps 128", "--num-minibatches 3"]),
        (["--num-envs", "1", "--num-steps", "2", "--num-minibatches", "2"], ["--num-minibatches 2", "--norm-adv"]),
        (["--num-envs", "0"], ["--num-envs 0"]),
        (["--num-steps", "-1"], ["--num-steps -1"]),
        (["--update-epochs", "0"], ["--update-epochs 0"]),
        (["--learning-rate", "-0.1"], ["--learning-rate -0.1"]),
        (["--gamma", "2"], ["--gamma 2"]),
        (["--seed", "-1"], ["--seed -1"]),
        (["--target-kl", "0"], ["--target-kl"]),
        (["--total-timesteps", "100"], ["--total-timesteps 100", "--num-envs 8", "--num-steps 128"]),
    ],
)
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bad_input_cli(name):
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(name, "--env-id", "NoSuchGame-v5"), "NoSuchGame-v5")


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *TINY)
