"""DQN: both scripts through their update path (the twin in every mode), the TensorBoard scalars and the profile,
twin-vs-baseline equivalence of the update, the target update and the greedy policy, the twin acting as the
baseline does before learning starts, the epsilon schedule, a learning test on CartPole, a training video, Ctrl-C
and bad input."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    MODES,
    assert_one_line_error,
    assert_return_curve,
    assert_same_update,
    assert_steady,
    assert_trace_phases,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_interrupted,
    run_main,
    run_main_stderr,
    tensorboard_scalars,
)

import harness

pytestmark = pytest.mark.usefixtures("workdir")

BASE, FAST = "dqn", "dqn_torchcompile"
SCRIPTS = pytest.mark.parametrize("name", [BASE, FAST])
# A tiny run that passes learning starts, warm-up (WARMUP_STEPS) and a measured window, with an update at every
# step and a target update every 50.
TINY_STEPS, TINY_LEARNING_STARTS = 2400, 200
TINY = ["--total-timesteps", str(TINY_STEPS), "--learning-starts", str(TINY_LEARNING_STARTS), "--train-frequency",
        "1", "--target-network-frequency", "50", "--batch-size", "32", "--buffer-size", "1000"]  # fmt: skip
N_OBS, N_ACT, CPU = 4, 3, torch.device("cpu")
# Bad input: (argv, the flags or names the one error line must name).
BAD_INPUT = [
    (["--env-id", "NoSuchEnv-v0"], ["--env-id 'NoSuchEnv-v0': gymnasium cannot make it"]),
    (["--env-id", "Pendulum-v1"], ["--env-id Pendulum-v1 has a Box action space", "discrete"]),
    (["--env-id", "Blackjack-v1"], ["--env-id Blackjack-v1 has a Tuple observation space", "flat Box"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--buffer-size", "0"], ["--buffer-size"]),
    (["--buffer-size", "10", "--batch-size", "256"], ["--buffer-size", "--batch-size"]),
    (["--train-frequency", "0"], ["--train-frequency"]),
    (["--target-network-frequency", "-1"], ["--target-network-frequency"]),
    (["--learning-rate", "-0.1"], ["--learning-rate"]),
    (["--num-envs", "4"], ["--num-envs"]),
    (["--exploration-fraction", "0"], ["--exploration-fraction"]),
    (["--exploration-fraction", "1.5"], ["--exploration-fraction"]),
    (["--start-e", "-0.1"], ["--start-e"]),
    (["--end-e", "1.5"], ["--end-e"]),
    (["--tau", "-0.1"], ["--tau"]),
    (["--gamma", "2"], ["--gamma"]),
    (["--total-timesteps", "1000"], ["--learning-starts", "--total-timesteps"]),
    (["--total-timesteps", "300", "--learning-starts", "100", "--target-network-frequency", "1000"],
     ["--target-network-frequency 1000 is never due", "env steps 101 to 299"]),  # the target would never be synced
    (["--total-timesteps", "300", "--learning-starts", "260", "--train-frequency", "250"],
     ["--train-frequency 250 is never due", "env steps 261 to 299"]),  # below the total, no multiple past 260
    (["--learning-rate", "1e300"], ["--learning-rate 1e+300 is beyond float32's range"]),
]


def test_baseline_update_path(tmp_path, monkeypatch, capsys):
    """The baseline through learning starts, warm-up and its fps window, with a progress tick at every step:
    TensorBoard gets both statistics at every step from the first update on, finite, the loss positive; the
    profile has every phase."""
    module = load_script(BASE)
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)
    record = run_main(BASE, TINY + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_steady(record, TINY_STEPS)
    assert record["compile"] is False and record["cudagraphs"] is False
    assert record["episodic_return"] > 0
    assert_return_curve(record)
    assert_trace_phases(tmp_path / "profile", BASE, env_steps_per_call=1)
    scalars = tensorboard_scalars(BASE, "CartPole-v1")
    for stat in module.STATS:
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == list(range(TINY_LEARNING_STARTS + 1, TINY_STEPS)), stat
        assert np.isfinite(values).all(), stat
    assert min(value for _, value in scalars["losses/td_loss"]) > 0


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_compiled_update_path(mode, capsys):
    """The twin through learning starts, warm-up and its fps window in each mode; its record says which flags took
    effect, and --cudagraphs without CUDA says once that it runs without graphs."""
    record, err = run_main_stderr(FAST, TINY + ["--no-tensorboard"] + mode, capsys)
    assert_steady(record, TINY_STEPS)
    assert record["compile"] == ("--compile" in mode)
    cudagraphs = "--cudagraphs" in mode
    assert record["cudagraphs"] == (cudagraphs and torch.cuda.is_available())
    assert err.count("--cudagraphs needs CUDA") == (cudagraphs and not torch.cuda.is_available())
    assert record["episodic_return"] > 0
    assert_return_curve(record)


def test_twin_logs_and_profiles(tmp_path, monkeypatch, capsys):
    """The twin's statistics reach TensorBoard from its fixed tensors as the baseline's do, and its profile has
    every phase."""
    monkeypatch.setattr(harness.progress, "PROGRESS_SECONDS", 0.0)
    run_main(FAST, TINY + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_trace_phases(tmp_path / "profile", FAST, env_steps_per_call=1)
    scalars = tensorboard_scalars(FAST, "CartPole-v1")
    steps, losses = zip(*scalars["losses/td_loss"])
    assert list(steps) == list(range(TINY_LEARNING_STARTS + 1, TINY_STEPS))
    assert np.isfinite(losses).all() and min(losses) > 0
    assert len(set(losses)) > 1, "the logged loss never changed: the fixed tensors are not written"


@pytest.mark.parametrize(
    "t, epsilon", [(0, 1.0), (250, 0.525), (499, 0.0519), (500, 0.05), (900, 0.05)], ids=lambda v: str(v)
)
def test_epsilon_schedule(t, epsilon):
    """CleanRL's linear schedule, from start-e to end-e over exploration-fraction x total-timesteps steps (here
    0.5 x 1000), then end-e; the same function in both scripts."""
    for name in (BASE, FAST):
        assert load_script(name).linear_schedule(1.0, 0.05, 0.5 * 1000, t) == pytest.approx(epsilon, abs=1e-6)


@SCRIPTS
def test_loop_follows_the_schedule(name, monkeypatch, capsys):
    """The loop asks the schedule for every step's epsilon, over exploration-fraction x total-timesteps; the twin
    also for the step after the last, as each training step draws for the step after it."""
    module = load_script(name)
    schedule, calls = module.linear_schedule, []

    def recording(start_e, end_e, duration, t):
        calls.append((start_e, end_e, duration, t))
        return schedule(start_e, end_e, duration, t)

    monkeypatch.setattr(module, "linear_schedule", recording)
    argv = ["--total-timesteps", "300", "--learning-starts", "100", "--start-e", "0.8", "--end-e", "0.1",
            "--exploration-fraction", "0.2", "--no-tensorboard"]  # fmt: skip
    run_main(name, argv, capsys)
    assert calls == [(0.8, 0.1, 0.2 * 300, t) for t in range(300 + (name == FAST))]


def test_twin_acts_as_the_baseline(capsys):
    """Before learning starts both scripts' Q networks are the same (same seed), and the twin draws whether to
    explore and the random action as the baseline does, from the same generators in the same order: the episodes
    are the same, return for return."""
    argv = ["--total-timesteps", "1500", "--learning-starts", "1499", "--exploration-fraction", "0.2",
            "--no-tensorboard"]  # fmt: skip
    curves = [[point[::2] for point in run_main(name, argv, capsys)["return_curve"]] for name in (BASE, FAST)]
    assert len(curves[0]) > 10 and curves[0] == curves[1]


def make_pair(compile, cudagraphs, device, **kwargs):
    """A baseline agent and a twin agent with identical parameters on `device`, the baseline's update functions,
    and the twin's replay buffer, training step (which may act for the next step), stats, policy and act; and the
    order of the twin's calls of its update and its policy, as Python runs them (eagerly, or to capture them)."""
    base, fast = load_script(BASE), load_script(FAST)
    args_b, args_f = base.Args(**kwargs), fast.Args(**kwargs, compile=compile, cudagraphs=cudagraphs)
    torch.manual_seed(0)
    agent_b, agent_f = base.Agent(args_b, N_OBS, N_ACT, device), fast.Agent(args_f, N_OBS, N_ACT, device)
    agent_f.q_network.load_state_dict(agent_b.q_network.state_dict())
    # A target apart from the live network, so that the target update shows.
    with torch.no_grad():
        for target in (agent_b.target_network, agent_f.target_network):
            for p, seed_p in zip(target.parameters(), agent_b.q_network.parameters()):
                p.copy_(seed_p * 0.5 - 0.01)
    rb = fast.ReplayBuffer(64, 32, N_OBS, device)
    update_f, update_target_f, policy_f = fast.make_update_fns(agent_f, args_f, rb.fields)
    calls = []

    def recorded(name, function):
        def call(*args):
            calls.append(name)
            return function(*args)

        return call

    act_f, act_on_device_f = fast.make_act(recorded("policy", policy_f), N_OBS, device)
    stats_f = {name: torch.zeros((), device=device) for name in fast.STATS}
    train_f = fast.make_train_step(
        rb, stats_f, recorded("update", update_f), update_target_f, act_f, act_on_device_f, args_f
    )
    return agent_b, base.make_update_fns(agent_b, args_b), agent_f, rb, train_f, stats_f, policy_f, act_f, calls


