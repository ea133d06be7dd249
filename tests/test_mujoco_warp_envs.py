"""The MuJoCo Warp envs (leanrl/mujoco_warp_envs.py) on the CPU, Warp's CPU device: the batched envs against
gymnasium's v5 envs from the same states and actions (observations, rewards, terminations, truncations, same-step
auto-reset), their reset distributions, the normalisation against gymnasium's; the twins' CapturableEnvs, the envs
every script on MuJoCo Warp makes, and Warp started without its warning that CUDA is missing.

Warp builds its kernels on first use (one to two minutes for the first model on the 2-core CPU, seconds for each
other; cached in ~/.cache/warp), inside the first test that makes envs."""

import subprocess
import sys
import threading

import gymnasium as gym
import mujoco
import numpy as np
import pytest
import torch
from gymnasium.envs.mujoco.humanoid_v5 import mass_center
from gymnasium.wrappers.utils import RunningMeanStd
from helpers import SCRIPTS, load_script

import mujoco_warp_envs
from mujoco_warp_envs import CapturableEnvs, Envs

ENV_IDS = ("HalfCheetah-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5")
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
# - Humanoid-v5, both with Newton (below; 2026-11-27): 1.1e-2 (a contact force of about 2000), 3e-5 in one step;
#   4.2e-5, 2.9e-6 in ten. Over 8 worlds and 40 steps (three action seeds), up to 7.9e-2 and 2.8e-4 in one step and
#   1.4e-2 and 4.8e-5 in ten: each observation difference above 1e-3 a contact force (up to 3700, relative 2e-5), the
#   rest within 1e-4.
# The tolerances are about five times those of this test.
TOLERANCE = {
    "HalfCheetah-v5": {"one": (2e-3, 3e-5), "free": (5e-3, 4e-4)},
    "Hopper-v5": {"one": (1e-5, 5e-6), "free": (5e-5, 5e-6)},
    "Walker2d-v5": {"one": (1e-3, 1e-4), "free": (5e-4, 4e-5)},
    "Ant-v5": {"one": (2e-2, 5e-5), "free": (2e-3, 4e-4)},
    "Humanoid-v5": {"one": (5e-2, 1.5e-4), "free": (2e-4, 1.5e-5)},
}
# Ant's contacts with gymnasium's pyramidal friction cone: MuJoCo Warp puts a capsule's contact with the floor in
# another tangent frame than MuJoCo C, and a pyramidal cone's friction depends on that frame; one MuJoCo step with a
# foot on the floor moves the velocities apart by up to 0.3 (of about 8). With an elliptic cone (which does not
# depend on the frame) they agree to 2e-5, so the physics check runs both with it, and test_ant_from_its_state checks
# the real Ant's observation, reward and termination from the state the batched env reaches.
ELLIPTIC = {"Ant-v5"}
# A reset world's first observation is gymnasium's at its state bit for bit, but Humanoid's inertias and velocities
# about the centre of mass, Warp's float32 kinematics against MuJoCo C's float64 (measured: up to 1.7e-6).
FIRST_OBS_TOLERANCE = {"Humanoid-v5": 1e-5}


def elliptic(model):
    model.opt.cone = mujoco.mjtCone.mjCONE_ELLIPTIC
    return model


def make_envs(env_id, num_envs, monkeypatch, cone=True):
    """The envs on the CPU (with an elliptic cone where ELLIPTIC says, unless cone is False)."""
    if cone and env_id in ELLIPTIC:
        load = mujoco.MjModel.from_xml_path
        monkeypatch.setattr(mujoco.MjModel, "from_xml_path", lambda path: elliptic(load(path)))
    torch.manual_seed(0)
    envs = Envs(env_id, num_envs, 0.99, CPU)
    envs.start()
    return envs


def time_limit(env):
    while not isinstance(env, gym.wrappers.TimeLimit):
        env = env.env
    return env


