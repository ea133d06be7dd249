"""SAC at GPU scale with the FastSAC recipe (leanrl/sac_gpu_mujoco.py and its _torchcompile twin) on the CPU, Warp's
CPU device: the twin's update (vmapped critics, fused target update, the entropy coefficient on the device) against
the baseline's from the same parameters and batches, eager, compiled and with --amp; the squashed Gaussian policy;
both scripts through their update (the twin in its modes; --cudagraphs falls back to no graphs on the CPU) and their
logged statistics; the per-env replay buffer; the evaluation's video; a learning check that a broken update fails;
bad input. The envs (leanrl/mujoco_warp_envs.py) are test_mujoco_warp_envs.py's. The checks that the TD3 pair shares
are off_policy_gpu.py's; what is SAC's is here, with the pair's Algo.

Warp's kernels load from ~/.cache/warp (a first build takes a minute or two on the 2-core CPU)."""

import math

import numpy as np
import off_policy_gpu as opg
import pytest
import torch
from helpers import load_script, run_main, tensorboard_scalars
from off_policy_gpu import HIGH, LOW, N_OBS, TINY

import harness

NAME = "sac_gpu_mujoco"
FAST = f"{NAME}_torchcompile"
pytestmark = pytest.mark.usefixtures("workdir")


def descending_loss(agent, obs):
    """The actor's loss with the critics' value's sign flipped, to descend it."""
    pi, log_pi, _ = agent.actor.get_action(obs)
    return (agent.log_alpha.detach().exp() * log_pi + torch.min(agent.qf1(obs, pi), agent.qf2(obs, pi))).mean()


SAC = opg.Algo(
    base=NAME,
    fast=FAST,
    small={"critic_hidden_dim": 32, "actor_hidden_dim": 16},
    bandit_args=dict(critic_hidden_dim=64, actor_hidden_dim=32, q_lr=1e-3, policy_lr=1e-3),
    stacked_critics="qvalues",
    value=lambda agent, q: q.view(-1),
    # The deterministic action: the squashed mean.
    bandit_action=lambda agent, obs: agent.actor.get_action(obs)[2],
    broken_actor_loss=descending_loss,
    extra_state=lambda agent_b, agent_f: [("log_alpha", agent_b.log_alpha, agent_f.log_alpha)],
    act=lambda policy, obs: policy(obs),
    bad_input=[
        (["--alpha", "0"], ["--alpha 0.0"]),
        (["--alpha", "-0.1"], ["--alpha -0.1"]),
        (["--critic-hidden-dim", "2"], ["--critic-hidden-dim 2"]),
        (["--q-lr", "0"], ["--q-lr 0"]),
    ],
)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_update_equivalence(compile):
    """The twin's update follows the baseline's, step for step, log_alpha included, with an alpha large enough that
    the entropy terms weigh and learning rates large enough that the targets lag the critics."""
    opg.check_update_equivalence(SAC, compile, alpha=0.2, tau=0.3, q_lr=1e-2, policy_lr=1e-2)


@pytest.mark.usefixtures("eager_random")
def test_amp_update():
    """The twin's bf16 update follows the baseline's, near the fp32 one; the policy's actions stay fp32."""
    opg.check_amp_update(SAC, alpha=0.2)


