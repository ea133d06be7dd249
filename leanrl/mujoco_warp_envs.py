"""gymnasium's MuJoCo locomotion envs (v5: HalfCheetah, Hopper, Walker2d, Ant, Humanoid) as N batched MuJoCo Warp
worlds on the device that torch uses, with gymnasium's time limit, same-step auto-reset and CleanRL's wrappers
(docs/gpu_mujoco.md). The scripts on MuJoCo Warp import it as they import gymnasium:

    envs = Envs(env_id, num_envs, gamma, device)  # the twins: CapturableEnvs, whose physics joins torch's CUDA graphs
    envs.start()  # the first reset, once Warp's kernels, which build from Envs(), are built
    next_obs, reward, done, final_obs, bootstrapped = envs.step(action)  # normalised, as PPO trains on them
    next_obs, final_obs, reward, terminated, truncated = envs.step_raw(action)  # raw; envs.obs_rms to normalise
    env = gymnasium_env(env_id, video_folder)  # --eval-checkpoint's: gymnasium's own, which renders videos
"""

import math
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from unittest.mock import patch

import gymnasium as gym
import mujoco
import mujoco_warp as mjw
import torch
import warp as wp

from harness import fail

# gymnasium's TimeLimit of its MuJoCo envs, and the clip of normalised observations and rewards (CleanRL's wrappers).
MAX_EPISODE_STEPS, NORMALIZED_CLIP = 1000, 10.0
# What Warp's C library prints as it starts on a machine without CUDA: on every run on a CPU, and no help there.
NO_CUDA_DRIVER = "Warp CUDA warning: Could not find or load the NVIDIA CUDA driver"


class HalfCheetah:
    """gymnasium's HalfCheetah-v5 with its defaults (as each class below, from gymnasium's v5 sources): reward the x
    velocity - 0.1 * sum(a^2), no termination, observation qpos[1:] and qvel, reset noise U(-0.1, 0.1) on positions
    and 0.1 * N(0, 1) on velocities."""

    xml, frame_skip, noise, normal_qvel, ctrl_cost = "half_cheetah.xml", 5, 0.1, True, 0.1
    healthy_reward, skipped_qpos, qvel_clip, contact_forces = 0.0, 1, math.inf, False
    forward_weight, com_obs = 1.0, False
    nconmax = njmax = None  # MuJoCo Warp's defaults

    @staticmethod
    def healthy(qpos, qvel):
        return torch.ones_like(qpos[:, 0], dtype=torch.bool)

    @staticmethod
    def x(envs):
        """The x position whose velocity the reward pays."""
        return envs.qpos[:, 0]


class Hopper(HalfCheetah):
    """Hopper-v5: + 1 while healthy, which it must stay; velocities clipped to 10 in the observation."""

    xml, frame_skip, noise, normal_qvel, ctrl_cost = "hopper.xml", 4, 5e-3, False, 1e-3
    healthy_reward, qvel_clip = 1.0, 10.0

    @staticmethod
    def healthy(qpos, qvel):
        state, z, angle = torch.cat((qpos[:, 2:], qvel), 1), qpos[:, 1], qpos[:, 2]
        return (state.abs() < 100).all(1) & (z > 0.7) & (angle > -0.2) & (angle < 0.2)


class Walker2d(Hopper):
    """Walker2d-v5: Hopper's reward, healthy while 0.8 < z < 2 and the torso's angle is within (-1, 1)."""

    xml = "walker2d_v5.xml"

    @staticmethod
    def healthy(qpos, qvel):
        z, angle = qpos[:, 1], qpos[:, 2]
        return (z > 0.8) & (z < 2.0) & (angle > -1.0) & (angle < 1.0)


class Ant(HalfCheetah):
    """Ant-v5: its torso's x velocity + 1 while healthy - 0.5 * sum(a^2) - 5e-4 * the sum of the squared external
    contact forces (cfrc_ext) clipped to [-1, 1], which the observation holds too (105 values)."""

    xml, ctrl_cost, contact_cost, healthy_reward, skipped_qpos, contact_forces = "ant.xml", 0.5, 5e-4, 1, 2, True
    force_clip, max_contact_cost = 1.0, math.inf

    @staticmethod
    def healthy(qpos, qvel):
        finite = torch.isfinite(qpos).all(1) & torch.isfinite(qvel).all(1)
        return finite & (qpos[:, 2] >= 0.2) & (qpos[:, 2] <= 1.0)

    @staticmethod
    def x(envs):
        return envs.xpos[:, 1, 0]  # the torso's


