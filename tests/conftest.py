"""Fixtures the test modules share. Helpers live in modules of their own (helpers.py, off_policy.py), imported
explicitly; pytest's default (prepend) import mode puts tests/ on sys.path for them."""

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import gymnasium  # noqa: F401  (its import sets PYGAME_HIDE_SUPPORT_PROMPT: before any test, not inside one)
import pytest
import torch

# The scripts import the harness and the GPU env modules from leanrl/, as they do when run as leanrl/<script>.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "leanrl"))
STOPS = (signal.SIGINT, signal.SIGTERM)
# What libraries set for the process as they first load or compile (pytest, Inductor, Triton, matplotlib, and the
# JAX setting of the benches that compare with it): theirs, not a test's leftovers.
LIBRARY_VARIABLES = ("PYTEST_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "MPL", "XLA_")
RECEIVED = []  # the read end of a pipe each signal this process receives writes its number into


# `pytest -m quick`: the harness once, the scripts' shared contract and every script's bad input, in minutes.
QUICK_FILES = {"test_contract.py", "test_harness.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "signals: the test sends SIGINT or SIGTERM to this process on purpose")
    config.addinivalue_line("markers", "quick: the quick subset (pytest -m quick), about 2 minutes on 2 cores, -n 2")
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # written whatever handler a script has put in
    RECEIVED.append(read)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in QUICK_FILES or "bad_input" in item.name:
            item.add_marker(pytest.mark.quick)


def signals_received():
    try:
        return set(os.read(RECEIVED[0], 1024))
    except BlockingIOError:
        return set()


def ignored_stops():
    """The stop signals this process ignores, as the kernel says (SigIgn): what its subprocesses inherit, and a shell
    such as run.sh then cannot trap."""
    with open("/proc/self/status") as status:
        mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return {signum for signum in STOPS if mask >> (signum - 1) & 1}


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request):
    """Ctrl-C or `timeout` ends the suite even when a script run in this process caught the signal (its run stops, and
    the suite with it, after the test); and no test leaves a signal handler or a blocked signal, an env variable or a
    thread behind."""
    # What ran before in this process (a script's end ignores them while it writes its record; a library) may have
    # left the stop signals ignored, which run.sh, started by a test, could not undo: each test starts with them as
    # a new process has them.
    for signum in ignored_stops() if os.path.exists("/proc/self/status") else ():
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    handlers = {signum: signal.getsignal(signum) for signum in STOPS}
    environ, threads = dict(os.environ), {t for t in threading.enumerate() if not t.daemon}
    signals_received()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a C library can block them, unseen by getsignal
    yield
    newly_blocked = (signal.pthread_sigmask(signal.SIG_BLOCK, []) - blocked) & set(STOPS)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, newly_blocked)  # its subprocesses would inherit the mask
    received = signals_received() & set(STOPS)
    if received and not request.node.get_closest_marker("signals"):
        pytest.exit(f"stopped by {signal.Signals(max(received)).name}", returncode=130)
    left = {signal.Signals(s).name: h for s, h in handlers.items() if signal.getsignal(s) != h}
    changed = {k for k in set(os.environ) | set(environ) if os.environ.get(k) != environ.get(k)}
    changed = {k for k in changed if not k.startswith(LIBRARY_VARIABLES) or k == "TRITON_INTERPRET"}  # ours, a test's
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for name in changed:
        if name in environ:
            os.environ[name] = environ[name]
        else:
            del os.environ[name]
    assert not left, f"the test left signal handlers behind: {left}"
    assert not newly_blocked, f"the test left signals blocked: {sorted(signal.Signals(s).name for s in newly_blocked)}"
    assert not changed, f"the test left env variables changed: {sorted(changed)}"
    # A thread pool a library keeps for the process (Inductor's compile workers) is not the test's to end.
    new_threads = [t.name for t in threading.enumerate() if not t.daemon and t not in threads and t.is_alive()
                   and not t.name.startswith("ThreadPoolExecutor")]  # fmt: skip
    assert not new_threads, f"the test left threads running: {new_threads}"


@pytest.fixture
def eager_random():
    """Inductor draws random numbers as eager code does, so compiled and eager runs compare draw for draw. The only
    place that sets fallback_random; restored when the test ends."""
    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """For tests that run a script's main() in this process: the working directory is tmp_path, so that the
    TensorBoard folder (runs/ in the working directory) lands there, and what main() sets for the whole process
    (torch's thread count, cuDNN's modes, the levels of the loggers it quiets, the SIGINT and SIGTERM handlers, env
    variables) is put back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    loggers = [logging.getLogger(name) for name in ("torch._dynamo.variables.ctx_manager", "tensordict")]
    levels = [logger.level for logger in loggers]
    # What ran before in this process (a script's end ignores them while it writes its record; a library) may have
    # left the stop signals ignored, which run.sh, started by a test, could not undo: each test starts with them as
    # a new process has them.
    for signum in ignored_stops() if os.path.exists("/proc/self/status") else ():
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    handlers = {signum: signal.getsignal(signum) for signum in STOPS}
    environ = dict(os.environ)  # a run without a display sets MUJOCO_GL for its videos
    yield tmp_path
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)

