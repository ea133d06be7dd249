"""Time the speed tricks that have no flag of their own, each in isolation: the same computation written the
plain way (before) and with the trick (after), at SAC's sizes on HalfCheetah (17 observations, 6 actions,
256-wide MLPs, batch 256), and PPO Atari's env step (Breakout, 8 envs). Before timing, each pair is checked to
compute the same result.

    python leanrl/tools/trick_bench.py [--device cuda] [--iters 2000] [--out FILE.md]

Prints (and with --out writes) a markdown table: microseconds per call before and after, in eager mode, so
the figure is what the trick saves before torch.compile and CUDA graphs change the rest. The trick's fps
effect on a script follows from the calls per env step (docs/tricks.md).
"""

import argparse
import sys
import time

import envpool
import numpy as np
import torch
import torch.nn as nn
from tensordict import from_module, from_modules

N_OBS, N_ACT, HIDDEN, BATCH, BUFFER, TAU = 17, 6, 256, 256, 100_000, 0.005


def fail(message):
    """Bad input: one line on stderr, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def mlp(n_in, n_out, device):
    return nn.Sequential(
        nn.Linear(n_in, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, n_out)
    ).to(device)


def check_same(name, before, after):
    """Both sides must compute the same thing, or the timing compares nothing."""
    for b, a in zip(before, after, strict=True):
        if not torch.allclose(torch.as_tensor(b), torch.as_tensor(a), rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{name}: the trick changes the result")


def acting_copy(device):
    """Acting with the trained actor (its parameters require grad) against a detached copy sharing storage."""
    actor = mlp(N_OBS, N_ACT, device)
    actor_detach = mlp(N_OBS, N_ACT, "meta")
    from_module(actor).data.to_module(actor_detach)
    actor_detach.requires_grad_(False)
    obs = np.random.default_rng(0).standard_normal(N_OBS).astype(np.float32)

    def before():
        return actor(torch.as_tensor(obs, device=device)).detach().cpu().numpy()

    def after():
        return actor_detach(torch.as_tensor(obs, device=device)).cpu().numpy()

    return before, after, lambda f: (f(),)


def vmap_ensemble(device):
    """Two Q networks' forward and backward, one after the other against one vmap over stacked parameters."""
    q1, q2 = mlp(N_OBS + N_ACT, 1, device), mlp(N_OBS + N_ACT, 1, device)
    stacked = from_modules(q1, q2, as_module=True)
    params = dict(stacked.flatten_keys(".").items())
    qnet = mlp(N_OBS + N_ACT, 1, "meta")
    x = torch.randn(BATCH, N_OBS + N_ACT, device=device)
    y = torch.randn(BATCH, 1, device=device)

    def before():
        loss = ((q1(x) - y) ** 2).mean() + ((q2(x) - y) ** 2).mean()
        q1.zero_grad(set_to_none=True), q2.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    def after():
        q = torch.vmap(lambda p: torch.func.functional_call(qnet, p, (x,)))(params)
        loss = ((q - y) ** 2).mean(dim=(1, 2)).sum()
        for p in params.values():
            p.grad = None
        loss.backward()
        return loss

    def results(f):
        loss = f()
        grads = [p.grad for p in params.values()] if f is after else None
        if grads is None:
            grads = [torch.stack([a.grad, b.grad]) for a, b in zip(q1.parameters(), q2.parameters())]
        return (loss.detach(), *[g.detach().clone() for g in grads])

    return before, after, results


