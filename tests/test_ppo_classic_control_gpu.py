"""PPO on GPU-resident classic control (the envs themselves: test_torch_classic_control.py): both scripts through full
iterations in every mode on every env, the same first rollout in both, GAE and update equivalence of the compiled
variant with the baseline, target-kl, learning-rate annealing, a learning test, the profile, Ctrl-C, bad input."""

import functools
import os
import signal

import numpy as np
import ppo
import pytest
import torch
from helpers import (
    MODES,
    PHASES,
    POLICY_IN_STEP_PHASES,
    agent_pair,
    assert_cudagraphs_fallback,
    assert_one_line_error,
    assert_return_curve,
    assert_steady,
    assert_trace_phases,
    first_rollout,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_main,
    run_mode,
    tensorboard_scalars,
)

from torch_classic_control import ENVS, CartPole

BASE, FAST = "ppo_classic_control_gpu", "ppo_classic_control_gpu_torchcompile"
ENV_IDS = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0")
envs_ids = pytest.mark.parametrize("env_id", ENV_IDS)

# The TINY runs: 8 envs, minibatches of 80, five iterations (WARMUP_ITERATIONS of them warm-up, then the fps
# window). Five rollouts of NUM_STEPS steps reach Acrobot's 500-step and MountainCar's 200-step time limits, so an
# episode ends in every env (CartPole's random ones end after about 20 steps). The equivalence tests use the same
# shapes, so the compiled ones find the TINY runs' graphs in Inductor's cache.
NUM_ENVS, MINIBATCH, ITERATIONS = 8, 80, 5
NUM_STEPS = {"CartPole-v1": 40, "Acrobot-v1": 100, "MountainCar-v0": 40}
# The returns an episode can have: CartPole +1 a step; Acrobot -1 a step but 0 for the last when it terminates;
# MountainCar -1 a step, at most 200 steps.
RETURNS = {"CartPole-v1": (1, 500), "Acrobot-v1": (-500, 0), "MountainCar-v0": (-200, -1)}
# The equivalence tests' agents: CartPole's sizes.
N_OBS, N_ACT = CartPole.n_obs, CartPole.n_act
pytestmark = pytest.mark.usefixtures("workdir")


