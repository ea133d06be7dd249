"""The TD3 and SAC tests at GPU scale, written once: both pairs (leanrl/td3_gpu_mujoco.py, leanrl/sac_gpu_mujoco.py and
their _torchcompile twins) share their shape (a baseline with two critic modules and their targets; a twin with the
same critics stacked by torch.func.stack_module_state and vmapped; update functions critic, actor, targets, policy;
the MuJoCo Warp envs, a per-env replay buffer and the same loop), so each check here takes an `Algo`, which says what
differs, and test_td3_gpu_mujoco.py and test_sac_gpu_mujoco.py call them with their pair's. Everything runs on the
CPU, Warp's CPU device."""

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
from helpers import (
    assert_evaluation_video,
    assert_one_line_error,
    assert_same_update,
    assert_steady,
    assert_trace_phases,
    load_script,
    mode_id,
    run_bad_input,
    run_cli,
    run_main,
    run_mode,
)

CPU = torch.device("cpu")
N_OBS, N_ACT, BATCH = 5, 2, 64
LOW, HIGH = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, 3.0])  # bounds of different widths and centres
# A tiny run: 4 Hopper envs, learning from env step 40, the fps window from 60 (WARMUP_STEPS vector steps later).
TINY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "400", "--learning-starts",
        "40", "--total-timesteps", "100", "--critic-hidden-dim", "32", "--actor-hidden-dim", "16", "--no-tensorboard"]
# The baseline's runs, in fp32 and with --amp, and the twin's modes (--cudagraphs falls back to no graphs on the CPU;
# compiled with --amp, as Humanoid's commands run; check_update_equivalence compiles the fp32 functions). Each also
# with 3-step returns, which reach across the episodes that end in these runs.
BASELINE_RUNS = [pytest.param([], id="fp32"), pytest.param(["--amp"], id="amp"),
                 pytest.param(["--num-steps", "3"], id="num-steps-3")]  # fmt: skip
TWIN_MODES = [], ["--cudagraphs"], ["--compile", "--cudagraphs", "--amp"], ["--amp"]
TWIN_RUNS = [pytest.param(mode, id=mode_id(mode)) for mode in TWIN_MODES] + [
    pytest.param(["--num-steps", "3"], id="num-steps-3")]
# Bad input that both twins refuse: (argv, fragments the error line must name).
BAD_INPUT = [
    (["--env-id", "HumanoidStandup-v5"], ["--env-id 'HumanoidStandup-v5'"]),
    (["--capture-video"], ["--capture-video", "--eval-checkpoint", "render no frames"]),
    (["--num-envs", "3"], ["--total-timesteps 51200000", "--num-envs 3"]),
    (["--batch-size", "1000", "--num-envs", "64"], ["--batch-size 1000", "--num-envs 64"]),
    (["--buffer-size", "1024"], ["--buffer-size 1024", "--batch-size 32768"]),
    (["--learning-starts", "60000000"], ["--learning-starts 60000000", "--total-timesteps 51200000"]),
    (["--num-updates", "0"], ["--num-updates 0"]),
    (["--num-steps", "0"], ["--num-steps 0"]),
    (["--total-timesteps", "20480", "--learning-starts", "10240", "--policy-frequency", "50"],
     ["--policy-frequency 50 is never due", "gradient updates 20 to 39"]),  # 1,024 envs: 10 vector steps of 2 updates
]


