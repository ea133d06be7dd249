"""TD3: both scripts through their update path in every mode, the TensorBoard scalars and the profile,
twin-vs-baseline equivalence, exploration within each bound, acting ahead, the replay buffer, a learning test,
Ctrl-C, bad input. The checks are off_policy.py's, shared with SAC (test_sac.py mirrors this file)."""

import numpy as np
import pytest
import torch
from helpers import MODES, assert_cudagraphs_fallback, assert_one_line_error, mode_id, requires_cuda, run_cli

import off_policy as op

BASE, FAST = "td3_continuous_action", "td3_continuous_action_torchcompile"
pytestmark = pytest.mark.usefixtures("workdir")


def baseline_step(fns_b, batch, actor_update):
    """The baseline's critic update, every other step the actor's with the soft update of every target."""
    update_critic, update_actor_and_targets = fns_b
    stats = update_critic(*batch)
    if actor_update:
        stats.update(update_actor_and_targets(batch[0]))
    return stats


def expected_action(agent_f, args, obs):
    """The baseline loop's exploration (noise, clip to the bounds), with the twin's trained actor."""
    with torch.no_grad():
        actions = agent_f.actor(obs) + torch.normal(0, agent_f.actor.action_scale * args.exploration_noise)
    return actions.cpu().numpy().clip(op.LOW, op.HIGH)


TD3 = op.Algo(
    base=BASE,
    fast=FAST,
    baseline_step=baseline_step,
    train_flags=(),
    expected_action=expected_action,
    # A faster learning rate and target rate: about -1200 with random actions, -356 and -389 seen for seed 1.
    learn_argv=["--total-timesteps", "5000", "--learning-starts", "500", "--batch-size", "64", "--learning-rate",
                "1e-3", "--tau", "0.05"],  # fmt: skip
    learn_return=-800,
    # Noise this large makes the smoothing clip, the target clamp and the exploration clamp all bite.
    args=dict(policy_noise=1.0, exploration_noise=1.0),
    bad_input=[(["--exploration-noise", "-0.1"], ["--exploration-noise -0.1 must not be negative"])],
    actors=("actor", "target_actor"),
)


def test_baseline_update_path(capsys):
    op.check_baseline_update_path(TD3, [], capsys)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_compiled_update_path(mode, capsys):
    op.check_compiled_update_path(TD3, mode, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_logs_stats_and_profiles_phases(name, tmp_path, monkeypatch, capsys):
    op.check_logs_and_profile(TD3, name, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline(compile):
    op.check_equivalence(TD3, compile, cudagraphs=False, device=torch.device("cpu"))


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline_cuda(compile):
    op.check_equivalence(TD3, compile, cudagraphs=True, device=torch.device("cuda"))


def test_policy_clips_to_each_bound():
    """The twin's exploration keeps every action in its own dimension's bounds and uses them."""
    policy_f = op.make_pair(TD3, compile=False, cudagraphs=False, device=torch.device("cpu")).policy_f
    actions = torch.cat([policy_f(torch.randn(1, op.N_OBS)) for _ in range(200)]).numpy()
    assert ((actions >= op.LOW) & (actions <= op.HIGH)).all()
    assert (actions == op.LOW.astype(np.float32)).any(0).all() and (actions == op.HIGH.astype(np.float32)).any(0).all()


def test_acts_ahead_with_the_current_actor(monkeypatch, capsys):
    op.check_acts_with_current_actor(TD3, monkeypatch, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_learns_pendulum(name, capsys):
    op.check_learns_pendulum(TD3, name, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    op.check_interrupted(name, capsys, monkeypatch)


BAD_INPUT = op.BAD_INPUT + TD3.bad_input


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=op.argv_ids(BAD_INPUT))
def test_bad_input(name, argv, fragments, capsys):
    op.check_bad_input(name, argv, fragments, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bad_input_cli(name):
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(name, "--env-id", "NoSuchEnv-v0"), "NoSuchEnv-v0")


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *op.TINY)


def test_buffer_samples_stored_rows():
    op.check_buffer_samples_stored_rows(TD3)


def test_stores_the_baseline_transitions(monkeypatch, capsys):
    op.check_stores_the_baseline_transitions(TD3, monkeypatch, capsys)
