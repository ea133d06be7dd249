"""Fixtures the test modules share. Helpers live in modules of their own (helpers.py, off_policy.py), imported
explicitly; pytest's default (prepend) import mode puts tests/ on sys.path for them."""

import logging
import signal
import sys
from pathlib import Path

import pytest
import torch

# The scripts import the harness and the GPU env modules from leanrl/, as they do when run as leanrl/<script>.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "leanrl"))


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
    (torch's thread count, cuDNN's modes, the levels of the loggers it quiets, the SIGINT and SIGTERM handlers) is
    put back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    loggers = [logging.getLogger(name) for name in ("torch._dynamo.variables.ctx_manager", "tensordict")]
    levels = [logger.level for logger in loggers]
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield tmp_path
    torch.set_num_threads(threads)
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)

