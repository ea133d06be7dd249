"""SAC: both scripts through their update path in every mode, the TensorBoard scalars and the profile,
twin-vs-baseline equivalence, acting ahead, the replay buffer, a learning test, Ctrl-C, bad input. The checks
are off_policy.py's, shared with TD3 (test_td3.py mirrors this file)."""

import pytest
import torch
from helpers import MODES, assert_cudagraphs_fallback, assert_one_line_error, mode_id, requires_cuda, run_cli

import off_policy as op

BASE, FAST = "sac_continuous_action", "sac_continuous_action_torchcompile"
pytestmark = pytest.mark.usefixtures("workdir")


def baseline_step(fns_b, batch, actor_update):
    """The baseline's critic update, every other step the actor's (with alpha), then the target update."""
    update_critic, update_actor, update_targets = fns_b
    stats = update_critic(*batch)
    if actor_update:
        stats.update(update_actor(batch[0]))
    update_targets()
    return stats


SAC = op.Algo(
    base=BASE,
    fast=FAST,
    baseline_step=baseline_step,
    train_flags=(True,),  # target update at every step (--target-network-frequency 1)
    expected_action=lambda agent_f, args, obs: agent_f.actor.get_action(obs)[0].detach().cpu().numpy(),
    learn_argv=["--total-timesteps", "5000", "--learning-starts", "500", "--batch-size", "64"],
    # About -1200 with random actions; about -700 seen.
    learn_return=-950,
    extra_state=lambda agent_b, agent_f: [
        ("log_alpha", agent_b.log_alpha, agent_f.log_alpha),
        ("alpha", torch.tensor([agent_b.alpha], device=agent_f.alpha.device), agent_f.alpha),
    ],
    constant=lambda args: set() if args.autotune else {"log_alpha", "alpha"},
    cpu_tol=1e-4,
)


def test_baseline_update_path(capsys):
    op.check_baseline_update_path(SAC, ["--no-autotune"], capsys)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_compiled_update_path(mode, capsys):
    op.check_compiled_update_path(SAC, mode, capsys)


def test_compiled_no_autotune_with_compile(capsys):
    op.check_compiled_update_path(SAC, ["--compile"], capsys, extra=["--no-autotune"])


@pytest.mark.parametrize("name", [BASE, FAST])
def test_logs_stats_and_profiles_phases(name, tmp_path, monkeypatch, capsys):
    op.check_logs_and_profile(SAC, name, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("autotune", [True, False], ids=["autotune", "fixed-alpha"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline(compile, autotune):
    op.check_equivalence(SAC, compile, cudagraphs=False, device=torch.device("cpu"), autotune=autotune)


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline_cuda(compile):
    op.check_equivalence(SAC, compile, cudagraphs=True, device=torch.device("cuda"), autotune=True)


def test_acts_ahead_with_the_current_actor(monkeypatch, capsys):
    op.check_acts_with_current_actor(SAC, monkeypatch, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_learns_pendulum(name, capsys):
    op.check_learns_pendulum(SAC, name, capsys)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    op.check_interrupted(name, capsys, monkeypatch)


BAD_INPUT = op.BAD_INPUT + SAC.bad_input


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
    op.check_buffer_samples_stored_rows(SAC)


def test_stores_the_baseline_transitions(monkeypatch, capsys):
    op.check_stores_the_baseline_transitions(SAC, monkeypatch, capsys)
