"""The run options every script shares, and the command line parsed into them: one-line errors for bad input."""

import difflib
import math
import os
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields

import tyro

from .checkpoints import checkpoint_file, read_checkpoint
from .compile_cache import kernel_caches_in
from .progress import fail

# Numeric flags must be finite and >= 0; these, where a script has them, > 0 or in (0, 1].
POSITIVE = ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "buffer_size",
            "batch_size", "learning_rate", "policy_lr", "q_lr", "policy_frequency", "target_network_frequency",
            "train_frequency", "eval_episodes", "target_kl", "max_grad_norm")  # fmt: skip
FRACTIONS = ("gamma", "gae_lambda", "tau")
# Flags a resumed run may change without --resume-anyway: they change how it runs, not what it computes.
FREE_ON_RESUME = ("total_timesteps", "compile", "cudagraphs", "compile_cache", "cuda", "capture_video")
PATHS = ("save_dir", "resume", "eval_checkpoint", "speed_log", "profile_dir", "compile_cache")
FLOAT32_MAX = 3.4028234663852886e38  # the networks compute in float32: a flag's value beyond it overflows there
SEED_MAX = 2**31 - 1  # numpy's and gymnasium's seeds end at 2**32 - 1: room for the ranks' and envs' offsets
NAME_MAX = 255  # bytes of a file or folder name (runs/<run name>, videos/<run name>)


def flag(name):
    return "--" + name.replace("_", "-")


@dataclass
class RunOptions:
    """What every script's Args adds to the algorithm's fields (docs/contract.md)."""

    exp_name: str | None = None
    """the name of this experiment, in the run's name (None: the script's name)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """use CUDA when it is available"""
    torch_threads: int = 1
    """torch's intra-op CPU threads (0: torch's default, one per core)"""
    track: bool = False
    """track the experiment with Weights and Biases"""
    wandb_project_name: str = "leanrl"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    tensorboard: bool = True
    """write TensorBoard scalars under runs/<run name>/"""
    speed_log: str | None = None
    """append the speed record (the last stdout line, one JSON object) to this file"""
    profile_dir: str | None = None
    """profile the start of the steady window and write the trace into this directory"""
    save_dir: str | None = None
    """write checkpoints into this directory: every --save-every env steps, at the end, and on Ctrl-C"""
    save_every: int = 0
    """env steps between checkpoints (0: only at the end and on Ctrl-C)"""
    resume: str | None = None
    """continue the run saved in this checkpoint (a file, or a --save-dir); checkpoints go on there"""
    resume_anyway: bool = False
    """with --resume: go on although flags that change the algorithm differ from the checkpoint's"""
    eval_checkpoint: str | None = None
    """evaluate the policy of this checkpoint (file or --save-dir) for --eval-episodes and exit"""
    eval_episodes: int = 10
    """episodes that --eval-checkpoint runs"""


def with_run_options(Args):
    """A script's Args (the algorithm's flags) with the RunOptions every script shares, which come first in --help."""
    return dataclass(type(Args.__name__, (Args, RunOptions), {"__doc__": Args.__doc__}))


