"""The steady fps window, and the speed record printed: the last stdout line of every run (docs/contract.md)."""

import json
import sys
import time

HEADLINE = ("script", "env_id", "total_timesteps", "fps", "warmup_seconds", "wall_seconds", "episodic_return",
            "interrupted", "diverged")  # fmt: skip


class SpeedWindow:
    """From the first unit of work at or past `opens_at` env steps (after warm-up: compilation, graph capture) to
    the end of the loop, less the seconds spent saving."""

    def __init__(self, first_step, opens_at):
        self.first_step, self.opens_at, self.t_open, self.paused = first_step, opens_at, None, 0.0
        self.t_loop = time.perf_counter()

    def opens(self, step):
        if self.t_open is None and step >= self.opens_at:
            self.t_open, self.step_open, self.paused_open = time.perf_counter(), step, self.paused
            return True
        return False

    def steady(self, step):
        return self.t_open is not None and step > self.step_open

    def fps(self, step, now):
        if self.steady(step):
            return (step - self.step_open) / (now - self.t_open - self.paused + self.paused_open)
        return (step - self.first_step) / max(now - self.t_loop - self.paused, 1e-9)


def print_record(record, speed_log):
    """Appended whole to --speed-log; the last stdout line: whole, or on a terminal its headline."""
    line = json.dumps(record)
    if speed_log:
        with open(speed_log, "a") as f:  # one write of a whole line: concurrent runs never interleave
            f.write(line + "\n")
    if sys.stdout.isatty():
        line = json.dumps({key: record[key] for key in HEADLINE})
    print(line, flush=True)
