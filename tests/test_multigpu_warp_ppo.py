"""The PPO pair on MuJoCo Warp (leanrl/ppo_continuous_action_gpu_mujoco.py and its _torchcompile twin) data-parallel
on the CPU, with gloo: two ranks, each its own worlds seeded apart, end with the same parameters and the same
normalisation statistics, those of every rank's observations and returns pooled; one rank under torchrun trains as
one process without it does, bit for bit."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from helpers import RECORD_KEYS, SCRIPTS, load_script, port_for, run_main

import mujoco_warp_envs
from mujoco_warp_envs import RunningMeanStd

NAME = "ppo_continuous_action_gpu_mujoco"
FAST = f"{NAME}_torchcompile"
# Per rank: 4 Hopper worlds (random episodes end within a rollout) x 8 steps, in 2 minibatches.
TINY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs",
        "1", "--no-tensorboard", "--no-cuda"]  # fmt: skip
RANKS, ITERATIONS, RESUMED = 2, 3, 2
STEPS, RESUMED_STEPS = (RANKS * 4 * 8 * iterations for iterations in (ITERATIONS, ITERATIONS + RESUMED))
# The runs of both ranks, one after another in the same two processes (Warp's kernels load once): each script for
# ITERATIONS iterations, then the twin resumed from its checkpoint for RESUMED more. {run: (script, argv)}
RUNS = {
    NAME: (NAME, [*TINY, "--total-timesteps", str(STEPS), "--save-dir", NAME]),
    FAST: (FAST, [*TINY, "--total-timesteps", str(STEPS), "--save-dir", FAST]),
    "resumed": (FAST, [*TINY, "--total-timesteps", str(RESUMED_STEPS), "--resume", FAST, "--save-dir", "resumed"]),
}


def rank_worker(rank, folder, results):
    """One of two ranks, started as torchrun starts them (its environment variables), for each of RUNS: the script's
    main(), what its envs fed their running statistics, the network it trained and the statistics it ended with."""
    os.chdir(folder)
    fed, made = [], {}
    update, init = RunningMeanStd.update, mujoco_warp_envs.Envs.__init__

    def recording_update(rms, x):
        fed.append(x.clone())
        update(rms, x)

    def recording_init(envs, *args):
        made["envs"] = envs
        init(envs, *args)

    RunningMeanStd.update, mujoco_warp_envs.Envs.__init__ = recording_update, recording_init  # CapturableEnvs' too
    for run, (name, argv) in RUNS.items():
        script = load_script(name)
        fed.clear()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_for(results, run, rank)), WORLD_SIZE=str(RANKS), RANK=str(rank),
                          LOCAL_RANK=str(rank))  # fmt: skip
        agent = script.Agent

        class RecordingAgent(agent):
            def __init__(self, *args):
                super().__init__(*args)
                made["agent"] = self

        script.Agent = RecordingAgent
        record = script.main(argv)
        script.Agent = agent
        envs = made["envs"]
        results[(run, rank)] = {
            "record": record,
            "net": {key: tensor.clone() for key, tensor in made["agent"].net.state_dict().items()},
            "obs": [x for x in fed if x.ndim == 2],  # each step's raw observations, the first the reset's
            "returns": [x for x in fed if x.ndim == 1],  # each step's discounted returns
            "obs_rms": [tensor.clone() for tensor in vars(envs.obs_rms).values()],  # mean, var, count
            "return_rms": [tensor.clone() for tensor in vars(envs.return_rms).values()],
        }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """(the folder the ranks ran in, {(run, rank): what rank_worker found})."""
    folder, results = tmp_path_factory.mktemp("ranks"), mp.Manager().dict()
    mp.spawn(rank_worker, args=(folder, results), nprocs=RANKS)
    return folder, dict(results)


def statistics_of(batches, shape, start=()):
    """gymnasium's RunningMeanStd after these batches, one after another, from `start` ([mean, var, count]) or a fresh
    one's: [mean, var, count]."""
    rms = RunningMeanStd(shape, "cpu")
    for value, saved in zip(vars(rms).values(), start):
        value.copy_(saved)
    for batch in batches:
        rms.update(batch)
    return list(vars(rms).values())


