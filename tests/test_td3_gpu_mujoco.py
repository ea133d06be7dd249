"""TD3 at GPU scale with the FastTD3 recipe (leanrl/td3_gpu_mujoco.py and its _torchcompile twin) on the CPU, Warp's
CPU device: C51's projection against a direct reference; the twin's update (vmapped critics, fused target update)
against the baseline's from the same parameters and batches, eager and compiled; the per-env replay buffer; both
scripts through their update (the twin in its modes; --cudagraphs falls back to no graphs on the CPU); a learning
check that a broken update fails; bad input. The envs themselves are test_gpu_mujoco.py's (the same class).

Warp's kernels load from ~/.cache/warp (a first build takes a minute or two on the 2-core CPU)."""

import numpy as np
import pytest
import torch
from helpers import (
    assert_one_line_error,
    assert_same_update,
    assert_steady,
    load_script,
    mode_id,
    run_bad_input,
    run_cli,
    run_main,
    run_mode,
)

NAME = "td3_gpu_mujoco"
FAST = f"{NAME}_torchcompile"
CPU = torch.device("cpu")
N_OBS, N_ACT, BATCH = 5, 2, 64
LOW, HIGH = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 3.0])  # bounds of different widths and centres
SMALL = {"critic_hidden_dim": 32, "actor_hidden_dim": 16, "num_atoms": 11, "v_max": 10.0}
# A tiny run: 4 Hopper envs, learning from env step 40, the fps window from 60 (WARMUP_STEPS vector steps later).
TINY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "400", "--learning-starts",
        "40", "--total-timesteps", "100", "--critic-hidden-dim", "32", "--actor-hidden-dim", "16", "--no-tensorboard"]
pytestmark = pytest.mark.usefixtures("workdir")


def reference_projection(probs, rewards, bootstrap, gamma, support):
    """C51's projection written out atom by atom: each atom's value moved, clipped, and its mass split between the
    two atoms around it in proportion to the distance, all of it on an atom it lands on."""
    v_min, v_max, n = support[0].item(), support[-1].item(), len(support)
    dz, out = (v_max - v_min) / (n - 1), np.zeros(probs.shape)
    for i in range(probs.shape[0]):
        for j in range(n):
            value = min(max(rewards[i].item() + bootstrap[i].item() * gamma * support[j].item(), v_min), v_max)
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
    bootstrap = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    projected = project(probs, rewards, bootstrap, 0.9, support)
    expected = reference_projection(probs, rewards, bootstrap, 0.9, support)
    np.testing.assert_allclose(projected.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(projected.sum(1).numpy(), 1.0, atol=1e-6)  # no mass lost
    assert projected[3].argmax() == 7 and projected[3, 7] == pytest.approx(1.0)  # reward 2, no bootstrap: atom 2
    # gamma 1, reward 0: the distribution itself, every value on its own atom.
    same = project(probs, torch.zeros(6), torch.ones(6), 1.0, support)
    np.testing.assert_allclose(same.numpy(), probs.numpy(), atol=1e-6)
    both = project(torch.stack([probs, probs.flip(1)]), rewards, bootstrap, 0.9, support)
    np.testing.assert_allclose(both[0].numpy(), expected, atol=1e-6)
    flipped = reference_projection(probs.flip(1), rewards, bootstrap, 0.9, support)
    np.testing.assert_allclose(both[1].numpy(), flipped, atol=1e-6)


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
    for tag, nets, params in (("q", "qf1 qf2", agent_f.qnet_params), ("t", "qf1_target qf2_target", agent_f.qnet_target)):
        stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets.split()])
        pairs += [(f"{tag}.{name}", value, params[name]) for name, value in stacked.items()]
    return pairs