@pytest.mark.usefixtures("eager_random")
def test_policy_is_the_squashed_gaussian():
    """The twin's policy samples CleanRL's squashed Gaussian, tanh(mean + std * N(0, 1)) scaled to each dimension's
    bounds, its log std within [LOG_STD_MIN, LOG_STD_MAX]; both scripts' log-probabilities are the Gaussian's less
    the log of the squashing's derivative (its 1e-6 included), finite where tanh saturates and the action is on a
    bound; the deterministic action is the squashed mean."""
    agent_b, _, agent_f, (*_, policy) = opg.make_pair(SAC, False)
    fast = load_script(FAST)
    obs = torch.randn(64, N_OBS) * torch.tensor([1.0, 1e4]).repeat_interleave(32)[:, None]  # half saturate tanh
    torch.manual_seed(3)
    actions = policy(obs)
    with torch.no_grad():
        mean, log_std = agent_f.actor(obs)
    torch.manual_seed(3)
    x = mean + log_std.exp() * torch.randn_like(mean)
    scale, bias = (HIGH - LOW) / 2, (HIGH + LOW) / 2
    torch.testing.assert_close(actions, torch.tanh(x) * scale + bias)
    assert not actions.requires_grad and ((actions >= LOW) & (actions <= HIGH)).all()
    assert ((actions == LOW) | (actions == HIGH)).any()
    assert ((log_std >= fast.LOG_STD_MIN) & (log_std <= fast.LOG_STD_MAX)).all()
    gaussian = -((x - mean) ** 2) / (2 * (2 * log_std).exp()) - log_std - math.log(math.sqrt(2 * math.pi))
    expected = (gaussian - torch.log(scale * (1 - torch.tanh(x) ** 2) + 1e-6)).sum(1, keepdim=True)
    for agent in (agent_b, agent_f):
        torch.manual_seed(3)
        with torch.no_grad():
            sampled, log_prob, deterministic = agent.actor.get_action(obs)
        torch.testing.assert_close(sampled, actions)
        torch.testing.assert_close(log_prob, expected, rtol=1e-4, atol=1e-3)
        assert torch.isfinite(log_prob).all()
        torch.testing.assert_close(deterministic, torch.tanh(mean) * scale + bias)


@pytest.mark.parametrize("amp", opg.BASELINE_RUNS)
def test_baseline_runs(amp, capsys):
    """The baseline through its fps window, in fp32 and with --amp."""
    opg.check_baseline_runs(SAC, amp, capsys)


@pytest.mark.parametrize("mode", opg.TWIN_RUNS)
def test_twin_runs(mode, capsys):
    """The twin through its fps window in its modes."""
    opg.check_twin_runs(SAC, mode, capsys)


def test_twin_runs_humanoid(capsys):
    opg.check_twin_runs_humanoid(SAC, capsys)


def test_evaluation_video(capsys):
    opg.check_evaluation_video(SAC, capsys)


@pytest.mark.parametrize("name, fixed_alpha", [(NAME, False), (FAST, True)], ids=["autotune", "fixed-alpha"])
def test_logs_the_statistics(name, fixed_alpha, monkeypatch, capsys):
    """With a progress tick at every vector step, TensorBoard gets each of STATS and losses/alpha once an actor update
    has run (the baseline: from the first, at env step 40; the twin: from learning starts + --policy-frequency vector
    steps, at 48) to the end, all finite; with --autotune alpha moves from --alpha, without it alpha stays there and
    its loss is 0."""
    module = load_script(name)
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)
    run_main(name, [arg for arg in TINY if arg != "--no-tensorboard"] + ["--no-autotune"] * fixed_alpha, capsys)
    scalars = tensorboard_scalars(name, "Hopper-v5")
    for stat in (*module.STATS, "alpha"):
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == list(range(40 if name == NAME else 48, 100, 4)), stat
        assert np.isfinite(values).all(), stat
    alphas, alpha_losses = ([value for _, value in scalars[f"losses/{tag}"]] for tag in ("alpha", "alpha_loss"))
    if fixed_alpha:
        assert alphas == pytest.approx([0.001] * len(alphas)) and not any(alpha_losses)
    else:
        # Adam moves log alpha by about --q-lr per alpha step: alpha by about 3e-4 of itself.
        assert all(abs(math.log(alpha / 0.001)) > 1e-4 for alpha in alphas) and all(alpha_losses), alphas
        assert len(set(alphas)) == len(alphas), alphas


@pytest.mark.parametrize("name, amp", opg.bandit_runs(SAC))
def test_learns_a_bandit(name, amp):
    """The critics learn the bandit's rewards and the actor's deterministic action moves towards its best actions,
    in fp32 and --amp."""
    opg.check_learns_a_bandit(SAC, name, amp)


def test_a_broken_actor_update_fails_the_bandit():
    """An actor update that descends the critics' value fails the learning check."""
    opg.check_a_broken_actor_update_fails_the_bandit(SAC)


@pytest.mark.parametrize("argv, fragments", opg.bad_input(SAC))
def test_bad_input(argv, fragments, capsys):
    opg.check_bad_input(SAC, argv, fragments, capsys)


def test_bad_input_cli():
    """As a user sees it."""
    opg.check_bad_input_cli(SAC)