def tiny(env_id, iterations=ITERATIONS):
    num_steps = NUM_STEPS[env_id]
    return ["--env-id", env_id, "--num-envs", str(NUM_ENVS), "--num-steps", str(num_steps),
            "--num-minibatches", str(NUM_ENVS * num_steps // MINIBATCH), "--update-epochs", "1",
            "--total-timesteps", str(iterations * NUM_ENVS * num_steps)]  # fmt: skip


def total(env_id):
    return ITERATIONS * NUM_ENVS * NUM_STEPS[env_id]


# ---- the scripts' runs


def check_record(record, env_id):
    assert_steady(record, total(env_id))
    low, high = RETURNS[env_id]
    assert record["episodic_return"] is not None and low <= record["episodic_return"] <= high
    assert_return_curve(record)


@envs_ids
def test_baseline_iterations(env_id, capsys):
    record = run_main(BASE, tiny(env_id), capsys)
    assert record["compile"] is False and record["cudagraphs"] is False
    check_record(record, env_id)


@envs_ids
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.usefixtures("eager_random")  # as in the equivalence tests, which then reuse these graphs
def test_compiled_iterations(env_id, mode, capsys):
    check_record(run_mode(FAST, tiny(env_id), mode, capsys), env_id)


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("target_kl, epochs", [(None, 2), ("1e-12", 1)], ids=["no-target-kl", "target-kl"])
def test_target_kl_stops_epochs(name, target_kl, epochs, monkeypatch, capsys):
    """Two epochs asked for; a --target-kl that any update exceeds stops each iteration after the first."""
    script = load_script(name)
    calls = []

    def make_update_fns(agent, args, make=script.make_update_fns):
        gae, update, *others = make(agent, args)

        def counting_update(*minibatch):
            calls.append(len(minibatch[0]))
            return update(*minibatch)

        return gae, counting_update, *others

    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    argv = tiny("CartPole-v1") + ["--update-epochs", "2", "--no-tensorboard"]
    run_main(name, argv + (["--target-kl", target_kl] if target_kl else []), capsys)
    assert calls == [MINIBATCH] * (epochs * total("CartPole-v1") // MINIBATCH)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_anneal_lr(name, monkeypatch, capsys):
    """The learning rate falls linearly from --learning-rate towards zero, once per iteration, and TensorBoard gets
    it, with every statistic of the iteration's last update and the mean return of the episodes that ended; with
    --no-anneal-lr it stays."""
    script = load_script(name)
    rates = []
    set_learning_rate = script.Agent.set_learning_rate

    def recording(agent, lr):
        rates.append(lr)
        set_learning_rate(agent, lr)

    monkeypatch.setattr(script.Agent, "set_learning_rate", recording)
    run_main(name, tiny("CartPole-v1") + ["--learning-rate", "0.003"], capsys)
    assert rates == pytest.approx([0.003 * (1 - i / ITERATIONS) for i in range(ITERATIONS)])
    scalars = tensorboard_scalars(name, "CartPole-v1")
    iteration_ends = [(i + 1) * NUM_ENVS * NUM_STEPS["CartPole-v1"] for i in range(ITERATIONS)]
    assert scalars["charts/learning_rate"] == [(step, pytest.approx(lr)) for step, lr in zip(iteration_ends, rates)]
    for stat in (*script.STATS, "explained_variance"):
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == iteration_ends and np.isfinite(values).all(), stat
    # CartPole's random episodes end in every rollout: one mean return and length per iteration.
    for key, (low, high) in {"episodic_return": (1, 500), "episodic_length": (1, 500)}.items():
        steps, values = zip(*scalars[f"charts/{key}"])
        assert list(steps) == iteration_ends and all(low <= v <= high for v in values), key
    rates.clear()
    run_main(name, tiny("CartPole-v1") + ["--no-anneal-lr", "--no-tensorboard"], capsys)
    assert rates == []


@pytest.mark.parametrize(
    "name, phases, steps_per_call",
    # The baseline steps every env in each env_step call; the twin's collect (policy included) takes a rollout.
    [(BASE, PHASES, NUM_ENVS), (FAST, POLICY_IN_STEP_PHASES, NUM_ENVS * NUM_STEPS["CartPole-v1"])],
    ids=[BASE, FAST],
)
def test_profile_dir(name, phases, steps_per_call, tmp_path, capsys):
    record = run_main(name, tiny("CartPole-v1") + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_steady(record, total("CartPole-v1"))
    assert_trace_phases(tmp_path / "profile", name, env_steps_per_call=steps_per_call, phases=phases)


@pytest.mark.signals
@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_a_checkpoint_and_the_record(name, monkeypatch, capsys):
    """SIGINT in the first rollout: the run ends as the second iteration would begin, with a checkpoint of the first
    iteration's env steps with --save-dir and a record that says it was cut short."""
    at_step = NUM_ENVS * NUM_STEPS["CartPole-v1"]
    run_class, handlers = load_script(name).Run, [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    tick = run_class.tick

    def interrupting_tick(self, step):
        # The first tick: an env step in the baseline, a rollout in the twin.
        if self.stops.signal is None and step <= at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return tick(self, step)

    monkeypatch.setattr(run_class, "tick", interrupting_tick)
    try:
        record = run_main(name, tiny("CartPole-v1") + ["--no-tensorboard", "--save-dir", "saved"], capsys, True)
    finally:
        for signum, handler in zip((signal.SIGINT, signal.SIGTERM), handlers):
            signal.signal(signum, handler)
    assert record["total_timesteps"] == at_step and record["steady"] is False
    checkpoint = torch.load(f"saved/{name}.pt", weights_only=True)
    assert checkpoint["global_step"] == at_step and set(checkpoint["state"]) == {"net", "optimizer"}


@pytest.mark.parametrize("name", [BASE, FAST])
def test_learns_cartpole(name, capsys):
    """120k steps take CartPole's return from about 22 (random policy) to about 480 (500 is the most) on this CPU,
    in either script; a broken update stays at or below the random return (the policy loss with its sign
    flipped: about 9; without the policy loss: about 22)."""
    record = run_main(name, ["--num-envs", "16", "--num-steps", "64", "--learning-rate", "2.5e-3",
                             "--total-timesteps", "120000", "--no-tensorboard"], capsys)  # fmt: skip
    assert record["episodic_return"] > 400
    assert_return_curve(record)


# ---- equivalence of the twin with the baseline


@envs_ids
@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_first_rollout_is_the_same(env_id, mode, capsys, monkeypatch):
    """With one seed, the first rollouts of both scripts agree slot by slot (observations, actions,
    log-probabilities, values, rewards, done flags), and so do GAE's inputs and outputs: the same parameters and
    the same random stream, drawn in the same order by the policy and the envs' resets."""
    argv = tiny(env_id, iterations=1)
    rollout_b, gae_b = first_rollout(BASE, argv + ["--no-tensorboard"], capsys, monkeypatch)
    rollout_f, gae_f = first_rollout(FAST, argv + mode + ["--no-tensorboard"], capsys, monkeypatch)
    for key in ("obs", "dones"):
        torch.testing.assert_close(getattr(rollout_f, key)[:-1], getattr(rollout_b, key))
    for key in ("actions", "logprobs", "values", "rewards"):
        torch.testing.assert_close(getattr(rollout_f, key), getattr(rollout_b, key))
    for x_f, x_b in zip(gae_f, gae_b, strict=True):
        torch.testing.assert_close(x_f, x_b)
    assert rollout_b.actions.unique().numel() == ENVS[env_id].n_act
    if env_id == "CartPole-v1":  # random CartPole episodes last about 20 steps: some end within this rollout
        assert rollout_b.dones.any()


make_pair = functools.partial(agent_pair, BASE, FAST, "net", (N_OBS, N_ACT))
check_gae = functools.partial(ppo.check_gae, make_pair, N_OBS)


def set_learning_rates(agent_b, agent_f, lr):
    for agent in (agent_b, agent_f):
        agent.set_learning_rate(lr)


check_updates = functools.partial(ppo.check_updates, make_pair, N_OBS,
                                  lambda gen, n: torch.randint(0, N_ACT, (n,), generator=gen),
                                  set_learning_rate=set_learning_rates)  # fmt: skip


@pytest.mark.parametrize("num_steps", [1, 2, 37, 64, 100])
def test_gae_equivalence(num_steps):
    check_gae(compile=False, cudagraphs=False, device="cpu", num_steps=num_steps, num_envs=3)


@pytest.mark.usefixtures("eager_random")
def test_gae_equivalence_compiled():
    check_gae(compile=True, cudagraphs=False, device="cpu", num_steps=NUM_STEPS["CartPole-v1"], num_envs=NUM_ENVS)


def check_update(compile, cudagraphs, device, updates=4, **kwargs):
    """ppo.check_updates (the twin's updates against the baseline's); then its acting policy (compiled and captured
    only within collect) sees the trained weights without recording an autograd graph: its action is the baseline's
    draw for draw, and so are its log-probability and value."""
    agent_b, _, policy_f, obs, _, tol = check_updates(compile, cudagraphs, device, MINIBATCH, updates, **kwargs)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = agent_b.net.get_action_and_value(obs)
    torch.manual_seed(5)
    action, logprob, value = policy_f(obs)
    assert not any(x.requires_grad for x in (action, logprob, value)), "the policy acts without autograd"
    torch.testing.assert_close(action, expected[0])
    torch.testing.assert_close(logprob, expected[1], atol=tol, rtol=tol)
    torch.testing.assert_close(value, expected[3].flatten(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "kwargs", [{}, {"norm_adv": False, "clip_vloss": False, "ent_coef": 0.0}], ids=["defaults", "options"]
)
def test_update_equivalence(kwargs):
    check_update(compile=False, cudagraphs=False, device="cpu", **kwargs)


@pytest.mark.usefixtures("eager_random")
def test_update_equivalence_compiled():
    check_update(compile=True, cudagraphs=False, device="cpu")


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_cuda(compile):
    check_gae(compile, cudagraphs=True, device="cuda", num_steps=128, num_envs=64, calls=4)
    check_update(compile, cudagraphs=True, device="cuda", updates=5)


# ---- bad input

BAD_INPUT = [
    (["--env-id", "Pendulum-v1"], ["Pendulum-v1", "CartPole-v1, Acrobot-v1, MountainCar-v0"]),
    (["--num-envs", "0"], ["--num-envs 0"]),
    (["--num-steps", "-1"], ["--num-steps -1"]),
    (["--num-minibatches", "0"], ["--num-minibatches 0"]),
    (["--update-epochs", "0"], ["--update-epochs 0"]),
    (["--total-timesteps", "0"], ["--total-timesteps 0"]),
    (["--learning-rate", "-0.1"], ["--learning-rate -0.1"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--gamma", "1.5"], ["--gamma 1.5"]),
    (["--clip-coef", "-1"], ["--clip-coef -1"]),
    (["--target-kl", "-0.1"], ["--target-kl -0.1"]),
    (["--num-steps", "100", "--num-minibatches", "32"], ["--num-envs 4 * --num-steps 100 = 400", "--num-minibatches 32"]),
    (["--num-envs", "2", "--num-steps", "4", "--num-minibatches", "8"], ["--num-minibatches 8 ", "--norm-adv"]),
    (["--total-timesteps", "500"], ["--total-timesteps 500 ", "= 512"]),
]  # fmt: skip


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bad_input_cli(name):
    """As a user sees it: exit code 2 and one line, no traceback; --help offers only what runs (no video while
    training: the envs are tensors, which do not render)."""
    assert_one_line_error(run_cli(name, "--env-id", "Pendulum-v1"), "CartPole-v1, Acrobot-v1, MountainCar-v0")
    help_text = run_cli(name, "--help").stdout
    assert "--num-minibatches" in help_text and "--capture-video" not in help_text


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *tiny("CartPole-v1"))
