"""Time the speed tricks that have no flag of their own, each in isolation: the same computation written the
plain way (before) and with the trick (after), at SAC's sizes on HalfCheetah (17 observations, 6 actions,
256-wide MLPs, batch 256), and PPO Atari's env step (Breakout, 8 envs). Before timing, each pair is checked to
compute the same result.

    python leanrl/tools/trick_bench.py [--device cuda] [--iters 2000] [--out FILE.md]

Prints (and with --out writes) a markdown table: microseconds per call before and after, in eager mode, so
the figure is what the trick saves before torch.compile and CUDA graphs change the rest. The trick's fps
effect on a script follows from the calls per env step (docs/tricks.md).
"""

import envpool
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from benchkit import Parser, count, markdown_table, measure, synchronizer, torch_device, writable_file, write_lines

N_OBS, N_ACT, HIDDEN, BATCH, BUFFER, TAU = 17, 6, 256, 256, 100_000, 0.005


def mlp(n_in, n_out, device):
    return nn.Sequential(
        nn.Linear(n_in, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, n_out)
    ).to(device)


def check_same(name, before, after):
    """Both sides must compute the same thing, or the timing compares nothing."""
    for b, a in zip(before, after, strict=True):
        if not torch.allclose(torch.as_tensor(b), torch.as_tensor(a), rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{name}: the trick changes the result")


class QNetwork(nn.Module):
    """SAC's and TD3's Q network: the observation and action concatenated, then a 256-256 MLP."""

    def __init__(self, device):
        super().__init__()
        self.fc1 = nn.Linear(N_OBS + N_ACT, HIDDEN, device=device)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN, device=device)
        self.fc3 = nn.Linear(HIDDEN, 1, device=device)

    def forward(self, x, a):
        x = torch.cat([x, a], 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def acting_no_grad(device):
    """Acting with the trained actor as it is (its parameters require grad, so each call records an autograd
    graph) against the same call under torch.no_grad(), as the twins' policies act."""
    actor = mlp(N_OBS, N_ACT, device)
    obs = np.random.default_rng(0).standard_normal(N_OBS).astype(np.float32)

    def before():
        return actor(torch.as_tensor(obs, device=device)).detach().cpu().numpy()

    def after():
        with torch.no_grad():
            return actor(torch.as_tensor(obs, device=device)).cpu().numpy()

    return before, after, lambda f: (f(),)


def vmap_ensemble(device):
    """Two Q networks' forward and backward, one after the other, against one vmap of functional_call over their
    parameters stacked by torch.func.stack_module_state, evaluated through a network without storage (meta), as
    the SAC and TD3 twins do."""
    q1, q2 = QNetwork(device), QNetwork(device)
    params, _ = torch.func.stack_module_state([q1, q2])  # {name: (2, ...) leaf tensor}, a copy of both
    qnet = QNetwork("meta")
    obs = torch.randn(BATCH, N_OBS, device=device)
    act = torch.randn(BATCH, N_ACT, device=device)
    y = torch.randn(BATCH, device=device)

    def before():
        loss = F.mse_loss(q1(obs, act).view(-1), y) + F.mse_loss(q2(obs, act).view(-1), y)
        q1.zero_grad(set_to_none=True), q2.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    def after():
        q = torch.vmap(lambda p: torch.func.functional_call(qnet, p, (obs, act)))(params)
        q1_values, q2_values = q.view(2, -1)
        loss = F.mse_loss(q1_values, y) + F.mse_loss(q2_values, y)
        for p in params.values():
            p.grad = None
        loss.backward()
        return loss

    def results(f):
        loss = f()
        if f is before:
            grads = [torch.stack([a.grad, b.grad]) for a, b in zip(q1.parameters(), q2.parameters())]
        else:
            grads = [p.grad for p in params.values()]
        return (loss.detach(), *[g.detach().clone() for g in grads])

    return before, after, results


def lerp_targets(device):
    """CleanRL's target update, a Python loop of two ops per tensor, against one torch._foreach_lerp_ over the
    lists of target and live tensors, as the SAC and TD3 twins update their stacked Q targets."""
    nets = [QNetwork(device) for _ in range(2)]
    targets = [QNetwork(device) for _ in range(2)]
    qnet_params, _ = torch.func.stack_module_state(nets)
    qnet_target = {name: p.detach().clone() for name, p in torch.func.stack_module_state(targets)[0].items()}
    pairs = [(p, t) for net, tgt in zip(nets, targets) for p, t in zip(net.parameters(), tgt.parameters())]

    def before():
        for param, target_param in pairs:
            target_param.data.copy_(TAU * param.data + (1 - TAU) * target_param.data)

    def after():
        sources = [p.detach() for p in qnet_params.values()]
        torch._foreach_lerp_(list(qnet_target.values()), sources, TAU)

    def results(f):
        f()
        if f is before:
            return tuple(torch.stack([t for _, t in pairs[i :: len(pairs) // 2]]) for i in range(len(pairs) // 2))
        return tuple(qnet_target.values())

    # qnet_target is a copy of the targets, so both sides start from the same values.
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
    "acting under torch.no_grad()": acting_no_grad,
    "twin Q as one vmap (stack_module_state)": vmap_ensemble,
    "target update as one lerp_": lerp_targets,
    "on-device replay buffer sample": device_buffer,
    "alpha kept on the device (no .item())": alpha_on_device,
    "envpool send/recv around the rollout writes": envpool_overlap,
}


def per_call_us(fn, iters, device):
    """Microseconds per call of fn over iters calls, after up to 20 calls of warm-up."""
    _, _, seconds = measure(fn, synchronizer(device), min(20, iters), min_calls=iters)
    return seconds / iters * 1e6


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=count("--iters"), default=2000, help="timed calls per side")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    device = torch_device(args.device)
    if args.out is not None:
        writable_file("--out", args.out)
    torch.manual_seed(0)

    rows = {}
    for trick, build in TRICKS.items():
        before, after, results = build(device)
        check_same(trick, results(before), results(after))
        rows[trick] = per_call_us(before, args.iters, device), per_call_us(after, args.iters, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"Eager, {name}, torch {torch.__version__}, {args.iters} calls per side, µs per call.", ""]
    cells = [[trick, f"{b:.1f}", f"{a:.1f}", f"{b - a:.1f}"] for trick, (b, a) in rows.items()]
    lines += markdown_table(["trick", "before", "after", "saved per call"], cells)
    print("\n".join(lines))
    if args.out:
        write_lines(args.out, lines)
    return rows


if __name__ == "__main__":
    main()
