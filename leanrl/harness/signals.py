"""Ctrl-C and SIGTERM: a run in its loop stops between units of work, with its checkpoint and speed record, or within
AT_ONCE_SECONDS in the middle of a unit that takes longer (a compilation)."""

import signal
import sys
import threading
import time

import tqdm

AT_ONCE_SECONDS = 5.0  # a unit still running this long after a stop signal is cut short: the run ends within 10 s, its
# record written and its process torn down, on a loaded machine too (6-10 s on 2 busy cores with 7)


class StopSignals:
    def __init__(self):
        self.signal, self.in_loop, self.handler, self.unit_seconds, self.units = None, False, self.on_signal, 0.0, 0
        self.pending = None  # deferred: the signal noted, not yet agreed on
        self.catch()

    def loop_begins(self):
        self.in_loop = True

    def unit_begins(self, last_unit_seconds):
        self.unit_seconds, self.units = last_unit_seconds, self.units + 1
        self.catch()

    def catch(self):  # again as each unit begins: Triton's LLVM puts its own handlers in when it compiles
        for signum in (signal.SIGINT, signal.SIGTERM):  # set, not inherited: a background job's SIGINT is ignored
            signal.signal(signum, self.handler)

    def ignore(self):  # nothing cuts the record short
        self.handler = signal.SIG_IGN
        self.catch()

    def defer(self):
        """Under torchrun: a signal is only noted as pending, and stops the run once the ranks agree on it (a rank
        that stopped alone would leave the others waiting in a collective; torchrun passes Ctrl-C on to every rank)."""
        self.pending, self.signal, self.handler = self.signal, None, self.note
        self.catch()

    def note(self, signum, frame):
        self.pending = signum

    def agreed(self, signum):
        """Under torchrun: the signal the ranks agreed on (the largest any rank noted), or None: go on."""
        self.signal = signum or None

    def on_signal(self, signum, frame):
        """In the loop: stop as the next unit begins, never inside a compilation or a graph capture. The same stop
        can come twice at once (`timeout` signals its command, then the command's process group), its second
        handling delayed by a blocking call: a second signal within 3 s is that one; a later one stops at once."""
        first, now = self.signal is None, time.monotonic()
        if not first and now - self.t_signal < 3.0:
            return
        self.signal, self.t_signal = signum, now
        if first and self.in_loop:
            wait = f", in about {self.unit_seconds:.0f} s" if self.unit_seconds >= 2 else ""  # the last unit's time
            timer = threading.Timer(AT_ONCE_SECONDS, self.at_once_if_still, (self.units,))
            timer.daemon = True
            timer.start()
            # tqdm.write: above a progress bar on a terminal, not glued to it
            return tqdm.tqdm.write(f"stopping at the end of this step{wait} (again: at once)", file=sys.stderr)
        raise KeyboardInterrupt

    def at_once_if_still(self, units):
        """AT_ONCE_SECONDS after the stop signal: a unit of work still running (compiling, capturing a graph) is cut
        short, as a second signal would, through the main thread's handler."""
        if self.units == units and signal.getsignal(self.signal) == self.on_signal:  # still this run's handler
            tqdm.tqdm.write(f"this step still runs {AT_ONCE_SECONDS:.0f} s after the stop signal (compiling?): "
                            "stopping in the middle of it", file=sys.stderr)  # fmt: skip
            signal.pthread_kill(threading.main_thread().ident, self.signal)  # a blocking call there returns early
