"""The SAC and TD3 tests, written once: both pairs share their shape (a baseline with CleanRL's loop, a twin with an
on-device replay buffer, stacked Q networks and one training step per env step), so each check here takes an
`Algo`, which says what differs, and test_off_policy.py calls them with each pair's."""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import gymnasium as gym
import numpy as np
import torch
from helpers import (
    assert_one_line_error,
    assert_return_curve,
    assert_same_update,
    assert_steady,
    assert_trace_phases,
    load_script,
    run_bad_input,
    run_interrupted,
    run_main,
    run_mode,
    tensorboard_scalars,
)

import harness

# A tiny run that passes learning starts, warm-up and a measured window (window from step 64 + WARMUP_STEPS).
TINY_STEPS, TINY_LEARNING_STARTS = 320, 64
TINY = ["--total-timesteps", str(TINY_STEPS), "--learning-starts", str(TINY_LEARNING_STARTS), "--batch-size", "16",
        "--buffer-size", "1000"]  # fmt: skip
# Bad input that every off-policy script refuses: (argv, fragments the error line must name).
BAD_INPUT = [
    (["--env-id", "NoSuchEnv-v0"], ["--env-id NoSuchEnv-v0"]),
    (["--env-id", "CartPole-v1"], ["--env-id CartPole-v1", "continuous"]),
    (["--batch-size", "0"], ["--batch-size 0"]),
    (["--buffer-size", "0"], ["--buffer-size 0"]),
    (["--buffer-size", "10"], ["--buffer-size 10", "--batch-size 256"]),
    (["--total-timesteps", "-5"], ["--total-timesteps -5"]),
    (["--gamma", "2"], ["--gamma 2"]),
    (["--tau", "-1"], ["--tau -1"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--learning-starts", "2000", "--total-timesteps", "1000"], ["--learning-starts 2000", "--total-timesteps 1000"]),
    (["--learning-starts", "2000000"], ["--learning-starts 2000000", "--total-timesteps 1000000"]),
    (["--num-envs", "0"], ["--num-envs 0"]),
    (["--num-envs", "3", "--total-timesteps", "1000"], ["--total-timesteps 1000", "--num-envs 3"]),
    (["--num-envs", "8", "--buffer-size", "4", "--batch-size", "4"], ["--buffer-size 4", "--num-envs 8"]),
    (["--total-timesteps", "300", "--learning-starts", "100", "--policy-frequency", "1000"],
     ["--policy-frequency 1000 is never due", "vector steps 100 to 299"]),  # no actor update would ever come
    (["--num-envs", "2", "--total-timesteps", "300", "--learning-starts", "100", "--policy-frequency", "150"],
     ["--policy-frequency 150 is never due", "vector steps 50 to 149"]),  # below the total, past the vector steps
    (["--env-id", "Pendulum"], ["--env-id Pendulum: name its version"]),
]
# The statistics of a critic-only update.
CRITIC_STATS = {"qf1_values", "qf2_values", "qf1_loss", "qf2_loss", "qf_loss"}
# The envs of the --num-envs tests, on Pendulum-v1: its episodes end by truncation at PENDULUM_STEPS, in every env
# at the same vector step.
NUM_ENVS, PENDULUM_STEPS = 4, 200
PENDULUM = ["--env-id", "Pendulum-v1", "--num-envs", str(NUM_ENVS)]
# Bounds of different widths and centres, so that a clamp to one scalar bound would show.
N_OBS, N_ACT = 5, 2
LOW, HIGH = np.array([-1.0, -2.0]), np.array([1.0, 3.0])


@dataclass(frozen=True)
class Algo:
    """What an off-policy pair's tests need to know about it."""

    base: str
    fast: str
    # The baseline's update functions, run on one batch as the twin's training step runs them: stats returned.
    baseline_step: Callable  # (fns_b, batch, actor_update) -> {name: tensor}
    # The twin's train_step arguments after actor_update.
    train_flags: tuple
    # The action the twin's policy must take for one observation, drawing as it does after a manual_seed.
    expected_action: Callable  # (agent_f, args, one_obs) -> numpy array
    # The learning test: argv on Pendulum-v1 and the mean return it must beat.
    learn_argv: list
    learn_return: float
    # Args fields both scripts get in the equivalence tests.
    args: dict = field(default_factory=dict)
    # Trained tensors beyond the actors and the Q networks: (agent_b, agent_f) -> [(name, baseline, twin)].
    extra_state: Callable = lambda agent_b, agent_f: []
    # Names of trained tensors that the given Args leave unchanged.
    constant: Callable = lambda args: set()
    # Bad input only this pair refuses.
    bad_input: list = field(default_factory=list)
    # The agents' actor modules (the first acts), copied and compared as they are.
    actors: tuple = ("actor",)
    # Scalars logged beside STATS, as losses/<name>.
    extra_scalars: tuple = ()
    cpu_tol: float = 1e-5


def check_baseline_update_path(algo, extra, capsys):
    """The baseline through learning starts, warm-up and its fps window. HalfCheetah ends no episode in 320 steps:
    no return to report."""
    record = run_main(algo.base, TINY + extra, capsys)
    assert_steady(record, TINY_STEPS)
    assert record["compile"] is False and record["cudagraphs"] is False
    assert record["episodic_return"] is None and record["return_curve"] == []


def check_compiled_update_path(algo, mode, capsys, extra=()):
    """The twin through learning starts, warm-up and its fps window in one of MODES; its record says which flags
    took effect."""
    record = run_mode(algo.fast, TINY + list(extra), mode, capsys)
    assert_steady(record, TINY_STEPS)
    assert record["episodic_return"] is None and record["return_curve"] == []


def check_logs_and_profile(algo, name, tmp_path, monkeypatch, capsys):
    """With a progress tick at every step, TensorBoard gets each of STATS at every step from the first one that
    follows an actor update (learning starts + policy frequency) to the end, every value finite and the critic's
    loss positive; --profile-dir writes a trace with every phase."""
    module = load_script(name)
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)
    run_main(name, TINY + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_trace_phases(tmp_path / "profile", name, env_steps_per_call=1)
    scalars = tensorboard_scalars(name)
    first = TINY_LEARNING_STARTS + module.Args.policy_frequency
    for stat in module.STATS + algo.extra_scalars:
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == list(range(first, TINY_STEPS)), stat
        assert np.isfinite(values).all(), stat
    assert min(value for _, value in scalars["losses/qf_loss"]) > 0
    assert [step for step, _ in scalars["charts/SPS"]] == list(range(1, TINY_STEPS + 1))


def make_pair(algo, compile, cudagraphs, device, **kwargs):
    """A baseline agent and a twin agent with identical parameters, the baseline's update functions, and the twin's
    replay buffer, training step, stats and policy."""
    base, fast = load_script(algo.base), load_script(algo.fast)
    args_b = base.Args(**algo.args, **kwargs)
    args_f = fast.Args(**algo.args, **kwargs, compile=compile, cudagraphs=cudagraphs)
    torch.manual_seed(0)
    agent_b = base.Agent(args_b, N_OBS, N_ACT, LOW, HIGH, device)
    agent_f = fast.Agent(args_f, N_OBS, N_ACT, LOW, HIGH, device)
    for actor in algo.actors:
        getattr(agent_f, actor).load_state_dict(getattr(agent_b, actor).state_dict())
    with torch.no_grad():
        for params, nets in ((agent_f.qnet_params, "qf1 qf2"), (agent_f.qnet_target, "qf1_target qf2_target")):
            stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets.split()])
            for name, value in stacked.items():
                params[name].copy_(value)
    fns_b = base.make_update_fns(agent_b, args_b)
    # The twin's updates read their batch from its replay buffer's fixed batch tensors.
    rb = fast.ReplayBuffer(64, 32, 1, N_OBS, N_ACT, device)
    *updates_f, policy_f = fast.make_update_fns(agent_f, args_f, rb.fields)
    train_f, stats_f = fast.make_train_step(rb, *updates_f, args_f)
    return SimpleNamespace(
        agent_b=agent_b, args_b=args_b, fns_b=fns_b, agent_f=agent_f, args_f=args_f, rb=rb, train_f=train_f,
        stats_f=stats_f, policy_f=policy_f,
    )  # fmt: skip


