"""PPO continuous on MuJoCo Warp (leanrl/ppo_continuous_action_gpu_mujoco.py and its _torchcompile twin) on the CPU,
Warp's CPU device: both scripts through their update (the twin in every mode), the twin's rollout (make_collect), GAE
and update against the baseline's, a resumed run against an uninterrupted one, evaluation and its video, a learning
test, bad input. The envs themselves (leanrl/mujoco_warp_envs.py) are test_mujoco_warp_envs.py's.

Warp builds its kernels on first use (one to two minutes for the first model on the 2-core CPU, seconds for each
other; cached in ~/.cache/warp), inside the first test that makes envs."""

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
    assert_equal,
    assert_evaluation_video,
    assert_one_line_error,
    assert_return_curve,
    assert_steady,
    assert_trace_phases,
    flag_value,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_main,
    run_main_stderr,
    tensorboard_scalars,
)

import mujoco_warp_envs

NAME = "ppo_continuous_action_gpu_mujoco"
FAST = f"{NAME}_torchcompile"  # the twin: the rollout one CUDA graph, GAE a scan, the update compiled and captured
TINY = ["--num-envs", "4", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs", "1", "--no-tensorboard"]
ITERATIONS = 5  # 3 of warm-up, then the fps window
pytestmark = pytest.mark.usefixtures("workdir")


def tiny(env_id="HalfCheetah-v5", iterations=ITERATIONS):
    return ["--env-id", env_id, *TINY, "--total-timesteps", str(iterations * 4 * 8)]


@pytest.mark.parametrize(
    "name, phases, steps_per_call",
    # The baseline steps every env in each env_step call; the twin's collect (policy included) takes a rollout.
    [(NAME, PHASES, 4), (FAST, POLICY_IN_STEP_PHASES, 4 * 8)],
    ids=[NAME, FAST],
)
def test_iterations_with_profile(name, phases, steps_per_call, tmp_path, capsys):
    """Hopper, whose random episodes end within a rollout: the run reaches its fps window, logs a mean return each
    iteration, and --profile-dir traces every phase."""
    record = run_main(name, tiny("Hopper-v5") + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_steady(record, ITERATIONS * 4 * 8)
    assert_return_curve(record)
    assert 0 < record["episodic_return"] < 100  # random Hopper episodes: about 20 steps, about 1 a step
    assert_trace_phases(tmp_path / "profile", name, env_steps_per_call=steps_per_call, phases=phases)


def test_twin_runs_humanoid(capsys):
    """Humanoid-v5 (348 observations, 17 actions in [-0.4, 0.4], resets that run Warp's kinematics) through the twin's
    iterations: the fps window reached, random episodes ended, about 5 a step for some 20 to 60 steps."""
    record = run_main(FAST, tiny("Humanoid-v5", iterations=8), capsys)
    assert_steady(record, 8 * 4 * 8)
    assert_return_curve(record)
    assert record["env_id"] == "Humanoid-v5" and 50 < record["episodic_return"] < 300


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.usefixtures("eager_random")  # as in the equivalence tests, which then reuse these graphs
def test_twin_iterations(mode, capsys):
    """The twin through its update in each mode (--cudagraphs without CUDA: one warning line, then a run without
    graphs, as its record says): the fps window reached, a mean return, and TensorBoard gets each iteration's
    statistics and its learning rate, annealed (a device tensor in the twin, filled in place)."""
    argv = [arg for arg in tiny("Hopper-v5") if arg != "--no-tensorboard"] + ["--learning-rate", "0.003"]
    record, err = run_main_stderr(FAST, argv + mode, capsys)
    cuda = torch.cuda.is_available()
    assert record["compile"] == ("--compile" in mode)
    assert record["cudagraphs"] == ("--cudagraphs" in mode and cuda)
    assert err.count("--cudagraphs needs CUDA") == ("--cudagraphs" in mode and not cuda)
    assert_steady(record, ITERATIONS * 4 * 8)
    assert_return_curve(record)
    assert 0 < record["episodic_return"] < 100
    scalars = tensorboard_scalars(FAST, "Hopper-v5")
    iteration_ends = [(i + 1) * 4 * 8 for i in range(ITERATIONS)]
    schedule = [0.003 * (1 - i / ITERATIONS) for i in range(ITERATIONS)]
    assert scalars["charts/learning_rate"] == [(step, pytest.approx(lr)) for step, lr in zip(iteration_ends, schedule)]
    for stat in (*load_script(FAST).STATS, "explained_variance"):
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == iteration_ends and np.isfinite(values).all(), stat


@pytest.mark.signals
@pytest.mark.parametrize("name", [NAME, FAST])
def test_resume_is_the_uninterrupted_run(name, capsys, monkeypatch):
    """Stopped by Ctrl-C in its third iteration (the baseline's within its rollout, the twin's as its rollout ends: its
    one tick an iteration) and resumed, a run ends where the uninterrupted one does, bit for bit: networks, Adam's
    state, the envs' state and statistics (a checkpoint holds the envs, which are tensors), the random generators
    (the twin's minibatches are shuffled by torch's); then the checkpoint's policy runs on gymnasium's own env."""
    run_main(name, tiny() + ["--save-dir", "whole"], capsys)
    run_class, at_step = load_script(name).Run, 2 * 4 * 8 + 4
    tick = run_class.tick

    def interrupting_tick(self, step):
        if self.stops.signal is None and step >= at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return tick(self, step)

    monkeypatch.setattr(run_class, "tick", interrupting_tick)
    record = run_main(name, tiny() + ["--save-dir", "parts"], capsys, interrupted=True)
    assert record["total_timesteps"] == 3 * 4 * 8
    monkeypatch.setattr(run_class, "tick", tick)
    record = run_main(name, tiny() + ["--resume", "parts"], capsys)
    assert record["resumed_from"] == 3 * 4 * 8 and record["total_timesteps"] == ITERATIONS * 4 * 8
    whole, parts = (torch.load(f"{folder}/{name}.pt", weights_only=True) for folder in ("whole", "parts"))
    assert whole["global_step"] == parts["global_step"] == ITERATIONS * 4 * 8
    assert_equal(whole["state"], parts["state"])
    assert_equal(whole["rng"], parts["rng"])
    evaluation = load_script(name).main(["--eval-checkpoint", "parts", "--eval-episodes", "1"])
    assert evaluation["episodes"] == 1 and np.isfinite(evaluation["mean"])


def test_evaluation_video(capsys):
    """--eval-checkpoint --capture-video: the saved policy's episode on gymnasium's Humanoid-v5 (an untrained one falls
    within some 60 steps: few frames to render), rendered by MuJoCo into one MP4 file under videos/<run name>/. The
    twin's evaluate is the baseline's (test_contract.py)."""
    run_main(NAME, tiny("Humanoid-v5") + ["--save-dir", "run"], capsys)
    assert_evaluation_video(NAME, "run")


@pytest.mark.parametrize("name", [NAME, FAST])
def test_learns_hopper(name, capsys):
    """16384 steps (8 iterations of 128 envs x 16 steps) lift Hopper's mean return (of the run's iterations) from
    about 8 (random policy) to about 43 (seeds 1-3: 42 to 46) on this CPU, in either script; a broken update stays at
    or below the random return (the policy loss with its sign flipped: about 2)."""
    record = run_main(name, ["--env-id", "Hopper-v5", "--num-envs", "128", "--num-steps", "16", "--num-minibatches",
                             "4", "--learning-rate", "3e-3", "--total-timesteps", "16384", "--no-tensorboard"],
                      capsys)  # fmt: skip
    assert record["episodic_return"] > 25
    assert_return_curve(record)


# ---- the twin against the baseline

# Two rollouts of 4 Hopper envs x 32 steps, the time limit at 16 steps: some random episodes fall (terminate) within
# it, the others meet it (truncated: the reward bootstrapped). Minibatches of 16, TINY's, so that the compiled twin
# finds its update's graphs in Inductor's cache.
ROLLOUT = ["--env-id", "Hopper-v5", "--num-envs", "4", "--num-steps", "32", "--num-minibatches", "8",
           "--update-epochs", "1", "--total-timesteps", str(2 * 4 * 32), "--no-tensorboard"]  # fmt: skip
ROLLOUT_KEYS = ("obs", "actions", "logprobs", "values", "rewards", "dones")
ENVS_STEP = mujoco_warp_envs.Envs.step  # as rollouts() records it


def rollouts(name, argv, capsys, monkeypatch):
    """A run of argv: each iteration's rollout as GAE gets it (copies of the storage), GAE's inputs and outputs, and
    each env step's done and bootstrapped (truncated, not terminated) flags."""
    script, seen = load_script(name), {"rollouts": [], "ends": []}

    class Recording(script.Rollout):
        def __init__(self, *args):
            super().__init__(*args)
            seen["storage"] = self

    def make_update_fns(agent, args, make=script.make_update_fns):
        gae, *others = make(agent, args)

        def recording_gae(*inputs):
            outputs = gae(*inputs)
            rollout = {key: getattr(seen["storage"], key).clone() for key in ROLLOUT_KEYS}
            seen["rollouts"].append({**rollout, "gae": [x.clone() for x in (*inputs, *outputs)]})
            return outputs

        return recording_gae, *others

    def recording_step(envs, action):
        out = ENVS_STEP(envs, action)
        seen["ends"].append(torch.stack((out[2].bool(), out[4])))
        return out

    monkeypatch.setattr(script, "Rollout", Recording)
    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    monkeypatch.setattr(mujoco_warp_envs.Envs, "step", recording_step)  # both scripts' envs step with it
    run_main(name, argv, capsys)
    # Compiled, the twin's GAE runs once more, first, on the empty rollout while Warp builds (trick 22).
    early = int("--compile" in argv)
    batch = flag_value(argv, "--num-envs", 0) * flag_value(argv, "--num-steps", 0)
    assert len(seen["rollouts"]) == early + flag_value(argv, "--total-timesteps", 0) // batch
    return seen["rollouts"][early:], torch.stack(seen["ends"])


@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_rollout_is_the_baselines(mode, capsys, monkeypatch):
    """With one seed, the twin's first rollout (make_collect; the policy draws with rsample, the baseline's with
    sample: the same numbers) is the baseline loop's slot by slot: observations, actions, log-probabilities, values,
    rewards (with the time-limit bootstrap), done flags; bit for bit in eager mode, to float rounding compiled. GAE
    gets the same inputs in both and gives the same advantages and returns (a scan against the loop: to float
    rounding). The second rollout starts, in both, from the observation and done flags the first ended in."""
    monkeypatch.setattr(mujoco_warp_envs, "MAX_EPISODE_STEPS", 16)
    (first_b, second_b), ends_b = rollouts(NAME, ROLLOUT, capsys, monkeypatch)
    (first_f, second_f), ends_f = rollouts(FAST, ROLLOUT + mode, capsys, monkeypatch)
    tol = {"atol": 1e-5, "rtol": 1e-5} if mode else {"atol": 0.0, "rtol": 0.0}
    for key in ROLLOUT_KEYS:
        actual = first_f[key][:-1] if key in ("obs", "dones") else first_f[key]
        torch.testing.assert_close(actual, first_b[key], **tol, msg=key)
    for i, (x_f, x_b) in enumerate(zip(first_f["gae"][:5], first_b["gae"][:5], strict=True)):
        torch.testing.assert_close(x_f, x_b, **tol, msg=f"GAE's input {i}")
    for x_f, x_b in zip(first_f["gae"][5:], first_b["gae"][5:], strict=True):
        torch.testing.assert_close(x_f, x_b, atol=1e-5, rtol=1e-5)
    assert torch.equal(ends_f[:32], ends_b[:32])
    done, bootstrapped = ends_b[:32].unbind(1)
    assert (done & ~bootstrapped).any() and bootstrapped.any()  # episodes that fell, and episodes cut at 16 steps
    for key in ("obs", "dones"):
        assert torch.equal(second_f[key][0], first_f[key][-1])
        torch.testing.assert_close(second_f[key][0], second_b[key][0], **tol)


@requires_cuda
@pytest.mark.parametrize("mode", [["--cudagraphs"], ["--compile", "--cudagraphs"]], ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_captured_rollout_is_the_eager_one(mode, capsys, monkeypatch):
    """On CUDA, the rollout that replays one captured env step's graph (its row a device index) is the same twin's
    without the graph, row for row (bit for bit; compiled, to float rounding): the first rollout crosses the warm-up
    calls, the capture and the first replays, the second is replays only."""
    monkeypatch.setattr(mujoco_warp_envs, "MAX_EPISODE_STEPS", 16)
    runs = []
    for argv in (ROLLOUT + mode[:-1], ROLLOUT + mode):
        with monkeypatch.context() as patch:  # one script module: each run's recording patches it afresh
            runs.append(rollouts(FAST, argv, capsys, patch)[0])
    eager, captured = runs
    tol = 1e-5 if "--compile" in mode else 0.0
    for i, (rollout_c, rollout_e) in enumerate(zip(captured, eager, strict=True)):
        for key in ROLLOUT_KEYS:
            torch.testing.assert_close(rollout_c[key], rollout_e[key], atol=tol, rtol=tol, msg=f"{i}: {key}")


# Hopper's sizes (11 observations, 3 actions), TINY's minibatches and rollouts: the compiled functions find the TINY
# runs' graphs in Inductor's cache.
N_OBS, N_ACT, MINIBATCH = 11, 3, 16
make_pair = functools.partial(agent_pair, NAME, FAST, "net", (N_OBS, N_ACT))
check_updates = functools.partial(ppo.check_updates, make_pair, N_OBS,
                                  lambda gen, n: torch.randn(n, N_ACT, generator=gen))  # fmt: skip
check_gae = functools.partial(ppo.check_gae, make_pair, N_OBS)


@pytest.mark.parametrize("num_steps", [1, 2, 8, 37, 64])
def test_gae_equivalence(num_steps):
    check_gae(compile=False, cudagraphs=False, device="cpu", num_steps=num_steps, num_envs=3)


@pytest.mark.usefixtures("eager_random")
def test_gae_equivalence_compiled():
    check_gae(compile=True, cudagraphs=False, device="cpu", num_steps=8, num_envs=4, calls=2)


def check_update(compile, cudagraphs, device, updates=4, **kwargs):
    """ppo.check_updates (the twin's updates against the baseline's); then its acting policy sees its trained weights
    without recording an autograd graph: its action, log-probability and value are the baseline's for the same
    generator state; with the same weights, bit for bit in eager mode on the CPU (rsample draws the numbers sample
    does)."""
    agent_b, agent_f, policy_f, obs, _, tol = check_updates(compile, cudagraphs, device, MINIBATCH, updates, **kwargs)
    obs = obs[:4]  # TINY's envs
    for weights in ("own", "the baseline's"):
        if weights != "own":  # the same weights in both (the trained ones: a standard deviation other than 1)
            assert agent_b.net.actor_logstd.abs().min() > 1e-3
            agent_f.net.load_state_dict(agent_b.net.state_dict())
        for call in range(4):  # with --compile: compilation, then the compiled function
            torch.manual_seed(call)
            with torch.no_grad():
                expected = agent_b.net.get_action_and_value(obs)
            torch.manual_seed(call)
            action, logprob, value = policy_f(obs)
            assert not any(x.requires_grad for x in (action, logprob, value)), "the policy acts without autograd"
            torch.testing.assert_close(action, expected[0], atol=tol, rtol=tol)
            torch.testing.assert_close(logprob, expected[1], atol=tol, rtol=tol)
            torch.testing.assert_close(value, expected[3].flatten(), atol=tol, rtol=tol)
            if weights != "own" and device == "cpu" and not compile:
                assert torch.equal(action, expected[0]), "rsample draws sample's numbers"
                assert torch.equal(logprob, expected[1]) and torch.equal(value, expected[3].flatten())


@pytest.mark.parametrize(
    "kwargs", [{}, {"norm_adv": False, "clip_vloss": False, "ent_coef": 0.01}], ids=["defaults", "options"]
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
    check_gae(compile, cudagraphs=True, device="cuda", num_steps=32, num_envs=64, calls=4)
    check_update(compile, cudagraphs=True, device="cuda", updates=5)


# ---- bad input

BAD_INPUT = [
    (["--env-id", "HalfCheetah-v4"], ["HalfCheetah-v4", "HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5, Humanoid-v5"]),
    (["--capture-video"], ["--capture-video", "--eval-checkpoint", "render no frames"]),
    (["--num-envs", "0"], ["--num-envs 0"]),
    (["--num-steps", "0"], ["--num-steps 0"]),
    (["--num-envs", "4", "--num-steps", "6", "--num-minibatches", "5"], ["= 24", "--num-minibatches 5"]),
    (["--num-envs", "2", "--num-steps", "4", "--num-minibatches", "8"], ["--num-minibatches 8 ", "--norm-adv"]),
    (["--num-envs", "4", "--num-steps", "8", "--num-minibatches", "2", "--total-timesteps", "31"],
     ["--total-timesteps 31 ", "= 32"]),
    (["--num-envs", "3000000000", "--num-steps", "1", "--num-minibatches", "1", "--total-timesteps", "3000000000",
      "--no-tensorboard"], ["--num-envs 3000000000", "MuJoCo Warp cannot make that many worlds"]),
]  # fmt: skip


@pytest.mark.parametrize("name", [NAME, FAST])
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv[:6]) for argv, _ in BAD_INPUT])
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


@pytest.mark.parametrize("name", [NAME, FAST])
def test_bad_input_cli(name):
    assert_one_line_error(run_cli(name, "--env-id", "HumanoidStandup-v5"), "HumanoidStandup-v5", "Humanoid-v5")
