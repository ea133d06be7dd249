"""Run: what a training loop talks to (docs/contract.md). start() before the loop; `if not run.proceed(step): break`
as each unit of work begins; phase() marks what the time that follows is spent on; episode() and tick() after env
steps, log(); `with run.stoppable():` around the loop, finish() after it. Under torchrun, start() joins the ranks,
proceed() makes them agree to stop together and finish() checks they end equal."""

import atexit
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from ctypes.util import find_library
from dataclasses import asdict

import gymnasium
import numpy as np
import torch
import tqdm
from torch.profiler import ProfilerActivity, profile, record_function

from .checkpoints import (
    CHECKPOINT_FORMAT,
    checkpoint_file,
    load_state,
    rng_states,
    rolled_back,
    set_rng_states,
    state_dict,
    write_checkpoint,
)
from .compile_cache import CompileCache
from .options import check_outputs, restarts, run_name
from .progress import CONSOLE_SECONDS, Progress, ScalarLog, fail
from .signals import StopSignals
from .speed import SpeedWindow, print_record

# Notes that are not the user's concern; the last three: the episode an evaluation leaves unfinished is not
# recorded, a stop cut torch.compile's trace of a backward short (it traces with autograd's anomaly mode on), and the
# run's video folder exists: claimed() made it, for this run alone.
QUIET_WARNINGS = (r".*The environment \S+-v\d+ is out of date", r"Using lock_\(\) inside a compiled graph",
                  r"TensorFloat32 tensor cores", r"The AccumulateGrad node's stream does not match",
                  r"\s*Online softmax is disabled on the fly", r".*Unable to save last video",
                  r"Error detected in \w+\. Traceback of forward call", r".*Overwriting existing videos at")  # fmt: skip