def trained_state(algo, agent_b, agent_f):
    """Every trained tensor of both agents as (name, baseline tensor, twin tensor)."""
    pairs = []
    for actor in algo.actors:
        named_b, params_f = getattr(agent_b, actor).named_parameters(), getattr(agent_f, actor).parameters()
        pairs += [(f"{actor}.{name}", p_b, p_f) for (name, p_b), p_f in zip(named_b, params_f, strict=True)]
    for tag, nets, params in (
        ("q", ("qf1", "qf2"), agent_f.qnet_params),
        ("q_target", ("qf1_target", "qf2_target"), agent_f.qnet_target),
    ):
        stacked, _ = torch.func.stack_module_state([getattr(agent_b, net) for net in nets])
        assert stacked.keys() == params.keys()
        pairs += [(f"{tag}.{name}", value, params[name]) for name, value in stacked.items()]
    return pairs + algo.extra_state(agent_b, agent_f)


def stage_transition(rb, rng):
    """Stage one random transition in a twin's replay buffer, as its loop does after an env step."""
    n_obs, n_act = rb.fields[0].shape[1], rb.fields[1].shape[1]
    obs, next_obs, action = rng.standard_normal((1, n_obs)), rng.standard_normal((1, n_obs)), rng.uniform(-1, 1, (1, n_act))
    rb.stage(obs, next_obs, action, rng.standard_normal(1), (rng.random(1) < 0.2).astype(float))