def gymnasium_envs(envs, env_id, cone=True):
    """gymnasium's own env for each world, reset and set to the world's state (float32 values, in float64)."""
    copies = [gym.make(env_id) for _ in range(envs.num_envs)]
    for i, env in enumerate(copies):
        env.unwrapped.model.opt.solver = mujoco.mjtSolver.mjSOL_NEWTON  # the batched worlds' (Humanoid's model: PGS)
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
    and the x position the forward reward starts from (Ant's: its torso's xpos, from the last step; Humanoid's: its
    centre of mass, which mass_center reads of xipos, moved as a whole to it)."""
    data = env.unwrapped.data
    data.qpos[:], data.qvel[:] = envs.qpos[i].double().numpy(), envs.qvel[i].double().numpy()
    data.qacc_warmstart[:] = envs.warmstart[i].double().numpy()
    data.xpos[1, 0] = envs.x_before[i].item()
    data.xipos[:, 0] += envs.x_before[i].item() - mass_center(env.unwrapped.model, data)[0]


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_steps_match_gymnasium(env_id, monkeypatch):
    """Random actions (some outside the action space, which both clip) from the same states: FREE_STEPS env steps
    from the same reset states, then SYNCED_STEPS with gymnasium's env set to the world's state before each; the time
    limit reached in each world at another step, episodes ended and reset in the same step. Observations and rewards
    agree within TOLERANCE, terminations and truncations exactly, and a reset world's first observation is
    gymnasium's at that state (Humanoid's: within FIRST_OBS_TOLERANCE)."""
    envs = make_envs(env_id, WORLDS, monkeypatch)
    limit = mujoco_warp_envs.MAX_EPISODE_STEPS
    envs.elapsed.copy_(limit - 3 - 4 * torch.arange(WORLDS, dtype=torch.int32))  # the limit at steps 3, 7, 11, 15
    copies, high = gymnasium_envs(envs, env_id), envs.high.numpy()  # Humanoid's actions in [-0.4, 0.4], the others' 1
    rng, errors, ends = np.random.default_rng(1), {"free": [0.0, 0.0], "one": [0.0, 0.0]}, [0, 0]
    for t in range(FREE_STEPS + SYNCED_STEPS):
        regime = "free" if t < FREE_STEPS else "one"
        for i, env in enumerate(copies):
            if regime == "one":
                synchronize(env, envs, i)
        actions = (rng.uniform(-1.2, 1.2, size=(WORLDS, envs.n_act)) * high).astype(np.float32)
        next_obs, final_obs, reward, terminated, truncated = envs.step_raw(torch.as_tensor(actions))
        for i, env in enumerate(copies):
            obs, r, term, trunc, _ = env.step(np.clip(actions[i], -high, high))
            errors[regime][0] = max(errors[regime][0], np.abs(final_obs[i].numpy() - obs).max())
            errors[regime][1] = max(errors[regime][1], abs(reward[i].item() - r))
            assert (term, trunc) == (bool(terminated[i]), bool(truncated[i])), (t, i)
            if term or trunc:
                ends[trunc] += 1
                env.reset()
                restart(env, envs, i)
                first = np.abs(next_obs[i].numpy() - env.unwrapped._get_obs().astype(np.float32)).max()
                assert first <= FIRST_OBS_TOLERANCE.get(env_id, 0.0), (t, i, first)
            else:
                assert torch.equal(next_obs[i], final_obs[i])
    for regime, (obs_error, reward_error) in errors.items():
        obs_tolerance, reward_tolerance = TOLERANCE[env_id][regime]
        assert obs_error <= obs_tolerance and reward_error <= reward_tolerance, (regime, obs_error, reward_error)
    if env_id in ("Hopper-v5", "Walker2d-v5", "Humanoid-v5"):
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
    U(-s, s) (Hopper, Walker2d, Humanoid); the bounds held, the means and standard deviations within 5 standard
    errors; the solver's warm start cleared and the forward reward's start at the new x position (Humanoid's: its
    centre of mass, gymnasium's mass_center at that state); 256 worlds reset 10 times."""
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
        assert not envs.warmstart.any()
        if env_id != "Humanoid-v5":
            assert torch.equal(envs.x_before, envs.qpos[:, 0])
    if env_id == "Humanoid-v5":
        for i in range(worlds):
            reference.set_state(envs.qpos[i].double().numpy(), envs.qvel[i].double().numpy())
            assert envs.x_before[i].item() == pytest.approx(mass_center(reference.model, reference.data)[0], abs=1e-6)
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
    raw, step_raw = {}, Envs.step_raw

    def recording(self, action):
        raw["out"] = [x.clone() for x in step_raw(self, action)]
        return raw["out"]

    monkeypatch.setattr(Envs, "step_raw", recording)
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