class Run:
    def __init__(self, args, script_file, checkpoint, ranks=None):
        """ranks: under torchrun, what setup_distributed returned (None: one process)."""
        self.program, self.args, self.checkpoint, self.ranks = is_program(script_file), args, checkpoint, ranks
        for stream in ("stdout", "stderr"):  # closed (>&-, 2>&-): its lines go nowhere, not onto the other one
            if getattr(sys, stream) is None:
                setattr(sys, stream, open(os.devnull, "w"))
        self.t_mark = time.perf_counter()  # the warm-up's split: "imports" the process's start to here, then "start"
        self.t_start = self.t_mark - (age() if self.program else 0.0)  # called from other code: from here
        self.warmup_split = {"imports": self.t_mark - self.t_start}
        self.script = os.path.basename(script_file).removesuffix(".py")
        if ranks is None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            fail(f"{self.script} runs in one process: start it with python, not torchrun")
        self.rank = ranks.rank if ranks else 0
        self.run_name = run_name(args)
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
        versions = sorted(k for k in gymnasium.envs.registry if k.startswith(f"{args.env_id}-v"))
        if versions and args.env_id not in gymnasium.envs.registry:  # gymnasium would take the latest, with a warning
            fail(f"--env-id {args.env_id}: name its version ({', '.join(versions)})")
        compile_cache = getattr(args, "compile_cache", None)
        if compile_cache and not (getattr(args, "compile", False) or "warp" in sys.modules):  # Warp builds kernels
            fail("--compile-cache keeps what --compile builds: pass --compile too")
        if not args.eval_checkpoint:
            check_outputs(args, self.script)
            self.run_name = claimed(self.run_name, args)
        self.compile_cache = None
        if compile_cache:
            self.compile_cache = CompileCache(args.compile_cache, self.device)
        headless_video(args)
        quiet_mujoco(args.env_id)
        self.video_folder = os.path.join("videos", self.run_name) if getattr(args, "capture_video", False) else None
        self.steps, self.window, self.profiler, self.progress, self.scalars = 0, None, None, None, None
        self.state, self.replicated, self.open_phase, self.phase_name = None, None, None, "start"
        self.finished, self.saved_step = threading.Event(), None
        # interrupted: by a signal; abrupt: at once, not where the loop's next unit begins
        self.interrupted, self.abrupt, self.diverged = False, False, None
        self.stops = StopSignals()

    def rolled_back(self, parts):
        """A block whose changes to parts ({name: module, fresh optimizer, tensor or dict of tensors}) and to the
        random generators are undone after it, in place: work done ahead of the loop, such as a compile."""
        return rolled_back(parts, self.device)

    def start(self, state, *, total_steps, warmup_steps, profile_steps, env_steps_per_call, warmup_from=0,
              replicated=None):
        """The loop's plan in env steps: total_steps; the fps window opens warmup_steps past warmup_from (SAC:
        learning_starts) or past a resumed run's first step, whichever is later; --profile-dir profiles its first
        profile_steps; one env_step phase takes env_steps_per_call. `state` is what checkpoints hold (state_dict):
        on --resume it is restored here, in place, with the random generators. Under torchrun, `replicated` (what
        has state_dict(): the trained tensors) is what every rank holds alike: rank 0's go to every rank here, and
        finish() checks them equal. Returns the first env step."""
        first_step, returns, curve, seconds = 0, [], [], 0.0
        if self.checkpoint is not None:
            saved_env = self.checkpoint["args"]["env_id"]
            env = self.args.env_id + (f" (the checkpoint's: {saved_env})" if saved_env != self.args.env_id else "")
            load_state(state, self.checkpoint["state"], env)
            set_rng_states(self.checkpoint["rng"])
            first_step, returns, curve = (self.checkpoint[key] for key in ("global_step", "returns", "curve"))
            seconds = self.checkpoint.get("seconds", 0.0)  # the runs before this one trained so long
            if first_step >= total_steps:
                rounded = "" if total_steps == self.args.total_timesteps else f" ({total_steps} in whole iterations)"
                fail(f"--resume {self.args.resume}: the checkpoint is at env step {first_step}, "
                     f"{'past' if first_step > total_steps else 'at'} the end that --total-timesteps "
                     f"{self.args.total_timesteps} sets{rounded}: pass a larger --total-timesteps")  # fmt: skip
            if self.rank == 0:
                print(f"resuming at env step {first_step}, episodes restarted; saving to {self.args.save_dir}",
                      file=sys.stderr)  # fmt: skip
        self.state, self.steps, self.profile_steps = state, first_step, profile_steps
        self.env_steps_per_call = env_steps_per_call
        self.next_save = self.save_due(first_step)
        self.scalars = ScalarLog(self.args, self.run_name)  # now that the env and networks are made: no empty run
        self.window = SpeedWindow(first_step, max(warmup_from, first_step) + warmup_steps)
        compiles = [flag for flag in ("compile", "cudagraphs") if getattr(self.args, flag, False)]
        if self.rank == 0:  # under torchrun, rank 0 speaks for every rank
            print(f"{self.script}: warm-up for {self.window.opens_at - first_step} env steps"
                  + (f" (--{' and --'.join(compiles)}: the first steps compile)" if compiles else "")
                  + "; fps and eta once the rate is steady", file=sys.stderr, flush=True)  # fmt: skip
        # The curve's seconds go on from the checkpoint's: a resumed run's curve is one run's. After the line: a bar.
        self.progress = Progress(self.script, first_step, total_steps, returns, curve, self.t_start - seconds)
        if self.ranks:
            self.replicated = replicated
            self.ranks.join(replicated, self.args.seed, first_step)
            self.stops.defer()
        self.stops.loop_begins()
        self.t_unit = time.perf_counter()
        self.warmup_lines = threading.Thread(target=self.say_warmup, daemon=True)
        self.warmup_lines.start()
        return first_step

    def save_due(self, step):
        return self.args.save_every and (step // self.args.save_every + 1) * self.args.save_every

    def proceed(self, step):
        """A unit of work begins after `step` env steps: the checkpoint when due, the fps window, the profiler; False
        when the run stops here instead (Ctrl-C, SIGTERM, a loss gone NaN), its checkpoint saved. Under torchrun
        the ranks agree on it (one all-reduce): every rank stops at the same step."""
        now = time.perf_counter()
        self.stops.unit_begins(now - self.t_unit)
        self.steps, self.t_unit = step, now
        self.mark(now)
        self.end_phase()
        self.phase_name = "other"  # until the loop names a phase
        if self.ranks:
            asked = self.stops.pending or (signal.SIGTERM if self.diverged else 0)
            self.stops.agreed(self.ranks.agree_to_stop(asked, self.device))
        stop = self.stops.signal or self.diverged
        if self.args.save_dir and (stop or self.next_save and step >= self.next_save) and not self.gone_nan(step):
            self.save(step)  # a diverged run keeps its last good checkpoint
        if stop:
            self.interrupted = self.diverged is None
            return False
        opened = self.window.opens(step)
        if opened and self.compile_cache:  # the warm-up's code, for the next start (each rank its device's)
            t_save = time.perf_counter()
            self.compile_cache.save()
            self.window.paused += time.perf_counter() - t_save
        if opened and self.args.profile_dir:
            cuda = self.device.type == "cuda"
            self.profiler = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            self.profiler.start()
            self.profiler.add_metadata_json("env_steps_per_call", str(self.env_steps_per_call))  # for breakdown.py
        elif self.profiler is not None and step >= self.window.step_open + self.profile_steps:
            self.save_profile()
        return True

    def phase(self, name):
        """The time from here to the next phase() or unit of work is spent on `name` (policy, env_step, data,
        update, other: --profile-dir's layers)."""
        self.mark(time.perf_counter())
        self.phase_name = name
        if self.profiler is not None:
            self.end_phase()
            self.open_phase = record_function(name)
            self.open_phase.__enter__()

    def mark(self, now):
        """The seconds since the last mark were spent on phase_name: the warm-up's split."""
        if self.window is None or self.window.t_open is None:
            self.warmup_split[self.phase_name] = self.warmup_split.get(self.phase_name, 0.0) + now - self.t_mark
        self.t_mark = now

    def end_phase(self):
        if self.open_phase is not None:
            self.open_phase.__exit__(None, None, None)
            self.open_phase = None

    def say_warmup(self):
        """While warm-up runs, a line every CONSOLE_SECONDS that a unit of work lasts (a compilation, a capture):
        the run is alive, and what it is doing. Under torchrun rank 0 speaks for every rank."""
        if self.rank:
            return
        args, t_said = self.args, 0.0
        doing = "compiling" if getattr(args, "compile", False) else "running"
        while not self.finished.wait(1.0) and self.window.t_open is None:
            now = time.perf_counter()
            if min(now - self.t_unit, now - t_said) >= CONSOLE_SECONDS:
                t_said, what = now, self.phase_name.replace("_", " ")
                tqdm.tqdm.write(f"{self.script}: {doing} the {what}, {now - self.t_unit:.0f} s (warm-up, env step "
                                f"{self.steps})", file=sys.stderr)  # fmt: skip

    def save_profile(self):
        self.end_phase()
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
        """Scalars to TensorBoard; a loss that is no longer finite stops the run as the next unit begins."""
        for key, value in self.scalars.log(step, scalars).items():
            if key.startswith("losses/") and not math.isfinite(value) and self.diverged is None:
                self.diverged = f"the run diverged: {key} became {value} at env step {step}"

    def gone_nan(self, step):
        """Whether the run diverged: a loss logged NaN, or trained tensors gone NaN that no logged loss showed (CleanRL's
        scripts log every 100 steps), which no checkpoint must hold."""
        if self.diverged is None and not all_finite(self.state):
            self.diverged = f"the run diverged: NaN in the trained tensors at env step {step}"
        return self.diverged is not None

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
        self.saved_step = step

    @contextmanager
    def stoppable(self):
        """Around the loop, for the stops that cannot wait for its next unit: a second Ctrl-C or SIGTERM, or one
        before the loop began, ends it at once; a distribution's check of its parameters (a ValueError) ends it as
        diverged, as does any ValueError when the trained tensors hold NaN or infinity."""
        try:
            yield
        except KeyboardInterrupt:
            self.interrupted = self.abrupt = True
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as e:  # a buffer or batch too large for this machine
            # torch's CPU allocator raises a plain RuntimeError, which only its text tells apart
            if type(e) is RuntimeError and raised_in(e, "optim"):  # a step too large for float32 (--learning-rate 1e38)
                self.diverged = f"the run diverged: the optimizer's step overflowed float32 at env step {self.steps}"
                return
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "DefaultCPUAllocator" not in str(e):
                raise  # another RuntimeError, or one of its kinds (a compiler's error)
            fail(f"out of memory: {str(e).splitlines()[0]}; a smaller --buffer-size, --num-envs or --batch-size needs "
                 "less")  # fmt: skip
        except ValueError as e:
            finite = self.state is None or all_finite(self.state)
            if finite and (self.state is None or not raised_in(e, "distributions")):
                raise
            what = "the policy's distribution out of range" if finite else "NaN in the policy"  # exp(log_std): 0, inf
            self.diverged = f"the run diverged: {what} at env step {self.steps}"

    def evaluation(self, returns):
        """--eval-checkpoint: the first --eval-episodes of `returns`, each printed, then their record. Ctrl-C or
        SIGTERM ends it with the episodes done (exit 130)."""
        done, args = [], self.args
        try:
            for episodic_return in returns:
                done.append(round(float(episodic_return), 2))
                print(f"episode {len(done)}: return {done[-1]:.2f}", flush=True)
                if len(done) == args.eval_episodes:
                    break
        except KeyboardInterrupt:
            self.interrupted = True
            print(f"interrupted after {len(done)} episodes", file=sys.stderr, flush=True)
        except RuntimeError as e:  # load_state_dict: the saved networks are of other sizes than this env's
            if not str(e).startswith("Error(s) in loading state_dict"):
                raise
            fail(f"--eval-checkpoint {args.eval_checkpoint}: the saved networks (trained on "
                 f"{self.checkpoint['args']['env_id']}) do not fit {args.env_id}: {str(e).splitlines()[1].strip()}")
        self.stops.ignore()
        record = {"script": self.script, "env_id": args.env_id, "episodes": len(done),
                  "checkpoint": checkpoint_file(args.eval_checkpoint, self.script),
                  "mean": round(float(np.mean(done)), 2) if done else None,
                  "std": round(float(np.std(done)), 2) if done else None, "returns": done,
                  "interrupted": self.interrupted}  # fmt: skip
        print(json.dumps(record), flush=True)
        return record

    def finish(self):
        """After the loop: the last checkpoint of a run that went to its end, under torchrun the ranks' check; the
        speed record: the last stdout line, appended to --speed-log. Without a window: the whole loop's."""
        self.stops.ignore()
        self.finished.set()
        if self.window is not None:
            self.warmup_lines.join()  # no thread left at the interpreter's exit
        completed = self.window is not None and not self.interrupted and not self.gone_nan(self.steps)
        if self.ranks and self.window is not None and not self.abrupt and self.stops.signal is None:
            # every rank ran the loop to its end: a loss gone NaN in the last step, which only rank 0 logs, is agreed
            completed = not self.ranks.agree_to_stop(signal.SIGTERM if self.diverged else 0, self.device)
        if completed and self.args.save_dir:
            self.save(self.steps)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t_end, window = time.perf_counter(), self.window or SpeedWindow(0, 0)
        if completed and self.ranks:
            rank_fps = (self.steps - window.first_step) / self.ranks.size / (t_end - window.t_loop)
            self.ranks.check(self.replicated, self.steps, rank_fps)
        if self.profiler is not None:
            self.save_profile()
        if self.window is not None and self.window.t_open is None:  # ended in its warm-up: no profile; the cache now
            if self.args.profile_dir and self.rank == 0:
                print(f"--profile-dir {self.args.profile_dir}: no trace: it profiles the steady window, which this "
                      "run never reached (a larger --total-timesteps reaches it)", file=sys.stderr)  # fmt: skip
            if self.compile_cache and not self.abrupt:
                self.compile_cache.save()
        if self.progress is not None:
            self.progress.close(self.steps, t_end)
            self.scalars.close()
        if self.interrupted:
            print(f"interrupted after {self.steps} env steps", file=sys.stderr, flush=True)
        if self.abrupt and self.args.save_dir:  # a step cut short is in no checkpoint
            saved = f"env step {self.saved_step}'s" if self.saved_step is not None else "none"
            print(f"the checkpoint in {self.args.save_dir} is the last one saved: {saved}", file=sys.stderr, flush=True)
        if self.diverged:
            print(f"error: {self.diverged}", file=sys.stderr, flush=True)
        record = self.record(window, t_end)
        print_record(record, self.args.speed_log)
        if self.abrupt and self.program:
            # A unit cut short leaves its worker threads running (Inductor's compile pool: its C++ builds), which the
            # interpreter's exit would wait for, seconds on a busy machine; the run's files are written.
            sys.stderr.flush()
            os._exit(exit_code(record))
        return record

    def record(self, window, t_end):
        """The speed record (docs/contract.md): the fps of the steady window, the warm-up apart."""
        args, cuda, steps, steady = self.args, self.device.type == "cuda", self.steps, window.steady(self.steps)
        imports = self.warmup_split["imports"]  # no window: its warm-up is what came before the loop
        split = self.warmup_split if steady else {"imports": imports, "start": window.t_loop - self.t_start - imports}
        return {
            "script": self.script, "env_id": args.env_id, "seed": args.seed, "compile": getattr(args, "compile", False),
            "cudagraphs": getattr(args, "cudagraphs", False), "amp": getattr(args, "amp", False),
            "device": self.device.type, "gpu": torch.cuda.get_device_name() if cuda else None,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "total_timesteps": steps, "fps": round(window.fps(steps, t_end), 1), "steady": steady,
            "interrupted": self.interrupted, "diverged": self.diverged is not None,
            "fps_overall": round((steps - window.first_step) / (t_end - self.t_start), 1),
            "resumed_from": window.first_step if self.checkpoint is not None else None, "restarts": restarts(),
            "checkpoint_seconds": round(window.paused, 3),
            "warmup_seconds": round((window.t_open if steady else window.t_loop) - self.t_start, 3),
            "warmup_split": {phase: round(seconds, 3) for phase, seconds in split.items()},
            "wall_seconds": round(t_end - self.t_start, 3),
            "episodic_return": self.progress and self.progress.mean_return(),
            "return_curve": self.progress and self.progress.curve or [],
        }  # fmt: skip


def claimed(name, args):
    """The run's name, made its own: its folder (runs/, else videos/) made now, with -2, -3 ... after a name that a run
    started in the same second holds (two runs would write one folder); removed at exit if still empty (a run that
    failed before its loop)."""
    parent = "runs" if args.tensorboard else "videos" if getattr(args, "capture_video", False) else None
    if parent is None:  # no folder of its own to share
        return name
    for n in range(1, 1000):
        mine = name if n == 1 else f"{name}-{n}"
        try:
            os.mkdir(os.path.join(parent, mine))
        except FileExistsError:
            continue
        atexit.register(lambda folder: os.path.isdir(folder) and not os.listdir(folder) and os.rmdir(folder),
                        os.path.join(parent, mine))  # fmt: skip
        return mine
    return name


def is_program(script_file):
    """Whether the script is this process's program (a bundle is its own)."""
    program = getattr(sys.modules.get("__main__"), "__file__", None)
    return program is not None and os.path.realpath(program) == os.path.realpath(script_file)


def age():
    """Seconds since this process started (Linux's /proc; elsewhere 0): a run's times count its imports too."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # the start, in clock ticks after the boot
            return max(float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def exit_code(record):
    """The process's exit code: 1 for a diverged run, 130 after Ctrl-C or SIGTERM, else 0."""
    return 1 if record.get("diverged") else 130 if record.get("interrupted") else 0


def all_finite(state):
    """Whether the trained tensors of a checkpoint's state (modules' parameters, tensors) are all finite."""
    if isinstance(state, dict):
        return all(all_finite(part) for part in state.values())
    tensors = state.parameters() if isinstance(state, torch.nn.Module) else [state] * isinstance(state, torch.Tensor)
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def raised_in(error, package):
    """Whether an error came from torch.<package> (distributions: a check of its parameters; optim: a step)."""
    return os.path.join("torch", package, "") in traceback.extract_tb(error.__traceback__)[-1].filename


def quiet_mujoco(env_id):
    """MuJoCo's note, as each v4 env is made, that its model uses a deprecated attribute: not the user's concern."""
    if "mujoco" in str(getattr(gymnasium.envs.registry.get(env_id), "entry_point", "")):
        import mujoco

        mujoco.set_mju_user_warning(lambda text: "settotalmass" in text or print(f"MuJoCo: {text}", file=sys.stderr))


def headless_video(args):
    """Without a display, MuJoCo renders videos through EGL, else OSMesa, or --capture-video is refused at start."""
    if getattr(args, "capture_video", False) and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        # pygame's frames (classic control) are drawn off screen: without it SDL tries a display and prints an
        # "error:" line of its own (XDG_RUNTIME_DIR), which reads like one of ours
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    if getattr(args, "capture_video", False) and not (os.environ.get("DISPLAY") or os.environ.get("MUJOCO_GL")):
        gl = next((gl for gl, lib in (("egl", "EGL"), ("osmesa", "OSMesa")) if find_library(lib)), None)
        if gl:
            os.environ["MUJOCO_GL"] = os.environ["PYOPENGL_PLATFORM"] = gl
        elif "mujoco" in str(getattr(gymnasium.envs.registry.get(args.env_id), "entry_point", "")):
            fail("--capture-video of MuJoCo without a display needs EGL or OSMesa: apt-get install libegl1")