def twin_training_steps(train, rb, steps, *flags):
    """Drive a twin as its loop does, from 8 rows stored before learning starts: each step stages a new
    transition, then runs train(actor_update, *flags) from seed i, alternating steps with and without the
    actor update. Check that each step stored the staged row and sampled its batch from the stored rows as the
    generator's draw after the seed says (a captured step must see the size grow). Yield (i, actor_update,
    copies of the batch fields), with the generator where the twin's updates began drawing, so that the
    baseline's updates on that batch draw the same numbers."""
    rng = np.random.default_rng(1)
    for _ in range(8):
        stage_transition(rb, rng)
        rb.push()
    for i in range(steps):
        stage_transition(rb, rng)
        actor_update = i % 2 == 0
        torch.manual_seed(i)
        train(actor_update, *flags)
        torch.manual_seed(i)
        stored = 9 + i
        idx = torch.randint(0, 2**62, (len(rb.batch),), device=rb.device) % stored
        assert torch.equal(rb.storage[stored - 1], rb.rows[0]), "the staged transition was not stored"
        assert torch.equal(rb.batch, rb.storage[idx]), "the batch is not the sample the draw says"
        yield i, actor_update, tuple(field.clone() for field in rb.fields)


def check_equivalence(algo, compile, cudagraphs, device, steps=8, **kwargs):
    """Same parameters and batches: each training step of the twin (store, sample, critic update, every other
    step the actor update, target updates) gives the stats and parameters of the baseline's updates on the batch
    it sampled. Eight steps, alternating the two kinds, so optimizer state and, under --cudagraphs, the capture
    and replays of both graphs (at the third and fourth call of each, with --compile) are covered. Then the
    policy acts as expected with the trained actor."""
    pair = make_pair(algo, compile, cudagraphs, device, **kwargs)
    agent_b, agent_f, stats_f = pair.agent_b, pair.agent_f, pair.stats_f
    stats_names = load_script(algo.fast).STATS
    assert load_script(algo.base).STATS == stats_names and set(stats_f) == set(stats_names)
    # Fixed 0-d tensors, which each step writes (a captured step writes into the same memory on each replay).
    fixed = {name: value.data_ptr() for name, value in stats_f.items()}
    assert all(value.shape == () for value in stats_f.values())
    tol = algo.cpu_tol if device.type == "cpu" else 1e-3  # GPU kernels of compiled and eager code round differently
    initial = [(name, p_b.detach().clone()) for name, p_b, _ in trained_state(algo, agent_b, agent_f)]
    latest = {}  # the latest value of each statistic: a step without an actor update leaves the actor's as it was
    for i, actor_update, batch in twin_training_steps(pair.train_f, pair.rb, steps, *algo.train_flags):
        stats_b = algo.baseline_step(pair.fns_b, batch, actor_update)
        assert set(stats_b) == (set(stats_names) if actor_update else CRITIC_STATS)
        latest.update(stats_b)
        # The first update starts from identical parameters; later ones carry the drift Adam amplifies.
        loss_tol = tol if i == 0 else 1e-2
        for name, value in latest.items():
            torch.testing.assert_close(stats_f[name], value, atol=loss_tol, rtol=loss_tol, msg=name)
        for (name, before), (_, p_b, p_f) in zip(initial, trained_state(algo, agent_b, agent_f), strict=True):
            assert_same_update(before, p_b.detach(), p_f.detach(), name=name)
    assert {name: value.data_ptr() for name, value in stats_f.items()} == fixed
    # The updates really moved every trained tensor but those the arguments keep constant.
    constant = algo.constant(pair.args_f)
    for (name, before), (_, _, p_f) in zip(initial, trained_state(algo, agent_b, agent_f), strict=True):
        assert torch.equal(before, p_f) == (name in constant), name
    # Target networks change by their soft update only: no gradient.
    targets = [*agent_f.qnet_target.values()]
    targets += [p for actor in algo.actors if actor.startswith("target") for p in getattr(agent_f, actor).parameters()]
    assert not any(t.requires_grad for t in targets)

    def expected(one_obs):
        return algo.expected_action(agent_f, pair.args_f, one_obs)

    act = load_script(algo.fast).make_act(pair.policy_f, pair.args_f, N_OBS, N_ACT, device)
    assert_acts_as_expected(expected, pair.policy_f, act, batch[0], tol)