class Humanoid(Ant):
    """Humanoid-v5: 1.25 * the x velocity of its centre of mass + 5 while healthy - 0.1 * sum(a^2) - 5e-7 * the sum of
    the squared external contact forces (cfrc_ext), that cost capped at 10; healthy while 1 < z < 2. Observation
    (348 values): qpos[2:], qvel, cinert[1:], cvel[1:], qfrc_actuator[6:], cfrc_ext[1:], none clipped. Reset noise
    U(-0.01, 0.01) on positions and velocities. gymnasium's model asks for MuJoCo's PGS solver, which MuJoCo Warp
    lacks: the worlds run Newton (docs/gpu_mujoco.md: what that changes on gymnasium's own Humanoid)."""

    xml, noise, normal_qvel, ctrl_cost, contact_cost, healthy_reward = "humanoid.xml", 1e-2, False, 0.1, 5e-7, 5.0
    forward_weight, force_clip, max_contact_cost, com_obs = 1.25, math.inf, 10.0, True
    # Contacts and constraint rows a world holds: at most 7 and 15 at any MuJoCo step, measured over about 3,000
    # episodes of the batched worlds on the CPU under random actions (gymnasium's Humanoid with Newton: 6 and 12 over
    # 30 episodes); about four times those.
    nconmax, njmax = 32, 64

    @staticmethod
    def healthy(qpos, qvel):
        return (qpos[:, 2] > 1.0) & (qpos[:, 2] < 2.0)

    @staticmethod
    def x(envs):
        return envs.xipos[:, :, 0] @ envs.mass_share  # gymnasium's mass_center: the bodies' masses over their xipos


ENVS = {
    "HalfCheetah-v5": HalfCheetah,
    "Hopper-v5": Hopper,
    "Walker2d-v5": Walker2d,
    "Ant-v5": Ant,
    "Humanoid-v5": Humanoid,
}


class RunningMeanStd:
    """gymnasium's RunningMeanStd (of its normalisation wrappers) on the device in float64, updated in place."""

    def __init__(self, shape, device):
        self.mean = torch.zeros(shape, dtype=torch.float64, device=device)
        self.var = torch.ones(shape, dtype=torch.float64, device=device)
        self.count = torch.full((), 1e-4, dtype=torch.float64, device=device)

    def update(self, x):
        x, n = x.double(), x.shape[0]
        delta, total = x.mean(0) - self.mean, self.count + n
        self.var.copy_((self.var * self.count + x.var(0, correction=0) * n + delta**2 * self.count * n / total) / total)
        self.mean.add_(delta * n / total)
        self.count.copy_(total)

    def normalize(self, x, center=True):
        return ((x - self.mean * center) / torch.sqrt(self.var + 1e-8)).clamp(-NORMALIZED_CLIP, NORMALIZED_CLIP).float()


def saved_obs_rms(envs_state, device):
    """The observation statistics of a checkpoint's envs (Envs.state), for an evaluation that keeps them frozen."""
    obs_rms = RunningMeanStd(envs_state["obs_mean"].shape, device)
    for key in ("mean", "var", "count"):
        getattr(obs_rms, key).copy_(envs_state[f"obs_{key}"])
    return obs_rms


def gymnasium_env(env_id, video_folder=None):
    """gymnasium's own env of env_id with RecordEpisodeStatistics, on which --eval-checkpoint plays the saved policy
    (MuJoCo's C simulator, which the batched worlds reproduce). The Warp worlds render nothing; this env does: with a
    video_folder, RecordVideo records every episode there as the gymnasium-based scripts do (rl-video-episode-N.mp4),
    through the model's camera that follows the body (gymnasium's default camera stays put, and a walker leaves it)."""
    env = gym.make(env_id, **({"render_mode": "rgb_array", "camera_name": "track"} if video_folder else {}))
    if video_folder:
        env = gym.wrappers.RecordVideo(env, video_folder, episode_trigger=lambda episode: True, disable_logger=True)
    return gym.wrappers.RecordEpisodeStatistics(env)