def trained_state(agent_b, agent_f):
    """Every trained tensor of both agents as (name, baseline tensor, twin tensor)."""
    return [
        (f"{net}.{name}", p_b, p_f)
        for net in ("q_network", "target_network")
        for (name, p_b), p_f in zip(getattr(agent_b, net).named_parameters(), getattr(agent_f, net).parameters())
    ]


@pytest.mark.parametrize(
    "compile, tau", [(False, 1.0), (False, 0.3), (True, 0.3)], ids=["eager", "eager-tau0.3", "compile-tau0.3"]
)
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline(compile, tau):
    check_equivalence(compile, False, CPU, tau)


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_with_baseline_cuda(compile):
    """The same on the GPU, with each kind of training step captured in a CUDA graph, the copies of acting and the
    policy included: the steps after the capture are graph replays, and so is the action each returns."""
    check_equivalence(compile, True, torch.device("cuda"), 0.3)


def check_equivalence(compile, cudagraphs, device, tau):
    """Same parameters and batches: each training step of the twin (store, sample, TD update, every other step
    the target update, then, in every other pair of steps, the greedy action for the next step) gives the loss,
    the Q values and the parameters of the baseline's update on the batch it sampled, and the action of the
    updated Q network; the policy runs after the update. Then the policy and make_act's act alone act greedily.
    Twenty steps: each of the four kinds of step is called five times, past the capture (the third call, the
    fourth with --compile)."""
    agent_b, (update_b, update_target_b), agent_f, rb, train_f, stats_f, policy_f, act_f, calls = make_pair(
        compile, cudagraphs, device, tau=tau
    )
    rng = np.random.default_rng(1)

    def stage():
        obs, next_obs = rng.standard_normal(N_OBS), rng.standard_normal(N_OBS)
        rb.stage(obs, next_obs, rng.integers(N_ACT), rng.standard_normal(), float(rng.random() < 0.2))

    for _ in range(8):
        stage()
        rb.push()
    fixed = {name: value.data_ptr() for name, value in stats_f.items()}
    initial = [(name, p_b.detach().clone()) for name, p_b, _ in trained_state(agent_b, agent_f)]
    for i in range(20):
        stage()
        target_update, greedy = i % 2 == 1, i // 2 % 2 == 0
        obs_ahead = rng.standard_normal(N_OBS).astype(np.float32)
        torch.manual_seed(i)
        action = train_f(True, target_update, obs_ahead if greedy else None)
        torch.manual_seed(i)
        idx = torch.randint(0, 2**62, (len(rb.batch),), device=device) % (9 + i)
        if device.type == "cuda" and not greedy:
            torch.cuda.synchronize()  # nothing waited for a step that does not act
        if greedy:
            with torch.no_grad():
                want = int(agent_f.q_network(torch.as_tensor(obs_ahead, device=device)[None]).argmax(dim=1)[0])
            assert action == want, f"step {i}: not the updated network's greedy action"
        else:
            assert action is None and rb.in_flight == (device.type == "cuda")
        assert torch.equal(rb.storage[8 + i], rb.row[0]), "the staged transition was not stored"
        assert torch.equal(rb.batch, rb.storage[idx]), "the batch is not the sample the draw says"
        obs, actions, rewards, next_obs, dones = (field.clone() for field in rb.fields)
        stats_b = update_b(obs, actions.long(), rewards, next_obs, dones)
        if target_update:
            update_target_b()
        tol = 1e-5 if i == 0 else 1e-3  # later updates carry the drift Adam amplifies
        for name, value in stats_b.items():
            torch.testing.assert_close(stats_f[name], value, atol=tol, rtol=tol, msg=name)
        for (name, before), (_, p_b, p_f) in zip(initial, trained_state(agent_b, agent_f), strict=True):
            assert_same_update(before, p_b.detach(), p_f.detach(), name=name)
    assert {name: value.data_ptr() for name, value in stats_f.items()} == fixed
    # The greedy action rarely changes with one small update: the order of the calls shows that the policy acts
    # with the updated network, and only in steps that act. Replays run no Python: only the calls before the
    # capture and the capture show.
    assert "update" in calls and calls[0] == "update", calls
    assert all(calls[k - 1] == "update" for k, name in enumerate(calls) if name == "policy"), calls
    assert calls.count("policy") < calls.count("update"), "a step that does not act ran the policy"
    for (name, before), (_, _, p_f) in zip(initial, trained_state(agent_b, agent_f), strict=True):
        assert not torch.equal(before, p_f), f"{name} never changed"
    if tau == 1.0:
        for p, target in zip(agent_f.q_network.parameters(), agent_f.target_network.parameters()):
            assert torch.equal(p, target), "tau 1: the target update copies the Q network"
    check_policy(agent_f.q_network, policy_f, act_f, rb.fields[0])


