"""Checkpoints: the state a loop names, the random generators, written atomically and restored in place."""

import os
import random
from contextlib import contextmanager

import numpy as np
import torch

from .progress import fail

CHECKPOINT_FORMAT = "leanrl-checkpoint-2"


def checkpoint_file(path, script):
    return os.path.join(path, f"{script}.pt") if os.path.isdir(path) else path


def read_checkpoint(option, path, script):
    """The checkpoint of `script` at path (a file or a --save-dir), or a one-line error that says what is wrong."""
    folder, path = path, checkpoint_file(path, script)
    if os.path.exists(path) and not os.path.isfile(path):
        fail(f"{option} {path}: not a checkpoint file (a pipe, a device?)")
    if not os.path.isfile(path):
        others = sorted(n for n in os.listdir(folder) if n.endswith(".pt")) if os.path.isdir(folder) else []
        held = f" (the folder holds {', '.join(others)}: another script's)" if others else ""
        fail(f"{option} {path}: no such checkpoint file{held}")
    try:  # tensors and plain values only: loading runs no code
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        fail(f"{option} {path}: not a readable checkpoint, truncated or corrupt ({type(e).__name__})")
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        fail(f"{option} {path}: not a checkpoint of this version of the collection")
    if checkpoint["script"] != script:
        fail(f"{option} {path}: a checkpoint of {checkpoint['script']}, not of {script}")
    return checkpoint


def state_dict(state):
    """A checkpoint's copy of {name: module, optimizer, object with state_dict(), tensor, or such a dict}."""
    if isinstance(state, dict):
        return {name: state_dict(part) for name, part in state.items()}
    return state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state.state_dict()


def load_state(state, saved, env_id, name="state"):
    """state_dict's inverse, in place: into the very tensors that compiled functions and captured graphs hold."""
    if isinstance(state, dict):
        return [load_state(part, saved[key], env_id, f"{name}.{key}") for key, part in state.items()]
    try:
        if isinstance(state, torch.Tensor) and saved.shape != state.shape:
            raise ValueError(f"shape {tuple(saved.shape)}, here {tuple(state.shape)}")
        if isinstance(state, torch.Tensor):
            return state.detach().copy_(saved)
        if not isinstance(state, torch.optim.Optimizer):
            return state.load_state_dict(saved)
        # capturable (--cudagraphs) is this run's; a tensor in a group (a learning rate on the device) stays the one
        # that graphs hold, with the saved value.
        now = state.param_groups
        tensors = [{key: value for key, value in g.items() if isinstance(value, torch.Tensor)} for g in now]
        groups = [{**g, "capturable": n.get("capturable", False)} for g, n in zip(saved["param_groups"], now)]
        state.load_state_dict({**saved, "param_groups": groups})
        for group, kept in zip(state.param_groups, tensors):
            group.update({key: tensor.copy_(torch.as_tensor(group[key])) for key, tensor in kept.items()})
    except (RuntimeError, ValueError, KeyError) as e:  # another network or env size than the checkpoint's
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # torch's first says only "Error(s)"
        why = lines[min(1, len(lines) - 1)]
        if why.startswith("zip()"):  # a strict zip of per-env parts: Python's words say nothing of the run
            why = "it holds another number of parts, one per env (another --num-envs?)"
        fail(f"--resume: the checkpoint's {name} does not fit this run on {env_id}: {why}")


@contextmanager
def rolled_back(parts, device):
    """What the block changes of parts ({name: module, tensor, dict of tensors, or optimizer}) and of torch's random
    generators, undone after it, in place: compiled functions and captured graphs hold these very tensors. An
    optimizer must be fresh: the state its first step makes stays, zeroed, as a first step makes it."""
    optimizers, tensors = [], []
    for part in (p for part in parts.values() for p in (part.values() if isinstance(part, dict) else [part])):
        if isinstance(part, torch.optim.Optimizer):
            optimizers.append(part)
        else:
            tensors += part.state_dict(keep_vars=True).values() if isinstance(part, torch.nn.Module) else [part]
    assert not any(optimizer.state for optimizer in optimizers), "rolled_back: an optimizer that has stepped"
    kept = [t.detach().clone() for t in tensors]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    for tensor, value in zip(tensors, kept):
        tensor.detach().copy_(value)
    for value in (v for optimizer in optimizers for state in optimizer.state.values() for v in state.values()):
        value.zero_()  # Adam's and AdamW's: the step count and both moments


def rng_states():
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_states(states):
    states["numpy"]["state"]["key"] = states["numpy"]["state"]["key"].numpy().astype(np.uint32)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


def write_checkpoint(checkpoint, folder, script):
    """Atomically: a temporary file, flushed to the disk, renamed over the last one; an OSError is the caller's. The
    temporary files of runs killed while they wrote (kill -9: no cleanup of their own) go first."""
    remove_stale_temporaries(folder, script)
    temporary = os.path.join(folder, f".{script}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, checkpoint_file(folder, script))
        os.fsync(fd := os.open(folder, os.O_RDONLY))  # the rename itself on the disk
        os.close(fd)
    except BaseException:  # a full disk, or a second Ctrl-C: no temporary file left behind
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def remove_stale_temporaries(folder, script):
    """The `.<script>.<pid>.tmp` files of processes that no longer run."""
    for name in os.listdir(folder):
        pid = name.removeprefix(f".{script}.").removesuffix(".tmp")
        if name == f".{script}.{pid}.tmp" and pid.isdigit() and int(pid) != os.getpid() and not running(int(pid)):
            os.unlink(os.path.join(folder, name))


def running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
