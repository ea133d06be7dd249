"""The steady fps window, and the speed record printed: the last stdout line of every run (docs/contract.md)."""

import json
import os
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
    """The last stdout line: whole, or on a terminal its headline; then appended whole to --speed-log (a log that
    cannot be written is one error line after the record, exit code 2)."""
    line = json.dumps(record)
    shown = json.dumps({key: record[key] for key in HEADLINE}) if sys.stdout.isatty() else line
    try:
        print(shown, flush=True)
        unprinted = None
    except OSError as e:  # > /dev/full
        unprinted = f"error: the speed record could not be printed: {e.strerror or e}"
    if speed_log:
        try:
            with open(speed_log, "a") as f:  # one write of a whole line: concurrent runs never interleave
                f.write(line + "\n")
        except OSError as e:
            print(f"error: --speed-log {speed_log}: the record was not appended: {e.strerror or e}", file=sys.stderr)
            sys.exit(2)
    if unprinted:  # at once: the interpreter's exit would fail again on what stdout still holds, in a traceback
        print(unprinted, file=sys.stderr, flush=True)
        os._exit(2)
