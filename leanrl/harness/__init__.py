"""The harness every training script imports (docs/contract.md): its run options, progress and logging, the speed
record, checkpoints, Ctrl-C and SIGTERM, and torchrun, each in a module of its own."""

from .checkpoints import state_dict
from .errors import fail
from .options import RunOptions, parse_args
from .run import Run, exit_code
from .torchrun import agree, agree_to_stop, average, average_gradients, check_ranks_agree, flat_gradients, join_ranks
from .torchrun import setup_distributed, world

__all__ = ["RunOptions", "Run", "agree", "agree_to_stop", "average", "average_gradients", "check_ranks_agree",
           "exit_code", "fail", "flat_gradients", "join_ranks", "parse_args", "setup_distributed", "state_dict",
           "world"]  # fmt: skip