@contextmanager
def stderr_without(prefix):
    """What is written to stderr's file descriptor meanwhile (C libraries' output too), less the lines that start with
    prefix."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as written:
        os.dup2(written.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            written.seek(0)
            lines = written.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith(prefix)))
            sys.stderr.flush()


def start_warp(device):
    """Warp on torch's device, without a line per kernel module it loads or its warning that CUDA is missing."""
    wp.config.log_level = wp.LOG_WARNING
    with stderr_without(NO_CUDA_DRIVER):
        wp.init()
    # torch's current CUDA device by its index (under torchrun each rank's own): Warp's "cuda" is that of whatever
    # CUDA context is current on the thread
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    wp.set_device(str(device))


def load_kernels(calls):
    """Start building (or loading from Warp's cache) every kernel module that `calls` launch, many at once; returns
    the builds' futures. Warp loads a module when one of its kernels first launches, so a first step builds its
    40-odd modules one after another; here a dry run of the calls, with Warp's launches only noted and each of its
    conditional blocks run once, finds them, and Warp's loader builds them on parallel threads (its compilers run
    outside Python's lock). The loader takes one block size a call; the calls run at once, or each size's modules
    would wait for the slowest module of the size before (Humanoid's cold build on an H200: 22 s so, 35 s one size
    after another). The process's own thread goes on meanwhile: the twins compile torch's code while Warp builds."""
    launched = {}  # block_dim -> {module name: module}

    def note(kernel, dim, *args, block_dim=None, **kwargs):
        if math.prod(dim if isinstance(dim, (tuple, list)) else [dim]) > 0:  # Warp loads nothing for an empty launch
            launched.setdefault(block_dim, {})[kernel.module.name] = kernel.module

    def body_once(condition, while_body, stream=None, **kwargs):
        while_body(**kwargs)

    def both_branches(condition, on_true=None, on_false=None, stream=None, **kwargs):
        for branch in (on_true, on_false):
            if branch is not None:
                branch(**kwargs)

    with patch.multiple(wp, launch=note, launch_tiled=note, capture_while=body_once, capture_if=both_branches):
        for call in calls:
            call()
    device = wp.get_device()
    sizes = ThreadPoolExecutor(len(launched))
    builds = [sizes.submit(wp.force_load, device, modules=list(modules.values()), block_dim=block_dim,
                           max_workers=os.cpu_count()) for block_dim, modules in launched.items()]  # fmt: skip
    sizes.shutdown(wait=False)
    return builds