@dataclass(frozen=True)
class Algo:
    """What a GPU-scale off-policy pair's tests need to know about it."""

    base: str
    fast: str
    # Args fields of the small networks of the update tests.
    small: dict
    # Args fields of the bandit's networks and learning rates.
    bandit_args: dict
    # The twin's Agent method that evaluates both critics from stacked parameters: (params, obs, actions) -> (2, ...).
    stacked_critics: str
    # A critic's value per sample from its output: (agent, output) -> (batch,) values.
    value: Callable
    # The action whose reward the bandit measures: (agent, obs) -> actions.
    bandit_action: Callable
    # The baseline actor's loss with the critics' value's sign flipped, descending it: (agent, obs) -> loss.
    broken_actor_loss: Callable
    # Trained tensors beyond the actor and the critics: (agent_b, agent_f) -> [(name, baseline, twin)].
    extra_state: Callable = lambda agent_b, agent_f: []
    # The twin's policy on a batch of observations, whose actions --amp must leave fp32 (None: not checked).
    act: Callable | None = None
    # Bad input only this pair's twin refuses.
    bad_input: list = field(default_factory=list)


def make_pair(algo, compile, **kwargs):
    """Baseline and twin agents with identical parameters (the baseline's critics and targets stacked into the twin's),
    and both scripts' update functions."""
    base, fast = load_script(algo.base), load_script(algo.fast)
    args_b = base.Args(**algo.small, **kwargs)
    args_f = fast.Args(**algo.small, **kwargs, compile=compile)
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


def trained_state(algo, agent_b, agent_f):
    """Every trained tensor of both agents as (name, baseline tensor, twin tensor)."""
    pairs = [(f"actor.{name}", p_b, p_f) for (name, p_b), p_f in
             zip(agent_b.actor.named_parameters(), agent_f.actor.parameters(), strict=True)]  # fmt: skip
    critics = (("q", "qf1 qf2", agent_f.qnet_params), ("t", "qf1_target qf2_target", agent_f.qnet_target))
    for tag, nets, params in critics:
        stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets.split()])
        pairs += [(f"{tag}.{name}", value, params[name]) for name, value in stacked.items()]
    return pairs + algo.extra_state(agent_b, agent_f)


def random_batch(rng):
    """Normalised observations, actions within the bounds (some on them), rewards of a few units that reach past the
    support of TD3's small critics, and discounts: some episodes ended, some transitions of 1, 2 or 3 steps."""
    obs, next_obs = (torch.as_tensor(rng.standard_normal((BATCH, N_OBS)), dtype=torch.float32) for _ in range(2))
    actions = torch.as_tensor(rng.uniform(LOW, HIGH, (BATCH, N_ACT)), dtype=torch.float32).clamp(LOW * 0.9, HIGH * 0.9)
    rewards = torch.as_tensor(rng.normal(0, 4, BATCH), dtype=torch.float32)
    discounts = 0.99 ** torch.as_tensor(rng.integers(1, 4, BATCH)) * torch.as_tensor(rng.random(BATCH) >= 0.2)
    return obs, actions, rewards, next_obs, discounts.float()


def check_update_equivalence(algo, compile, **kwargs):
    """Same parameters, batches and random draws: six vector steps of two updates each (the second steps the actor,
    with SAC the entropy coefficient too, then the targets), with the Args `kwargs` (chosen so that each algorithm's
    terms weigh); the twin's statistics and every trained tensor follow the baseline's, every one of them moves, and
    the targets take no gradient."""
    agent_b, fns_b, agent_f, fns_f = make_pair(algo, compile, **kwargs)
    rng = np.random.default_rng(1)
    initial = [(n, b.detach().clone()) for n, b, _ in trained_state(algo, agent_b, agent_f)]
    args = load_script(algo.base).Args()  # 2 updates per vector step, the actor's every other
    for step in range(6):
        for actor_update in load_script(algo.base).actor_updates(args, step):
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
            for (name, before), (_, p_b, p_f) in zip(initial, trained_state(algo, agent_b, agent_f), strict=True):
                assert_same_update(before, p_b.detach(), p_f.detach(), name=name)
    for (name, before), (_, _, p_f) in zip(initial, trained_state(algo, agent_b, agent_f), strict=True):
        assert not torch.equal(before, p_f), f"{name} never moved"
    assert not any(p.requires_grad for p in agent_f.qnet_target.values())


