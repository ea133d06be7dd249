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
    make_update_fns, make_single_env = module.make_update_fns, module.make_single_env
    events = []

    def logged(fn):
        def call(*args):
            out = fn(*args)
            events.append((fn.__name__, out))
            return out

        return call

    def logged_env(*args):
        env = make_single_env(*args)
        step = env.step

        def logged_step(action):
            events.append(("env_step", action))
            return step(action)

        env.step = logged_step
        return env

    monkeypatch.setattr(module, "make_update_fns", lambda *args: tuple(map(logged, make_update_fns(*args))))
    monkeypatch.setattr(module, "make_single_env", logged_env)
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
            assert torch.equal(torch.as_tensor(value), segment[chosen][1][0].cpu()), f"step {env_steps}: stale action"
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
        for name, got in (("policy", lambda: policy(one).cpu().numpy()), ("act", lambda: act(one[0].cpu().numpy())[None])):
            torch.manual_seed(seed)
            np.testing.assert_allclose(got(), want, atol=tol, rtol=tol, err_msg=name)


def stage_transition(rb, rng):
    """Stage one random transition in an off-policy twin's replay buffer, as its loop does after an env step."""
    n_obs, n_act = rb.fields[0].shape[1], rb.fields[1].shape[1]
    obs, next_obs, action = rng.standard_normal(n_obs), rng.standard_normal(n_obs), rng.uniform(-1, 1, n_act)
    rb.stage(obs, next_obs, action, rng.standard_normal(), float(rng.random() < 0.2))


def twin_training_steps(train, rb, steps, *flags):
    """Drive an off-policy twin as its loop does, from 8 rows stored before learning starts: each step stages a
    new transition, then runs train(actor_update, *flags) from seed i, alternating steps with and without the
    actor update. Check that each step stored the staged row and sampled its batch from the stored rows as the
    generator's draw after the seed says (a captured step must see the size grow). Yield (i, actor_update,
    copies of the batch fields), with the generator where the twin's updates began drawing, so that the
    baseline's updates on that batch draw the same numbers."""
    rng = np.random.default_rng(1)
    for _ in range(8):
        stage_transition(rb, rng)
        rb.push()
    for i in range(steps):
        stage_transition(rb, rng)
        actor_update = i % 2 == 0
        torch.manual_seed(i)
        train(actor_update, *flags)
        torch.manual_seed(i)
        stored = 9 + i
        idx = torch.randint(0, 2**62, (len(rb.batch),), device=rb.device) % stored
        assert torch.equal(rb.storage[stored - 1], rb.row[0]), "the staged transition was not stored"
        assert torch.equal(rb.batch, rb.storage[idx]), "the batch is not the sample the draw says"
        yield i, actor_update, tuple(field.clone() for field in rb.fields)


def assert_buffer_samples_stored_rows(name):
    """An off-policy twin's replay buffer samples, into its fixed batch, only the rows it holds (the last 10
    of 13 added to a buffer of 10), and all of them; its fields show each row's parts, the scalars as 1-d
    views."""
    module = load_script(name)
    rb = module.ReplayBuffer(10, 256, 3, 2, torch.device("cpu"))
    stored = []
    for i in range(13):
        obs, next_obs, action = np.full(3, i), np.full(3, 100 + i), np.full(2, 200 + i)
        rb.stage(obs, next_obs, action, 300.0 + i, float(i % 2))
        rb.push()
        stored.append(np.concatenate([obs, action, [300 + i], next_obs, [i % 2]]))
    torch.manual_seed(0)
    rb.sample()
    rows = rb.batch.numpy()
    matches = [[np.array_equal(row, s) for s in stored[3:]] for row in rows]
    assert all(any(m) for m in matches), "a sampled row that the buffer does not hold"
    assert all(any(m[j] for m in matches) for j in range(10)), "a held row never sampled in 256 draws"
    obs, actions, rewards, next_obs, dones = rb.fields
    assert rewards.shape == dones.shape == (256,)
    np.testing.assert_array_equal(rewards.numpy(), 300 + obs[:, 0].numpy())
    np.testing.assert_array_equal(next_obs.numpy(), 100 + obs.numpy())
    np.testing.assert_array_equal(dones.numpy(), obs[:, 0].numpy() % 2)
    assert actions.shape == (256, 2) and rewards.data_ptr() == rb.batch[:, 5].data_ptr()


def assert_stores_the_baseline_transitions(base, fast, monkeypatch, capsys):
    """An off-policy twin's single env (reset in the step that ends an episode) and its replay buffer store
    the baseline's transitions bit for bit: the same observations, random actions, rewards and dones, and the
    true final observation where an episode ends (Pendulum's 200-step limit, twice). Learning starts at the
    last step, so every earlier action is the env's seeded random one."""
    argv = ["--env-id", "Pendulum-v1", "--total-timesteps", "450", "--learning-starts", "449", "--batch-size", "8"]
    buffers, records = {}, {}
    for name in (base, fast):
        module = load_script(name)

        class Recording(module.ReplayBuffer):
            def __init__(self, *args):
                super().__init__(*args)
                buffers[name] = self

        monkeypatch.setattr(module, "ReplayBuffer", Recording)
        records[name] = run_main(name, argv, capsys)
    b, f = buffers[base], buffers[fast]
    rows_b = np.concatenate([b.obs, b.actions, b.rewards[:, None], b.next_obs, b.dones[:, None]], axis=1)[:450]
    rows_f = f.storage.cpu().numpy()[:450]
    assert int(f.size) == 450
    np.testing.assert_array_equal(rows_f[:449], rows_b[:449])  # the last step acts with the policy
    np.testing.assert_array_equal(rows_f[449, :3], rows_b[449, :3])
    # Where the first episode ended, the stored next observation is the final one, not the reset one.
    assert not np.array_equal(rows_f[199, -4:-1], rows_f[200, :3])
    assert records[fast]["episodic_return"] == records[base]["episodic_return"] is not None