def random_batch(rng):
    """Normalised observations, actions within the bounds (some on them), rewards that reach past the support, and
    some episodes ended."""
    obs, next_obs = (torch.as_tensor(rng.standard_normal((BATCH, N_OBS)), dtype=torch.float32) for _ in range(2))
    actions = torch.as_tensor(rng.uniform(LOW, HIGH, (BATCH, N_ACT)), dtype=torch.float32).clamp(LOW * 0.9, HIGH * 0.9)
    rewards = torch.as_tensor(rng.normal(0, 4, BATCH), dtype=torch.float32)
    dones = torch.as_tensor(rng.random(BATCH) < 0.2, dtype=torch.float32)
    return obs, actions, rewards, next_obs, dones


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile"])
@pytest.mark.usefixtures("eager_random")
def test_update_equivalence(compile):
    """Same parameters and batches: six vector steps of two updates each (the second steps the actor, then the
    targets), with a large smoothing noise so its clip and the action clamp bite; the twin's statistics and every
    trained tensor follow the baseline's."""
    agent_b, fns_b, agent_f, fns_f = make_pair(compile, policy_noise=0.8, tau=0.3)
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
    from the fp32 update's statistics by bf16's rounding, no more."""
    batch, stats = random_batch(np.random.default_rng(2)), {}
    for amp in (False, True):
        _, fns_b, _, fns_f = make_pair(False, amp=amp)
        for script, (update_critic, update_actor, *_) in ((NAME, fns_b), (FAST, fns_f)):
            torch.manual_seed(0)
            stats[script, amp] = {**update_critic(*batch), **update_actor(batch[0])}
    for name, value in stats[NAME, True].items():
        torch.testing.assert_close(stats[FAST, True][name], value, atol=1e-2, rtol=1e-2, msg=name)
        torch.testing.assert_close(value, stats[NAME, False][name], atol=5e-2, rtol=5e-2, msg=name)
    assert all(not torch.equal(stats[NAME, True][name], stats[NAME, False][name]) for name in ("qf_loss", "actor_loss"))


@pytest.mark.usefixtures("eager_random")
def test_policy_explores_per_env_within_bounds():
    """The twin's policy: the actor's action plus each env's own noise scale, clamped to each dimension's bounds."""
    _, _, agent_f, (*_, policy) = make_pair(False)
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


@pytest.mark.parametrize("name", [NAME, FAST])
def test_buffer_per_env_storage(name):
    """Each step writes one slot of every env, circularly (buffer_size // num_envs slots); a sample draws the same
    number of rows of each env, all of them stored ones; a resumed buffer holds the saved rows."""
    rb = load_script(name).ReplayBuffer(12, 4, 2, 1, CPU)  # 3 slots of 4 envs
    for t in range(5):
        obs = torch.arange(4.0)[:, None] * 100 + t + torch.zeros(4, 2)  # env * 100 + step
        rb.add(obs, torch.full((4, 1), t), torch.full((4,), float(t)), obs + 0.5, torch.zeros(4))
    assert int(rb.size) == 3 and int(rb.ptr) == 2
    torch.manual_seed(0)
    obs, _, rewards, next_obs, dones = rb.sample(400)
    envs, steps = (obs[:, 0] // 100).long(), obs[:, 0] % 100
    assert torch.equal(envs.view(100, 4), torch.arange(4).expand(100, 4))  # 100 rows of each env
    assert set(steps.tolist()) == {2.0, 3.0, 4.0}  # the last three steps, the first two overwritten
    assert torch.equal(rewards, steps) and torch.equal(next_obs, obs + 0.5) and rewards.shape == dones.shape == (400,)
    copy = load_script(name).ReplayBuffer(12, 4, 2, 1, CPU)
    copy.load_state_dict(rb.state_dict())
    assert torch.equal(copy.storage, rb.storage) and int(copy.ptr) == 2 and int(copy.size) == 3


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


def bandit_batch(n=256):
    """A fixed batch of one-step episodes (every transition ends its episode): reward 1 - |action - tanh(obs_0)|^2
    summed over the two action dimensions, best where each action equals tanh of the first observation."""
    torch.manual_seed(5)
    obs = torch.randn(n, N_OBS)
    actions = torch.rand(n, N_ACT) * 2 - 1
    rewards = 1 - (actions - torch.tanh(obs[:, :1])).square().sum(1)
    return obs, actions, rewards, torch.randn(n, N_OBS), torch.ones(n)


def bandit_progress(name, broken=False, amp=False):
    """300 updates (every other one the actor's) of a script on the bandit batch: (mean squared error of the first
    critic's expected values against the rewards, mean reward of the actor's actions), before and after. `broken`
    (the baseline): the actor's update with its sign flipped, descending the critics' value. `amp`: --amp."""
    module = load_script(name)
    torch.set_num_threads(1)  # as the scripts run (the workdir fixture puts the count back): far quicker on busy cores
    args = module.Args(critic_hidden_dim=64, actor_hidden_dim=32, num_atoms=51, v_max=4.0, learning_rate=1e-3,
                       weight_decay=0.0, amp=amp)  # fmt: skip
    box = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0])
    torch.manual_seed(0)
    agent = module.Agent(args, N_OBS, N_ACT, *box, CPU)
    update_critic, update_actor, update_targets, *_ = module.make_update_fns(agent, args)
    obs, actions, rewards, next_obs, dones = bandit_batch()

    def measure():
        with torch.no_grad():
            logits = agent.qf1(obs, actions) if hasattr(agent, "qf1") else agent.qlogits(agent.qnet_params, obs, actions)[0]
            q = (torch.softmax(logits, -1) * agent.support).sum(-1)
            best = 1 - (agent.actor(obs) - torch.tanh(obs[:, :1])).square().sum(1)
        return (q - rewards).square().mean().item(), best.mean().item()

    def descending(obs):
        values = [(torch.softmax(qf(obs, agent.actor(obs)), -1) * agent.support).sum(1) for qf in (agent.qf1, agent.qf2)]
        agent.actor_optimizer.zero_grad()
        torch.minimum(*values).mean().backward()
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
    """The critics learn the rewards of a fixed batch (their error falls to a fifth) and the actor moves towards the
    best actions (mean reward up by 0.3 of its 2 of headroom), in fp32 and with --amp's bf16 layers; an actor that
    descends the critics' value instead of ascending it (a broken update) gets worse."""
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
    (["--num-atoms", "1"], ["--num-atoms 1"]),
    (["--v-max", "0"], ["--v-max 0"]),
    (["--std-min", "0.5"], ["--std-min 0.5", "--std-max 0.4"]),
    (["--num-updates", "0"], ["--num-updates 0"]),
    (["--v-max", "-5"], ["--v-max -5"]),
]


@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(argv, fragments, capsys):
    assert_one_line_error(run_bad_input(FAST, argv, capsys), *fragments)


def test_bad_input_cli():
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(NAME, "--env-id", "NoSuchEnv-v0"), "NoSuchEnv-v0")
