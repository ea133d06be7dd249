"""Run: what a training loop talks to (docs/contract.md). start() before the loop, unit() as each unit of work
begins, episode() and tick() after env steps, log(); `with run.stoppable():` around the loop, finish() after it."""

import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext
from ctypes.util import find_library
from dataclasses import asdict

import gymnasium
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .checkpoints import (
    CHECKPOINT_FORMAT,
    checkpoint_file,
    load_state,
    rng_states,
    set_rng_states,
    state_dict,
    write_checkpoint,
)
from .errors import fail
from .options import check_outputs
from .progress import Progress, ScalarLog
from .signals import StopSignals
from .speed import SpeedWindow, print_record, speed_record
from .torchrun import world

# Notes that are not the user's concern; the last: the episode an evaluation leaves unfinished is not recorded.
QUIET_WARNINGS = (r".*The environment \S+-v\d+ is out of date", r"Using lock_\(\) inside a compiled graph",
                  r"TensorFloat32 tensor cores", r"The AccumulateGrad node's stream does not match",
                  r"\s*Online softmax is disabled on the fly", r".*Unable to save last video")  # fmt: skip


class Diverged(Exception):
    pass


class Run:
    def __init__(self, args, script_file, checkpoint):
        self.t_start, self.args, self.checkpoint = time.perf_counter(), args, checkpoint
        self.script = os.path.basename(script_file).removesuffix(".py")
        self.run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
        self.device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        if getattr(args, "cudagraphs", False) and self.device.type != "cuda":
            print("warning: --cudagraphs needs CUDA; running without CUDA graphs", file=sys.stderr)
            args.cudagraphs = False
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message)
        logging.getLogger("tensordict").setLevel(logging.WARNING)  # its INFO lines on each graph capture
        # torch.compile's note that it skips the profiler scopes inside optimizer steps: they are still timed.
        logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        if args.torch_threads:  # 0: torch's own default
            torch.set_num_threads(args.torch_threads)
        if not args.eval_checkpoint:
            check_outputs(args, self.script)
        headless_video(args)
        quiet_mujoco(args.env_id)
        self.video_folder = os.path.join("videos", self.run_name) if getattr(args, "capture_video", False) else None
        self.phase = record_function if args.profile_dir else lambda name: nullcontext()
        self.steps, self.window, self.profiler, self.progress, self.scalars = 0, None, None, None, None
        self.interrupted, self.diverged = False, None
        self.stops = StopSignals()

    def start(self, state, *, total_steps, warmup_steps, profile_steps, env_steps_per_call, warmup_from=0):
        """The loop's plan in env steps: total_steps; the fps window opens warmup_steps past warmup_from (SAC:
        learning_starts) or past a resumed run's first step, whichever is later; --profile-dir profiles its first
        profile_steps; one env_step phase takes env_steps_per_call. `state` is what checkpoints hold (state_dict):
        on --resume it is restored here, in place, with the random generators. Returns the first env step."""
        first_step, returns, curve, seconds = 0, [], [], 0.0
        if self.checkpoint is not None:
            saved_env = self.checkpoint["args"]["env_id"]
            env = self.args.env_id + (f" (the checkpoint's: {saved_env})" if saved_env != self.args.env_id else "")
            load_state(state, self.checkpoint["state"], env)
            set_rng_states(self.checkpoint["rng"])
            first_step, returns, curve = (self.checkpoint[key] for key in ("global_step", "returns", "curve"))
            seconds = self.checkpoint.get("seconds", 0.0)  # the runs before this one trained so long
            if first_step >= total_steps:
                fail(f"--resume {self.args.resume}: that run is finished ({first_step} env steps); "
                     "pass a larger --total-timesteps")  # fmt: skip
            if world()[0] == 0:
                print(f"resuming at env step {first_step}, episodes restarted; saving to {self.args.save_dir}",
                      file=sys.stderr)  # fmt: skip
        self.state, self.steps, self.profile_steps = state, first_step, profile_steps
        self.env_steps_per_call = env_steps_per_call
        self.next_save = self.save_due(first_step)
        self.scalars = ScalarLog(self.args, self.run_name)  # now that the env and networks are made: no empty run
        self.window = SpeedWindow(first_step, max(warmup_from, first_step) + warmup_steps)
        compiles = [flag for flag in ("compile", "cudagraphs") if getattr(self.args, flag, False)]
        if world()[0] == 0:  # under torchrun, rank 0 speaks for every rank
            print(f"{self.script}: warm-up for {self.window.opens_at - first_step} env steps"
                  + (f" (--{' and --'.join(compiles)}: the first steps compile)" if compiles else "")
                  + "; fps and eta once the rate is steady", file=sys.stderr, flush=True)  # fmt: skip
        # The curve's seconds go on from the checkpoint's: a resumed run's curve is one run's. After the line: a bar.
        self.progress = Progress(self.script, first_step, total_steps, returns, curve, self.t_start - seconds)
        self.stops.in_loop, self.t_unit = True, time.perf_counter()
        return first_step

    def save_due(self, step):
        return self.args.save_every and (step // self.args.save_every + 1) * self.args.save_every

    def unit(self, step):
        """A unit of work begins after `step` env steps: checkpoint, stop, fps window, profiler."""
        now = time.perf_counter()
        self.steps, self.stops.unit_seconds, self.t_unit = step, now - self.t_unit, now
        self.stops.catch()
        due = self.stops.signal or self.next_save and step >= self.next_save
        if self.args.save_dir and due and self.diverged is None:  # a diverged run keeps its last good checkpoint
            self.save(step)
        if self.stops.signal:
            raise KeyboardInterrupt
        if self.window.opens(step) and self.args.profile_dir:
            cuda = self.device.type == "cuda"
            self.profiler = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            self.profiler.start()
            self.profiler.add_metadata_json("env_steps_per_call", str(self.env_steps_per_call))  # for breakdown.py
        elif self.profiler is not None and step >= self.window.step_open + self.profile_steps:
            self.save_profile()

    def save_profile(self):
        self.profiler.stop()
        self.profiler.export_chrome_trace(os.path.join(self.args.profile_dir, f"{self.script}.trace.json"))
        self.profiler = None

    def tick(self, step):
        """After an env step, `step` in all: the return curve, and every second the progress, and True."""
        self.steps, now = step, time.perf_counter()
        if not self.progress.due(step, now) or self.stops.signal:
            return False
        fps = self.window.fps(step, now)
        self.progress.show(step, now, fps, self.window.steady(step))
        self.log(step, {"charts/SPS": fps})
        return True

    def episode(self, step, episodic_return, length):
        self.progress.returns.append(float(episodic_return))
        self.log(step, {"charts/episodic_return": float(episodic_return), "charts/episodic_length": int(length)})

    def log(self, step, scalars):
        """Scalars to TensorBoard; a loss that is no longer finite ends the run (under torchrun: as the ranks next
        agree to stop, every rank, else the others would wait in their next collective)."""
        for key, value in self.scalars.log(step, scalars).items():
            if key.startswith("losses/") and not math.isfinite(value) and self.diverged is None:
                self.diverged = f"the run diverged: {key} became {value} at env step {step}"
                if world()[1] == 1:
                    raise Diverged
                self.rank_signal = signal.SIGTERM

    def save(self, step):
        """The checkpoint, atomically; the seconds it takes are left out of the fps."""
        t_save, args = time.perf_counter(), self.args
        checkpoint = {"format": CHECKPOINT_FORMAT, "script": self.script, "args": asdict(args), "global_step": step,
                      "returns": list(self.progress.returns), "curve": self.progress.curve, "rng": rng_states(),
                      "seconds": round(t_save - self.progress.t_start, 3), "state": state_dict(self.state)}  # fmt: skip
        try:
            write_checkpoint(checkpoint, args.save_dir, self.script)
        except OSError as e:  # a full disk
            fail(f"--save-dir {args.save_dir}: the checkpoint of step {step} was not written: {e.strerror or e}")
        self.next_save, self.window.paused = self.save_due(step), self.window.paused + time.perf_counter() - t_save

    @contextmanager
    def stoppable(self):
        """Around the loop: Ctrl-C or SIGTERM ends it early, a loss gone NaN ends it as diverged; a run that ends
        otherwise saves its last checkpoint."""
        try:
            yield
            if self.args.save_dir:
                self.save(self.steps)
        except KeyboardInterrupt:
            self.interrupted = True
        except Diverged:
            pass
        except ValueError as e:  # a distribution's check of its parameters, the first place NaN shows
            if "invalid values" not in str(e):
                raise
            self.diverged = f"the run diverged: NaN in the policy at env step {self.steps}"

    def evaluation(self, returns):
        """--eval-checkpoint: the first --eval-episodes of `returns`, each printed, then their record."""
        done = []
        for episodic_return in returns:
            done.append(round(float(episodic_return), 2))
            print(f"episode {len(done)}: return {done[-1]:.2f}", flush=True)
            if len(done) == self.args.eval_episodes:
                break
        record = {"script": self.script, "env_id": self.args.env_id, "episodes": len(done),
                  "checkpoint": checkpoint_file(self.args.eval_checkpoint, self.script),
                  "mean": round(float(np.mean(done)), 2), "std": round(float(np.std(done)), 2), "returns": done}
        print(json.dumps(record), flush=True)
        return record

    def finish(self):
        """The speed record: the last stdout line, appended to --speed-log. Without a window: the whole loop's."""
        self.stops.ignore()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t_end, window = time.perf_counter(), self.window or SpeedWindow(0, 0)
        if self.profiler is not None:
            self.save_profile()
        if self.progress is not None:
            self.progress.close(self.steps, t_end)
            self.scalars.close()
        if self.interrupted:
            print(f"interrupted after {self.steps} env steps", file=sys.stderr, flush=True)
        if self.diverged:
            print(f"error: {self.diverged}", file=sys.stderr, flush=True)
        record = speed_record(self, window, self.steps, t_end, self.interrupted, self.diverged is not None)
        print_record(record, self.args.speed_log)
        return record


def exit_code(record):
    """The process's exit code: 1 for a diverged run, 130 after Ctrl-C or SIGTERM, else 0."""
    return 1 if record.get("diverged") else 130 if record.get("interrupted") else 0


def quiet_mujoco(env_id):
    """MuJoCo's note, as each v4 env is made, that its model uses a deprecated attribute: not the user's concern."""
    if "mujoco" in str(getattr(gymnasium.envs.registry.get(env_id), "entry_point", "")):
        import mujoco

        mujoco.set_mju_user_warning(lambda text: "settotalmass" in text or print(f"MuJoCo: {text}", file=sys.stderr))


def headless_video(args):
    """Without a display, MuJoCo renders videos through EGL, else OSMesa, or --capture-video is refused at start."""
    if getattr(args, "capture_video", False) and not (os.environ.get("DISPLAY") or os.environ.get("MUJOCO_GL")):
        gl = next((gl for gl, lib in (("egl", "EGL"), ("osmesa", "OSMesa")) if find_library(lib)), None)
        if gl:
            os.environ["MUJOCO_GL"] = os.environ["PYOPENGL_PLATFORM"] = gl
        elif "mujoco" in str(getattr(gymnasium.envs.registry.get(args.env_id), "entry_point", "")):
            fail("--capture-video of MuJoCo without a display needs EGL or OSMesa: apt-get install libegl1")
