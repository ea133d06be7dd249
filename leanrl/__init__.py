"""The training scripts run as files (`python leanrl/dqn.py`, as CleanRL's) or as modules (`python -m leanrl.dqn`):
either way the modules they import (the harness, the env modules) are found beside them."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
