"""A toy script around the harness (least squares on a stream of samples): tests/test_harness.py runs it to test the
harness once for every training script."""
import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "leanrl"))  # the harness
from harness import Run, exit_code, fail, parse_args  # noqa: E402


@dataclass
class Args:  # the toy's flags; parse_args adds the run options every script shares
    env_id: str = "LeastSquares"
    """the name the toy's runs go by"""
    total_timesteps: int = 2000
    """samples to learn from"""
    num_envs: int = 4
    """samples per step"""
    learning_rate: float = 1e-2
    """the learning rate of the optimizer"""
    step_seconds: float = 0.0
    """seconds each step (and each evaluated episode) sleeps, so that tests can interrupt a run in its loop"""
    worker_seconds: float = 0.0
    """seconds a worker thread started with the first step runs (as a compiler's pool runs its builds)"""
    capture_video: bool = False
    """record videos under videos/<run name>/ (env 0 in training; every episode of --eval-checkpoint)"""


def check_args(args):
    """What the harness's range checks leave to a script: here, whole steps."""
    if args.total_timesteps % args.num_envs:
        fail(f"--total-timesteps {args.total_timesteps} must be a multiple of --num-envs {args.num_envs}")


def train(args, run):
    torch.manual_seed(args.seed)
    weights = torch.arange(1.0, 5.0)  # what the toy learns
    model = nn.Linear(4, 1, device=run.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    seen = torch.zeros((), dtype=torch.long)  # a counter a checkpoint restores in place
    state = {"model": model, "optimizer": optimizer, "seen": seen}
    first_step = run.start(state, total_steps=args.total_timesteps, warmup_steps=8 * args.num_envs,
                           profile_steps=4 * args.num_envs, env_steps_per_call=args.num_envs)  # fmt: skip
    if args.worker_seconds:
        threading.Thread(target=time.sleep, args=(args.worker_seconds,)).start()
    for global_step in range(first_step, args.total_timesteps, args.num_envs):
        if not run.proceed(global_step):
            break
        run.phase("env_step")
        x = torch.randn(args.num_envs, 4)
        y = x @ weights
        time.sleep(args.step_seconds)
        run.phase("update")
        loss = (model(x.to(run.device)).squeeze(1) - y.to(run.device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += args.num_envs
        if (global_step // args.num_envs) % 10 == 9:
            run.episode(global_step, -loss.item(), 10)
        if run.tick(global_step + args.num_envs):
            run.log(global_step, {"losses/loss": loss.detach()})


def evaluate(args, run, saved):
    model = nn.Linear(4, 1)
    model.load_state_dict(saved["model"])
    while True:
        x = torch.randn(16, 4)
        time.sleep(args.step_seconds)
        yield -(model(x).squeeze(1) - x @ torch.arange(1.0, 5.0)).pow(2).mean().item()


def main(argv=None):
    """Train, or with --eval-checkpoint evaluate, as the arguments say; returns the record printed last."""
    args, checkpoint = parse_args(Args, __file__, argv)
    check_args(args)
    run = Run(args, __file__, checkpoint)
    if args.eval_checkpoint:
        return run.evaluation(evaluate(args, run, checkpoint["state"]))
    with run.stoppable():
        train(args, run)
    return run.finish()


if __name__ == "__main__":
    sys.exit(exit_code(main()))
