"""Several machines, on the CPU: two torchrun "nodes" on this one host, each started with the same command as on
two machines (c10d rendezvous at 127.0.0.1, one rank a node, gloo), each in a working directory of its own, train
the GPU classic-control baseline as one run."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path

import torch
from helpers import RECORD_KEYS, SCRIPTS, free_port

NAME = "ppo_classic_control_gpu"
# Per rank: 4 envs x 32 steps, in 2 minibatches. --total-timesteps rounds down to whole iterations of both ranks'
# 256 env steps: 1152 gives 4 iterations, 1024 env steps (one rank alone would have run 9, 1152 env steps).
ARGV = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1", "--no-tensorboard",
        "--no-cuda", "--total-timesteps", "1152", "--save-dir", "saved"]  # fmt: skip
STEPS = 1024
TIMEOUT_SECONDS = 90  # both nodes together; they take 6-14 s on 2 busy cores


def node_command(endpoint, rdzv_id):
    """What every machine runs: the same command and the same arguments. --local-addr keeps the process group's
    store at 127.0.0.1 rather than the host's name."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--local-addr", "127.0.0.1",
            str(SCRIPTS / f"{NAME}.py"), *ARGV]  # fmt: skip


def end(proc):
    """A node still running when the test failed: its ranks first (torchrun starts each in a session of its own, and
    a torchrun killed leaves them running), then torchrun."""
    for children in Path(f"/proc/{proc.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    proc.kill()
    proc.wait()


def test_two_nodes_train_as_one_run(tmp_path):
    """Both nodes exit 0 (the end check found rank 1's parameters equal to rank 0's, else exit code 2); the node
    that the rendezvous made rank 0 (either one) prints the record, counting both nodes' env steps, and writes the
    one checkpoint; the other node prints nothing to stdout and writes nothing."""
    command = node_command(f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex}")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # gloo on the loopback, whatever the host's name resolves to
    nodes, procs = [tmp_path / f"node{i}" for i in range(2)], []
    try:
        for node in nodes:
            node.mkdir()
            with open(node / "stdout", "w") as out, open(node / "stderr", "w") as err:
                procs.append(subprocess.Popen(command, cwd=node, env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + TIMEOUT_SECONDS
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                end(proc)
    outs, errs = [[(node / name).read_text() for node in nodes] for name in ("stdout", "stderr")]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(errs)
    assert all("Traceback" not in err for err in errs), "\n".join(errs)
    (first,) = [i for i, out in enumerate(outs) if out.strip()]
    assert outs[1 - first] == "", outs[1 - first]
    record = json.loads(outs[first].strip().splitlines()[-1])
    assert set(record) == RECORD_KEYS and record["script"] == NAME
    assert record["total_timesteps"] == STEPS and record["steady"] is True and record["fps"] > 0
    (fps,) = [line for line in errs[first].splitlines() if line.startswith("env steps per second of each rank")]
    assert len(json.loads(fps.split(": ")[1])) == 2
    assert not (nodes[1 - first] / "saved").exists()
    assert [path.name for path in (nodes[first] / "saved").iterdir()] == [f"{NAME}.pt"]
    checkpoint = torch.load(nodes[first] / "saved" / f"{NAME}.pt", weights_only=True)
    assert checkpoint["global_step"] == STEPS
