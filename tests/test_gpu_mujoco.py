"""PPO continuous on MuJoCo Warp (leanrl/ppo_continuous_action_gpu_mujoco.py and its _torchcompile twin) on the CPU,
Warp's CPU device: the batched envs against gymnasium's v5 envs from the same states and actions (observations,
rewards, terminations, truncations, same-step auto-reset), their reset distributions, the normalisation against
gymnasium's; both scripts through their update (the twin in every mode), the twin's rollout (make_collect), GAE and
update against the baseline's, a resumed run against an uninterrupted one, evaluation, a learning test, bad input.

Warp builds its kernels on first use (one to two minutes for the first model on the 2-core CPU, seconds for each
other; cached in ~/.cache/warp), inside the first test that makes envs."""

import functools
import inspect
import os
import signal

import gymnasium as gym
import helpers
import mujoco
import numpy as np
import ppo
import pytest
import torch
from gymnasium.wrappers.utils import RunningMeanStd
from helpers import (
    MODES,
    PHASES,
    SCRIPTS,
    assert_one_line_error,
    assert_return_curve,
    assert_steady,
    assert_trace_phases,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_main,
    run_main_stderr,
    tensorboard_scalars,
)

NAME = "ppo_continuous_action_gpu_mujoco"
FAST = f"{NAME}_torchcompile"  # the twin: the rollout one CUDA graph, GAE a scan, the update compiled and captured
ENV_IDS = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5")
CPU = torch.device("cpu")
WORLDS, FREE_STEPS, SYNCED_STEPS = 4, 10, 20
# The largest differences from gymnasium (MuJoCo's C step, float64) over one env step from the same state, and over
# FREE_STEPS env steps from the same reset state, measured on the CPU (2026-11-25, mujoco 4.0.0, mujoco-warp 4.0.0,
# warp-lang 1.19.0; this test, and 4-8 worlds over 40 steps): observation, reward.
# - HalfCheetah-v5: 4.6e-4, 4.7e-6 in one step; 9.2e-4, 7.4e-5 in ten (chaotic beyond: 2.7e-2, 1e-3 by step 20).
# - Hopper-v5: 2.1e-6, 1.1e-6 in one step; 8.2e-6, 8.6e-7 in ten.
# - Walker2d-v5: 1.5e-4, 1.6e-5 in one step; 9.7e-5, 7.4e-6 in ten.
# - Ant-v5, both with an elliptic friction cone (below): 4.2e-3 (a contact force), 6.9e-6 in one step; 2.5e-4, 8e-5
#   in ten.
# The tolerances are about five times those.
TOLERANCE = {
    "HalfCheetah-v5": {"one": (2e-3, 3e-5), "free": (5e-3, 4e-4)},
    "Hopper-v5": {"one": (1e-5, 5e-6), "free": (5e-5, 5e-6)},
    "Walker2d-v5": {"one": (1e-3, 1e-4), "free": (5e-4, 4e-5)},
    "Ant-v5": {"one": (2e-2, 5e-5), "free": (2e-3, 4e-4)},
}
# Ant's contacts with gymnasium's pyramidal friction cone: MuJoCo Warp puts a capsule's contact with the floor in
# another tangent frame than MuJoCo C, and a pyramidal cone's friction depends on that frame; one MuJoCo step with a
# foot on the floor moves the velocities apart by up to 0.3 (of about 8). With an elliptic cone (which does not
# depend on the frame) they agree to 2e-5, so the physics check runs both with it, and test_ant_from_its_state checks
# the real Ant's observation, reward and termination from the state the batched env reaches.
ELLIPTIC = {"Ant-v5"}
TINY = ["--num-envs", "4", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs", "1", "--no-tensorboard"]
ITERATIONS = 5  # 3 of warm-up, then the fps window
pytestmark = pytest.mark.usefixtures("workdir")


def elliptic(model):
    model.opt.cone = mujoco.mjtCone.mjCONE_ELLIPTIC
    return model


def make_envs(env_id, num_envs, monkeypatch, cone=True):
    """The script's envs on the CPU (with an elliptic cone where ELLIPTIC says, unless cone is False)."""
    script = load_script(NAME)
    if cone and env_id in ELLIPTIC:
        load = mujoco.MjModel.from_xml_path
        monkeypatch.setattr(script.mujoco.MjModel, "from_xml_path", lambda path: elliptic(load(path)))
    torch.manual_seed(0)
    return script.Envs(env_id, num_envs, 0.99, CPU)


def time_limit(env):
    while not isinstance(env, gym.wrappers.TimeLimit):
        env = env.env
    return env


def gymnasium_envs(envs, env_id, cone=True):
    """gymnasium's own env for each world, reset and set to the world's state (float32 values, in float64)."""
    copies = [gym.make(env_id) for _ in range(envs.num_envs)]
    for i, env in enumerate(copies):
        if cone and env_id in ELLIPTIC:
            elliptic(env.unwrapped.model)
        env.reset(seed=i)
        restart(env, envs, i)
    return copies


def restart(env, envs, i):
    """As a reset leaves gymnasium's env (mj_resetData, then set_state's mj_forward), at the world's new state."""
    env.unwrapped.set_state(envs.qpos[i].double().numpy(), envs.qvel[i].double().numpy())
    time_limit(env)._elapsed_steps = int(envs.elapsed[i])


def synchronize(env, envs, i):
    """gymnasium's env in the world's whole state that a step reads: positions, velocities, the solver's warm start
    and the x position the forward reward starts from (Ant's: its torso's xpos, from the last step)."""
    data = env.unwrapped.data
    data.qpos[:], data.qvel[:] = envs.qpos[i].double().numpy(), envs.qvel[i].double().numpy()
    data.qacc_warmstart[:] = envs.warmstart[i].double().numpy()
    data.xpos[1, 0] = envs.x_before[i].item()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_steps_match_gymnasium(env_id, monkeypatch):
    """Random actions (some outside the action space, which both clip) from the same states: FREE_STEPS env steps
    from the same reset states, then SYNCED_STEPS with gymnasium's env set to the world's state before each; the time
    limit reached in each world at another step, episodes ended and reset in the same step. Observations and rewards
    agree within TOLERANCE, terminations and truncations exactly, and a reset world's first observation is
    gymnasium's at that state."""
    envs = make_envs(env_id, WORLDS, monkeypatch)
    limit = load_script(NAME).MAX_EPISODE_STEPS
    envs.elapsed.copy_(limit - 3 - 4 * torch.arange(WORLDS, dtype=torch.int32))  # the limit at steps 3, 7, 11, 15
    copies = gymnasium_envs(envs, env_id)
    rng, errors, ends = np.random.default_rng(1), {"free": [0.0, 0.0], "one": [0.0, 0.0]}, [0, 0]
    for t in range(FREE_STEPS + SYNCED_STEPS):
        regime = "free" if t < FREE_STEPS else "one"
        for i, env in enumerate(copies):
            if regime == "one":
                synchronize(env, envs, i)
        actions = rng.uniform(-1.2, 1.2, size=(WORLDS, envs.n_act)).astype(np.float32)
        next_obs, final_obs, reward, terminated, truncated = envs.step_raw(torch.as_tensor(actions))
        for i, env in enumerate(copies):
            obs, r, term, trunc, _ = env.step(np.clip(actions[i], -1, 1))
            errors[regime][0] = max(errors[regime][0], np.abs(final_obs[i].numpy() - obs).max())
            errors[regime][1] = max(errors[regime][1], abs(reward[i].item() - r))
            assert (term, trunc) == (bool(terminated[i]), bool(truncated[i])), (t, i)
            if term or trunc:
                ends[trunc] += 1
                env.reset()
                restart(env, envs, i)
                assert np.array_equal(next_obs[i].numpy(), env.unwrapped._get_obs().astype(np.float32))
            else:
                assert torch.equal(next_obs[i], final_obs[i])
    for regime, (obs_error, reward_error) in errors.items():
        obs_tolerance, reward_tolerance = TOLERANCE[env_id][regime]
        assert obs_error <= obs_tolerance and reward_error <= reward_tolerance, (regime, obs_error, reward_error)
    if env_id in ("Hopper-v5", "Walker2d-v5"):
        assert ends[0] > 0 and ends[1] > 0  # random actions make them fall, some worlds first met the time limit
    else:  # each world met the time limit (and an Ant can leave its healthy range)
        assert ends[1] == WORLDS and (ends[0] == 0 or env_id == "Ant-v5")
    assert not envs.data.overflow.numpy().any()  # no world ran out of room for contacts or constraints


def test_ant_from_its_state(monkeypatch):
    """The real Ant (pyramidal friction cone): gymnasium's env, put in the state a step leaves a world in (positions,
    velocities, contact forces; before the world resets), computes the world's observation, reward and termination.
    World 0 starts above the healthy range and ends at once."""
    envs = make_envs("Ant-v5", WORLDS, monkeypatch, cone=False)
    envs.qpos[0, 2] = 1.2
    reset, ended = envs.reset, {}

    def recording_reset(mask):  # the state each world ended its step in, before it resets
        ended.update(qpos=envs.qpos.clone(), qvel=envs.qvel.clone())
        reset(mask)

    monkeypatch.setattr(envs, "reset", recording_reset)
    env, rng, contacts, terminations = gym.make("Ant-v5").unwrapped, np.random.default_rng(2), 0, 0
    env.reset(seed=0)
    for _ in range(25):
        actions = rng.uniform(-1.2, 1.2, size=(WORLDS, envs.n_act)).astype(np.float32)
        x_before = envs.x_before.clone()
        _, final_obs, reward, terminated, _ = envs.step_raw(torch.as_tensor(actions))
        for i in range(WORLDS):
            data = env.data
            data.qpos[:], data.qvel[:] = ended["qpos"][i].double().numpy(), ended["qvel"][i].double().numpy()
            data.cfrc_ext[:] = envs.cfrc_ext[i].double().numpy()
            contacts += np.abs(data.cfrc_ext).max() > 0
            np.testing.assert_allclose(final_obs[i].numpy(), env._get_obs(), atol=1e-6)
            x_velocity = (envs.xpos[i, 1, 0].item() - x_before[i].item()) / env.dt
            expected, _ = env._get_rew(x_velocity, np.clip(actions[i], -1, 1))
            assert reward[i].item() == pytest.approx(expected, abs=1e-5)
            assert bool(terminated[i]) == (not env.is_healthy)
            terminations += bool(terminated[i])
    assert contacts > WORLDS and terminations > 0  # contact forces and an end were among what was checked


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reset_distribution(env_id, monkeypatch):
    """gymnasium's reset_model: qpos0 plus U(-s, s) on every position, velocities s * N(0, 1) (HalfCheetah, Ant) or
    U(-s, s) (Hopper, Walker2d); the bounds held, the means and standard deviations within 5 standard errors; the
    solver's warm start cleared and the forward reward's start at the new x position; 256 worlds reset 10 times."""
    worlds, resets = 256, 10
    envs = make_envs(env_id, worlds, monkeypatch)
    reference = gym.make(env_id).unwrapped
    s, normal = reference._reset_noise_scale, env_id in ("HalfCheetah-v5", "Ant-v5")
    everyone, qpos, qvel = torch.ones(worlds, dtype=torch.bool), [], []
    for _ in range(resets):
        envs.warmstart.fill_(1.0)
        envs.reset(everyone)
        qpos.append(envs.qpos.double() - torch.as_tensor(reference.init_qpos))
        qvel.append(envs.qvel.double())
        assert not envs.warmstart.any() and torch.equal(envs.x_before, envs.qpos[:, 0])
    qpos, qvel, n = torch.cat(qpos), torch.cat(qvel), worlds * resets
    assert qpos.abs().max() <= s + 1e-6  # and float32's rounding of qpos0 + noise
    for noise, std in ((qpos, s / 3**0.5), (qvel, s if normal else s / 3**0.5)):
        assert (noise.mean(0).abs() < 5 * std / n**0.5).all()
        assert ((noise.std(0) - std).abs() < 5 * std / (2 * n) ** 0.5).all()
    if not normal:
        assert qvel.abs().max() <= s * (1 + 1e-6)


def test_normalization_is_gymnasiums(monkeypatch):
    """step's observations and rewards are step_raw's through gymnasium's RunningMeanStd (vector NormalizeObservation:
    the batch of next observations; vector NormalizeReward in same-step mode: discounted returns cut by terminations,
    restarted after every end), clipped to [-10, 10]; the final observation normalised as the next ones."""
    envs = make_envs("Hopper-v5", WORLDS, monkeypatch)
    script, raw = load_script(NAME), {}
    step_raw = script.Envs.step_raw

    def recording(self, action):
        raw["out"] = [x.clone() for x in step_raw(self, action)]
        return raw["out"]

    monkeypatch.setattr(script.Envs, "step_raw", recording)
    obs_rms, return_rms = RunningMeanStd(shape=envs.obs.shape[1:]), RunningMeanStd(shape=())
    obs_rms.update(envs.observe(fresh=torch.ones(WORLDS, dtype=torch.bool)).double().numpy())
    accumulated, ends = np.zeros(WORLDS), 0
    for _ in range(30):
        obs, reward, done, final_obs, bootstrapped = envs.step(torch.rand(WORLDS, envs.n_act) * 2 - 1)
        raw_obs, raw_final, raw_reward, terminated, truncated = (x.double().numpy() for x in raw["out"])
        obs_rms.update(raw_obs)
        scale = np.sqrt(obs_rms.var + 1e-8)
        np.testing.assert_allclose(obs.numpy(), np.clip((raw_obs - obs_rms.mean) / scale, -10, 10), atol=1e-5)
        np.testing.assert_allclose(final_obs.numpy(), np.clip((raw_final - obs_rms.mean) / scale, -10, 10), atol=1e-5)
        accumulated = accumulated * 0.99 * (1 - terminated) + raw_reward
        return_rms.update(accumulated)
        expected = np.clip(raw_reward / np.sqrt(return_rms.var + 1e-8), -10, 10)
        np.testing.assert_allclose(reward.numpy(), expected, rtol=1e-5, atol=1e-6)
        accumulated[(terminated + truncated) > 0] = 0
        assert np.array_equal(done.numpy(), (terminated + truncated) > 0)
        assert np.array_equal(bootstrapped.numpy(), (truncated > 0) & (terminated == 0))
        ends += int(done.sum())
    assert ends > 0


def test_the_envs_are_one_stamped_block():
    """The envs the tests above check in the baseline are every MuJoCo Warp script's, word for word: one block
    stamped from the baseline (test_contract checks each copy); the PPO twin's normalising step is the baseline's.
    Only simulate differs, in the twins: there Warp's physics joins torch's capture of a rollout on CUDA."""
    for name in (NAME, FAST, "td3_gpu_mujoco", "td3_gpu_mujoco_torchcompile", "sac_gpu_mujoco",
                 "sac_gpu_mujoco_torchcompile"):  # fmt: skip
        assert "\n# ======== MuJoCo Warp envs:" in (SCRIPTS / f"{name}.py").read_text(), name
    base, fast = load_script(NAME), load_script(FAST)
    assert inspect.getsource(base.Envs.step) == inspect.getsource(fast.Envs.step)
    assert inspect.getsource(base.Envs.simulate) != inspect.getsource(fast.Envs.simulate)


# ---- the scripts


def tiny(env_id="HalfCheetah-v5", iterations=ITERATIONS):
    return ["--env-id", env_id, *TINY, "--total-timesteps", str(iterations * 4 * 8)]


@pytest.mark.parametrize(
    "name, phases, steps_per_call",
    # The baseline steps every env in each env_step call; the twin's collect (policy included) takes a rollout.
    [(NAME, PHASES, 4), (FAST, tuple(p for p in PHASES if p != "policy"), 4 * 8)],
    ids=[NAME, FAST],
)
def test_iterations_with_profile(name, phases, steps_per_call, tmp_path, monkeypatch, capsys):
    """Hopper, whose random episodes end within a rollout: the run reaches its fps window, logs a mean return each
    iteration, and --profile-dir traces every phase."""
    monkeypatch.setattr(helpers, "PHASES", phases)
    record = run_main(name, tiny("Hopper-v5") + ["--profile-dir", str(tmp_path / "profile")], capsys)
    assert_steady(record, ITERATIONS * 4 * 8)
    assert_return_curve(record)
    assert 0 < record["episodic_return"] < 100  # random Hopper episodes: about 20 steps, about 1 a step
    assert_trace_phases(tmp_path / "profile", name, env_steps_per_call=steps_per_call)


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
        if self.signal is None and step >= at_step:
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


def assert_equal(a, b, where="state"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


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

    def recording_step(envs, action, step=script.Envs.step):
        out = step(envs, action)
        seen["ends"].append(torch.stack((out[2].bool(), out[4])))
        return out

    monkeypatch.setattr(script, "Rollout", Recording)
    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    monkeypatch.setattr(script.Envs, "step", recording_step)
    run_main(name, argv, capsys)
    return seen["rollouts"], torch.stack(seen["ends"])


@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_rollout_is_the_baselines(mode, capsys, monkeypatch):
    """With one seed, the twin's first rollout (make_collect; the policy draws with rsample, the baseline's with
    sample: the same numbers) is the baseline loop's slot by slot: observations, actions, log-probabilities, values,
    rewards (with the time-limit bootstrap), done flags; bit for bit in eager mode, to float rounding compiled. GAE
    gets the same inputs in both and gives the same advantages and returns (a scan against the loop: to float
    rounding). The second rollout starts, in both, from the observation and done flags the first ended in."""
    for name in (NAME, FAST):
        monkeypatch.setattr(load_script(name), "MAX_EPISODE_STEPS", 16)
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


# Hopper's sizes (11 observations, 3 actions), TINY's minibatches and rollouts: the compiled functions find the TINY
# runs' graphs in Inductor's cache.
N_OBS, N_ACT, MINIBATCH = 11, 3, 16
make_pair = functools.partial(ppo.make_pair, NAME, FAST, N_OBS, N_ACT)
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
    (["--env-id", "HalfCheetah-v4"], ["HalfCheetah-v4", "HalfCheetah-v5, Hopper-v5, Walker2d-v5, Ant-v5"]),
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
    assert_one_line_error(run_cli(name, "--env-id", "Humanoid-v5"), "Humanoid-v5", "Ant-v5")
