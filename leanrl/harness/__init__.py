"""The harness every training script imports (docs/contract.md): its run options, progress and logging, the speed
record, checkpoints, Ctrl-C and SIGTERM, and torchrun, each in a module of its own."""

from .checkpoints import state_dict
from .options import RunOptions, check_due, parse_args
from .progress import fail
from .run import Run, exit_code
from .torchrun import agree, average, flat_gradients, setup_distributed, world

__all__ = ["RunOptions", "Run", "agree", "average", "check_due", "exit_code", "fail", "flat_gradients", "parse_args",
           "setup_distributed", "state_dict", "world"]  # fmt: skip