def parse_args(Args, script_file, argv=None):
    """(args, checkpoint): argv over the arguments of the checkpoint to resume or evaluate, range-checked, of Args with
    the run options."""
    script = os.path.basename(script_file).removesuffix(".py")
    argv = home_paths(sys.argv[1:] if argv is None else argv)
    Args = with_run_options(Args)
    check_flag_names(Args, argv)
    args, checkpoint = tyro.cli(Args, args=argv), None
    for name, value in asdict(args).items():
        if value == "":  # else read as no value at all: no checkpoint, a fresh run, no log
            fail(f"{flag(name)} '': an empty name (leave the flag out for its default)")
    if args.resume and args.eval_checkpoint:
        fail("--resume and --eval-checkpoint exclude each other")
    for name in ("save_dir", "save_every", "speed_log", "profile_dir"):
        if args.eval_checkpoint and getattr(args, name):  # the user's own flags: a checkpoint's are not read yet
            fail(f"{flag(name)} is for training: --eval-checkpoint evaluates, saves nothing and keeps no speed record")
    if restarts() and args.save_dir and not args.resume and os.path.isfile(checkpoint_file(args.save_dir, script)):
        # torchrun --max-restarts started the ranks again after one died: the run goes on from its last checkpoint
        print(f"torchrun restart {restarts()}: resuming from {args.save_dir}", file=sys.stderr)
        argv = [*argv, "--resume", args.save_dir]
        args = tyro.cli(Args, args=argv)
    if args.resume or args.eval_checkpoint:
        option = "--resume" if args.resume else "--eval-checkpoint"
        checkpoint = read_checkpoint(option, args.resume or args.eval_checkpoint, script)
        saved = Args(**{f.name: checkpoint["args"][f.name] for f in fields(Args) if f.name in checkpoint["args"]})
        save_dir, args = args.save_dir, tyro.cli(Args, args=argv, default=saved)
        # A resumed run saves where it was resumed from, unless --save-dir names another folder.
        resumed = args.resume and os.path.abspath(checkpoint_file(args.resume, script))
        args.save_dir = (save_dir or os.path.dirname(resumed)) if args.resume else None
        if args.resume:
            check_resumed(args, saved)
    args.exp_name = args.exp_name or script
    if "/" in args.exp_name or os.sep in args.exp_name or not args.exp_name.isprintable():
        fail(f"--exp-name {args.exp_name!r}: a name of printable characters, not a path (it names the run's folders)")
    name = run_name(args)
    if len(name.encode()) > NAME_MAX:
        fail(f"--exp-name: the run's folder name {name[:40]}... would be {len(name.encode())} bytes, over "
             f"the {NAME_MAX} a file system allows: pass a shorter --exp-name")  # fmt: skip
    for name, value in asdict(args).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                fail(f"{flag(name)} {value} must be a finite number")
            if abs(value) > FLOAT32_MAX and isinstance(value, float):
                fail(f"{flag(name)} {value} is beyond float32's range (about 3.4e38), in which the networks compute")
            if name in FRACTIONS and not 0 < value <= 1:
                fail(f"{flag(name)} {value} must be in (0, 1]")
            if not (value >= 0 and (value > 0 or name not in POSITIVE)):
                fail(f"{flag(name)} {value} must be {'positive' if name in POSITIVE else '0 or more'}")
    if args.seed > SEED_MAX:
        fail(f"--seed {args.seed} must be at most {SEED_MAX} (the envs and generators seed from it, plus an offset)")
    if args.torch_threads > (os.cpu_count() or 1):  # more threads than cores: every op waits for them
        fail(f"--torch-threads {args.torch_threads}: this machine has {os.cpu_count()} cores (0: torch's default)")
    if args.save_every and not args.save_dir:
        fail(f"--save-every {args.save_every} needs --save-dir")
    if args.track and not args.tensorboard:
        fail("--track mirrors the TensorBoard scalars to wandb: drop --no-tensorboard")
    if getattr(args, "compile_cache", None):
        kernel_caches_in(args.compile_cache)
    return args, checkpoint


def check_due(args, name, first, end, unit, offset=0):
    """A frequency the user changed must fall on one of the steps first..end-1 that update (counted in unit: each
    script counts its own), those with step % frequency == offset; else a one-line error, not a run without that
    update. The script's default may miss a short run's updates: CleanRL's behaviour."""
    every = getattr(args, name)
    due = first + (offset - first) % every  # the first step from first on with step % every == offset
    if every != next(f.default for f in fields(args) if f.name == name) and due >= end:
        fail(f"{flag(name)} {every} is never due: after --learning-starts {args.learning_starts}, --total-timesteps "
             f"{args.total_timesteps} leaves {unit} {first} to {end - 1} to update, and it acts on one in every "
             f"{every}")  # fmt: skip


def run_name(args):
    """CleanRL's name of a run, its folders' (runs/, videos/) and wandb's: env, experiment, seed, start second."""
    return f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"


def home_paths(argv):
    """argv with a path flag's value from ~ read from the home folder: no shell expands `--save-dir=~/x`."""
    paths, out = {flag(name) for name in PATHS}, []
    for token in argv:
        name, _, value = token.partition("=")
        if name in paths and value.startswith("~"):
            token = f"{name}={os.path.expanduser(value)}"
        elif out and out[-1] in paths and token.startswith("~"):  # "--save-dir" "~/x", quoted
            token = os.path.expanduser(token)
        out.append(token)
    return out