def test_capturable_envs_step_as_envs():
    """Where torch is not capturing (here: no CUDA), the twins' CapturableEnvs steps as Envs does, bit for bit: 40
    Hopper steps of random actions, episodes ended and reset among them."""
    steps = []
    for make in (Envs, CapturableEnvs):
        torch.manual_seed(0)
        envs = make("Hopper-v5", WORLDS, 0.99, CPU)
        envs.start()
        actions = torch.rand(40, WORLDS, envs.n_act) * 2 - 1
        steps.append([torch.cat([x.double().flatten() for x in envs.step(action)]) for action in actions])
        assert envs.ended_episodes()[0] > 0
    for step, (ours, theirs) in enumerate(zip(*steps, strict=True)):
        assert torch.equal(ours, theirs), step


@pytest.mark.parametrize("env_id", ["Ant-v5", "Humanoid-v5"])
def test_load_kernels_loads_every_module_the_physics_launches(env_id, monkeypatch):
    """load_kernels' dry run finds every Warp module an env's physics launches (Ant: its contact forces; Humanoid:
    the kinematics call too) and hands those alone to Warp's loader: after it the physics loads no module, and the
    modules loaded are the ones the physics then launches. Warp's launch functions are its own again afterwards. The
    loader's calls (one a block size) run at once: each waits here until another has started."""
    warp_context = mujoco_warp_envs.wp._src.context
    envs = Envs(env_id, WORLDS, 0.99, CPU)
    envs.start()  # its own builds done before the modules are unloaded
    calls = [envs.mujoco_steps] + [envs.kinematics] * envs.task.com_obs
    for module in warp_context.user_modules.values():
        module.unload()
    wp, forced, force_load = mujoco_warp_envs.wp, set(), mujoco_warp_envs.wp.force_load
    block_sizes, together = set(), threading.Barrier(2, timeout=120)

    def noted_force_load(device, modules, block_dim, **kwargs):
        block_sizes.add(block_dim)
        together.wait()  # broken (an error) when the calls come one after another
        forced.update(module.name for module in modules)
        return force_load(device, modules=modules, block_dim=block_dim, **kwargs)

    launches = wp.launch, wp.launch_tiled, wp.capture_while, wp.capture_if
    monkeypatch.setattr(wp, "force_load", noted_force_load)
    for build in mujoco_warp_envs.load_kernels(calls):
        build.result()
    assert (wp.launch, wp.launch_tiled, wp.capture_while, wp.capture_if) == launches
    loaded = {name for name, module in warp_context.user_modules.items() if module.execs}
    assert len(loaded) > 10  # the physics' own modules and the model's specialised kernels
    assert len(block_sizes) == 4  # Warp's default and the tiled kernels' 32, 64 and 128 threads

    launched, load = set(), warp_context.Module.load

    def noted_load(module, *args, **kwargs):
        launched.add(module.name)
        assert module.execs, f"{module.name} was not loaded by load_kernels"
        return load(module, *args, **kwargs)

    monkeypatch.setattr(warp_context.Module, "load", noted_load)
    for call in calls:
        call()
    assert launched == loaded == forced  # each found by the dry run, none loaded by a kernel run in it