def assert_acts_as_expected(expected, policy, act, obs, tol):
    """A twin's policy, and make_act's round trip around it (pinned copies; under --cudagraphs captured with the
    policy), give the expected action for one env's observation, draw for draw, and record no autograd graph.
    Five observations: the calls cover warm-up, capture and replays that must read each new observation."""
    for seed in range(5):
        one = obs[seed : seed + 1]
        torch.manual_seed(seed)
        want = expected(one)
        torch.manual_seed(seed)
        action = policy(one)
        assert not action.requires_grad, "the policy acts without autograd"
        np.testing.assert_allclose(action.cpu().numpy(), want, atol=tol, rtol=tol, err_msg="policy")
        torch.manual_seed(seed)
        np.testing.assert_allclose(act(one.cpu().numpy()), want, atol=tol, rtol=tol, err_msg="act")


def check_acts_with_current_actor(algo, monkeypatch, capsys):
    """The twin chooses the next action before an update that leaves the actor unchanged. Check, running the twin
    without flags: from learning starts on, each env step takes the action of the one policy call made since the
    previous env step, no actor update comes after that call, and some calls do come before a critic update (the
    acting ahead happens)."""
    module = load_script(algo.fast)
    make_update_fns, env_step = module.make_update_fns, module.OneEnv.step
    events = []

    def logged(fn):
        def call(*args):
            out = fn(*args)
            events.append((fn.__name__, out))
            return out

        return call

    def logged_step(self, actions):
        events.append(("env_step", actions))
        return env_step(self, actions)

    monkeypatch.setattr(module, "make_update_fns", lambda *args: tuple(map(logged, make_update_fns(*args))))
    monkeypatch.setattr(module.OneEnv, "step", logged_step)
    run_main(algo.fast, TINY, capsys)

    segment, env_steps, acted_ahead = [], 0, 0
    for event, value in events:
        if event != "env_step":
            segment.append((event, value))
            continue
        calls = [e for e, _ in segment]
        if env_steps < TINY_LEARNING_STARTS:
            assert "policy" not in calls, f"step {env_steps}: random actions before learning starts"
        else:
            assert calls.count("policy") == 1, f"step {env_steps}: {calls}"
            chosen = calls.index("policy")
            assert not any(c.startswith("update_actor") for c in calls[chosen:]), f"step {env_steps}: {calls}"
            acted_ahead += "update_critic" in calls[chosen:]
            assert torch.equal(torch.as_tensor(value), segment[chosen][1].cpu()), f"step {env_steps}: stale action"
        segment, env_steps = [], env_steps + 1
    assert env_steps == TINY_STEPS
    assert acted_ahead > 0