def lerp_targets(device):
    """CleanRL's target update, a Python loop of two ops per tensor, against one lerp_ over a TensorDict."""
    nets = [mlp(N_OBS + N_ACT, 1, device) for _ in range(2)]
    targets = [mlp(N_OBS + N_ACT, 1, device) for _ in range(2)]
    params = from_modules(*nets, as_module=True).data
    target_td = from_modules(*targets, as_module=True).data.clone()
    pairs = [(p, t) for net, tgt in zip(nets, targets) for p, t in zip(net.parameters(), tgt.parameters())]

    def before():
        for param, target_param in pairs:
            target_param.data.copy_(TAU * param.data + (1 - TAU) * target_param.data)

    def after():
        target_td.lerp_(params, TAU)

    def results(f):
        f()
        if f is before:
            return tuple(torch.stack([t for _, t in pairs[i :: len(pairs) // 2]]) for i in range(len(pairs) // 2))
        return tuple(target_td.flatten_keys(".").values())

    # target_td is a copy of the targets, so both sides start from the same values.
    return before, after, results


def device_buffer(device):
    """A batch from numpy arrays copied over field by field against a gather from one device tensor."""
    rng = np.random.default_rng(0)
    widths = [N_OBS, N_ACT, 1, N_OBS, 1]
    host = [rng.standard_normal((BUFFER, w)).astype(np.float32) for w in widths]
    storage = torch.as_tensor(np.concatenate(host, axis=1), device=device)
    idx_np = rng.integers(0, BUFFER, BATCH)
    idx = torch.as_tensor(idx_np, device=device)

    def before():
        inds = idx_np if fixed else np.random.randint(0, BUFFER, BATCH)
        return [torch.as_tensor(a[inds]).to(device) for a in host]

    def after():
        inds = idx if fixed else torch.randint(0, BUFFER, (BATCH,), device=device)
        return storage[inds].split(widths, dim=1)

    fixed = True

    def results(f):
        nonlocal fixed
        fixed = True
        out = f()
        fixed = False
        return tuple(out)

    return before, after, results


def alpha_on_device(device):
    """Reading the entropy coefficient back as a Python float each update against keeping it on the device."""
    log_alpha = torch.zeros(1, device=device, requires_grad=True)
    alpha_t = torch.ones(1, device=device)
    x = torch.randn(BATCH, HIDDEN, device=device)
    w = torch.randn(HIDDEN, HIDDEN, device=device)

    def before():
        alpha = log_alpha.exp().item()
        return (x @ w).relu().mean() * alpha

    def after():
        alpha_t.copy_(log_alpha.detach().exp())
        return (x @ w).relu().mean() * alpha_t

    return before, after, lambda f: (f().detach(),)


def envpool_overlap(device):
    """envpool's step and then the rollout writes, against send, the writes while the envs step, recv."""

    def make():
        envs = envpool.make(
            "Breakout-v5", env_type="gymnasium", num_envs=8, episodic_life=True, reward_clip=True, seed=1
        )
        envs.reset()
        return envs

    plain, split = make(), make()
    actions = np.random.default_rng(0).integers(0, plain.action_space.n, 8)
    action_t = torch.as_tensor(actions, device=device)
    value, logprob = torch.randn(8, device=device), torch.randn(8, device=device)
    storage = torch.zeros(3, 8, device=device)

    def writes():  # what PPO Atari's twin writes into its rollout each step
        storage[0] = value
        storage[1] = action_t
        storage[2] = logprob

    def before():
        obs = plain.step(actions)[0]
        writes()
        return obs

    def after():
        split.send(actions)
        writes()
        return split.recv()[0]

    return before, after, lambda f: (f(),)


TRICKS = {
    "acting copy without autograd (from_module)": acting_copy,
    "twin Q as one vmap (from_modules)": vmap_ensemble,
    "target update as one lerp_": lerp_targets,
    "on-device replay buffer sample": device_buffer,
    "alpha kept on the device (no .item())": alpha_on_device,
    "envpool send/recv around the rollout writes": envpool_overlap,
}


def per_call_us(fn, iters, device):
    for _ in range(min(20, iters)):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per side")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.iters < 1:
        fail(f"--iters must be positive, got {args.iters}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        fail(f"bad --device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")
    torch.manual_seed(0)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"Eager, {name}, torch {torch.__version__}, {args.iters} calls per side, µs per call.",
        "",
        "| trick | before | after | saved per call |",
        "|---|---|---|---|",
    ]
    rows = {}
    for trick, build in TRICKS.items():
        before, after, results = build(device)
        check_same(trick, results(before), results(after))
        b, a = per_call_us(before, args.iters, device), per_call_us(after, args.iters, device)
        rows[trick] = (b, a)
        lines.append(f"| {trick} | {b:.1f} | {a:.1f} | {b - a:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()
