"""TD3 at GPU scale with the FastTD3 recipe (leanrl/td3_gpu_mujoco.py and its _torchcompile twin) on the CPU, Warp's
CPU device: C51's projection against a direct reference; the twin's update (vmapped critics, fused target update)
against the baseline's from the same parameters and batches, eager and compiled; the per-env replay buffer; both
scripts through their update (the twin in its modes; --cudagraphs falls back to no graphs on the CPU); the
evaluation's video; a learning check that a broken update fails; bad input. The envs themselves are
test_gpu_mujoco.py's (the same class). The checks that the SAC pair shares are off_policy_gpu.py's; what is TD3's is
here, with the pair's Algo.

Warp's kernels load from ~/.cache/warp (a first build takes a minute or two on the 2-core CPU)."""

import numpy as np
import off_policy_gpu as opg
import pytest
import torch
from helpers import load_script
from off_policy_gpu import HIGH, LOW, N_OBS

NAME = "td3_gpu_mujoco"
FAST = f"{NAME}_torchcompile"
pytestmark = pytest.mark.usefixtures("workdir")


def expected_value(agent, logits):
    """A C51 critic's value: the expected value of its distribution over the agent's support."""
    return (torch.softmax(logits, -1) * agent.support).sum(-1)


def descending_loss(agent, obs):
    """The actor's loss with its sign flipped: the smaller of the critics' expected values, to descend."""
    return torch.minimum(*[expected_value(agent, qf(obs, agent.actor(obs))) for qf in (agent.qf1, agent.qf2)]).mean()


TD3 = opg.Algo(
    base=NAME,
    fast=FAST,
    small={"critic_hidden_dim": 32, "actor_hidden_dim": 16, "num_atoms": 11, "v_max": 10.0},
    bandit_args=dict(critic_hidden_dim=64, actor_hidden_dim=32, num_atoms=51, v_max=4.0, learning_rate=1e-3),
    stacked_critics="qlogits",
    value=expected_value,
    bandit_action=lambda agent, obs: agent.actor(obs),
    broken_actor_loss=descending_loss,
    bad_input=[
        (["--num-atoms", "1"], ["--num-atoms 1"]),
        (["--v-max", "0"], ["--v-max 0"]),
        (["--std-min", "0.5"], ["--std-min 0.5", "--std-max 0.4"]),
        (["--v-max", "-5"], ["--v-max -5"]),
    ],
)


def reference_projection(probs, rewards, discounts, support):
    """C51's projection written out atom by atom: each atom's value moved, clipped, and its mass split between the
    two atoms around it in proportion to the distance, all of it on an atom it lands on."""
    v_min, v_max, n = support[0].item(), support[-1].item(), len(support)
    dz, out = (v_max - v_min) / (n - 1), np.zeros(probs.shape)
    for i in range(probs.shape[0]):
        for j in range(n):
            value = min(max(rewards[i].item() + discounts[i].item() * support[j].item(), v_min), v_max)
            b = (value - v_min) / dz
            lower = int(np.floor(b))
            if abs(b - round(b)) < 1e-9:
                out[i, round(b)] += probs[i, j].item()
            else:
                out[i, lower] += probs[i, j].item() * (lower + 1 - b)
                out[i, lower + 1] += probs[i, j].item() * (b - lower)
    return out


@pytest.mark.parametrize("name", [NAME, FAST])
def test_projection_matches_reference(name):
    """Values inside the support, beyond both ends (clipped), on atoms exactly (no bootstrap, rewards on atoms), and
    the same projection of both critics at once (leading dimension, as the twin's)."""
    project = load_script(name).project
    support = torch.linspace(-5.0, 5.0, 11)
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 11), -1)
    rewards = torch.tensor([0.3, -7.0, 9.0, 2.0, -1.0, 0.05])
    discounts = torch.tensor([0.9, 0.81, 0.9, 0.0, 0.0, 0.729])  # 1 to 3 steps of gamma 0.9; episodes ended
    projected = project(probs, rewards, discounts, support)
    expected = reference_projection(probs, rewards, discounts, support)
    np.testing.assert_allclose(projected.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(projected.sum(1).numpy(), 1.0, atol=1e-6)  # no mass lost
    assert projected[3].argmax() == 7 and projected[3, 7] == pytest.approx(1.0)  # reward 2, no bootstrap: atom 2
    # discount 1, reward 0: the distribution itself, every value on its own atom.
    same = project(probs, torch.zeros(6), torch.ones(6), support)
    np.testing.assert_allclose(same.numpy(), probs.numpy(), atol=1e-6)
    both = project(torch.stack([probs, probs.flip(1)]), rewards, discounts, support)
    np.testing.assert_allclose(both[0].numpy(), expected, atol=1e-6)
    flipped = reference_projection(probs.flip(1), rewards, discounts, support)
    np.testing.assert_allclose(both[1].numpy(), flipped, atol=1e-6)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_update_equivalence(compile):
    """The twin's update follows the baseline's, step for step, with a large smoothing noise so its clip and the
    action clamp bite."""
    opg.check_update_equivalence(TD3, compile, policy_noise=0.8, tau=0.3)


@pytest.mark.usefixtures("eager_random")
def test_amp_update():
    """The twin's bf16 update follows the baseline's, near the fp32 one."""
    opg.check_amp_update(TD3)


@pytest.mark.usefixtures("eager_random")
def test_policy_explores_per_env_within_bounds():
    """The twin's policy: the actor's action plus each env's own noise scale, clamped to each dimension's bounds."""
    _, _, agent_f, (*_, policy) = opg.make_pair(TD3, False)
    obs, scales = torch.randn(4, N_OBS), torch.tensor([[0.0], [0.01], [0.4], [5.0]])
    torch.manual_seed(3)
    actions = policy(obs, scales)
    torch.manual_seed(3)
    with torch.no_grad():
        mean = agent_f.actor(obs)
    expected = (mean + torch.randn_like(mean) * scales * agent_f.actor.action_scale).clamp(LOW, HIGH)
    torch.testing.assert_close(actions, expected)
    assert torch.equal(actions[0], mean[0]) and not actions.requires_grad
    assert ((actions >= LOW) & (actions <= HIGH)).all()


@pytest.mark.parametrize("amp", opg.BASELINE_RUNS)
def test_baseline_runs(amp, capsys):
    """The baseline through its fps window, in fp32 and with --amp."""
    opg.check_baseline_runs(TD3, amp, capsys)


@pytest.mark.parametrize("mode", opg.TWIN_RUNS)
def test_twin_runs(mode, capsys):
    """The twin through its fps window in its modes."""
    opg.check_twin_runs(TD3, mode, capsys)


def test_twin_runs_humanoid(capsys):
    opg.check_twin_runs_humanoid(TD3, capsys)


def test_evaluation_video(capsys):
    opg.check_evaluation_video(TD3, capsys)


@pytest.mark.parametrize("name, amp", opg.bandit_runs(TD3))
def test_learns_a_bandit(name, amp):
    """The critics learn the bandit's rewards and the actor moves towards its best actions, in fp32 and --amp."""
    opg.check_learns_a_bandit(TD3, name, amp)


def test_a_broken_actor_update_fails_the_bandit():
    """An actor update that descends the critics' expected value fails the learning check."""
    opg.check_a_broken_actor_update_fails_the_bandit(TD3)


@pytest.mark.parametrize("argv, fragments", opg.bad_input(TD3))
def test_bad_input(argv, fragments, capsys):
    opg.check_bad_input(TD3, argv, fragments, capsys)


def test_bad_input_cli():
    """As a user sees it."""
    opg.check_bad_input_cli(TD3)
