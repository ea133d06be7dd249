"""SAC at GPU scale with the FastSAC recipe (leanrl/sac_gpu_mujoco.py and its _torchcompile twin) on the CPU, Warp's
CPU device: the twin's update (vmapped critics, fused target update, the entropy coefficient on the device) against
the baseline's from the same parameters and batches, eager, compiled and with --amp; the squashed Gaussian policy;
both scripts through their update (the twin in its modes; --cudagraphs falls back to no graphs on the CPU) and their
logged statistics; a learning check that a broken update fails; bad input. The envs are test_gpu_mujoco.py's and the
replay buffer test_td3_gpu_mujoco.py's (the same classes, checked here).

Warp's kernels load from ~/.cache/warp (a first build takes a minute or two on the 2-core CPU)."""

import ast
import math

import numpy as np
import pytest
import torch
from helpers import (
    SCRIPTS,
    assert_one_line_error,
    assert_same_update,
    assert_steady,
    load_script,
    mode_id,
    run_bad_input,
    run_cli,
    run_main,
    run_mode,
    tensorboard_scalars,
)

NAME = "sac_gpu_mujoco"
FAST = f"{NAME}_torchcompile"
CPU = torch.device("cpu")
N_OBS, N_ACT, BATCH = 5, 2, 64
LOW, HIGH = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 3.0])  # bounds of different widths and centres
SMALL = {"critic_hidden_dim": 32, "actor_hidden_dim": 16}
# A tiny run: 4 Hopper envs, learning from env step 40, the fps window from 60 (WARMUP_STEPS vector steps later).
TINY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "400", "--learning-starts",
        "40", "--total-timesteps", "100", "--critic-hidden-dim", "32", "--actor-hidden-dim", "16", "--no-tensorboard"]
pytestmark = pytest.mark.usefixtures("workdir")


def class_source(name, cls):
    source = (SCRIPTS / f"{name}.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return ast.get_source_segment(source, node)


@pytest.mark.parametrize("name", [NAME, FAST])
def test_the_buffer_is_td3s(name):
    """The per-env device buffer is the TD3 pair's, word for word (its test is test_td3_gpu_mujoco.py's)."""
    assert class_source(name, "ReplayBuffer") == class_source(name.replace("sac", "td3"), "ReplayBuffer")


def make_pair(compile, **kwargs):
    """Baseline and twin agents with identical parameters, and both scripts' update functions."""
    base, fast = load_script(NAME), load_script(FAST)
    args_b = base.Args(**SMALL, **kwargs)
    args_f = fast.Args(**SMALL, **kwargs, compile=compile)
    torch.manual_seed(0)
    agent_b = base.Agent(args_b, N_OBS, N_ACT, LOW, HIGH, CPU)
    agent_f = fast.Agent(args_f, N_OBS, N_ACT, LOW, HIGH, CPU)
    agent_f.actor.load_state_dict(agent_b.actor.state_dict())
    with torch.no_grad():
        for params, nets in ((agent_f.qnet_params, "qf1 qf2"), (agent_f.qnet_target, "qf1_target qf2_target")):
            stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets.split()])
            for name, value in stacked.items():
                params[name].copy_(value)
    return agent_b, base.make_update_fns(agent_b, args_b), agent_f, fast.make_update_fns(agent_f, args_f)


def trained_state(agent_b, agent_f):
    """Every trained tensor of both agents as (name, baseline tensor, twin tensor)."""
    pairs = [(f"actor.{name}", p_b, p_f) for (name, p_b), p_f in
             zip(agent_b.actor.named_parameters(), agent_f.actor.parameters(), strict=True)]  # fmt: skip
    stacks = ("q", "qf1 qf2", agent_f.qnet_params), ("t", "qf1_target qf2_target", agent_f.qnet_target)
    for tag, nets, params in stacks:
        stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets.split()])
        pairs += [(f"{tag}.{name}", value, params[name]) for name, value in stacked.items()]
    return pairs + [("log_alpha", agent_b.log_alpha, agent_f.log_alpha)]


