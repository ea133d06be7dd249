"""PQN on GPU-resident classic control: both scripts through full iterations in every mode, the same first rollout in
both, the twin's Q(lambda) returns, update and policy against the baseline's, the returns against hand-computed ones,
a learning test that a broken update or a broken return fails, a resumed run against an uninterrupted one, bad
input."""

import functools
import os
import signal

import pytest
import torch
from helpers import (
    MODES,
    agent_pair,
    assert_cudagraphs_fallback,
    assert_equal,
    assert_one_line_error,
    assert_return_curve,
    assert_same_update,
    assert_steady,
    first_rollout,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_main,
    run_mode,
)

from torch_classic_control import ENVS, CartPole

BASE, FAST = "pqn_classic_control_gpu", "pqn_classic_control_gpu_torchcompile"
ENV_IDS = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0")
# The TINY runs: 8 envs, five iterations (WARMUP_ITERATIONS of them warm-up, then the fps window). Five rollouts reach
# Acrobot's 500-step and MountainCar's 200-step time limits, so an episode ends in every env. The equivalence tests
# use CartPole's shapes, so the compiled ones find the TINY runs' graphs in Inductor's cache.
NUM_ENVS, ITERATIONS = 8, 5
NUM_STEPS = {"CartPole-v1": 32, "Acrobot-v1": 100, "MountainCar-v0": 40}
RETURNS = {"CartPole-v1": (1, 500), "Acrobot-v1": (-500, 0), "MountainCar-v0": (-200, -1)}
N_OBS, N_ACT = CartPole.n_obs, CartPole.n_act
pytestmark = pytest.mark.usefixtures("workdir")


def tiny(env_id="CartPole-v1", iterations=ITERATIONS):
    return ["--env-id", env_id, "--num-envs", str(NUM_ENVS), "--num-steps", str(NUM_STEPS[env_id]),
            "--num-minibatches", "2", "--update-epochs", "2",
            "--total-timesteps", str(iterations * NUM_ENVS * NUM_STEPS[env_id])]  # fmt: skip


def total(env_id="CartPole-v1"):
    return ITERATIONS * NUM_ENVS * NUM_STEPS[env_id]


def check_record(record, env_id):
    assert_steady(record, total(env_id))
    low, high = RETURNS[env_id]
    assert record["episodic_return"] is not None and low <= record["episodic_return"] <= high
    assert_return_curve(record)


# ---- the scripts' runs


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_baseline_iterations(env_id, capsys):
    record = run_main(BASE, tiny(env_id), capsys)
    assert record["compile"] is False and record["cudagraphs"] is False
    check_record(record, env_id)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.usefixtures("eager_random")  # as in the equivalence tests, which then reuse these graphs
def test_compiled_iterations(mode, capsys):
    check_record(run_mode(FAST, tiny(), mode, capsys), "CartPole-v1")


@pytest.mark.parametrize("name", [BASE, FAST])
def test_learns_cartpole(name, capsys):
    """100k steps take CartPole's return from about 22 (random policy) to about 437 (baseline) and 406 (twin) on this
    CPU. Broken, the baseline stays at or below the random return: the TD loss's sign flipped 15; the Q(lambda)
    returns' sign flipped 30, computed forwards in time 30, without the done mask 10, without bootstrapping 18."""
    record = run_main(name, ["--num-envs", "16", "--num-steps", "64", "--learning-rate", "2.5e-3",
                             "--total-timesteps", "100000", "--no-tensorboard"], capsys)  # fmt: skip
    assert record["episodic_return"] > 200
    assert_return_curve(record)


@pytest.mark.signals
@pytest.mark.parametrize("name", [BASE, FAST])
def test_resume_is_the_uninterrupted_run(name, capsys, monkeypatch):
    """Stopped by Ctrl-C in its third iteration (the baseline's within its rollout, the twin's as its rollout ends: its
    one tick an iteration) and resumed, a run ends where the uninterrupted one does, bit for bit: the Q-network,
    RAdam's state, the envs' state (a checkpoint holds the envs, which are tensors), the random generators; then the
    checkpoint's policy runs on gymnasium's own env."""
    argv = tiny() + ["--no-tensorboard"]
    run_main(name, argv + ["--save-dir", "whole"], capsys)
    run_class, batch = load_script(name).Run, NUM_ENVS * NUM_STEPS["CartPole-v1"]
    tick = run_class.tick

    def interrupting_tick(self, step):
        if self.stops.signal is None and step >= 2 * batch + NUM_ENVS:
            os.kill(os.getpid(), signal.SIGINT)
        return tick(self, step)

    monkeypatch.setattr(run_class, "tick", interrupting_tick)
    record = run_main(name, argv + ["--save-dir", "parts"], capsys, interrupted=True)
    assert record["total_timesteps"] == 3 * batch
    monkeypatch.setattr(run_class, "tick", tick)
    record = run_main(name, argv + ["--resume", "parts"], capsys)
    assert record["resumed_from"] == 3 * batch and record["total_timesteps"] == total()
    whole, parts = (torch.load(f"{folder}/{name}.pt", weights_only=True) for folder in ("whole", "parts"))
    assert whole["global_step"] == parts["global_step"] == total()
    assert set(whole["state"]) == {"q_network", "optimizer", "envs"}
    assert_equal(whole["state"], parts["state"])
    assert_equal(whole["rng"], parts["rng"])
    evaluation = load_script(name).main(["--eval-checkpoint", "parts", "--eval-episodes", "1"])
    assert evaluation["episodes"] == 1 and 1 <= evaluation["mean"] <= 500


