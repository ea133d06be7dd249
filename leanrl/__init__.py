"""The training scripts and tools run as files (`python leanrl/dqn.py`, as CleanRL's) or as modules (`python -m
leanrl.dqn`, `python -m leanrl.tools.bundle`): either way what they import (the harness, the env modules, the tools'
benchkit) is found beside them."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "tools")]