def check_amp_update(algo, **kwargs):
    """--amp: from the same parameters and batch (and the Args `kwargs`), the twin's bf16 update follows the
    baseline's, and both move away from the fp32 update's statistics by bf16's rounding, no more; where `algo.act`
    says how, the twin's policy's actions stay fp32."""
    batch, stats = random_batch(np.random.default_rng(2)), {}
    for amp in (False, True):
        _, fns_b, _, fns_f = make_pair(algo, False, **kwargs, amp=amp)
        for script, (update_critic, update_actor, *_) in ((algo.base, fns_b), (algo.fast, fns_f)):
            torch.manual_seed(0)
            stats[script, amp] = {**update_critic(*batch), **update_actor(batch[0])}
        if algo.act:  # in --amp's autocast, which the collect step enters around the policy
            with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                assert algo.act(fns_f[-1], batch[0]).dtype == torch.float32
    for name, value in stats[algo.base, True].items():
        torch.testing.assert_close(stats[algo.fast, True][name], value, atol=1e-2, rtol=1e-2, msg=name)
        torch.testing.assert_close(value, stats[algo.base, False][name], atol=5e-2, rtol=5e-2, msg=name)
    fp32, bf16 = stats[algo.base, False], stats[algo.base, True]
    assert all(not torch.equal(bf16[name], fp32[name]) for name in ("qf_loss", "actor_loss"))


def check_baseline_runs(algo, amp, capsys):
    """The baseline through learning starts, warm-up and its fps window (with --amp: bf16 autocast); --profile-dir
    traces every phase, a vector step of 4 envs per env_step call."""
    record = run_main(algo.base, TINY + amp + ["--profile-dir", "profile"], capsys)
    assert_steady(record, 100)
    assert record["compile"] is False and record["cudagraphs"] is False
    assert_trace_phases("profile", algo.base, env_steps_per_call=4)


def check_twin_runs(algo, mode, capsys):
    """The twin through learning starts, warm-up and its fps window; without CUDA --cudagraphs runs without graphs
    (--compile with it: the compiled functions). --profile-dir traces its phases (the policy runs in env_step).
    Compiled, every graph is one AOTAutograd's cache keeps (--amp's autocast entered around them, not in them): a
    warm start traces none of them again."""
    aot = torch._dynamo.utils.counters["aot_autograd"]
    aot.clear()
    assert_steady(run_mode(algo.fast, TINY + ["--profile-dir", "profile"], mode, capsys), 100)
    if "--compile" in mode:
        assert aot["total"] >= 3 and aot["autograd_cache_bypass"] == 0, dict(aot)  # losses, policy
    assert_trace_phases("profile", algo.fast, env_steps_per_call=4, phases=("env_step", "update", "other"))


def check_twin_runs_humanoid(algo, capsys):
    """The twin on Humanoid-v5 (348 observations, 17 actions in [-0.4, 0.4], resets that run Warp's kinematics)
    through its fps window: random episodes ended, about 5 a step for some 20 to 60 steps."""
    argv = ["--env-id", "Humanoid-v5", *TINY[2:]]
    argv[argv.index("--total-timesteps") + 1] = "200"  # 50 steps an env: random episodes end
    record = run_main(algo.fast, argv, capsys)
    assert_steady(record, 200)
    assert record["env_id"] == "Humanoid-v5" and 50 < record["episodic_return"] < 300


def check_evaluation_video(algo, capsys):
    """--eval-checkpoint --capture-video: the baseline's saved actor on gymnasium's Humanoid-v5 (an untrained one falls
    within some 50 steps: few frames to render), its episode one MP4 file under videos/<run name>/. The twin's
    evaluate is the baseline's (test_contract.py)."""
    run_main(algo.base, ["--env-id", "Humanoid-v5", *TINY[2:], "--save-dir", "run"], capsys)
    assert_evaluation_video(algo.base, "run")