def restarts():
    """How often torchrun (--max-restarts) has started this job's ranks again: 0 for a run started once."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def check_flag_names(Args, argv):
    """A flag the script does not have: one line naming it and the script's flags of a similar name or meaning
    (SAC's --learning-rate: --q-lr and --policy-lr), where tyro would suggest by spelling alone."""
    names = [f.name.replace("_", "-") for f in fields(Args)]
    known = {"--help", *(f"--{n}" for n in names)}
    known |= {f"--no-{n}" for n, f in zip(names, fields(Args)) if f.type is bool}
    for token in argv:
        given = token.split("=")[0]
        if not given.startswith("--") or given.replace("_", "-") in known:
            continue
        words = set(given[2:].replace("_", "-").replace("learning-rate", "lr").split("-")) - {"num", "max", "min"}
        alike = [n for n in names if words & set(n.replace("learning-rate", "lr").split("-"))]
        alike += [n for n in difflib.get_close_matches(given[2:], names, n=3, cutoff=0.6) if n not in alike]
        hint = f"; did you mean {', '.join('--' + n for n in alike)}?" if alike else ""
        fail(f"{given}: not a flag of this script{hint} (--help lists them all)")


def check_resumed(args, saved):
    """Name the flags that differ from the checkpoint's; refuse those that change the algorithm unless told."""
    run_options = {f.name for f in fields(RunOptions)}
    changed = {k: (v, getattr(saved, k)) for k, v in asdict(args).items() if v != getattr(saved, k)}
    changed = {k: v for k, v in changed.items() if k not in run_options or k in ("seed", "torch_deterministic")}
    algorithm = [k for k in changed if k not in FREE_ON_RESUME]
    listed = ", ".join(f"{flag(k)} {new} (saved: {old})" for k, (new, old) in changed.items())
    if algorithm and not args.resume_anyway:
        fail(f"--resume: {listed} differ from the checkpoint's; {', '.join(map(flag, algorithm))} "
             f"{'changes' if len(algorithm) == 1 else 'change'} the algorithm: pass the checkpoint's values, or "
             "--resume-anyway")  # fmt: skip
    if changed:
        print(f"resuming with {listed}", file=sys.stderr)


def check_outputs(args, script):
    """Before the run: every output writable, and no other run's checkpoint overwritten."""
    speed_log_folder = args.speed_log and os.path.dirname(os.path.abspath(args.speed_log))
    folders = {"--save-dir": args.save_dir, "--profile-dir": args.profile_dir, "--speed-log": speed_log_folder,
               "--compile-cache": getattr(args, "compile_cache", None),
               "runs": args.tensorboard and "runs", "videos": getattr(args, "capture_video", False) and "videos"}
    if args.save_dir and args.speed_log and os.path.realpath(args.speed_log) == os.path.realpath(
            os.path.join(args.save_dir, f"{script}.pt")):  # fmt: skip (a link to it too)
        fail(f"--speed-log {args.speed_log} is the checkpoint file of --save-dir {args.save_dir}: name another file")
    if args.speed_log and os.path.isdir(args.speed_log):
        fail(f"--speed-log {args.speed_log} is a folder: it names a file, which the record is appended to")
    if args.speed_log and os.path.exists(args.speed_log) and stat.S_ISFIFO(os.stat(args.speed_log).st_mode):
        fail(f"--speed-log {args.speed_log} is a pipe: it names a file, which the record is appended to")
    for option, folder in folders.items():
        if folder and os.path.islink(folder) and not os.path.exists(folder):
            fail(f"{option} {folder} is a symbolic link to nothing (a loop, or a target that does not exist)")
        if folder and option in ("--save-dir", "--profile-dir", "--compile-cache") and os.path.isfile(folder):
            fail(f"{option} {folder} is a file: it names a folder")
        if folder and option in ("runs", "videos") and os.path.isfile(folder):
            what = "TensorBoard's scalars (or pass --no-tensorboard)" if option == "runs" else "the videos"
            fail(f"a file named {folder} is in the way of the folder {folder}/ for {what}: move it")
        named = args.speed_log if option == "--speed-log" else folder
        if folder and option == "--speed-log" and os.path.isfile(folder):
            fail(f"--speed-log {named} cannot be written: {folder} is a file, not a folder")
        try:
            if folder:
                os.makedirs(folder, exist_ok=True)
                if option == "--speed-log":  # the file itself: its folder may admit no other (/proc)
                    open(args.speed_log, "a").close()
                else:
                    tempfile.TemporaryFile(dir=folder).close()
        except OSError as e:
            fail(f"{option} {named} cannot be written: {e.strerror or e}")
    existing = args.save_dir and checkpoint_file(args.save_dir, script)
    resumed = args.resume and checkpoint_file(args.resume, script)
    if existing and os.path.exists(existing) and not (resumed and os.path.samefile(resumed, existing)):
        fail(f"--save-dir {args.save_dir} holds another run's checkpoint: --resume it, or pass another --save-dir")
