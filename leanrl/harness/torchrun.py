"""Data-parallel runs under torchrun: one process a GPU (or CPU process over gloo), rank 0 writes every output."""

import datetime
import gc
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from .progress import fail

DIST_TIMEOUT_SECONDS = 900  # a rank that died or hangs ends the job; long enough for compilation and capture
STUCK_SECONDS = 25  # a rank not stopped this long after a signal waits for a dead one (torchrun kills it at 30)


def world():
    """(rank, world size) of this process: (0, 1) without torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def leave_process_group():
    time.sleep(0.1)  # a worker thread of the last collectives may still need the interpreter's lock to let go
    gc.collect()  # NCCL closes only once the CUDA graphs that captured its collectives are gone: it waits silently
    dist.destroy_process_group()


def fail_on_every_rank(message):
    rank = dist.get_rank()
    leave_process_group()
    if rank == 0:
        fail(message)
    sys.exit(2)


def digests_differ(digest):
    """The ranks whose digest (a string) differs from rank 0's."""
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return [rank for rank, other in enumerate(digests) if other != digests[0]]


def setup_distributed(args):
    """Under torchrun: this rank on cuda:LOCAL_RANK, the process group joined, every rank's arguments checked equal;
    ranks other than 0 write nothing (no TensorBoard, wandb, speed log, profile, checkpoint or stdout). Returns the
    Ranks that Run works with, or None without torchrun."""
    if "WORLD_SIZE" not in os.environ:
        return None
    cuda = torch.cuda.is_available() and args.cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=DIST_TIMEOUT_SECONDS)
    # torchrun's store outlives a restart (--max-restarts): the ranks' addresses go under a prefix of their attempt,
    # else a restarted rank may read a dead rank's address, written before the restart, and fail to connect.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    if differ := digests_differ(hashlib.sha256(json.dumps(asdict(args), sort_keys=True).encode()).hexdigest()):
        fail_on_every_rank(f"ranks {differ} were started with other arguments than rank 0: every rank needs the same")
    if dist.get_rank():
        args.tensorboard = args.track = False
        args.speed_log = args.profile_dir = args.save_dir = None
        args.save_every = 0
        sys.stdout = open(os.devnull, "w")
    return Ranks()


def agree(value, op, device):
    """A number every rank gives, reduced over the ranks by op (dist.ReduceOp), as every rank's float."""
    reduced = torch.tensor([float(value)], device=device)
    dist.all_reduce(reduced, op=op)
    return reduced.item()


def average(flat):
    """A tensor replaced, in place, by its mean over the ranks: one all-reduce."""
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def flat_gradients(parameters):
    """The parameters' gradients made views into one flat buffer, returned, which backward fills in place: average()
    needs no copy, captured graphs find them at fixed addresses. Each view starts on 16 bytes (after a bias of one
    element too): compiled kernels load in vectors, which fail on a misaligned address."""
    parameters = list(parameters)
    aligned = [-(-p.numel() // 4) * 4 for p in parameters]
    flat = torch.zeros(sum(aligned), device=parameters[0].device)
    for p, grad in zip(parameters, flat.split(aligned)):
        p.grad = grad[: p.numel()].view_as(p)
    return flat


def exit_if_stuck(rank, seconds=STUCK_SECONDS):
    """A rank waiting in a collective for a rank that died runs no signal handler (they run between Python
    bytecodes), and torchrun kills it without a word: `seconds` after a signal, a thread woken by it says so, and
    ends the process. A rank that stops as it should is gone by then, unless the signal came while the ranks
    compiled: they stop at the end of a unit of work, and torchrun's grace (30 s) may end before it."""
    wake, signalled = os.pipe()
    os.set_blocking(signalled, False)
    signal.set_wakeup_fd(signalled)  # written at the signal itself, whatever the main thread waits in

    def watch():
        os.read(wake, 1)
        time.sleep(seconds)
        print(f"error: rank {rank} had not stopped {seconds} s after a stop signal: a rank has died or hangs, or the "
              "ranks were still compiling", file=sys.__stderr__, flush=True)  # fmt: skip
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


class Ranks:
    """What Run does with the other ranks: join them at the start, agree with them to stop, check at the end that
    every rank holds rank 0's `replicated` (what has state_dict(): the trained tensors)."""

    def __init__(self):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def join(self, replicated, seed, global_step):
        """Rank 0's tensors on every rank; after a resume, the other ranks' generators reseeded apart (every rank
        restored rank 0's); a rank that hangs after a stop signal ends the process (exit_if_stuck)."""
        for tensor in replicated.state_dict().values():
            dist.broadcast(tensor, 0)
        if global_step and self.rank:
            for seed_generator in (random.seed, np.random.seed, torch.manual_seed):
                seed_generator(seed + self.rank + global_step)
        exit_if_stuck(self.rank)

    def agree_to_stop(self, signum, device):
        """The largest signal any rank asks to stop for (0: none), as every rank's: they stop at the same step."""
        signum = int(agree(signum, dist.ReduceOp.MAX, device))
        if signum and self.rank:
            sys.stderr = open(os.devnull, "w")  # rank 0 tells where the run stopped
        return signum

    def check(self, replicated, global_step, rank_fps):
        """Every rank holds rank 0's tensors bit for bit, else an error; rank 0 prints each rank's fps; the ranks
        leave the process group."""
        data = b"".join(t.detach().cpu().numpy().tobytes() for t in replicated.state_dict().values())
        if differ := digests_differ(hashlib.sha256(data).hexdigest()):
            fail_on_every_rank(f"after {global_step} env steps, the parameters of ranks {differ} differ from rank 0's")
        fps = [None] * self.size
        dist.all_gather_object(fps, round(rank_fps, 1))
        if self.rank == 0:
            print(f"env steps per second of each rank over its whole loop: {fps}", file=sys.stderr, flush=True)
        leave_process_group()
