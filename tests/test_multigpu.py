"""Data-parallel PPO on the CPU, with gloo, for the PPO Atari pair and the GPU classic-control pair: two ranks under
torchrun train as one run (one record, one checkpoint, the same parameters on both ranks), and go on from a
checkpoint; the averaged gradient is the gradient of the whole batch; a rank that drifted or was started with other
arguments ends the run with one error line; resumed ranks draw apart; and one rank under torchrun trains as one
process without it does."""

import datetime
import functools
import io
import json
import os
import random
import signal
import subprocess
import sys
from contextlib import redirect_stderr

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import RECORD_KEYS, SCRIPTS, free_port, load_script, run_main, wait_for

from harness.torchrun import Ranks
from torch_classic_control import CartPole

BASE, FAST = "ppo_atari_envpool", "ppo_atari_envpool_torchcompile"
# Per rank: 2 envs x 32 steps, in 2 minibatches. Two ranks, 512 env steps: 4 iterations, the last one steady.
TINY = ["--num-envs", "2", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1", "--no-tensorboard",
        "--no-cuda"]  # fmt: skip
N_ACT, FRAMES = 4, 8
CLASSIC_BASE, CLASSIC_FAST = "ppo_classic_control_gpu", "ppo_classic_control_gpu_torchcompile"
# Per rank: 4 envs x 32 steps, in 2 minibatches. Two ranks, 1024 env steps: 4 iterations, the last one steady.
CLASSIC_TINY = ["--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2", "--update-epochs", "1",
                "--no-tensorboard", "--no-cuda"]  # fmt: skip
# Each script's tiny run: its arguments and its env steps over both ranks.
RUNS = {BASE: (TINY, 512), FAST: (TINY, 512), CLASSIC_BASE: (CLASSIC_TINY, 1024), CLASSIC_FAST: (CLASSIC_TINY, 1024)}
# Collectives in the spawned groups; a rank that fails leaves the other waiting this long at most.
TIMEOUT = datetime.timedelta(seconds=60)


def torchrun(name, *argv, ranks=2):
    """The command that starts ranks of a script (two unless told) under torchrun on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(SCRIPTS / f"{name}.py"), *argv]  # fmt: skip


def launch(name, *argv, cwd, ranks=2):
    return subprocess.run(torchrun(name, *argv, ranks=ranks), capture_output=True, text=True, timeout=300, cwd=cwd)


def check_one_run(name, proc, steps, tmp_path, ranks=2):
    """Rank 0 alone printed the record (env steps of all ranks) and wrote the checkpoint; the run ended with
    every rank's parameters checked equal to rank 0's, and each rank's fps on stderr. Returns the record."""
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    record = json.loads(line)
    assert set(record) == RECORD_KEYS and record["script"] == name
    assert record["total_timesteps"] == steps and record["steady"] is True and record["fps"] > 0
    assert [path.name for path in (tmp_path / "saved").iterdir()] == [f"{name}.pt"]
    checkpoint = torch.load(tmp_path / "saved" / f"{name}.pt", weights_only=True)
    assert checkpoint["global_step"] == steps
    (fps,) = [line for line in proc.stderr.splitlines() if line.startswith("env steps per second of each rank")]
    assert len(json.loads(fps.split(": ")[1])) == ranks
    assert "Traceback" not in proc.stderr
    return record


@pytest.mark.parametrize("name", RUNS)
def test_two_ranks_train_as_one_run(name, tmp_path):
    argv, steps = RUNS[name]
    proc = launch(name, *argv, "--total-timesteps", str(steps), "--save-dir", "saved", cwd=tmp_path)
    check_one_run(name, proc, steps, tmp_path)


