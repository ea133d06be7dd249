"""Shared helpers for the tests: load a training script as a module, run it, read its speed record."""

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "leanrl"
RECORD_KEYS = {
    "script", "env_id", "seed", "compile", "cudagraphs", "device", "gpu", "cpu_count", "torch",
    "total_timesteps", "fps", "fps_overall", "warmup_seconds", "wall_seconds", "episodic_return", "return_curve",
}  # fmt: skip
# Bad input that every off-policy script (SAC, TD3) refuses: (argv, fragments the error line must name).
OFF_POLICY_BAD_INPUT = [
    (["--env-id", "NoSuchEnv-v0"], ["NoSuchEnv-v0"]),
    (["--env-id", "CartPole-v1"], ["CartPole-v1", "continuous"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--learning-starts", "2000", "--total-timesteps", "1000"], ["--learning-starts"]),
]
# A tiny off-policy run (SAC, TD3) that passes learning starts, warm-up and a measured window.
OFF_POLICY_TINY = ["--total-timesteps", "320", "--learning-starts", "64", "--batch-size", "16", "--buffer-size", "1000"]
# The four modes of a compiled script.
MODES = [[], ["--compile"], ["--cudagraphs"], ["--compile", "--cudagraphs"]]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@functools.cache
def load_script(name):
    """Import leanrl/<name>.py as a module, without running its main()."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(name, argv, capsys):
    """Run a script's main() in this process; check the speed-record contract and return the record."""
    record = load_script(name).main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == record, "the last stdout line must be the speed record"
    assert set(record) == RECORD_KEYS
    assert record["script"] == name and record["total_timesteps"] > 0
    return record


def run_mode(name, argv, mode, capsys):
    """Run a compiled twin in one of MODES; its record says which flags took effect and return it."""
    record = run_main(name, argv + mode, capsys)
    assert record["compile"] == ("--compile" in mode)
    # Without CUDA, --cudagraphs falls back to running without graphs and says so in the record.
    assert record["cudagraphs"] == ("--cudagraphs" in mode and torch.cuda.is_available())
    return record


def run_cli(name, *argv):
    """Run a script as a user does, in a subprocess."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / f"{name}.py"), *argv], capture_output=True, text=True, timeout=600
    )


def assert_one_line_error(proc, *fragments):
    """Bad input: a non-zero exit and one 'error:' line naming the problem, no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def assert_same_update(before, expected, actual, rtol=5e-2, name=""):
    """The compiled twin moved a tensor as the baseline did: the gap between the two results is at most
    rtol (5%) of the baseline's own change. Element-wise tolerances do not fit after Adam steps: Adam divides by
    the gradient's running scale, so float rounding in a near-zero gradient can move one element by a good
    part of the learning rate, while a real difference in the algorithm moves the whole update."""
    change = (expected.double() - before.double()).norm()
    gap = (actual.double().to(expected.device) - expected.double()).norm()
    assert gap <= rtol * change + 1e-7, f"{name}: gap {gap:.3g} against a change of {change:.3g}"


def assert_cudagraphs_fallback(name, *argv):
    """--cudagraphs without CUDA: one warning line, a normal run, and a record that says no graphs were used."""
    proc = run_cli(name, *argv, "--cudagraphs", "--no-cuda")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("--cudagraphs needs CUDA") == 1
    assert json.loads(proc.stdout.strip().splitlines()[-1])["cudagraphs"] is False


def assert_acts_with_current_actor(name, argv, monkeypatch, capsys):
    """SAC's and TD3's twins choose the next action before an update that leaves the actor unchanged. Check,
    running the twin without flags: from learning starts on, each env step takes the action of the one policy
    call made since the previous env step, no actor update comes after that call, and some calls do come before
    a critic update (the acting ahead happens)."""
    module = load_script(name)
    make_update_fns, make_envs = module.make_update_fns, module.make_envs
    events = []

    def logged(fn):
        def call(*args):
            out = fn(*args)
            events.append((fn.__name__, out))
            return out

        return call

    def logged_envs(*args):
        envs = make_envs(*args)
        step = envs.step

        def logged_step(actions):
            events.append(("env_step", actions))
            return step(actions)

        envs.step = logged_step
        return envs

    monkeypatch.setattr(module, "make_update_fns", lambda *args: tuple(map(logged, make_update_fns(*args))))
    monkeypatch.setattr(module, "make_envs", logged_envs)
    run_main(name, argv, capsys)

    learning_starts = int(argv[argv.index("--learning-starts") + 1])
    segment, env_steps, acted_ahead = [], 0, 0
    for event, value in events:
        if event != "env_step":
            segment.append((event, value))
            continue
        calls = [e for e, _ in segment]
        if env_steps < learning_starts:
            assert "policy" not in calls, f"step {env_steps}: random actions before learning starts"
        else:
            assert calls.count("policy") == 1, f"step {env_steps}: {calls}"
            chosen = calls.index("policy")
            assert not any(c.startswith("update_actor") for c in calls[chosen:]), f"step {env_steps}: {calls}"
            acted_ahead += "update_critic" in calls[chosen:]
            assert torch.equal(torch.as_tensor(value), segment[chosen][1].cpu()), f"step {env_steps}: stale action"
        segment, env_steps = [], env_steps + 1
    assert env_steps == int(argv[argv.index("--total-timesteps") + 1])
    assert acted_ahead > 0


def assert_acts_as_expected(expected, policy, act, obs, tol):
    """An off-policy twin's policy, and make_act's round trip around it (pinned copies; under --cudagraphs
    captured with the policy), give the expected action for one env's observation, draw for draw. Five
    observations: the calls cover warm-up, capture and replays that must read each new observation."""
    for seed in range(5):
        one = obs[seed : seed + 1]
        torch.manual_seed(seed)
        want = expected(one)
        for name, got in (("policy", lambda: policy(one).cpu().numpy()), ("act", lambda: act(one.cpu().numpy()))):
            torch.manual_seed(seed)
            np.testing.assert_allclose(got(), want, atol=tol, rtol=tol, err_msg=name)


def fill(fields, batch):
    """Write a batch into an off-policy twin's fixed batch tensors (its replay buffer's fields)."""
    for field, x in zip(fields, batch, strict=True):
        field.copy_(x)


def assert_buffer_samples_stored_rows(name):
    """An off-policy twin's replay buffer samples, into its fixed batch, only rows it stored, and all of them
    in time; its fields show each row's parts, the scalars as 1-d views."""
    module = load_script(name)
    rb = module.ReplayBuffer(10, 64, 3, 2, torch.device("cpu"))
    stored = []
    for i in range(3):
        obs, next_obs, action = np.full(3, i), np.full(3, 10 + i), np.full(2, 20 + i)
        rb.add(obs, next_obs, action, 30.0 + i, float(i % 2))
        stored.append(np.concatenate([obs, action, [30 + i], next_obs, [i % 2]]))
    rb.sample()
    rows = rb.batch.numpy()
    matches = [[np.array_equal(row, s) for s in stored] for row in rows]
    assert all(any(m) for m in matches), "a sampled row that was never stored"
    assert all(any(m[j] for m in matches) for j in range(3)), "a stored row never sampled in 64 draws"
    obs, actions, rewards, next_obs, dones = rb.fields
    assert rewards.shape == dones.shape == (64,)
    np.testing.assert_array_equal(rewards.numpy(), 30 + obs[:, 0].numpy())
    np.testing.assert_array_equal(next_obs.numpy(), 10 + obs.numpy())
    np.testing.assert_array_equal(dones.numpy(), obs[:, 0].numpy() % 2)
    assert actions.shape == (64, 2) and rewards.data_ptr() == rb.batch[:, 5].data_ptr()
