"""Trick 22 of the three twins on MuJoCo Warp: with --compile each calls its compiled functions once on zeros (an
update, an action; PPO's GAE too) between making its envs and their first reset, while Warp builds the kernels, and
rolls back what that changed. The loop then compiles nothing, and the run is the uncompiled twin's."""

import pytest
import torch
from helpers import run_main

import mujoco_warp_envs

OFF_POLICY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "400",
              "--learning-starts", "40", "--total-timesteps", "100", "--critic-hidden-dim", "32",
              "--actor-hidden-dim", "16", "--no-tensorboard"]  # fmt: skip
TWINS = {
    "ppo_continuous_action_gpu_mujoco_torchcompile": ["--env-id", "Hopper-v5", "--num-envs", "4", "--num-steps", "8",
                                                      "--num-minibatches", "2", "--update-epochs", "2",
                                                      "--total-timesteps", "96", "--no-tensorboard"],  # fmt: skip
    "td3_gpu_mujoco_torchcompile": OFF_POLICY,
    "sac_gpu_mujoco_torchcompile": OFF_POLICY,
}


def tensors(state, name="state"):
    """{dotted name: tensor} of a checkpoint's state."""
    if isinstance(state, dict):
        return {k: v for key, part in state.items() for k, v in tensors(part, f"{name}.{key}").items()}
    return {name: state} if isinstance(state, torch.Tensor) else {}


def graphs_at_start(monkeypatch):
    """The number of graphs Dynamo has made, at each start() of a twin's envs (a list that grows)."""
    graphs, counts, start = torch._dynamo.utils.counters["stats"], [], mujoco_warp_envs.CapturableEnvs.start

    def counted_start(envs):
        counts.append(graphs["unique_graphs"])
        start(envs)

    monkeypatch.setattr(mujoco_warp_envs.CapturableEnvs, "start", counted_start)
    return counts


def assert_made_before_the_loop(counts):
    made = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert counts[-1] > 0 and made == counts[-1], f"{counts[-1]} graphs when the envs started, {made} at the end"


@pytest.mark.parametrize("name", TWINS)
@pytest.mark.usefixtures("eager_random", "workdir")
def test_compiled_while_warp_builds_then_the_uncompiled_run(name, capsys, monkeypatch):
    """Compiled, every graph of the run exists when the envs start (none is made in the loop), and the run ends
    where the same twin's uncompiled run does (draw for draw: eager_random), every tensor its checkpoint holds
    (networks, optimizers, envs, buffer) to float rounding: the roll-back left the networks, the optimizers, the
    buffer and the random generators as a run that had not compiled early would have them."""
    counts, saved = graphs_at_start(monkeypatch), []
    for folder, mode in (("eager", []), ("compiled", ["--compile"])):
        run_main(name, TWINS[name] + mode + ["--save-dir", folder], capsys)
        saved.append(tensors(torch.load(f"{folder}/{name}.pt", weights_only=True)["state"]))
    assert_made_before_the_loop(counts)
    eager, compiled = saved
    assert eager.keys() == compiled.keys()
    for key, value in eager.items():
        torch.testing.assert_close(compiled[key], value, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["td3_gpu_mujoco_torchcompile", "sac_gpu_mujoco_torchcompile"])
@pytest.mark.usefixtures("workdir")
def test_compiled_while_warp_builds_with_amp(name, capsys, monkeypatch):
    """With --amp (autocast entered around the compiled functions, as the loop enters it) too, no graph is made in
    the loop."""
    counts = graphs_at_start(monkeypatch)
    run_main(name, TWINS[name] + ["--compile", "--amp"], capsys)
    assert_made_before_the_loop(counts)