def random_batch(rng):
    """Normalised observations, actions within the bounds, rewards of a few units, and some episodes ended."""
    obs, next_obs = (torch.as_tensor(rng.standard_normal((BATCH, N_OBS)), dtype=torch.float32) for _ in range(2))
    actions = torch.as_tensor(rng.uniform(LOW, HIGH, (BATCH, N_ACT)), dtype=torch.float32).clamp(LOW * 0.9, HIGH * 0.9)
    rewards = torch.as_tensor(rng.normal(0, 4, BATCH), dtype=torch.float32)
    dones = torch.as_tensor(rng.random(BATCH) < 0.2, dtype=torch.float32)
    return obs, actions, rewards, next_obs, dones


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_update_equivalence(compile):
    """Same parameters, batches and random draws: six vector steps of two updates each (the second steps the actor
    and the entropy coefficient, then the targets), with an alpha large enough that the entropy terms weigh and
    learning rates large enough that the targets lag the critics; the twin's statistics and every trained tensor,
    log_alpha included, follow the baseline's."""
    agent_b, fns_b, agent_f, fns_f = make_pair(compile, alpha=0.2, tau=0.3, q_lr=1e-2, policy_lr=1e-2)
    rng, initial = np.random.default_rng(1), [(n, b.detach().clone()) for n, b, _ in trained_state(agent_b, agent_f)]
    args = load_script(NAME).Args()  # 2 updates per vector step, the actor's every other
    for step in range(6):
        for actor_update in load_script(NAME).actor_updates(args, step):
            batch = random_batch(rng)
            stats = []
            for (update_critic, update_actor, update_targets, *_) in (fns_b, fns_f):
                torch.manual_seed(step)
                out = update_critic(*batch)
                if actor_update:
                    out.update(update_actor(batch[0]))
                update_targets()
                stats.append(out)
            assert stats[0].keys() == stats[1].keys()
            tol = 1e-5 if step == 0 else 1e-2  # later updates carry the drift Adam amplifies
            for name, value in stats[0].items():
                torch.testing.assert_close(stats[1][name], value, atol=tol, rtol=tol, msg=name)
            for (name, before), (_, p_b, p_f) in zip(initial, trained_state(agent_b, agent_f), strict=True):
                assert_same_update(before, p_b.detach(), p_f.detach(), name=name)
    for (name, before), (_, _, p_f) in zip(initial, trained_state(agent_b, agent_f), strict=True):
        assert not torch.equal(before, p_f), f"{name} never moved"
    assert not any(p.requires_grad for p in agent_f.qnet_target.values())


@pytest.mark.usefixtures("eager_random")
def test_amp_update():
    """--amp: from the same parameters and batch, the twin's bf16 update follows the baseline's, and both move away
    from the fp32 update's statistics by bf16's rounding, no more; the policy's actions stay fp32."""
    batch, stats = random_batch(np.random.default_rng(2)), {}
    for amp in (False, True):
        _, fns_b, _, fns_f = make_pair(False, alpha=0.2, amp=amp)
        for script, (update_critic, update_actor, *_) in ((NAME, fns_b), (FAST, fns_f)):
            torch.manual_seed(0)
            stats[script, amp] = {**update_critic(*batch), **update_actor(batch[0])}
        assert fns_f[-1](batch[0]).dtype == torch.float32
    for name, value in stats[NAME, True].items():
        torch.testing.assert_close(stats[FAST, True][name], value, atol=1e-2, rtol=1e-2, msg=name)
        torch.testing.assert_close(value, stats[NAME, False][name], atol=5e-2, rtol=5e-2, msg=name)
    assert all(not torch.equal(stats[NAME, True][name], stats[NAME, False][name]) for name in ("qf_loss", "actor_loss"))


@pytest.mark.usefixtures("eager_random")
def test_policy_is_the_squashed_gaussian():
    """The twin's policy samples CleanRL's squashed Gaussian, tanh(mean + std * N(0, 1)) scaled to each dimension's
    bounds, its log std within [LOG_STD_MIN, LOG_STD_MAX]; both scripts' log-probabilities are the Gaussian's less
    the log of the squashing's derivative (its 1e-6 included), finite where tanh saturates and the action is on a
    bound; the deterministic action is the squashed mean."""
    agent_b, _, agent_f, (*_, policy) = make_pair(False)
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


@pytest.mark.parametrize("amp", [[], ["--amp"]], ids=["fp32", "amp"])
def test_baseline_runs(amp, capsys):
    """The baseline through learning starts, warm-up and its fps window (with --amp: bf16 autocast)."""
    record = run_main(NAME, TINY + amp, capsys)
    assert_steady(record, 100)
    assert record["compile"] is False and record["cudagraphs"] is False


@pytest.mark.parametrize("mode", [[], ["--cudagraphs"], ["--compile", "--cudagraphs"], ["--amp"]], ids=mode_id)
def test_twin_runs(mode, capsys):
    """The twin through learning starts, warm-up and its fps window; without CUDA --cudagraphs runs without graphs
    (--compile with it: the compiled functions)."""
    assert_steady(run_mode(FAST, TINY, mode, capsys), 100)


@pytest.mark.parametrize("name, fixed_alpha", [(NAME, False), (FAST, True)], ids=["autotune", "fixed-alpha"])
def test_logs_the_statistics(name, fixed_alpha, monkeypatch, capsys):
    """With a progress tick at every vector step, TensorBoard gets each of STATS and losses/alpha once an actor update
    has run (the baseline: from the first, at env step 40; the twin: from learning starts + --policy-frequency vector
    steps, at 48) to the end, all finite; with --autotune alpha moves from --alpha, without it alpha stays there and
    its loss is 0."""
    module = load_script(name)
    monkeypatch.setattr(module, "PROGRESS_SECONDS", 0.0)
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