def bandit_batch(n=256):
    """A fixed batch of one-step episodes (every transition ends its episode): reward 1 - |action - tanh(obs_0)|^2
    summed over the two action dimensions, best where each action equals tanh of the first observation."""
    torch.manual_seed(5)
    obs = torch.randn(n, N_OBS)
    actions = torch.rand(n, N_ACT) * 2 - 1
    rewards = 1 - (actions - torch.tanh(obs[:, :1])).square().sum(1)
    return obs, actions, rewards, torch.randn(n, N_OBS), torch.zeros(n)


def bandit_runs(algo):
    """The learning check's runs: the baseline, and the twin in fp32 and with --amp, as (name, amp)."""
    return [pytest.param(algo.base, False, id=algo.base), pytest.param(algo.fast, False, id=algo.fast),
            pytest.param(algo.fast, True, id=f"{algo.fast}-amp")]  # fmt: skip


def bandit_progress(algo, name, broken=False, amp=False):
    """300 updates (every other one the actor's, with SAC the entropy coefficient's too) of a script on the bandit
    batch: (mean squared error of the first critic's values against the rewards, mean reward of the actor's actions
    as `algo` measures them), before and after. `broken` (the baseline): the actor's update with the critics'
    value's sign flipped, descending it. `amp`: --amp."""
    module = load_script(name)
    torch.set_num_threads(1)  # as the scripts run (the workdir fixture puts the count back): far quicker on busy cores
    args = module.Args(**algo.bandit_args, weight_decay=0.0, amp=amp)
    box = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0])
    torch.manual_seed(0)
    agent = module.Agent(args, N_OBS, N_ACT, *box, CPU)
    update_critic, update_actor, update_targets, *_ = module.make_update_fns(agent, args)
    obs, actions, rewards, next_obs, discounts = bandit_batch()

    def measure():
        with torch.no_grad():
            if hasattr(agent, "qf1"):
                output = agent.qf1(obs, actions)
            else:
                output = getattr(agent, algo.stacked_critics)(agent.qnet_params, obs, actions)[0]
            best = 1 - (algo.bandit_action(agent, obs) - torch.tanh(obs[:, :1])).square().sum(1)
        return (algo.value(agent, output) - rewards).square().mean().item(), best.mean().item()

    def descending(obs):
        loss = algo.broken_actor_loss(agent, obs)
        agent.actor_optimizer.zero_grad()
        loss.backward()
        agent.actor_optimizer.step()

    before = measure()
    for i in range(300):
        update_critic(obs, actions, rewards, next_obs, discounts)
        if i % 2:
            (descending if broken else update_actor)(obs)
        update_targets()
    return before, measure()


def check_learns_a_bandit(algo, name, amp):
    """The critics learn the rewards of a fixed batch (their error falls to a fifth) and the actor moves towards the
    best actions (mean reward up by 0.3 of its 2 of headroom), in fp32 and with --amp's bf16 layers."""
    (q_error0, reward0), (q_error, reward) = bandit_progress(algo, name, amp=amp)
    assert q_error < q_error0 / 5, (q_error0, q_error)
    assert reward > reward0 + 0.3, (reward0, reward)


def check_a_broken_actor_update_fails_the_bandit(algo):
    """An actor that descends the critics' value instead of ascending it (a broken update) does not gain the 0.3."""
    (_, reward0), (_, reward) = bandit_progress(algo, algo.base, broken=True)
    assert reward < reward0 + 0.3, (reward0, reward)


def bad_input(algo):
    """The twin's bad input, as (argv, fragments) with the argv as id."""
    return [pytest.param(argv, fragments, id=" ".join(argv)) for argv, fragments in BAD_INPUT + algo.bad_input]


def check_bad_input(algo, argv, fragments, capsys):
    """Exit code 2 and one error line that names the problem."""
    assert_one_line_error(run_bad_input(algo.fast, argv, capsys), *fragments)


def check_bad_input_cli(algo):
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(algo.base, "--env-id", "NoSuchEnv-v0"), "NoSuchEnv-v0")
