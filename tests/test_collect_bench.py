"""collect_bench.py: a tiny sweep through main() (one record per backend and size, samples/s as recorded, the table,
the figures, the backends that cannot run here skipped with their reason), and a tiny S/C sweep (Figure 9); the
trajectories the backends write, against a direct run of the script's make_collect and against the simulators
replayed; the heavier CartPole against gymnasium's; the event counts on a hand-built trace; and bad input."""

import importlib.util
import json
import os
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, load_script, run_bad_input, run_cli

from torch_classic_control import ENVS, CartPole, Envs

TOOL = "tools/collect_bench"
SCRIPT = "ppo_classic_control_gpu_torchcompile"
SIZES = ["--envs", "1", "2^2", "--steps", "1", "8", "--fixed-steps", "8", "--fixed-envs", "4"]
# The (N, K) of SIZES with --sweep both, and the figures each belongs to.
POINTS = {(1, 8): ["figure4"], (4, 8): ["figure4", "figure8"], (4, 1): ["figure8"]}
CPU = torch.device("cpu")


def importable(name):
    try:
        return importlib.util.find_spec(name) is not None and importlib.import_module(name) is not None
    except Exception:  # a package that is there but fails to import is not importable either
        return False


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """main() over every backend at the sizes of SIZES: (records, skipped, out directory)."""
    bench = load_script(TOOL)
    out = tmp_path_factory.mktemp("collect_bench")
    threads = torch.get_num_threads()
    try:
        records, skipped = bench.main([*SIZES, "--backends", *bench.BACKENDS, "--min-seconds", "0.05",
                                       "--device", "cpu", "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return records, skipped, out


def expected_skips():
    """The backends this machine cannot run, each with a fragment of the reason it must give."""
    skips = {"torch-graph-eager": "need CUDA", "torch-graph": "need CUDA"}  # the sweep runs on --device cpu
    for backend in ("envpool", "jax"):
        if not importable(backend):
            skips[backend] = f"import {backend}"
    # The Triton kernel runs on the CPU only under Triton's interpreter, which this process had to start with.
    if not importable("triton"):
        skips["torch-fused"] = "needs Triton"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        skips["torch-fused"] = "set TRITON_INTERPRET=1"
    return skips


def test_sweep_records(sweep):
    """One record per measured backend and (N, K), in the jsonl as returned; samples/s = N*K*calls/seconds, after at
    least --min-seconds; torch.compile leaves fewer aten ops per step than eager (Figure 6's point, on the CPU)."""
    bench = load_script(TOOL)
    records, _, out = sweep
    measured = [b for b in bench.BACKENDS if b not in expected_skips()]
    assert {"gymnasium", "torch-eager", "torch-compile"} <= set(measured)
    keys = [(r["backend"], r["num_envs"], r["num_steps"], r["state_factor"], r["compute_factor"]) for r in records]
    assert sorted(keys) == sorted((b, n, k, 1, 1) for b in measured for n, k in POINTS)
    assert [json.loads(line) for line in (out / "collect_bench.jsonl").read_text().splitlines()] == records
    for r in records:
        assert r["calls"] >= 1 and r["seconds"] >= 0.05 and r["warmup_seconds"] > 0
        assert r["samples_per_second"] > 0
        assert r["samples_per_second"] == pytest.approx(r["num_envs"] * r["num_steps"] * r["calls"] / r["seconds"])
        assert r["figures"] == POINTS[r["num_envs"], r["num_steps"]]
        assert r["device"] == "cpu" and r["torch"] == torch.__version__ and r["date"]
        assert r["kernels_per_step"] is None and r["launches_per_step"] is None  # no GPU to count on
        assert (r["aten_ops_per_step"] is None) == (r["backend"] == "jax")
    ops = {(r["backend"], r["num_envs"], r["num_steps"]): r["aten_ops_per_step"] for r in records}
    for n, k in POINTS:
        assert 0 < ops["torch-compile", n, k] < ops["torch-eager", n, k]


def test_sweep_skips_and_outputs(sweep):
    """What cannot run here is skipped with its reason, printed in the table; the table has a row per record as
    recorded; both figures are written."""
    records, skipped, out = sweep
    reasons = dict(skipped)
    assert set(reasons) == set(expected_skips())
    for backend, fragment in expected_skips().items():
        assert fragment in reasons[backend], reasons[backend]
    md = (out / "collect_bench.md").read_text()
    assert "| backend | N | K | S | C | samples/s | calls | warm-up s | kernels per step |" in md
    for r in records:
        row = f"| {r['backend']} | {r['num_envs']} | {r['num_steps']} | 1 | 1 | {r['samples_per_second']:,.0f} |"
        assert row in md, row
    for backend, reason in skipped:
        assert f"- {backend}: {reason}" in md
    assert ("## Torch against JAX" in md) == any(r["backend"] == "jax" for r in records)
    for figure in ("figure4.png", "figure8.png"):
        png = (out / figure).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_other_envs_skip_the_cartpole_backends(tmp_path, workdir):
    """Acrobot: the torch backends measure it; gymnasium, envpool and jax are CartPole only, and say so."""
    bench = load_script(TOOL)
    argv = ["--env-id", "Acrobot-v1", "--envs", "2", "--sweep", "n", "--fixed-steps", "2", "--min-seconds", "0"]
    argv += ["--backends", "torch-eager,gymnasium", "envpool", "jax", "--out", str(tmp_path)]
    records, skipped = bench.main(argv)
    assert [(r["backend"], r["env_id"], r["num_envs"], r["num_steps"]) for r in records] == [
        ("torch-eager", "Acrobot-v1", 2, 2)
    ]
    assert [backend for backend, _ in skipped] == ["gymnasium", "envpool", "jax"]
    assert all("CartPole-v1 only" in reason for _, reason in skipped)
    assert (tmp_path / "figure4.png").exists() and not (tmp_path / "figure8.png").exists()


def test_state_and_compute_sweep(tmp_path):
    """--sweep sc (Figure 9): S at C = 1 and C at S = 1, at --fixed-envs and --fixed-steps, each point once; the
    heavier points run the heavier CartPole, whose state holds every cart; the CPU simulators have none, and say
    so; figure9.png is written."""
    bench = load_script(TOOL)
    argv = ["--sweep", "sc", "--fixed-envs", "3", "--fixed-steps", "4", "--state-factors", "1", "2",
            "--compute-factors", "1", "5", "--backends", "torch-eager", "gymnasium", "--min-seconds", "0",
            "--out", str(tmp_path)]  # fmt: skip
    records, skipped = bench.main(argv)
    points = [(1, 1), (2, 1), (1, 5)]
    assert [(r["backend"], r["num_envs"], r["num_steps"], r["state_factor"], r["compute_factor"]) for r in records] == [
        ("gymnasium", 3, 4, 1, 1), *[("torch-eager", 3, 4, s, c) for s, c in points]
    ]
    assert [r["env_id"] for r in records[1:]] == ["CartPole-v1", "CartPole-v1-S2-C1", "CartPole-v1-S1-C5"]
    assert all(r["figures"] == ["figure9"] for r in records)
    assert skipped == [(f"gymnasium N=3 K=4 S={s} C={c}", "no heavier CartPole") for s, c in points[1:]]
    assert ENVS["CartPole-v1-S2-C1"].n_noise == 8
    assert "| torch-eager | 3 | 4 | 2 | 1 |" in (tmp_path / "collect_bench.md").read_text()
    assert (tmp_path / "figure9.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "figure4.png").exists()


def test_heavier_cartpole_is_gymnasium_substepped():
    """Each cart of the heavier CartPole, over one step, is gymnasium's CartPole with tau / C stepped C times with
    the action; the episode ends where any cart's would; the policy sees cart 0; the reset draws every cart."""
    tool = load_script(TOOL)
    copies, substeps = 4, 3
    heavier = ENVS[tool.heavier_cartpole(copies, substeps)]
    n = 64
    torch.manual_seed(0)
    state = heavier.initial(torch.rand(n, heavier.n_noise)) * 5  # spread out, so that some carts end
    assert state.shape == (n, 4 * copies) and heavier.observe(state).shape == (n, 4)
    actions = torch.randint(0, 2, (n,))
    stepped, reward, terminated = heavier.step(state, actions)
    env = gym.make("CartPole-v1").unwrapped
    env.tau = heavier.tau / substeps
    env.reset(seed=0)
    ended = torch.zeros(n, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium warns when a terminated cart is stepped again
        for i in range(n):
            for j in range(copies):
                env.state = state[i, j::copies].double().numpy()
                for _ in range(substeps):
                    obs, _, cart_ended, _, _ = env.step(int(actions[i]))
                torch.testing.assert_close(stepped[i, j::copies], torch.as_tensor(obs), rtol=1e-4, atol=1e-5)
                ended[i] |= cart_ended
    assert torch.equal(terminated, ended) and 0 < ended.sum() < n
    assert torch.equal(heavier.observe(state), state[:, ::copies]) and (reward == 1).all()


def direct_rollout(n, k, seed, calls):
    """The script's own collect in eager mode, built as its train() builds it, after `calls` calls."""
    script = load_script(SCRIPT)
    args = script.Args(num_envs=n, num_steps=k)
    torch.manual_seed(seed)
    envs = Envs(args.env_id, n, CPU)
    agent = script.Agent(args, envs.physics.n_obs, envs.physics.n_act, CPU)
    _, _, policy, _ = script.make_update_fns(agent, args)
    rollout = script.Rollout(k, n, envs.physics.n_obs, CPU)
    rollout.obs[-1] = envs.observe()
    collect = script.make_collect(policy, envs, rollout, args)
    for _ in range(calls):
        collect()
    return rollout, agent.net


ROLLOUT = ("obs", "actions", "logprobs", "rewards", "dones", "values")


def assert_policy_wrote(net, obs, actions, logprobs, values):
    """The actions, their log-probabilities and the values written are the network's on the observations acted on."""
    obs, actions = torch.as_tensor(np.asarray(obs)), torch.as_tensor(np.asarray(actions)).long()
    n_act = net.actor[-1].out_features
    assert ((actions >= 0) & (actions < n_act)).all()
    with torch.no_grad():
        _, logprob, _, value = net.get_action_and_value(obs.flatten(0, 1), actions.flatten())
    torch.testing.assert_close(torch.as_tensor(np.asarray(logprobs)).flatten(), logprob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.as_tensor(np.asarray(values)).flatten(), value.flatten(), rtol=1e-5, atol=1e-5)


def test_torch_eager_writes_the_scripts_trajectory():
    """Two calls of the bench's torch-eager collect leave the rollout a direct make_collect run leaves, tensor for
    tensor, and the trajectory is the network's and the env's, not the zeros it started from."""
    bench = load_script(TOOL).build("torch-eager", "CartPole-v1", 4, 8, CPU, seed=3)
    for _ in range(2):
        bench.collect()
    expected, _ = direct_rollout(4, 8, seed=3, calls=2)
    for name in ROLLOUT:
        assert torch.equal(getattr(bench.rollout, name), getattr(expected, name)), name
    r = bench.rollout
    assert (r.obs[1:].abs().sum(-1) > 0).all() and (r.rewards == 1).all()
    assert_policy_wrote(bench.net, r.obs[:-1], r.actions, r.logprobs, r.values)


def test_torch_compile_writes_the_eager_trajectory(eager_random):
    """The compiled collect the bench times collects what the eager one does (random numbers drawn as eager's)."""
    bench = load_script(TOOL).build("torch-compile", "CartPole-v1", 4, 8, CPU, seed=3)
    for _ in range(2):
        bench.collect()
    expected, _ = direct_rollout(4, 8, seed=3, calls=2)
    for name in ROLLOUT:
        torch.testing.assert_close(getattr(bench.rollout, name), getattr(expected, name), msg=name)


@pytest.mark.parametrize("backend", ["gymnasium", "envpool"])
def test_simulator_backends_write_what_the_simulator_gives(backend):
    """Replaying the recorded actions in a fresh simulator from the same seed gives the recorded observations,
    rewards and dones; the policy's part is the network's, the same network as the torch backends'."""
    if not importable(backend):
        pytest.skip(f"{backend} does not import here")
    tool = load_script(TOOL)
    bench = tool.build(backend, "CartPole-v1", 4, 16, CPU, seed=3)
    bench.collect()
    r = bench.rollout
    envs, obs, _ = tool.make_simulator(backend, 4, seed=3)
    np.testing.assert_array_equal(r.obs[0].numpy(), obs)
    for t in range(16):
        obs, reward, terminated, truncated, _ = envs.step(r.actions[t].numpy())
        np.testing.assert_array_equal(r.obs[t + 1].numpy(), obs)
        np.testing.assert_array_equal(r.rewards[t].numpy(), reward)
        np.testing.assert_array_equal(r.dones[t + 1].numpy(), terminated | truncated)
    assert_policy_wrote(bench.net, r.obs[:-1], r.actions, r.logprobs, r.values)
    _, torch_net = direct_rollout(4, 16, seed=3, calls=0)
    for name, value in torch_net.state_dict().items():
        assert torch.equal(bench.net.state_dict()[name], value), name


@pytest.mark.skipif(not importable("jax"), reason="jax does not import here")
def test_jax_runs_the_scripts_cartpole_and_network():
    """JAX's trajectory follows torch_classic_control's CartPole step by step (its physics where no episode ended; a
    fresh start where one did, for the reason Envs ends one), acts with the torch network's weights, and
    carries on from where the last call ended."""
    tool = load_script(TOOL)
    n, k = 16, 64
    bench = tool.build("jax", "CartPole-v1", n, k, CPU, seed=3)
    # Ten steps short of the time limit, so that it ends every episode not ended before (a random policy's never
    # last 500 steps).
    state, elapsed, episode_return, ended, key = bench.carry
    bench.carry = (state, elapsed + CartPole.max_episode_steps - 10, episode_return, ended, key)
    calls = []
    for _ in range(2):
        bench.collect()
        bench.sync()
        calls.append({name: np.asarray(value) for name, value in bench.rollout.items()})
    traj = {name: np.concatenate([c[name] for c in calls]) for name in calls[0]}
    _, torch_net = direct_rollout(n, k, seed=3, calls=0)
    for name, value in torch_net.state_dict().items():
        assert torch.equal(bench.net.state_dict()[name], value), name
    assert_policy_wrote(torch_net, traj["obs"], traj["actions"], traj["logprobs"], traj["values"])
    assert (traj["rewards"] == 1).all() and traj["dones"].any()
    assert traj["dones"][:10].any(0).all()
    obs, actions = torch.as_tensor(traj["obs"]), torch.as_tensor(traj["actions"]).long()
    elapsed = torch.full((n,), CartPole.max_episode_steps - 10, dtype=torch.int32)
    for t in range(2 * k - 1):
        stepped, _, terminated = CartPole.step(obs[t], actions[t])
        elapsed += 1
        done = terminated | (elapsed >= CartPole.max_episode_steps)
        assert torch.equal(done.float(), torch.as_tensor(traj["dones"][t])), t
        torch.testing.assert_close(obs[t + 1][~done], stepped[~done], rtol=1e-5, atol=1e-6)
        assert ((obs[t + 1][done] >= -0.05) & (obs[t + 1][done] < 0.05)).all()
        elapsed[done] = 0


def test_count_events():
    """Per env step: kernels the GPU ran (a graph replay's each), the CUDA API calls that launch, and the aten ops
    called from outside another aten op, per thread."""
    tool = load_script(TOOL)

    def x(name, cat, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        x("aten::linear", "cpu_op", 0, 10),
        x("aten::addmm", "cpu_op", 2, 5),  # inside linear: not a call of its own
        x("aten::tanh", "cpu_op", 10, 3),  # starts as linear ends
        x("aten::rand", "cpu_op", 4, 2, tid=2),  # another thread
        x("Torch-Compiled Region", "cpu_op", 20, 5),  # not an aten op
        x("cudaLaunchKernel", "cuda_runtime", 3, 1),
        x("cuLaunchKernel", "cuda_driver", 11, 1),
        x("cudaGraphLaunch", "cuda_runtime", 21, 1),
        x("cudaMemcpyAsync", "cuda_runtime", 22, 1),
        *[x(f"kernel{i}", "kernel", 30 + i, 1, tid=7) for i in range(6)],
        x("Memcpy HtoD", "gpu_memcpy", 40, 1, tid=7),
    ]
    assert tool.count_events(events, steps=2) == {"kernels_per_step": 3.0, "launches_per_step": 1.5,
                                                  "aten_ops_per_step": 1.5}  # fmt: skip


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--envs", "0"], "--envs 0 must be positive"),
        (["--steps", "4", "-8"], "--steps -8 must be positive"),
        (["--fixed-envs", "many"], "--fixed-envs 'many' is not a whole number"),
        (["--backends", "torch-eager,pytorch"], "--backends 'pytorch'"),
        (["--env-id", "Pendulum-v1"], "--env-id 'Pendulum-v1'"),
        (["--min-seconds", "-1"], "--min-seconds -1.0"),
        (["--min-seconds", "1e39"], "--min-seconds 1e+39 must be at most 86400"),
        (["--sweep", "x"], "--sweep"),
        (["--sweep", "sc", "--env-id", "Acrobot-v1"], "--sweep sc weighs CartPole-v1 down, not Acrobot-v1"),
        (["--state-factors", "1", "3"], "--state-factors 3 is not a power of two"),
        (["--seed", "-1"], "--seed -1 must be 0 or more"),
    ],
)
def test_bad_input(argv, fragment, capsys, tmp_path):
    """Refused before anything is measured or written."""
    assert_one_line_error(run_bad_input(TOOL, [*argv, "--out", str(tmp_path)], capsys), fragment)
    assert not any(tmp_path.iterdir())


def test_bad_input_cli(tmp_path, capsys):
    assert_one_line_error(run_cli(TOOL, "--steps", "0", "--out", tmp_path), "--steps 0 must be positive")
    assert_one_line_error(run_bad_input(TOOL, ["--envs", "4"], capsys), "--out")


def test_nothing_measured_is_an_error(tmp_path, monkeypatch):
    """Every point skipped (the fused kernel on a CPU without Triton's interpreter): its reason, and exit code 1, not a
    table with no row and exit code 0."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    proc = run_cli(TOOL, "--backends", "torch-fused", "--device", "cpu", "--sweep", "n", "--envs", "2", "--fixed-steps",
                   "2", "--min-seconds", "0", "--no-kernels", "--out", tmp_path)  # fmt: skip
    assert proc.returncode == 1 and "skipped torch-fused" in proc.stdout, proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: nothing was measured: every point was skipped (the lines above say why)"


def test_help_gives_defaults_but_not_a_switchs():
    """--help: each option's default, but no "(default: True)" after --no-kernels, which turns the count off."""
    help_text = run_cli(TOOL, "--help").stdout
    assert "(default: " in help_text
    assert "--no-kernels          skip the profiled call that counts kernels per step\n" in help_text
