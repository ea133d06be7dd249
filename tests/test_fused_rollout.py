"""fused_rollout.py, the rollout of ppo_classic_control_gpu_torchcompile.py --fused-rollout as one Triton kernel, on
the CPU through Triton's interpreter: from the same parameters, env states and uniform numbers, its trajectory and
episode sums are the torch rollout's (the twin's make_collect) on every env, and on collect_bench's heavier CartPole;
its own Philox stream repeats from the seed and samples the policy; the bench's torch-fused backend collects what the
script does; the script trains with it end to end; bad input. The same comparison on CUDA, where there is one.

Triton decides between compiling and interpreting when a kernel is defined (as fused_rollout is imported), its own
(tl.rand, tl.argmax, ...) at its first import: a process that imported it without TRITON_INTERPRET=1 (any test that
loaded the script) cannot switch. The interpreter's checks therefore run in a new Python started with it
(in_interpreter); the runs of the script set it for theirs through monkeypatch, which restores it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import RECORD_KEYS, SCRIPTS, assert_one_line_error, load_script, requires_cuda, run_bad_input, run_cli

import fused_rollout
from torch_classic_control import ENVS, Envs

pytest.importorskip("triton", reason="--fused-rollout needs Triton (requirements-dev.txt)")

FAST, TOOL = "ppo_classic_control_gpu_torchcompile", "tools/collect_bench"
ROLLOUT = ("obs", "actions", "logprobs", "rewards", "dones", "values")
ENVS_STATE = ("state", "elapsed", "episode_return", "ended")
# Small enough for the interpreter (a second or two a rollout), long enough that episodes end: random CartPole
# episodes last about 20 steps, and half the envs start fewer than num_steps steps short of the time limit.
NUM_ENVS = 12
# collect_bench's heavier CartPole (Figure 9): 4 carts per env, 3 Euler substeps per step.
HEAVIER = "CartPole-v1-S4-C3"
NUM_STEPS = {"CartPole-v1": 48, "Acrobot-v1": 24, "MountainCar-v0": 24, HEAVIER: 32}
# States one step short of termination, which random Acrobot and MountainCar episodes of a few dozen steps never
# reach: the link upright (-cos(t1) - cos(t1 + t2) is about 1.98 > 1), the car at 0.49 moving right at 0.05.
NEAR_GOAL = {"Acrobot-v1": (3.0, 0.0, 0.0, 0.0), "MountainCar-v0": (0.49, 0.05)}
NEAR_GOAL_ENVS = slice(NUM_ENVS // 2, NUM_ENVS // 2 + 3)
TINY = ["--num-envs", "8", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1",
        "--total-timesteps", str(5 * 8 * 16), "--no-tensorboard"]  # fmt: skip


def in_interpreter(check, *args):
    """check(*args), a function of this module, in a new Python with TRITON_INTERPRET=1; its failure is this one.
    leanrl/ goes on its sys.path first, as conftest.py puts it on this one's."""
    code = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import {Path(__file__).stem} as module; "
            f"module.{check.__name__}(*{args!r})")  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def make_pair(env_id, num_steps, device, seed=0):
    """One agent, and two copies of the same envs (half of them near their time limit) with a rollout each, the
    first collected by the twin's make_collect, the second by make_fused_collect: agent, [(envs, rollout, collect)]
    * 2. The heavier CartPole is collect_bench's, registered in torch_classic_control's ENVS."""
    script = load_script(FAST)
    if env_id == HEAVIER:
        assert load_script(TOOL).heavier_cartpole(4, 3) == HEAVIER
    args = script.Args(env_id=env_id, num_envs=NUM_ENVS, num_steps=num_steps, fused_rollout=True)
    torch.manual_seed(seed)
    physics = ENVS[env_id]
    agent = script.Agent(args, physics.n_obs, physics.n_act, device)
    _, _, policy, _ = script.make_update_fns(agent, args)
    elapsed = torch.randint(0, physics.max_episode_steps, (NUM_ENVS,), dtype=torch.int32)
    elapsed[: NUM_ENVS // 2] = physics.max_episode_steps - torch.randint(1, num_steps, (NUM_ENVS // 2,))
    if env_id in NEAR_GOAL:
        elapsed[NEAR_GOAL_ENVS] = 0
    pair = []
    for make in (lambda envs, rollout: script.make_collect(policy, envs, rollout, args),
                 lambda envs, rollout: fused_rollout.make_fused_collect(agent.net, envs, rollout)):  # fmt: skip
        torch.manual_seed(seed)
        envs = Envs(env_id, NUM_ENVS, device)
        envs.elapsed.copy_(elapsed)
        if env_id in NEAR_GOAL:
            envs.state[NEAR_GOAL_ENVS] = torch.tensor(NEAR_GOAL[env_id], device=device)
        rollout = script.Rollout(num_steps, NUM_ENVS, physics.n_obs, device)
        rollout.obs[-1] = envs.observe()
        pair.append((envs, rollout, make(envs, rollout)))
    return agent, pair


def collect_with_uniforms(pair, uniforms):
    """Both collects, fed the same uniforms ([num_steps, num_envs, n_act + n_noise]): the torch one draws each
    step's first n_act through torch.rand_like (the policy's Gumbel noise), then the rest through torch.rand
    (Envs.noise)."""
    (_, _, torch_collect), (envs, _, fused_collect) = pair
    n_act = envs.physics.n_act
    draws = iter([piece for step in uniforms for piece in (step[:, :n_act], step[:, n_act:])])

    def handed_out(shape):
        piece = next(draws)
        assert piece.shape == tuple(shape), (piece.shape, shape)
        return piece.clone()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand_like", lambda x: handed_out(x.shape))
        mp.setattr(torch, "rand", lambda *size, device=None: handed_out(size))
        torch_collect()
    assert next(draws, None) is None, "the torch rollout drew fewer numbers than given"
    fused_collect(uniforms)


def check_exactness(env_id, device, atol=1e-5):
    """Two rollouts in a row (the second starts where the first ended), each fed the same uniforms: the same
    trajectory, env states and episode sums, every action taken, and episodes ended."""
    num_steps = NUM_STEPS[env_id]
    _, pair = make_pair(env_id, num_steps, torch.device(device))
    (envs_t, rollout_t, _), (envs_f, rollout_f, _) = pair
    physics = envs_t.physics
    gen = torch.Generator().manual_seed(1)
    for first in (True, False):
        uniforms = torch.rand(num_steps, NUM_ENVS, physics.n_act + physics.n_noise, generator=gen).to(device)
        collect_with_uniforms(pair, uniforms)
        for name in ROLLOUT:
            expected, actual = getattr(rollout_t, name), getattr(rollout_f, name)
            torch.testing.assert_close(actual, expected, atol=atol, rtol=atol, msg=name)
        for name in ENVS_STATE:
            expected, actual = getattr(envs_t, name), getattr(envs_f, name)
            torch.testing.assert_close(actual, expected, atol=atol, rtol=atol, msg=name)
        assert rollout_t.actions.unique().numel() == physics.n_act
        if first and env_id in NEAR_GOAL:  # terminated at the first step, far from the time limit
            assert rollout_t.dones[1, NEAR_GOAL_ENVS].all()
    assert envs_t.ended[0].sum() >= NUM_ENVS // 2  # the envs started near their time limit have ended


@pytest.mark.parametrize("env_id", list(NUM_STEPS))
def test_fused_rollout_is_the_torch_rollout(env_id):
    in_interpreter(check_exactness, env_id, "cpu")


@requires_cuda
@pytest.mark.parametrize("env_id", list(NUM_STEPS))
def test_fused_rollout_is_the_torch_rollout_cuda(env_id):
    """The compiled kernel on the GPU; its float32 products and transcendentals round otherwise than torch's."""
    check_exactness(env_id, "cuda", atol=1e-4)


def check_philox_stream():
    """Without given uniforms the kernel draws its own: the same seed gives the same rollouts, another seed other
    ones; the log-probabilities written are the policy's at the actions taken; the actions follow the initial
    actor's near-uniform policy; the envs that ended restart from reset states."""
    runs = []
    for seed in (3, 3, 4):
        agent, (_, (envs, rollout, collect)) = make_pair("CartPole-v1", 32, torch.device("cpu"), seed)
        collect()
        runs.append([getattr(rollout, name).clone() for name in ROLLOUT])
    for name, first, again in zip(ROLLOUT, runs[0], runs[1]):
        assert torch.equal(first, again), name
    assert not torch.equal(runs[0][1], runs[2][1])
    obs, actions, logprobs, _, dones, values = runs[2]
    with torch.no_grad():
        _, logprob, _, value = agent.net.get_action_and_value(obs[:-1].flatten(0, 1), actions.flatten())
    torch.testing.assert_close(logprobs.flatten(), logprob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values.flatten(), value.flatten(), atol=1e-5, rtol=1e-5)
    assert 0.4 < actions.float().mean() < 0.6
    restarted = obs[dones.bool()]
    assert len(restarted) and ((restarted >= -0.05) & (restarted <= 0.05)).all()


def test_philox_stream():
    in_interpreter(check_philox_stream)


def check_bench_backend():
    """The bench's torch-fused backend runs make_fused_collect: from one seed the same rollouts twice, the actions'
    log-probabilities and the values the network's, CartPole's rewards."""
    tool = load_script(TOOL)
    benches = [tool.build("torch-fused", "CartPole-v1", NUM_ENVS, 8, torch.device("cpu"), seed=3) for _ in range(2)]
    for bench in benches:
        bench.collect()
        bench.collect()
    first, again = (bench.rollout for bench in benches)
    for name in ROLLOUT:
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert benches[0].variant.endswith("make_fused_collect") and (first.rewards == 1).all()
    obs, actions = first.obs[:-1].flatten(0, 1), first.actions.flatten()
    with torch.no_grad():
        _, logprob, _, value = benches[0].net.get_action_and_value(obs, actions)
    torch.testing.assert_close(first.logprobs.flatten(), logprob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first.values.flatten(), value.flatten(), atol=1e-5, rtol=1e-5)


def test_bench_backend():
    in_interpreter(check_bench_backend)


def test_trains_end_to_end(tmp_path, monkeypatch):
    """The script with --fused-rollout on the CPU under the interpreter, through the update, to its speed record."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    log = tmp_path / "speed.jsonl"
    proc = run_cli(FAST, *TINY, "--fused-rollout", "--speed-log", log)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(record) == RECORD_KEYS and json.loads(log.read_text()) == record
    assert record["total_timesteps"] == 5 * 8 * 16 and record["steady"] and record["episodic_return"] > 0


def test_resume_goes_on_with_the_kernel_seed(tmp_path, monkeypatch):
    """The checkpoint keeps the seed of the kernel's next launch, and a resumed run counts on from it (one launch an
    iteration): its random stream goes on instead of repeating the first run's, whose first seed a fresh draw
    from --seed would give again."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    saved, seeds = tmp_path / "saved", []
    # Two iterations, then one more: each launch is slow in the interpreter.
    for extra in (["--save-dir", saved, "--total-timesteps", str(2 * 8 * 16)],
                  ["--resume", saved, "--total-timesteps", str(3 * 8 * 16)]):  # fmt: skip
        proc = run_cli(FAST, *TINY, "--fused-rollout", *extra)
        assert proc.returncode == 0, proc.stderr
        seeds.append(int(torch.load(saved / f"{FAST}.pt", weights_only=True)["state"]["fused_seed"]))
    assert seeds[1] == seeds[0] + 1


def test_without_triton(monkeypatch, capsys, workdir):  # workdir: main() in this process puts its handlers in
    monkeypatch.setattr(fused_rollout, "triton", None)
    assert_one_line_error(run_bad_input(FAST, ["--fused-rollout"], capsys), "--fused-rollout needs Triton")


def test_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    proc = run_cli(FAST, *TINY, "--fused-rollout", "--no-cuda")
    assert_one_line_error(proc, "--fused-rollout", "needs CUDA", "TRITON_INTERPRET=1")