def test_envs_return_while_warp_builds(monkeypatch):
    """Envs() returns while Warp's loader builds the kernels, so that the caller's own work (a twin's compile) runs
    meanwhile; start() waits for the builds, then resets every env and takes the observation statistics' first
    sample; a build's error is raised by start(). Here each build waits until the test lets it go."""
    go, failing, force_load = threading.Event(), [], mujoco_warp_envs.wp.force_load

    def held_force_load(device, modules, block_dim, **kwargs):
        assert go.wait(timeout=120)
        if failing:
            raise RuntimeError("NVRTC failed")
        return force_load(device, modules=modules, block_dim=block_dim, **kwargs)

    monkeypatch.setattr(mujoco_warp_envs.wp, "force_load", held_force_load)
    envs = Envs("Hopper-v5", WORLDS, 0.99, CPU)
    assert envs.builds and not any(build.done() for build in envs.builds)
    assert envs.n_obs == 11 and float(envs.obs_rms.count) < 1  # nothing observed yet
    go.set()
    envs.start()
    assert float(envs.obs_rms.count) > WORLDS - 1 and torch.equal(envs.elapsed, torch.zeros_like(envs.elapsed))
    first = envs.observe(fresh=torch.ones(WORLDS, dtype=torch.bool))
    torch.testing.assert_close(envs.obs, envs.obs_rms.normalize(first))
    failing.append(True)
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        Envs("Hopper-v5", WORLDS, 0.99, CPU).start()


@pytest.mark.parametrize("name", ["ppo_continuous_action_gpu_mujoco", "td3_gpu_mujoco", "sac_gpu_mujoco"])
def test_every_script_on_mujoco_warp_makes_these_envs(name):
    """The envs checked here are the scripts': each baseline makes Envs, each twin CapturableEnvs, from the module."""
    for script, envs in ((name, Envs), (f"{name}_torchcompile", CapturableEnvs)):
        assert "from mujoco_warp_envs import" in (SCRIPTS / f"{script}.py").read_text(), script
        assert getattr(load_script(script), envs.__name__) is envs, script
        assert load_script(script).ENVS is mujoco_warp_envs.ENVS, script


@pytest.mark.parametrize("env_id", mujoco_warp_envs.ENVS)
def test_videos_follow_the_body(env_id, tmp_path):
    """--eval-checkpoint --capture-video's env renders through the model's camera that tracks the body (gymnasium's
    default free camera stays where the episode started: a trained walker leaves its frame within seconds)."""
    env = mujoco_warp_envs.gymnasium_env(env_id, str(tmp_path / "videos"))
    model = env.unwrapped.model
    assert env.unwrapped.mujoco_renderer.camera_id == mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, "track")
    assert model.cam_mode[env.unwrapped.mujoco_renderer.camera_id] == mujoco.mjtCamLight.mjCAMLIGHT_TRACKCOM
    env.close()


# Warp's warning, then a line of its own, written to stderr's file descriptor as Warp's C library writes; then Warp
# started in a process of its own (where it starts once), on a machine without CUDA here.
QUIET_START = """
import os, torch, mujoco_warp_envs as m
with m.stderr_without(m.NO_CUDA_DRIVER):
    os.write(2, (m.NO_CUDA_DRIVER + ". GPU execution will not be available.\\nanother line\\n").encode())
m.start_warp(torch.device("cpu"))
"""


def test_warp_starts_without_its_cuda_warning():
    """Warp's C library warns on stderr that it finds no CUDA driver where there is none, on every run on a CPU:
    start_warp leaves that line out, and keeps any other that is written meanwhile."""
    proc = subprocess.run([sys.executable, "-c", QUIET_START], capture_output=True, text=True, cwd=SCRIPTS, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "another line\n"