@pytest.mark.parametrize("name", [CLASSIC_BASE, CLASSIC_FAST])
def test_two_ranks_go_on_from_a_checkpoint(name, tmp_path):
    """Two ranks resumed from rank 0's checkpoint train on to the new total, as one run again."""
    argv, steps = RUNS[name]
    first = launch(name, *argv, "--total-timesteps", str(steps), "--save-dir", "saved", cwd=tmp_path)
    check_one_run(name, first, steps, tmp_path)
    argv = [*argv, "--total-timesteps", str(2 * steps), "--resume", "saved", "--save-dir", "saved"]
    record = check_one_run(name, launch(name, *argv, cwd=tmp_path), 2 * steps, tmp_path)
    assert record["resumed_from"] == steps


@pytest.mark.parametrize("name", [BASE, FAST])
def test_atari_ranks_go_on_from_a_checkpoint(name, tmp_path):
    """Two ranks of the Atari pair resumed from rank 0's checkpoint train on to the new total, as one run again,
    their episodes restarted (envpool's envs are not in a checkpoint)."""
    argv, steps = RUNS[name]
    first = launch(name, *argv, "--total-timesteps", str(steps), "--save-dir", "saved", cwd=tmp_path)
    check_one_run(name, first, steps, tmp_path)
    proc = launch(name, *argv, "--total-timesteps", str(2 * steps), "--resume", "saved", cwd=tmp_path)
    assert check_one_run(name, proc, 2 * steps, tmp_path)["resumed_from"] == steps
    assert f"resuming at env step {steps}, episodes restarted" in proc.stderr


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_stops_every_rank_together(name, tmp_path):
    """Ctrl-C to torchrun and its ranks, as a terminal sends it to its process group: every rank stops at the end
    of the same iteration, rank 0 writes its checkpoint and the interrupted record, and no rank ends in a
    traceback (torchrun prefixes a rank's with [rankN])."""
    argv = [*TINY, "--total-timesteps", "100000", "--save-every", "128", "--save-dir", "run"]
    proc = subprocess.Popen(torchrun(name, *argv), cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    wait_for(tmp_path / "run" / f"{name}.pt", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    record = json.loads(out.strip().splitlines()[-1])
    assert record["interrupted"] is True
    checkpoint = torch.load(tmp_path / "run" / f"{name}.pt", weights_only=True)
    assert checkpoint["global_step"] == record["total_timesteps"] < 100000
    assert "[rank0]" not in err and "[rank1]" not in err, err
    stopped = [line for line in err.splitlines() if line.startswith("interrupted after")]
    assert stopped and set(stopped) == {f"interrupted after {record['total_timesteps']} env steps"}, err


def joined_run(rank, store, world_size=2):
    """This rank's Run of the Atari baseline in a gloo group, started (a toy network every rank holds alike)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=TIMEOUT)
    base = load_script(BASE)
    args, _ = base.parse_args(base.Args, BASE, ["--no-cuda", "--no-tensorboard"])
    run = base.Run(args, BASE, None, Ranks())
    run.start({}, total_steps=100, warmup_steps=10, profile_steps=1, env_steps_per_call=1,
              replicated=torch.nn.Linear(2, 2))  # fmt: skip
    return run


def stop_worker(rank, store, results):
    """A signal to rank 0 alone is only pending on it until the ranks agree as the next unit begins (else rank 0
    would stop while rank 1 waits in its next all-reduce); then both stop there."""
    run = joined_run(rank, store)
    going_on = [run.proceed(0)]
    if rank == 0:
        os.kill(os.getpid(), signal.SIGINT)
    stops = [run.stops.signal, run.stops.pending]
    going_on.append(run.proceed(1))
    results[rank] = [*going_on, *stops, run.stops.signal]
    dist.destroy_process_group()


def test_a_signal_to_one_rank_waits_for_the_others(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(stop_worker, args=(tmp_path / "store", results), nprocs=2)
    assert results[0] == [True, False, None, signal.SIGINT, signal.SIGINT]
    assert results[1] == [True, False, None, None, signal.SIGINT]


def diverge_worker(rank, store, results):
    """Rank 0 logs a loss gone NaN: it does not stop alone (rank 1 would wait in its next collective until the
    timeout), and the ranks stop together as the next unit begins."""
    run = joined_run(rank, store)
    run.log(10, {"losses/loss": torch.tensor(float("nan") if rank == 0 else 1.0)})
    results[rank] = (run.proceed(10), run.diverged, run.stops.signal)
    dist.destroy_process_group()


def test_a_diverged_rank_stops_every_rank(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(diverge_worker, args=(tmp_path / "store", results), nprocs=2)
    assert results[0] == (False, "the run diverged: losses/loss became nan at env step 10", signal.SIGTERM)
    assert results[1] == (False, None, signal.SIGTERM)


def draw_worker(rank, store, results):
    """One rank of a gloo group of three, resumed at env step 512: every rank restored rank 0's generators (here all
    seeded with 7); what it draws after the ranks join."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3, timeout=TIMEOUT)
    network = torch.nn.Linear(2, 2)
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(7)
    Ranks().join(network, 1, 512)
    results[rank] = (torch.rand(4).tolist(), np.random.rand(), random.random())
    dist.destroy_process_group()


def test_resumed_ranks_draw_apart(tmp_path):
    """Every rank of a resumed run restores rank 0's generators: rank 0 goes on with them, the others reseed apart,
    each its own way, and apart from the start of the run (seeded with --seed + rank)."""
    results = mp.Manager().dict()
    mp.spawn(draw_worker, args=(tmp_path / "store", results), nprocs=3)
    draws = [results[rank] for rank in range(3)]
    torch.manual_seed(7)
    assert draws[0][0] == torch.rand(4).tolist()
    for one, other in ((draws[0], draws[1]), (draws[1], draws[2])):
        assert all(a != b for a, b in zip(one, other))
    torch.manual_seed(1 + 1)  # --seed 1 (the default) + rank 1: the run's start
    assert draws[1][0] != torch.rand(4).tolist()


def test_ranks_with_other_arguments_are_one_error(tmp_path):
    """Ranks started by hand, as torchrun starts them (its environment variables), one with another seed: rank
    0 prints one error line naming rank 1, and both exit with code 2, at once."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / f"{BASE}.py"), *TINY, "--seed", str(1 + rank)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    (_, err0), (_, err1) = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], err0 + err1
    errors = [line for line in err0.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ranks [1]" in errors[0], err0
    assert "error:" not in err1 and "Traceback" not in err0 + err1


def loss_of(network, obs, actions):
    """A loss that, like PPO's, is a mean over the batch: its gradient over two equal halves, averaged, is its
    gradient over the whole batch."""
    _, logprob, entropy, value = network.get_action_and_value(obs, actions)
    return (value.squeeze(1) ** 2 - logprob - 0.01 * entropy).mean()


def updated_on_whole_and_half(rank, script, args, make_agent, minibatch, whole_args=None):
    """[(agent, stats)] of a twin's update, from the same start, on the whole minibatch (made with whole_args where
    given) and on this rank's half."""
    results, half = [], slice(rank * FRAMES // 2, (rank + 1) * FRAMES // 2)
    for part, part_args in ((slice(None), whole_args or args), (half, args)):
        torch.manual_seed(0)
        agent = make_agent()
        _, update, _, stats = script.make_update_fns(agent, part_args)
        update(*(tensor[part] for tensor in minibatch))
        results.append((agent, stats))
    return results


def classic_update_is_the_whole_batch_update(rank):
    """The GPU classic-control twin in a process group: its update (the captured backward, the all-reduce of the
    flat gradient buffer, the captured step) on this rank's half of a minibatch gives the parameters and the loss
    statistics of the update on the whole minibatch (advantages not normalised per minibatch, so that the loss is
    a mean over the batch); the gradient norm is the whole batch's."""
    classic = load_script(CLASSIC_FAST)
    args = classic.Args(norm_adv=False)
    n_obs, n_act = CartPole.n_obs, CartPole.n_act
    generator = torch.Generator().manual_seed(2)
    obs = torch.randn(FRAMES, n_obs, generator=generator)
    actions = torch.randint(0, n_act, (FRAMES,), generator=generator)
    logprobs = torch.full((FRAMES,), -0.7) + torch.rand(FRAMES, generator=generator) * 0.2
    advantages, returns, values = torch.randn(3, FRAMES, generator=generator)
    minibatch = (obs, actions, logprobs, advantages, returns, values)
    make_agent = functools.partial(classic.Agent, args, n_obs, n_act, torch.device("cpu"))
    (whole, whole_stats), (halves, halves_stats) = updated_on_whole_and_half(rank, classic, args, make_agent, minibatch)
    assert halves.grads is not None, "in a process group the gradients are views of one flat buffer"
    for p_whole, p_halves in zip(whole.net.parameters(), halves.net.parameters()):
        torch.testing.assert_close(p_halves, p_whole, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(halves.grads, whole.grads, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(halves_stats["grad_norm"], whole_stats["grad_norm"], rtol=1e-4, atol=1e-6)


def atari_update_is_the_whole_batch_update(rank, obs, actions, compile):
    """The Atari twin in a process group: its update (backward into the flat gradient buffer, the all-reduce, then
    clipping and Adam; with --compile all in one compiled function, as it is captured on GPUs) on this rank's half of
    a minibatch gives the gradient and the parameters of the eager update on the whole minibatch (advantages not
    normalised per minibatch, so that the loss is a mean over the batch; the whole batch's update eager, as one
    compilation a rank is enough)."""
    fast = load_script(FAST)
    args = fast.Args(norm_adv=False, compile=compile)
    generator = torch.Generator().manual_seed(3)
    logprobs = torch.full((FRAMES,), -1.4) + torch.rand(FRAMES, generator=generator) * 0.2
    advantages, returns, values = torch.randn(3, FRAMES, generator=generator)
    minibatch = (obs, actions, logprobs, advantages, returns, values)
    make_agent = functools.partial(fast.Agent, args, N_ACT, "cpu")
    eager = fast.Args(norm_adv=False)
    (whole, _), (halves, _) = updated_on_whole_and_half(rank, fast, args, make_agent, minibatch, eager)
    assert halves.grads is not None, "in a process group the gradients are views of one flat buffer"
    torch.testing.assert_close(halves.grads, whole.grads, rtol=1e-4, atol=1e-6)
    for p_whole, p_halves in zip(whole.network.parameters(), halves.network.parameters()):
        torch.testing.assert_close(p_halves, p_whole, rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    assert not torch.equal(whole.network.critic.bias, fast.Agent(args, N_ACT, "cpu").network.critic.bias)


def flat_grads(network):
    return torch.cat([p.grad.reshape(-1) for p in network.parameters()])


def ranks_worker(rank, store, results):
    """One rank of a gloo group: the gradient averaged over the ranks' halves of a batch against the whole
    batch's, in the Atari scripts and in the GPU classic-control twin's update; then a rank that drifted, which
    must end the run."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=TIMEOUT)
    classic_update_is_the_whole_batch_update(rank)
    base, fast = load_script(BASE), load_script(FAST)
    generator = torch.Generator().manual_seed(1)
    obs = torch.randint(0, 256, (FRAMES, 4, 84, 84), generator=generator, dtype=torch.uint8)
    actions = torch.randint(0, N_ACT, (FRAMES,), generator=generator)
    half = slice(rank * FRAMES // 2, (rank + 1) * FRAMES // 2)
    for compile in (False, True):
        atari_update_is_the_whole_batch_update(rank, obs, actions, compile)
    torch.manual_seed(0)
    agent = fast.Agent(fast.Args(), N_ACT, "cpu")
    network = agent.network
    loss_of(network, obs, actions).backward()
    whole = flat_grads(network)

    # The twin's gradients are views into agent.grads, which backward fills and the all-reduce averages in place.
    agent.optimizer.zero_grad(set_to_none=False)
    loss_of(network, obs[half], actions[half]).backward()
    fast.average(agent.grads)
    torch.testing.assert_close(flat_grads(network), whole, rtol=1e-4, atol=1e-6)
    # Every view starts on 16 bytes, also after a bias of 6 actions (Pong's), as compiled kernels need.
    pong = fast.Agent(fast.Args(), 6, "cpu").network.parameters()
    assert all(p.grad.data_ptr() % 16 == 0 for p in pong)

    # The baseline averages the same way: its gradients are views into its own flat buffer.
    base_agent = base.Agent(base.Args(), N_ACT, "cpu")
    base_agent.network.load_state_dict(network.state_dict())
    base_agent.optimizer.zero_grad(set_to_none=False)
    loss_of(base_agent.network, obs[half], actions[half]).backward()
    base.average(base_agent.grads)
    torch.testing.assert_close(flat_grads(base_agent.network), whole, rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        network.critic.bias += rank
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        Ranks().check(network, 512, 100.0)
    results[rank] = (exit_info.value.code, stderr.getvalue())


def test_averaged_gradient_is_the_whole_batch_gradient_and_drift_is_an_error(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(ranks_worker, args=(tmp_path / "store", results), nprocs=2)
    (code0, err0), (code1, err1) = results[0], results[1]
    assert code0 == code1 == 2
    assert err0.startswith("error: after 512 env steps, the parameters of ranks [1] differ") and err0.count("\n") == 1
    assert err1 == ""


@pytest.mark.parametrize("name", [BASE, FAST])
def test_one_rank_under_torchrun_trains_as_one_process(name, workdir, capsys, monkeypatch):
    """One rank under torchrun (a process group of one: the all-reduce, in the twin the flat gradient buffer and the
    update, the agreement to stop, the end check) trains as one process without torchrun: from the same
    seed, the same return and the same final parameters and optimizer state, bit for bit."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*TINY, "--total-timesteps", "256"]
    alone = run_main(name, [*argv, "--save-dir", "alone"], capsys)
    rank = check_one_run(name, launch(name, *argv, "--save-dir", "saved", cwd=workdir, ranks=1), 256, workdir, ranks=1)
    assert rank["episodic_return"] == alone["episodic_return"]
    states = [torch.load(workdir / folder / f"{name}.pt", weights_only=True)["state"] for folder in ("alone", "saved")]
    for key, tensor in states[0]["network"].items():
        assert torch.equal(states[1]["network"][key], tensor), key
    for index, adam in states[0]["optimizer"]["state"].items():
        for key, tensor in adam.items():
            assert torch.equal(states[1]["optimizer"]["state"][index][key], tensor), (index, key)


def worker_pids(torchrun_pid):
    """{rank: pid} of the workers torchrun started (its children, each with RANK in its environment)."""
    pids = {}
    for child in open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read().split():
        try:
            environ = dict(v.split("=", 1) for v in open(f"/proc/{child}/environ").read().split("\0") if "=" in v)
        except FileNotFoundError:  # ended meanwhile
            continue
        if "RANK" in environ:
            pids[int(environ["RANK"])] = int(child)
    return pids


def test_a_killed_rank_restarts_and_the_run_finishes(tmp_path):
    """kill -9 of rank 1 mid-run under `torchrun --max-restarts 1`: torchrun starts both ranks again, they resume from
    the last checkpoint in --save-dir by themselves, and the run finishes (exit 0) with its record, which counts the
    restart; what was lost is at most one --save-every interval."""
    argv, steps = [*CLASSIC_TINY, "--save-dir", "run", "--save-every", "1024"], 256 * 100
    command = torchrun(CLASSIC_BASE, *argv, "--total-timesteps", str(steps))
    command[command.index("--standalone")] += " --max-restarts 1".replace(" ", "\0")  # two arguments, below
    command = [part for arg in command for part in arg.split("\0")]
    proc = subprocess.Popen(command, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(tmp_path / "run" / f"{CLASSIC_BASE}.pt", proc, seconds=600)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["restarts"] == 1 and record["total_timesteps"] == steps and record["interrupted"] is False
    assert 1024 <= record["resumed_from"] < steps and record["resumed_from"] % 1024 == 0
    assert "torchrun restart 1: resuming from run" in err
