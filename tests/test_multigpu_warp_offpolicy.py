"""Data-parallel TD3 and SAC on MuJoCo Warp (leanrl/td3_gpu_mujoco.py, leanrl/sac_gpu_mujoco.py and their twins,
the twins in their default mode) on the CPU over gloo. The ranks are started as torchrun starts them (its
environment variables), each a process that runs the scripts' main() one after the other, the scripts' Agent, envs
and replay buffer recorded as train() makes them: two ranks end with the same trained tensors while their envs and
buffers differ (seeded apart), each rank drawing its share of the global --batch-size; one rank under torchrun
trains bit for bit as one process without it; a total or a batch that does not split over the ranks is one error
line on every rank. Warp's kernels load from ~/.cache/warp."""

import hashlib
import os
from contextlib import redirect_stderr
from io import StringIO

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_equal, load_script, port_for

NAMES = ("td3_gpu_mujoco", "sac_gpu_mujoco", "td3_gpu_mujoco_torchcompile", "sac_gpu_mujoco_torchcompile")
# Per rank: 2 Hopper envs, batches of 8 from a buffer of 100 steps of each env. --total-timesteps and
# --learning-starts count the env steps of all ranks: 2 ranks run 8 vector steps, the last 4 with 2 updates each.
TINY = ["--env-id", "Hopper-v5", "--num-envs", "2", "--batch-size", "8", "--buffer-size", "200", "--learning-starts",
        "16", "--total-timesteps", "32", "--critic-hidden-dim", "32", "--actor-hidden-dim", "16", "--no-tensorboard",
        "--no-cuda"]  # fmt: skip


def as_rank(rank, world_size, port):
    """This process as torchrun starts a rank: its environment variables."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank))  # fmt: skip


def recorded_run(name, argv):
    """A script's main(argv), with what train() makes kept: (record, {"agent": its Agent, "rb": its replay buffer,
    "first_qpos": its envs' positions after their first reset, "rows": the sizes of the buffer's samples})."""
    script, made = load_script(name), {}
    kind = "Capturable" if name.endswith("_torchcompile") else ""
    for key, attribute in (("agent", "Agent"), ("first_qpos", f"{kind}Envs"), ("rb", f"{kind}ReplayBuffer")):

        class Recorded(getattr(script, attribute)):
            def __init__(self, *args, key=key):
                super().__init__(*args)
                if key != "first_qpos":
                    made[key] = self

            def start(self):  # the envs': their positions after the first reset
                super().start()
                made["first_qpos"] = self.qpos.clone()

            def sample(self, batch_size):  # the replay buffer's
                sample = super().sample(batch_size)
                made.setdefault("rows", set()).add(len(sample[0]))
                return sample

        setattr(script, attribute, Recorded)
    return script.main(argv), made


def digest(tensors):
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def two_ranks_worker(rank, tmp, results):
    """One rank: each script's tiny run on two ranks, then (rank 0) each on one rank and alone, then a total that
    does not split over two ranks."""
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS: two ranks on two cores
    for name in NAMES:
        as_rank(rank, 2, port_for(results, (name, 2), rank))
        record, made = recorded_run(name, [*TINY, "--save-dir", str(tmp / f"{name}_2")])
        results[name, rank] = (record, digest(made["agent"].state_dict().values()), digest([made["first_qpos"]]),
                               digest([made["rb"].storage]), sorted(made["rows"]))  # fmt: skip
    if rank == 0:
        for name in NAMES:
            as_rank(0, 1, port_for(results, (name, 1), 0))
            recorded_run(name, [*TINY, "--save-dir", str(tmp / f"{name}_1")])
            del os.environ["WORLD_SIZE"]
            recorded_run(name, [*TINY, "--save-dir", str(tmp / f"{name}_alone")])
    for flag, value in (("--total-timesteps", "34"), ("--batch-size", "6")):
        as_rank(rank, 2, port_for(results, flag, rank))
        stderr = StringIO()
        with redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
            load_script(NAMES[0]).main([*TINY, flag, value])
        results[flag, rank] = (exit_info.value.code, stderr.getvalue())
        dist.destroy_process_group()  # the error left this process in its group


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The workers' results, and the folder of the runs' checkpoints."""
    tmp = tmp_path_factory.mktemp("ranks")
    results = mp.Manager().dict()
    mp.spawn(two_ranks_worker, args=(tmp, results), nprocs=2)
    return dict(results), tmp


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_end_alike_from_envs_apart(name, ranks):
    """The run went to its end (where every rank's parameters are checked against rank 0's, inside it), and both
    ranks hold the same trained tensors, bit for bit: rank 0's at the start, the same averaged gradients every update.
    Their envs started apart (seeded with --seed + rank), so their buffers hold other transitions; each sample drew
    half the global --batch-size 8 (the mean of the two ranks' gradients is the gradient of a batch of 8). Rank 0
    alone wrote the checkpoint."""
    results, tmp = ranks
    (record, agent0, qpos0, rb0, rows0), (_, agent1, qpos1, rb1, rows1) = results[name, 0], results[name, 1]
    assert rows0 == rows1 == [4]
    assert record["total_timesteps"] == 32 and not record["interrupted"] and not record["diverged"]
    assert agent0 == agent1
    assert qpos0 != qpos1 and rb0 != rb1
    assert [path.name for path in (tmp / f"{name}_2").iterdir()] == [f"{name}.pt"]
    assert torch.load(tmp / f"{name}_2" / f"{name}.pt", weights_only=True)["global_step"] == 32


@pytest.mark.parametrize("name", NAMES)
def test_one_rank_trains_as_one_process(name, ranks):
    """One rank under torchrun (the all-reduces over one rank; in the twin the updates in pieces around them, the
    gradients in flat buffers) trains as one process without torchrun: the same checkpoint, bit for bit: networks,
    targets, optimizers, replay buffer, envs, random generators."""
    _, tmp = ranks
    one, alone = (torch.load(tmp / f"{name}_{run}" / f"{name}.pt", weights_only=True) for run in ("1", "alone"))
    assert one["global_step"] == alone["global_step"] == 32
    assert_equal(one["state"], alone["state"])
    assert_equal(one["rng"], alone["rng"], "rng")


@pytest.mark.parametrize("flag, value", [("--total-timesteps", "34"), ("--batch-size", "6")])
def test_a_total_or_batch_that_does_not_split_over_the_ranks_is_one_error_on_every_rank(flag, value, ranks):
    results, _ = ranks
    for rank in range(2):
        code, stderr = results[flag, rank]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert code == 2 and errors == [f"error: {flag} {value} must be a multiple of --num-envs 2 x 2 ranks"]
