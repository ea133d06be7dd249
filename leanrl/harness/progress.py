"""What a run shows: a one-line error for bad input, the progress bar or lines, the mean return and its curve, the
scalars logged to TensorBoard (which --track mirrors to wandb, as in CleanRL)."""

import os
import sys
from collections import deque

import numpy as np
import torch
import tqdm


PROGRESS_SECONDS, CONSOLE_SECONDS = 1.0, 10.0  # the bar's refresh; a progress line off a terminal
CURVE_POINTS, CURVE_SECONDS = 50, 10.0  # a return curve point every 1/50 of the run, and at least every 10 s


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class ScalarLog:
    def __init__(self, args, run_name):
        self.writer = self.wandb = None
        if args.track:  # before the writer: wandb mirrors the writers made after it
            import wandb

            try:
                self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name,
                                        config=vars(args), sync_tensorboard=True, settings=wandb.Settings(silent=True))
            except Exception as e:  # no `wandb login`, WANDB_API_KEY or WANDB_MODE=offline; no network
                fail(f"--track: wandb did not start: {str(e).splitlines()[0]} (WANDB_MODE=offline logs without an "
                     "account or network)")
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join("runs", run_name))
            table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
            self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)

    def log(self, step, scalars):
        """Tensors read back together, in one sync; returns the scalars as floats."""
        tensors = [key for key, value in scalars.items() if isinstance(value, torch.Tensor)]
        if tensors:
            values = torch.stack([scalars[key].detach().float().reshape(()).cpu() for key in tensors]).tolist()
            scalars = {**scalars, **dict(zip(tensors, values))}
        for key, value in scalars.items() if self.writer else ():
            self.writer.add_scalar(key, value, step)
        return scalars

    def close(self):
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()


class Progress:
    """A bar on a terminal; elsewhere (logs, CI) a line every CONSOLE_SECONDS. No eta before the fps is steady: the
    bar shows ours, not tqdm's, which would count the warm-up's rate."""

    def __init__(self, script, first_step, total_steps, returns, curve, t_start):
        self.script, self.total_steps, self.t_start = script, total_steps, t_start
        self.returns, self.curve = deque(returns, maxlen=20), curve  # curve: [env step, seconds, mean return]
        self.t_shown = self.t_line = 0.0
        self.bar = tqdm.tqdm(total=total_steps, initial=first_step, unit="step", unit_scale=True, disable=None,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")  # fmt: skip

    def mean_return(self):
        return round(float(np.mean(self.returns)), 2) if self.returns else None

    def add_point(self, step, now):
        if self.returns and (not self.curve or self.curve[-1][0] < step):
            self.curve.append([step, round(now - self.t_start, 3), self.mean_return()])

    def due(self, step, now):
        """The curve's point when due; True every PROGRESS_SECONDS, when the progress is shown."""
        last_step, last_time = self.curve[-1][:2] if self.curve else (0, 0.0)
        fraction = CURVE_POINTS * step // self.total_steps > CURVE_POINTS * last_step // self.total_steps
        if fraction or now - self.t_start - last_time >= CURVE_SECONDS:
            self.add_point(step, now)
        return now - self.t_shown >= PROGRESS_SECONDS

    def show(self, step, now, fps, steady):
        self.t_shown = now
        status, mean = f"fps {fps:.0f}" if steady else "warm-up", self.mean_return()
        status += "" if mean is None else f", return {mean}"
        status += f", eta {(self.total_steps - step) / max(fps, 1e-9) / 60:.1f} min" if steady else ""
        self.bar.set_postfix_str(status, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.bar.disable and now - self.t_line >= CONSOLE_SECONDS:
            self.t_line = now
            print(f"{self.script}: {step}/{self.total_steps} steps, {status}", file=sys.stderr, flush=True)

    def close(self, step, now):
        self.add_point(step, now)  # the curve ends where the run did
        self.bar.update(step - self.bar.n)
        self.bar.close()