# ---- equivalence of the twin with the baseline


@pytest.mark.parametrize("mode", [[], ["--compile"]], ids=mode_id)
@pytest.mark.usefixtures("eager_random")
def test_first_rollout_is_the_same(mode, capsys, monkeypatch):
    """With one seed, the first rollouts of both scripts agree slot by slot (observations, epsilon-greedy actions,
    greedy values, rewards, done flags), and so do the Q(lambda) returns' inputs and outputs: the same parameters and
    the same random stream, drawn in the same order by the policy and the envs' resets."""
    argv = tiny(iterations=1) + ["--no-tensorboard"]
    rollout_b, returns_b = first_rollout(BASE, argv, capsys, monkeypatch)
    rollout_f, returns_f = first_rollout(FAST, argv + mode, capsys, monkeypatch)
    for key in ("obs", "dones"):
        torch.testing.assert_close(getattr(rollout_f, key)[:-1], getattr(rollout_b, key))
    for key in ("actions", "values", "rewards"):
        torch.testing.assert_close(getattr(rollout_f, key), getattr(rollout_b, key))
    for x_f, x_b in zip(returns_f, returns_b, strict=True):
        torch.testing.assert_close(x_f, x_b)
    assert rollout_b.dones.any() and rollout_b.actions.unique().numel() == N_ACT


make_pair = functools.partial(agent_pair, BASE, FAST, "q_network", (N_OBS, N_ACT))


def check_q_lambda(compile, cudagraphs, device, num_steps, num_envs, calls=1, q_lambda=0.65):
    """Same rewards, greedy values, dones and next observation: the twin's scan gives the baseline loop's returns.
    Several calls with new data each, so that graph replays are covered."""
    (_, (q_lambda_b, _)), (_, (q_lambda_f, *_)) = make_pair(
        compile, cudagraphs, device, num_steps=num_steps, q_lambda=q_lambda
    )
    tol = 1e-5 if device == "cpu" else 1e-4
    gen = torch.Generator().manual_seed(1)
    for _ in range(calls):
        next_obs = torch.randn(num_envs, N_OBS, generator=gen)
        rewards, values = torch.randn(2, num_steps, num_envs, generator=gen)
        # Few dones, so that some sums run over dozens of steps: every round of the scan counts.
        dones = (torch.rand(num_steps, num_envs, generator=gen) < 0.03).float()
        dones[0, 0] = 1.0
        next_done = (torch.arange(num_envs) == 1).float()
        inputs = [x.to(device) for x in (next_obs, next_done, rewards, values, dones)]
        torch.testing.assert_close(q_lambda_f(*inputs), q_lambda_b(*inputs), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_steps", [1, 2, 37, 64])
@pytest.mark.parametrize("q_lambda", [0.0, 0.65, 1.0])
def test_q_lambda_equivalence(num_steps, q_lambda):
    check_q_lambda(compile=False, cudagraphs=False, device="cpu", num_steps=num_steps, num_envs=3, q_lambda=q_lambda)


@pytest.mark.usefixtures("eager_random")
def test_q_lambda_equivalence_compiled():
    check_q_lambda(compile=True, cudagraphs=False, device="cpu", num_steps=NUM_STEPS["CartPole-v1"], num_envs=NUM_ENVS)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_q_lambda_by_hand(name):
    """One env, three steps, gamma 0.5, lambda 0.5: the returns worked out by hand, an episode ending after the second
    step (obs[2] starts a new one) and the last step bootstrapping from the greedy value of the next observation."""
    script = load_script(name)
    args = script.Args(num_steps=3, gamma=0.5, q_lambda=0.5)
    agent = script.Agent(args, N_OBS, N_ACT, torch.device("cpu"))
    q_lambda, *_ = script.make_update_fns(agent, args)
    next_obs = torch.randn(1, N_OBS)
    with torch.no_grad():
        bootstrap = agent.q_network(next_obs).max().item()
    rewards, values = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[10.0], [20.0], [30.0]])
    dones = torch.tensor([[0.0], [0.0], [1.0]])
    returns = q_lambda(next_obs, torch.zeros(1), rewards, values, dones)
    last = 3 + 0.5 * bootstrap
    middle = 2.0  # obs[2] starts a new episode: nothing after step 1 counts
    first = 1 + 0.5 * (0.5 * middle + 0.5 * 20.0)
    torch.testing.assert_close(returns.flatten(), torch.tensor([first, middle, last]))