def check_learns_pendulum(algo, name, capsys):
    """A few thousand steps lift Pendulum from about -1200 (random) well above it; a broken update stays near the
    random return."""
    record = run_main(name, ["--env-id", "Pendulum-v1"] + algo.learn_argv, capsys)
    assert record["episodic_return"] > algo.learn_return
    assert_return_curve(record)


def check_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


def check_buffer_samples_stored_rows(algo):
    """A twin's replay buffer samples, into its fixed batch, only the rows it holds (the last 10 of 13 added to a
    buffer of 10), and all of them; its fields show each row's parts, the scalars as 1-d views."""
    module = load_script(algo.fast)
    rb = module.ReplayBuffer(10, 256, 1, 3, 2, torch.device("cpu"))
    stored = []
    for i in range(13):
        obs, next_obs, action = np.full((1, 3), i), np.full((1, 3), 100 + i), np.full((1, 2), 200 + i)
        rb.stage(obs, next_obs, action, np.array([300.0 + i]), np.array([i % 2]))
        rb.push()
        stored.append(np.concatenate([obs[0], action[0], [300 + i], next_obs[0], [i % 2]]))
    torch.manual_seed(0)
    rb.sample()
    rows = rb.batch.numpy()
    matches = [[np.array_equal(row, s) for s in stored[3:]] for row in rows]
    assert all(any(m) for m in matches), "a sampled row that the buffer does not hold"
    assert all(any(m[j] for m in matches) for j in range(10)), "a held row never sampled in 256 draws"
    obs, actions, rewards, next_obs, dones = rb.fields
    assert rewards.shape == dones.shape == (256,)
    np.testing.assert_array_equal(rewards.numpy(), 300 + obs[:, 0].numpy())
    np.testing.assert_array_equal(next_obs.numpy(), 100 + obs.numpy())
    np.testing.assert_array_equal(dones.numpy(), obs[:, 0].numpy() % 2)
    assert actions.shape == (256, 2) and rewards.data_ptr() == rb.batch[:, 5].data_ptr()


def run_keeping_buffer(name, argv, monkeypatch, capsys):
    """Run a script; return its record and its replay buffer."""
    module, buffers = load_script(name), []

    class Recording(module.ReplayBuffer):
        def __init__(self, *args):
            super().__init__(*args)
            buffers.append(self)

    monkeypatch.setattr(module, "ReplayBuffer", Recording)
    return run_main(name, argv, capsys), buffers[0]