def check_one_run(folder, run, one, other, steps):
    """Rank 0's record counts both ranks' env steps, and the one checkpoint is rank 0's; both ranks ended with the
    same parameters (the script's own end check ends a run whose ranks differ with exit code 2) and the same
    statistics, bit for bit, which the checkpoint holds."""
    record, (name, _) = one["record"], RUNS[run]
    assert set(record) == RECORD_KEYS and record["total_timesteps"] == steps and record["episodic_return"] > 0
    assert [path.name for path in (folder / run).iterdir()] == [f"{name}.pt"]
    checkpoint = torch.load(folder / run / f"{name}.pt", weights_only=True)
    assert checkpoint["global_step"] == steps
    for key, tensor in one["net"].items():
        assert torch.equal(other["net"][key], tensor) and torch.equal(checkpoint["state"]["net"][key], tensor), key
    assert all(torch.equal(a, b) for key in ("obs_rms", "return_rms") for a, b in zip(one[key], other[key]))
    assert torch.equal(checkpoint["state"]["envs"]["obs_mean"], one["obs_rms"][0])


@pytest.mark.parametrize("name", [NAME, FAST])
def test_two_ranks_train_as_one_run(name, two_ranks):
    """Two ranks train as one run, each stepping worlds of its own (seeded with --seed + rank), and their statistics
    are those of both ranks' observations (returns) together, as one RunningMeanStd fed every batch of both."""
    folder, results = two_ranks
    one, other = results[(name, 0)], results[(name, 1)]
    check_one_run(folder, name, one, other, STEPS)
    assert len(one["obs"]) == len(other["obs"]) == 1 + 8 * ITERATIONS
    assert all(not torch.equal(a, b) for a, b in zip(one["obs"], other["obs"])), "each rank steps worlds of its own"
    for key, batches in (("obs_rms", "obs"), ("return_rms", "returns")):
        expected = statistics_of(one[batches] + other[batches], one[key][0].shape)
        for actual, wanted in zip(one[key], expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)
    assert one["obs_rms"][2] == pytest.approx(1e-4 + RANKS * 4 * (1 + 8 * ITERATIONS))


def test_two_ranks_go_on_from_a_checkpoint(two_ranks):
    """The twin's two ranks resumed from rank 0's checkpoint (every rank restores it, its envs too) train on to the
    new total as one run again: their statistics go on from the checkpoint's, each rank adding what its worlds see
    (counted once), and the worlds part at the first step (the ranks other than 0 reseeded as run.start joins them)."""
    folder, results = two_ranks
    one, other = results[("resumed", 0)], results[("resumed", 1)]
    check_one_run(folder, "resumed", one, other, RESUMED_STEPS)
    assert one["record"]["resumed_from"] == STEPS
    # The first observations, of the envs as made, are fed to statistics that the checkpoint's then replace.
    assert len(one["obs"]) == 1 + 8 * RESUMED and len(one["returns"]) == 8 * RESUMED
    fed = {"obs": (one["obs"][1:], other["obs"][1:]), "return": (one["returns"], other["returns"])}
    assert all(not torch.equal(a, b) for a, b in zip(*fed["obs"]))
    saved = torch.load(folder / FAST / f"{FAST}.pt", weights_only=True)["state"]["envs"]
    for key, (first, second) in fed.items():
        start = [saved[f"{key}_{part}"] for part in ("mean", "var", "count")]
        expected = statistics_of(first + second, start[0].shape, start)
        for actual, wanted in zip(one[f"{key}_rms"], expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [NAME, FAST])
def test_one_rank_under_torchrun_trains_as_one_process(name, workdir, capsys, monkeypatch):
    """One rank under torchrun (a process group of one: the all-reduce, in the twin the flat gradient buffer and the
    update in two graphs' functions, the end check) trains as one process without torchrun: from the same seed, the
    same return and the same parameters, Adam's state and envs, bit for bit."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*TINY, "--total-timesteps", str(4 * 8 * ITERATIONS)]
    alone = run_main(name, [*argv, "--save-dir", "alone"], capsys)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(SCRIPTS / f"{name}.py"), *argv, "--save-dir", "rank"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["episodic_return"] == alone["episodic_return"]
    states = [torch.load(workdir / folder / f"{name}.pt", weights_only=True)["state"] for folder in ("alone", "rank")]
    for part in ("net", "envs"):
        for key, tensor in states[0][part].items():
            assert torch.equal(states[1][part][key], tensor), (part, key)
    for index, adam in states[0]["optimizer"]["state"].items():
        for key, tensor in adam.items():
            assert torch.equal(states[1]["optimizer"]["state"][index][key], tensor), (index, key)