def check_update(compile, cudagraphs, device, updates=4):
    """Same parameters and minibatches: each update gives the same statistics and parameters in both scripts, with the
    learning rate changed between updates (annealing), so that RAdam's state (its rectified steps after the fifth
    included) and graph replays are covered. The twin writes its statistics into the same fixed tensors each time.
    Then its acting policy sees the trained weights without recording an autograd graph: its actions are the
    baseline's draw for draw, at a device-tensor epsilon."""
    (agent_b, (_, update_b)), (agent_f, (_, update_f, policy_f, stats_f)) = make_pair(
        compile, cudagraphs, device, learning_rate=1e-2
    )
    assert load_script(FAST).STATS == load_script(BASE).STATS == tuple(stats_f)
    fixed = [value.data_ptr() for value in stats_f.values()]
    tol = 1e-5 if device == "cpu" else 1e-3
    initial = [p.detach().clone() for p in agent_f.q_network.parameters()]
    gen = torch.Generator().manual_seed(1)
    for i in range(updates):
        obs = torch.randn(128, N_OBS, generator=gen).to(device)
        actions = torch.randint(0, N_ACT, (128,), generator=gen).to(device)
        returns = torch.randn(128, generator=gen).to(device)
        agent_b.set_learning_rate(1e-2 / (i + 1))
        agent_f.set_learning_rate(1e-2 / (i + 1))
        stats_b = update_b(obs, actions, returns)
        assert update_f(obs, actions, returns) is None
        for name in stats_b:
            torch.testing.assert_close(stats_f[name], stats_b[name], atol=tol, rtol=tol, msg=name)
        for p0, (name, p_b), p_f in zip(initial, agent_b.q_network.named_parameters(), agent_f.q_network.parameters()):
            assert_same_update(p0, p_b.detach(), p_f.detach(), name=name)
    assert [value.data_ptr() for value in stats_f.values()] == fixed
    assert all(not torch.equal(p0, p) for p0, p in zip(initial, agent_f.q_network.parameters()))
    torch.manual_seed(5)
    with torch.no_grad():
        expected = agent_b.q_network.act(obs, 0.5)
    torch.manual_seed(5)
    action, value = policy_f(obs, torch.tensor(0.5, device=device))
    assert not action.requires_grad and not value.requires_grad, "the policy acts without autograd"
    torch.testing.assert_close(action, expected[0])
    torch.testing.assert_close(value, expected[1], atol=tol, rtol=tol)


def test_update_equivalence():
    check_update(compile=False, cudagraphs=False, device="cpu", updates=7)


@pytest.mark.usefixtures("eager_random")
def test_update_equivalence_compiled():
    check_update(compile=True, cudagraphs=False, device="cpu")


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_cuda(compile):
    check_q_lambda(compile, cudagraphs=True, device="cuda", num_steps=128, num_envs=64, calls=4)
    check_update(compile, cudagraphs=True, device="cuda", updates=5)


# ---- bad input

BAD_INPUT = [
    (["--env-id", "Pendulum-v1"], ["Pendulum-v1", "CartPole-v1, Acrobot-v1, MountainCar-v0"]),
    (["--num-envs", "0"], ["--num-envs 0"]),
    (["--num-steps", "-1"], ["--num-steps -1"]),
    (["--num-minibatches", "0"], ["--num-minibatches 0"]),
    (["--update-epochs", "0"], ["--update-epochs 0"]),
    (["--total-timesteps", "0"], ["--total-timesteps 0"]),
    (["--learning-rate", "-0.1"], ["--learning-rate -0.1"]),
    (["--gamma", "1.5"], ["--gamma 1.5"]),
    (["--q-lambda", "1.5"], ["--q-lambda 1.5"]),
    (["--q-lambda", "-0.5"], ["--q-lambda -0.5"]),
    (["--max-grad-norm", "0"], ["--max-grad-norm 0"]),
    (["--exploration-fraction", "0"], ["--exploration-fraction 0"]),
    (["--start-e", "2"], ["--start-e 2"]),
    (["--end-e", "-0.1"], ["--end-e -0.1"]),
    (["--num-steps", "100", "--num-minibatches", "32"], ["--num-envs 4 * --num-steps 100 = 400", "--num-minibatches 32"]),
    (["--total-timesteps", "500"], ["--total-timesteps 500 ", "= 512"]),
]  # fmt: skip


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bad_input_cli(name):
    """As a user sees it: exit code 2 and one line, no traceback; --help offers CleanRL's flags and no video."""
    assert_one_line_error(run_cli(name, "--q-lambda", "2"), "--q-lambda 2")
    help_text = run_cli(name, "--help").stdout
    assert "--q-lambda" in help_text and "--exploration-fraction" in help_text and "--capture-video" not in help_text


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *tiny())


def test_envs_are_the_module_envs():
    """The scripts offer every env of torch_classic_control, CartPole-v1 first."""
    assert list(ENVS)[0] == load_script(BASE).Args.env_id == load_script(FAST).Args.env_id