class Envs:
    """num_envs copies of one of ENVS as MuJoCo Warp worlds on torch's device, whose arrays torch reads and writes in
    place (wp.to_torch: no copy), with gymnasium's time limit and same-step auto-reset, and CleanRL's wrappers as
    gymnasium's vector ones: actions clipped; observations and rewards normalised with statistics of all envs, then
    clipped. The envs' returns and lengths are summed on the device until ended_episodes() reads them. `state`: the
    tensors the envs go on from, for checkpoints. Warp's kernels build on threads from the envs' making until
    start(), the first reset, which comes before any step."""

    def __init__(self, env_id, num_envs, gamma, device):
        self.task, self.num_envs, self.gamma = ENVS[env_id], num_envs, gamma
        assets = os.path.join(os.path.dirname(gym.__file__), "envs", "mujoco", "assets")
        mjm = mujoco.MjModel.from_xml_path(os.path.join(assets, self.task.xml))  # gymnasium's own model file
        mjm.opt.solver = mujoco.mjtSolver.mjSOL_NEWTON  # MuJoCo Warp has no PGS, Humanoid's; the others' already
        self.dt, self.n_act, self.graphs = mjm.opt.timestep * self.task.frame_skip, mjm.nu, {}
        start_warp(device)
        try:
            self.model = mjw.put_model(mjm)
            self.data = mjw.make_data(mjm, nworld=num_envs, nconmax=self.task.nconmax, njmax=self.task.njmax)
        except (ValueError, RuntimeError) as e:  # too many worlds for an array, or for the memory
            fail(f"--num-envs {num_envs}: MuJoCo Warp cannot make that many worlds here: {str(e).splitlines()[0]}")
        names = "qpos", "qvel", "qacc_warmstart", "ctrl", "xpos", "xipos", "cinert", "cvel", "qfrc_actuator", "cfrc_ext"
        views = [wp.to_torch(getattr(self.data, name)) for name in names]
        self.qpos, self.qvel, self.warmstart, self.ctrl, self.xpos, self.xipos = views[:6]
        self.cinert, self.cvel, self.qfrc_actuator, self.cfrc_ext = views[6:]
        self.qpos0 = torch.as_tensor(mjm.qpos0, device=device).float()
        self.mass_share = torch.as_tensor(mjm.body_mass / mjm.body_mass.sum(), device=device).float()
        self.low, self.high = torch.as_tensor(mjm.actuator_ctrlrange, device=device).float().unbind(1)
        self.n_obs = self.observe().shape[1]
        zeros = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.x_before, self.episode_return, self.ended = zeros(num_envs), zeros(num_envs), zeros(3, num_envs)
        self.elapsed, self.discounted_return = zeros(num_envs, dtype=torch.int32), zeros(num_envs, dtype=torch.float64)
        self.obs_rms, self.return_rms = RunningMeanStd(self.n_obs, device), RunningMeanStd((), device)
        self.obs, self.done = zeros(num_envs, self.n_obs), zeros(num_envs)
        names = "qpos", "qvel", "warmstart", "x_before", "elapsed", "episode_return", "discounted_return", "obs", "done"
        self.state = {name: getattr(self, name) for name in names}
        for name, rms in (("obs", self.obs_rms), ("return", self.return_rms)):
            self.state.update({f"{name}_{key}": value for key, value in vars(rms).items()})
        # The kernels build (or load from Warp's cache) on threads from here, all at once, until start().
        self.physics_calls = ["mujoco_steps"] + ["kinematics"] * self.task.com_obs
        self.builds = load_kernels([getattr(self, physics) for physics in self.physics_calls])

    def start(self):
        """The envs' first reset, of every env, after Warp's kernels are built (on CUDA each Warp call of the envs is
        then one Warp graph); the observation statistics start from its observations."""
        for build in self.builds:
            build.result()  # a build's error, raised here
        for physics in self.physics_calls:
            if self.qpos.is_cuda:
                with wp.ScopedCapture() as capture:
                    getattr(self, physics)()
                self.graphs[physics] = capture.graph
            else:
                getattr(self, physics)()
        wp.synchronize_device()
        everyone = torch.ones(self.num_envs, dtype=torch.bool, device=self.qpos.device)
        self.reset(everyone)
        raw_obs = self.observe(fresh=everyone)
        self.obs_rms.update(raw_obs)
        self.obs.copy_(self.obs_rms.normalize(raw_obs))

    def mujoco_steps(self):
        """gymnasium's do_simulation: frame_skip MuJoCo steps, and Ant's contact forces (mj_rnePostConstraint)."""
        for _ in range(self.task.frame_skip):
            mjw.step(self.model, self.data)
        if self.task.contact_forces:
            mjw.rne_postconstraint(self.model, self.data)

    def kinematics(self):
        """What Humanoid's observation and reward read of gymnasium's mj_forward after a reset: the bodies' positions,
        inertias and velocities (xipos, cinert, cvel)."""
        mjw.fwd_kinematics(self.model, self.data)
        mjw.com_vel(self.model, self.data)

    def simulate(self, physics="mujoco_steps"):
        """A Warp call of the envs (mujoco_steps or kinematics); on CUDA, its Warp graph launched on torch's current
        stream."""
        if not self.graphs:
            return getattr(self, physics)()
        wp.capture_launch(self.graphs[physics], stream=wp.stream_from_torch(torch.cuda.current_stream()))

    def observe(self, fresh=None):
        """gymnasium's _get_obs; no actuator or contact forces where an episode has just reset, `fresh` (mj_resetData
        zeroes the controls and the contact forces, and mj_forward leaves the latter)."""
        task = self.task
        parts = [self.qpos[:, task.skipped_qpos :], self.qvel.clamp(-task.qvel_clip, task.qvel_clip)]
        forces = []
        if task.com_obs:
            parts += [self.cinert[:, 1:].flatten(1), self.cvel[:, 1:].flatten(1)]
            forces.append(self.qfrc_actuator[:, 6:])
        if task.contact_forces:
            forces.append(self.cfrc_ext[:, 1:].clamp(-task.force_clip, task.force_clip).flatten(1))
        if fresh is not None:
            forces = [torch.where(fresh[:, None], 0.0, force) for force in forces]
        return torch.cat(parts + forces, 1)

    def reset(self, mask):
        """gymnasium's reset of the envs in mask: qpos0 and zero velocities plus the noise, the solver's warm start
        cleared (mj_resetData). Noise is drawn for every env: the same random stream whichever reset."""
        task = self.task
        qpos = self.qpos0 + (torch.rand_like(self.qpos) * 2 - 1) * task.noise
        qvel = torch.randn_like(self.qvel) if task.normal_qvel else torch.rand_like(self.qvel) * 2 - 1
        self.qpos.copy_(torch.where(mask[:, None], qpos, self.qpos))
        self.qvel.copy_(torch.where(mask[:, None], qvel * task.noise, self.qvel))
        self.warmstart.masked_fill_(mask[:, None], 0.0)
        if task.com_obs:  # in every world: a step's own mj_forward overwrites what it computes
            self.simulate("kinematics")
        x = task.x(self) if task.com_obs else self.qpos[:, 0]  # Ant's torso: at its free joint's qpos
        self.x_before.copy_(torch.where(mask, x, self.x_before))

    def step_raw(self, action):
        """gymnasium's vector env of these envs with ClipAction, the time limit and RecordEpisodeStatistics: (next
        observation, final observation, reward, terminated, truncated); the next observation is the first of a new
        episode where the step ended one, the final the one it ended in."""
        task, action = self.task, torch.clamp(action, self.low, self.high)
        self.ctrl.copy_(action)
        self.simulate()
        # Ant's and Humanoid's x from the bodies' positions: as of the last MuJoCo step's start (RK4: its last stage).
        x_after, healthy = task.x(self), task.healthy(self.qpos, self.qvel)
        reward = task.forward_weight * (x_after - self.x_before) / self.dt + task.healthy_reward * healthy
        reward -= task.ctrl_cost * action.square().sum(1)
        if task.contact_forces:
            forces = self.cfrc_ext.clamp(-task.force_clip, task.force_clip)
            reward -= (task.contact_cost * forces.square().sum((1, 2))).clamp(max=task.max_contact_cost)
        self.elapsed += 1
        terminated, truncated = ~healthy, self.elapsed >= MAX_EPISODE_STEPS
        done, final_obs = terminated | truncated, self.observe()
        self.x_before.copy_(x_after)
        self.reset(done)
        self.episode_return += reward
        self.ended += torch.stack((done.float(), self.episode_return, self.elapsed.float())) * done
        self.elapsed.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return torch.where(done[:, None], self.observe(fresh=done), final_obs), final_obs, reward, terminated, truncated

    def step(self, action):
        """step_raw through gymnasium's vector NormalizeObservation and NormalizeReward (same-step auto-reset) and the
        clips: (next observation, reward, done, final observation, truncated and not terminated), normalised."""
        raw_obs, final_obs, reward, terminated, truncated = self.step_raw(action)
        self.obs_rms.update(raw_obs)
        self.obs.copy_(self.obs_rms.normalize(raw_obs))
        self.discounted_return.copy_(self.discounted_return * self.gamma * ~terminated + reward)
        self.return_rms.update(self.discounted_return)
        self.done.copy_(terminated | truncated)
        self.discounted_return.masked_fill_(self.done.bool(), 0.0)
        reward = self.return_rms.normalize(reward, center=False)
        return self.obs, reward, self.done, self.obs_rms.normalize(final_obs), truncated & ~terminated

    def ended_episodes(self):
        """(episodes ended, sum of their returns, sum of their lengths) since the last call, device scalars."""
        ended = self.ended.sum(1)
        self.ended.zero_()
        return ended


class CapturableEnvs(Envs):
    """Envs whose physics joins torch's capture of a CUDA graph (the twins': a rollout or an env step one graph,
    Warp's kernels in it); launched plainly, simulate is Envs'."""

    def __init__(self, *args):
        super().__init__(*args)
        self.captured = []  # the Warp graphs that simulate's captures leave, kept: they own their kernels' memory

    @torch.compiler.disable  # Warp's launches: outside what torch.compile traces
    def simulate(self, physics="mujoco_steps"):
        if not self.graphs or not torch.cuda.is_current_stream_capturing():
            return super().simulate(physics)
        # In torch's capture a Warp graph cannot launch, but Warp's kernels join that capture once Warp is told of it
        # (an external capture); the Warp graph it returns holds their memory, kept.
        stream = wp.stream_from_torch(torch.cuda.current_stream())
        wp.capture_begin(stream=stream, external=True, capture_mode=wp.CaptureMode.GLOBAL)
        with wp.ScopedStream(stream, sync_enter=False):
            getattr(self, physics)()
        self.captured.append(wp.capture_end(stream=stream))