def check_policy(q_network, policy, act, obs):
    """The greedy action of the trained Q network, from the policy and from act alone (its pinned copies, as at a
    run's first step); no autograd graph."""
    for k in range(6):
        one = obs[k : k + 1]
        with torch.no_grad():
            want = q_network(one).argmax(dim=1)
        action = policy(one)
        assert not action.requires_grad and action.dtype == torch.long
        assert torch.equal(action, want), k
        assert act(one[0].cpu().numpy()) == int(want[0])


def test_learns_cartpole_baseline(capsys):
    """Tuned-down hyperparameters: 10000 steps lift CartPole from about 22 (random) to 210-280 (seeds 1 and 2);
    the update with its loss's sign flipped stays at 9-14."""
    check_learns(BASE, capsys)


def test_learns_cartpole_twin(capsys):
    """The same for the twin (eager): 329 seen, 10 with the sign flipped."""
    check_learns(FAST, capsys)


def check_learns(name, capsys):
    argv = ["--total-timesteps", "10000", "--learning-starts", "1000", "--train-frequency", "2",
            "--target-network-frequency", "100", "--batch-size", "64", "--learning-rate", "1e-3",
            "--exploration-fraction", "0.3", "--no-tensorboard"]  # fmt: skip
    record = run_main(name, argv, capsys)
    assert record["episodic_return"] > 100
    assert_return_curve(record)