def stored_rows(rb):
    """The transitions a replay buffer of either script holds, as rows [obs, action, reward, next_obs, done]: a numpy
    array on the host in the baseline, a tensor on the device in the twin."""
    rows = rb.storage[: int(rb.size)]
    return rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows


def check_stores_the_baseline_transitions(algo, monkeypatch, capsys):
    """The twin's single env (reset in the step that ends an episode) and its replay buffer store the baseline's
    transitions bit for bit: the same observations, random actions, rewards and dones, and the true final
    observation where an episode ends (Pendulum's 200-step limit, twice). Learning starts at the last step, so
    every earlier action is the env's seeded random one. The run ends before its fps window would open: the
    record says so and measures fps over the whole loop."""
    argv = ["--env-id", "Pendulum-v1", "--total-timesteps", "450", "--learning-starts", "449", "--batch-size", "8",
            "--no-tensorboard"]  # fmt: skip
    rows, records = {}, {}
    for name in (algo.base, algo.fast):
        records[name], rb = run_keeping_buffer(name, argv, monkeypatch, capsys)
        rows[name] = stored_rows(rb)
        assert records[name]["steady"] is False and records[name]["total_timesteps"] == 450
        # Over the loop alone: at least the fps over the whole run, set-up included.
        assert records[name]["fps"] >= records[name]["fps_overall"]
    rows_b, rows_f = rows[algo.base], rows[algo.fast]
    assert len(rows_b) == len(rows_f) == 450
    np.testing.assert_array_equal(rows_f[:449], rows_b[:449])  # the last step acts with the policy
    np.testing.assert_array_equal(rows_f[449, :3], rows_b[449, :3])
    # Where the first episode ended, the stored next observation is the final one, not the reset one.
    assert not np.array_equal(rows_f[199, -4:-1], rows_f[200, :3])
    assert records[algo.fast]["episodic_return"] == records[algo.base]["episodic_return"] is not None
    # The same return curve: points at the same steps with the same mean returns (their times differ).
    curve_b, curve_f = ([point[::2] for point in records[name]["return_curve"]] for name in (algo.base, algo.fast))
    assert curve_f == curve_b and len(curve_b) > 1


def check_interrupted(name, capsys, monkeypatch):
    """Ctrl-C in the middle of the random steps: the record covers the 40 steps done and says it was cut short.
    --torch-threads takes effect (run_main checks the record's count; a run without updates, so that two threads on
    a busy machine cost nothing)."""
    run_interrupted(name, TINY + ["--no-tensorboard", "--torch-threads", "2"], 40, capsys, monkeypatch)


