"""The tools run as files (`python leanrl/tools/bundle.py`) or as modules (`python -m leanrl.tools.bundle`): either
way benchkit and speed_report are found beside them."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