@SCRIPTS
def test_training_video(name, capsys):
    """--capture-video while training on CartPole (pygame renders it, no display needed): the first episode, as
    CleanRL's schedule records it, is an MP4 file."""
    run_main(name, ["--total-timesteps", "300", "--learning-starts", "100", "--no-tensorboard", "--capture-video"],
             capsys)  # fmt: skip
    (folder,) = Path("videos").iterdir()
    video = (folder / "rl-video-episode-0.mp4").read_bytes()
    assert len(video) > 1000 and video[4:8] == b"ftyp"


@SCRIPTS
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    run_interrupted(name, TINY + ["--no-tensorboard"], 40, capsys, monkeypatch)


@SCRIPTS
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(name, argv, fragments, capsys):
    """One error line naming the flag, and exit code 2, before any training."""
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


def test_training_video_without_a_display_prints_no_error_line(monkeypatch):
    """Without a display, SDL (under pygame) printed `error: XDG_RUNTIME_DIR is invalid ...` as the run's first
    line, though the run went well: the run's stderr now has no `error:` line at all."""
    for variable in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(variable, raising=False)
    proc = run_cli(BASE, "--total-timesteps", "300", "--learning-starts", "100", "--no-tensorboard", "--capture-video")
    assert proc.returncode == 0 and [line for line in proc.stderr.splitlines() if "error" in line.lower()] == []