def check_num_envs_update_path(algo, name, mode, monkeypatch, capsys):
    """--num-envs 4 on Pendulum through learning starts, warm-up and the fps window, in one of MODES (the baseline
    in none): the record counts env steps, 4 per vector step, and (where no CUDA graph replays the updates) each
    vector step from learning starts on makes one critic update, every --policy-frequency-th one an actor update,
    as CleanRL counts its steps."""
    module = load_script(name)
    make_update_fns, calls = module.make_update_fns, []

    def counted(fn):
        def call(*args):
            calls.append(fn)
            return fn(*args)

        return call

    def counting_update_fns(*args):
        critic, actor, *others = make_update_fns(*args)
        return counted(critic), counted(actor), *others

    monkeypatch.setattr(module, "make_update_fns", counting_update_fns)
    argv = TINY + PENDULUM
    record = run_main(name, argv, capsys) if name == algo.base else run_mode(name, argv, mode, capsys)
    assert_steady(record, TINY_STEPS)
    if not record["cudagraphs"]:
        vector_steps = range(TINY_LEARNING_STARTS // NUM_ENVS, TINY_STEPS // NUM_ENVS)
        actor_steps = [step for step in vector_steps if step % module.Args.policy_frequency == 0]
        assert len(calls) == len(vector_steps) + len(actor_steps)
        assert len(set(calls)) == 2


def check_truncation_transitions(name, monkeypatch, capsys):
    """--num-envs 4 on Pendulum, past the truncation that ends every env's first episode at the same vector step,
    all random actions but the last step's. Each env's stored transitions are those of a Pendulum env seeded as the
    vector env seeds it and stepped with the stored actions: at the truncating step the true final observation,
    with done 0 (a truncation is no termination). No stored transition goes from a final observation into the
    reset one: each env's next observation is where its next transition starts, but at the truncation."""
    steps = PENDULUM_STEPS + 10
    argv = PENDULUM + ["--total-timesteps", str(NUM_ENVS * steps), "--learning-starts", str(NUM_ENVS * (steps - 1)),
                       "--batch-size", "8", "--no-tensorboard"]  # fmt: skip
    record, rb = run_keeping_buffer(name, argv, monkeypatch, capsys)
    assert record["total_timesteps"] == NUM_ENVS * steps and record["episodic_return"] is not None
    rows = stored_rows(rb)
    assert len(rows) == NUM_ENVS * steps
    # Row NUM_ENVS * t + i: env i's transition of vector step t.
    obs, actions, rewards, next_obs, dones = (
        part.reshape(steps, NUM_ENVS, -1) for part in np.split(rows, [3, 4, 5, 8], axis=1)
    )
    for i in range(NUM_ENVS):
        env = gym.make("Pendulum-v1")
        observation, _ = env.reset(seed=1 + i)
        for t in range(PENDULUM_STEPS):
            np.testing.assert_array_equal(obs[t, i], observation.astype(np.float32))
            observation, reward, terminated, truncated, _ = env.step(actions[t, i])
            np.testing.assert_array_equal(next_obs[t, i], observation.astype(np.float32))
            assert rewards[t, i, 0] == np.float32(reward) and dones[t, i, 0] == 0
            assert not terminated and truncated == (t == PENDULUM_STEPS - 1)
    assert not dones.any()
    breaks = np.argwhere((next_obs[:-1] != obs[1:]).any(axis=2))
    assert breaks.tolist() == [[PENDULUM_STEPS - 1, i] for i in range(NUM_ENVS)]


def check_num_envs_resume(name, tmp_path, capsys):
    """--num-envs 4, stopped after the truncation that ends every env's first episode and resumed from its
    checkpoint folder: the run goes on from the saved step and writes into that folder, its replay buffer holds the
    saved transitions and then the new ones, and its networks and optimizers are the saved ones trained further."""
    argv = PENDULUM + ["--learning-starts", "200", "--batch-size", "32", "--buffer-size", "2000", "--no-tensorboard"]
    run_main(name, argv + ["--total-timesteps", "808", "--save-dir", str(tmp_path)], capsys)
    saved = torch.load(tmp_path / f"{name}.pt", map_location="cpu", weights_only=True)
    record = run_main(name, argv + ["--total-timesteps", "1000", "--resume", str(tmp_path)], capsys)
    assert record["resumed_from"] == 808 and record["total_timesteps"] == 1000
    resumed = torch.load(tmp_path / f"{name}.pt", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 1000 and resumed["returns"][: len(saved["returns"])] == saved["returns"]
    buffer = resumed["state"]["rb"]
    assert int(buffer["size"]) == 1000
    for part, rows in saved["state"]["rb"].items():
        if part not in ("ptr", "size"):
            assert len(rows) == 808 and torch.equal(buffer[part][:808], rows), f"{part}: the saved rows are not kept"
    # Each optimizer went on from its saved step count: 808 env steps, 4 per vector step, then 48 more.
    for optimizer in ("q_optimizer", "actor_optimizer"):
        steps = [float(s["step"]) for s in resumed["state"][optimizer]["state"].values()]
        saved_steps = [float(s["step"]) for s in saved["state"][optimizer]["state"].values()]
        assert all(a > b > 0 for a, b in zip(steps, saved_steps, strict=True)), optimizer