def bandit_batch(n=256):
    """A fixed batch of one-step episodes (every transition ends its episode): reward 1 - |action - tanh(obs_0)|^2
    summed over the two action dimensions, best where each action equals tanh of the first observation."""
    torch.manual_seed(5)
    obs = torch.randn(n, N_OBS)
    actions = torch.rand(n, N_ACT) * 2 - 1
    rewards = 1 - (actions - torch.tanh(obs[:, :1])).square().sum(1)
    return obs, actions, rewards, torch.randn(n, N_OBS), torch.ones(n)


def bandit_progress(name, broken=False, amp=False):
    """300 updates (every other one the actor's and the entropy coefficient's) of a script on the bandit batch:
    (mean squared error of the first critic's values against the rewards, mean reward of the actor's deterministic
    actions), before and after. `broken` (the baseline): the actor's update with the critics' value's sign flipped,
    descending it. `amp`: --amp."""
    module = load_script(name)
    torch.set_num_threads(1)  # as the scripts run (the workdir fixture puts the count back): far quicker on busy cores
    args = module.Args(critic_hidden_dim=64, actor_hidden_dim=32, q_lr=1e-3, policy_lr=1e-3, weight_decay=0.0,
                       amp=amp)  # fmt: skip
    box = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0])
    torch.manual_seed(0)
    agent = module.Agent(args, N_OBS, N_ACT, *box, CPU)
    update_critic, update_actor, update_targets, *_ = module.make_update_fns(agent, args)
    obs, actions, rewards, next_obs, dones = bandit_batch()

    def measure():
        with torch.no_grad():
            q = agent.qf1(obs, actions) if hasattr(agent, "qf1") else agent.qvalues(agent.qnet_params, obs, actions)[0]
            _, _, deterministic = agent.actor.get_action(obs)
            best = 1 - (deterministic - torch.tanh(obs[:, :1])).square().sum(1)
        return (q.view(-1) - rewards).square().mean().item(), best.mean().item()

    def descending(obs):
        pi, log_pi, _ = agent.actor.get_action(obs)
        loss = (agent.log_alpha.detach().exp() * log_pi + torch.min(agent.qf1(obs, pi), agent.qf2(obs, pi))).mean()
        agent.actor_optimizer.zero_grad()
        loss.backward()
        agent.actor_optimizer.step()

    before = measure()
    for i in range(300):
        update_critic(obs, actions, rewards, next_obs, dones)
        if i % 2:
            (descending if broken else update_actor)(obs)
        update_targets()
    return before, measure()


@pytest.mark.parametrize("name, amp", [(NAME, False), (FAST, False), (FAST, True)], ids=[NAME, FAST, f"{FAST}-amp"])
def test_learns_a_bandit(name, amp):
    """The critics learn the rewards of a fixed batch (their error falls to a fifth) and the actor's deterministic
    action moves towards the best actions (mean reward up by 0.3), in fp32 and with --amp's bf16 layers; an actor
    that descends the critics' value instead of ascending it (a broken update) does not."""
    (q_error0, reward0), (q_error, reward) = bandit_progress(name, amp=amp)
    assert q_error < q_error0 / 5, (q_error0, q_error)
    assert reward > reward0 + 0.3, (reward0, reward)


def test_a_broken_actor_update_fails_the_bandit():
    (_, reward0), (_, reward) = bandit_progress(NAME, broken=True)
    assert reward < reward0 + 0.3, (reward0, reward)


BAD_INPUT = [
    (["--env-id", "Humanoid-v5"], ["--env-id 'Humanoid-v5'"]),
    (["--num-envs", "3"], ["--total-timesteps 51200000", "--num-envs 3"]),
    (["--batch-size", "1000", "--num-envs", "64"], ["--batch-size 1000", "--num-envs 64"]),
    (["--buffer-size", "1024"], ["--buffer-size 1024", "--batch-size 32768"]),
    (["--learning-starts", "60000000"], ["--learning-starts 60000000", "--total-timesteps 51200000"]),
    (["--alpha", "0"], ["--alpha 0.0"]),
    (["--alpha", "-0.1"], ["--alpha -0.1"]),
    (["--num-updates", "0"], ["--num-updates 0"]),
    (["--critic-hidden-dim", "2"], ["--critic-hidden-dim 2"]),
    (["--q-lr", "0"], ["--q-lr 0"]),
]


@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(argv, fragments, capsys):
    assert_one_line_error(run_bad_input(FAST, argv, capsys), *fragments)


def test_bad_input_cli():
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(NAME, "--env-id", "NoSuchEnv-v0"), "NoSuchEnv-v0")
