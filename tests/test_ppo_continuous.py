"""PPO continuous: both scripts through full iterations in every mode, the TensorBoard scalars and the profile,
GAE and update equivalence of the compiled variant with the baseline, bootstrapping at truncations, the
normalisation statistics in checkpoints (resume and evaluation), a learning test, Ctrl-C, bad input."""

import functools
import json
from pathlib import Path

import numpy as np
import ppo
import pytest
import torch
from helpers import (
    MODES,
    agent_pair,
    assert_cudagraphs_fallback,
    assert_one_line_error,
    assert_return_curve,
    assert_steady,
    assert_trace_phases,
    first_rollout,
    load_script,
    mode_id,
    requires_cuda,
    run_bad_input,
    run_cli,
    run_interrupted,
    run_main,
    run_mode,
    tensorboard_scalars,
)

BASE, FAST = "ppo_continuous_action", "ppo_continuous_action_torchcompile"
# Pendulum-v1 (3 observations, 1 action, episodes truncated at 200 steps), 2 envs x 100 steps a rollout,
# minibatches of 50. One iteration past the warm-up ones reaches the fps window and ends an episode in each env.
# The equivalence tests use the same shapes, so the compiled ones find the TINY runs' graphs in Inductor's cache.
N_OBS, N_ACT, NUM_ENVS, NUM_STEPS, MINIBATCH = 3, 1, 2, 100, 50
ITERATIONS = load_script(BASE).WARMUP_ITERATIONS + 1
TOTAL = ITERATIONS * NUM_ENVS * NUM_STEPS
TINY = ["--env-id", "Pendulum-v1", "--num-envs", str(NUM_ENVS), "--num-steps", str(NUM_STEPS),
        "--num-minibatches", str(NUM_ENVS * NUM_STEPS // MINIBATCH), "--update-epochs", "2",
        "--total-timesteps", str(TOTAL)]  # fmt: skip
pytestmark = pytest.mark.usefixtures("workdir")


def check_record(record):
    assert_steady(record, TOTAL)
    # Pendulum's own rewards lie in [-16.3, 0]: these are raw returns of 200-step episodes, not normalized ones.
    assert -16.3 * 200 < record["episodic_return"] < -200
    assert_return_curve(record)


@pytest.mark.parametrize(
    "extra",
    [[], ["--target-kl", "1e-4", "--no-anneal-lr", "--no-norm-adv", "--no-clip-vloss", "--ent-coef", "0.01"]],
    ids=["defaults", "options"],
)
def test_baseline_iterations(extra, capsys):
    record = run_main(BASE, TINY + extra, capsys)
    assert record["compile"] is False and record["cudagraphs"] is False
    check_record(record)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.usefixtures("eager_random")  # as in the equivalence tests, which then reuse these graphs
def test_compiled_iterations(mode, capsys):
    """With --compile, --compile-cache keeps what the warm-up compiled: a file for this device and torch."""
    cache = ["--compile-cache", "cache"] * ("--compile" in mode)
    record = run_mode(FAST, TINY + cache, mode, capsys)
    check_record(record)
    assert len(list(Path("cache").glob("torch-*.bin"))) == len(cache) // 2


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("target_kl, epochs", [(None, 2), ("1e-12", 1)], ids=["no-target-kl", "target-kl"])
def test_target_kl_stops_epochs(name, target_kl, epochs, monkeypatch, capsys):
    """TINY asks for 2 epochs; a --target-kl that any update exceeds stops each iteration after the first."""
    script = load_script(name)
    calls = []

    def make_update_fns(agent, args, make=script.make_update_fns):
        gae, update, *others = make(agent, args)

        def counting_update(*minibatch):
            calls.append(len(minibatch[0]))
            return update(*minibatch)

        return gae, counting_update, *others

    monkeypatch.setattr(script, "make_update_fns", make_update_fns)
    run_main(name, TINY + (["--target-kl", target_kl] if target_kl else []), capsys)
    assert calls == [MINIBATCH] * (ITERATIONS * epochs * NUM_ENVS * NUM_STEPS // MINIBATCH)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_anneal_lr(name, monkeypatch, capsys):
    """The learning rate falls linearly from --learning-rate towards zero, once per iteration: every optimizer step
    of an iteration uses that iteration's rate, and TensorBoard gets it, with every statistic of the iteration's last
    update; with --no-anneal-lr it stays."""
    script = load_script(name)
    rates, step = [], script.optim.Adam.step

    def recording(optimizer, *args, **kwargs):
        rates.append(float(optimizer.param_groups[0]["lr"]))
        return step(optimizer, *args, **kwargs)

    monkeypatch.setattr(script.optim.Adam, "step", recording)
    run_main(name, TINY + ["--learning-rate", "0.003"], capsys)
    steps_per_iteration = 2 * NUM_ENVS * NUM_STEPS // MINIBATCH  # TINY's 2 epochs of its minibatches
    schedule = [0.003 * (1 - i / ITERATIONS) for i in range(ITERATIONS)]
    assert rates == pytest.approx([lr for lr in schedule for _ in range(steps_per_iteration)])
    scalars = tensorboard_scalars(name, "Pendulum-v1")
    iteration_ends = [(i + 1) * NUM_ENVS * NUM_STEPS for i in range(ITERATIONS)]
    assert scalars["charts/learning_rate"] == [(step, pytest.approx(lr)) for step, lr in zip(iteration_ends, schedule)]
    for stat in (*script.STATS, "explained_variance"):
        steps, values = zip(*scalars[f"losses/{stat}"])
        assert list(steps) == iteration_ends and np.isfinite(values).all(), stat
    rates.clear()
    run_main(name, TINY + ["--no-anneal-lr", "--no-tensorboard"], capsys)
    assert rates == [pytest.approx(script.Args.learning_rate)] * (ITERATIONS * steps_per_iteration)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_profile_dir(name, tmp_path, capsys):
    record = run_main(name, TINY + ["--target-kl", "1e-4", "--profile-dir", str(tmp_path / "profile")], capsys)
    assert_steady(record, TOTAL)
    # One env_step call steps every env: the breakdown tool counts env steps as the record does.
    assert_trace_phases(tmp_path / "profile", name, env_steps_per_call=NUM_ENVS)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bootstrap_at_truncation(name):
    """At a truncation the reward gains gamma * V(true final observation); at a termination it does not."""
    script = load_script(name)
    args = script.Args(env_id="Pendulum-v1", num_envs=2)
    envs = script.make_envs(args, args.num_envs)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    torch.manual_seed(0)
    agent = script.Agent(args, N_OBS, N_ACT, torch.device("cpu"))
    for _ in range(200):
        next_obs, reward, terminations, truncations, infos = envs.step(envs.action_space.sample())
    envs.close()
    assert truncations.all() and not terminations.any()
    final_obs = torch.as_tensor(np.stack(infos["final_obs"]), dtype=torch.float32)
    assert not torch.allclose(final_obs, torch.as_tensor(next_obs)), "next_obs is already the reset observation"
    with torch.no_grad():
        agent.net.critic[-1].bias.fill_(5.0)  # values clearly away from zero, still depending on the observation
        final_value = agent.net.critic(final_obs).flatten().numpy()
        next_value = agent.net.critic(torch.as_tensor(next_obs)).flatten().numpy()
    assert np.abs(final_value - next_value).min() > 1e-2
    out = script.bootstrap_truncated(agent, reward, terminations, truncations, infos, args.gamma, "cpu")
    np.testing.assert_allclose(out, reward + args.gamma * final_value, rtol=1e-6)
    # An episode that terminates in the same step keeps its reward.
    out = script.bootstrap_truncated(agent, reward, np.array([True, False]), truncations, infos, args.gamma, "cpu")
    np.testing.assert_allclose(out, reward + args.gamma * final_value * [0, 1], rtol=1e-6)
    # Nothing ended: the reward is left as it is.
    no = np.zeros(2, dtype=bool)
    assert script.bootstrap_truncated(agent, reward, no, no, {}, args.gamma, "cpu") is reward


def test_env_stack_is_the_baseline_one():
    """The twin's running statistics in closed form give the baseline's wrapped envs bit for bit: observations,
    normalised and clipped rewards, and the statistics themselves, across episode ends."""
    steps, stats = [], []
    for name in (BASE, FAST):
        script = load_script(name)
        envs = script.make_envs(script.Args(env_id="Pendulum-v1"), NUM_ENVS)
        envs.reset(seed=0)
        envs.action_space.seed(0)
        # Copies: the twin's vector env returns its own observation buffer, which the next step overwrites.
        steps.append([[np.copy(x) for x in envs.step(envs.action_space.sample())[:4]] for _ in range(450)])
        wrapped = envs.envs[1]
        stats.append([wrapped.get_wrapper_attr(name) for name in ("obs_rms", "return_rms")])
        envs.close()
    assert sum(truncations.all() for *_, truncations in steps[0]) == 2  # Pendulum's 200-step limit, twice
    for step_b, step_f in zip(*steps, strict=True):
        for x_b, x_f in zip(step_b, step_f, strict=True):
            np.testing.assert_array_equal(x_f, x_b)
    for rms_b, rms_f in zip(*stats, strict=True):
        assert type(rms_f).__name__ == "RunningMeanStdOfOne" and rms_f.count == rms_b.count
        np.testing.assert_array_equal(rms_f.mean, rms_b.mean)
        np.testing.assert_array_equal(rms_f.var, rms_b.var)


# One iteration with a truncation inside.
FIRST_ROLLOUT = ["--env-id", "Pendulum-v1", "--num-envs", "2", "--num-steps", "250", "--num-minibatches", "2",
                 "--update-epochs", "1", "--total-timesteps", "500"]  # fmt: skip


def test_first_rollout_is_the_same(monkeypatch, capsys):
    """With one seed, the first rollouts of both scripts agree slot by slot (observations, actions,
    log-probabilities, values, rewards with the truncation bootstrap, done flags), and so do GAE's inputs and
    outputs: this checks the compiled variant's storage and staging against the baseline's plain loop."""
    rollout_b, gae_b = first_rollout(BASE, FIRST_ROLLOUT, capsys, monkeypatch)
    rollout_f, gae_f = first_rollout(FAST, FIRST_ROLLOUT, capsys, monkeypatch)
    for key in ("obs", "dones"):
        torch.testing.assert_close(getattr(rollout_f, key)[:-1], getattr(rollout_b, key))
    for key in ("actions", "logprobs", "values", "rewards"):
        torch.testing.assert_close(getattr(rollout_f, key), getattr(rollout_b, key))
    for x_f, x_b in zip(gae_f, gae_b, strict=True):
        torch.testing.assert_close(x_f, x_b)
    # Pendulum truncates its episodes after 200 steps: obs[200] starts new ones in both envs, and only it.
    assert rollout_b.dones.sum(1).nonzero().flatten().tolist() == [200] and (rollout_b.dones[200] == 1).all()


make_pair = functools.partial(agent_pair, BASE, FAST, "net", (N_OBS, N_ACT))
check_gae = functools.partial(ppo.check_gae, make_pair, N_OBS)
check_updates = functools.partial(ppo.check_updates, make_pair, N_OBS,
                                  lambda gen, n: torch.randn(n, N_ACT, generator=gen))  # fmt: skip


@pytest.mark.parametrize("num_steps", [1, 37, 64])
def test_gae_equivalence(num_steps):
    check_gae(compile=False, cudagraphs=False, device="cpu", num_steps=num_steps, num_envs=3)


@pytest.mark.usefixtures("eager_random")
def test_gae_equivalence_compiled():
    check_gae(compile=True, cudagraphs=False, device="cpu", num_steps=NUM_STEPS, num_envs=NUM_ENVS)


def check_update(compile, cudagraphs, device, updates=4, **kwargs):
    """ppo.check_updates (the twin's updates against the baseline's); then its acting policy sees the trained weights
    without recording an autograd graph: its first action is the baseline's draw for draw, and each call's
    log-probability and value are the baseline's."""
    agent_b, agent_f, policy_f, obs, gen, tol = check_updates(compile, cudagraphs, device, MINIBATCH, updates, **kwargs)
    obs = obs[:NUM_ENVS]
    torch.manual_seed(5)
    with torch.no_grad():
        expected_action = agent_b.net.get_action_and_value(obs)[0]
    for call in range(4):  # with --cudagraphs: warm-up calls, capture, replay
        torch.manual_seed(5)
        action, logprob, value = policy_f(obs)
        assert not any(x.requires_grad for x in (action, logprob, value)), "the policy acts without autograd"
        if call == 0:
            torch.testing.assert_close(action, expected_action, atol=tol, rtol=tol)
        with torch.no_grad():
            _, expected_logprob, _, expected_value = agent_b.net.get_action_and_value(obs, action)
        torch.testing.assert_close(logprob, expected_logprob, atol=tol, rtol=tol)
        torch.testing.assert_close(value, expected_value.flatten(), atol=tol, rtol=tol)
    # make_act's round trip (pinned copies; under --cudagraphs captured with the policy) gives the policy's
    # outputs draw for draw, reading a new observation at each call: warm-up calls, capture, replays.
    fast = load_script(FAST)
    args_act = fast.Args(compile=compile, cudagraphs=cudagraphs, num_envs=NUM_ENVS)
    act = fast.make_act(policy_f, args_act, N_OBS, N_ACT, torch.device(device))
    for call in range(5):
        obs = torch.randn(NUM_ENVS, N_OBS, generator=gen).to(device)
        torch.manual_seed(call)
        expected = [x.cpu().numpy() for x in policy_f(obs)]
        torch.manual_seed(call)
        for out, ref in zip(act(obs.cpu().numpy()), expected, strict=True):
            np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "kwargs", [{}, {"norm_adv": False, "clip_vloss": False, "ent_coef": 0.01}], ids=["defaults", "options"]
)
def test_update_equivalence(kwargs):
    check_update(compile=False, cudagraphs=False, device="cpu", **kwargs)


@pytest.mark.usefixtures("eager_random")
def test_update_equivalence_compiled():
    check_update(compile=True, cudagraphs=False, device="cpu")


@requires_cuda
@pytest.mark.parametrize("compile", [False, True], ids=["cudagraphs", "compile+cudagraphs"])
@pytest.mark.usefixtures("eager_random")
def test_equivalence_cuda(compile):
    check_gae(compile, cudagraphs=True, device="cuda", num_steps=2048, num_envs=8, calls=4)
    check_update(compile, cudagraphs=True, device="cuda", updates=5)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_learns_inverted_pendulum(name, capsys):
    """4096 steps lift InvertedPendulum's return from about 8 (random policy) to about 100 on this CPU; a broken
    update stays near the random return (the policy loss with its sign flipped: about 3)."""
    record = run_main(name, ["--env-id", "InvertedPendulum-v4", "--num-envs", "2", "--num-steps", "128",
                             "--num-minibatches", "4", "--learning-rate", "1e-3", "--total-timesteps", "4096"],
                      capsys)  # fmt: skip
    assert record["episodic_return"] > 40
    assert_return_curve(record)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_ctrl_c_ends_with_the_record(name, capsys, monkeypatch):
    """Ctrl-C within the first rollout (KeyboardInterrupt, as from a second Ctrl-C): the record covers the 100 env
    steps done and says it was cut short."""
    run_interrupted(name, TINY + ["--no-tensorboard"], 100, capsys, monkeypatch)


def normalization(envs):
    """Each env's observation and return statistics: [(count, mean, var), ...], env by env."""
    stats = [env.get_wrapper_attr(name) for env in envs.envs for name in ("obs_rms", "return_rms")]
    return [(float(rms.count), np.copy(rms.mean), np.copy(rms.var)) for rms in stats]


@pytest.mark.parametrize("name", [BASE, FAST])
def test_normalization_in_checkpoints(name, tmp_path):
    """The checkpoint's normalisation statistics, through a weights_only load, into fresh envs: the same numbers
    (counts, means, variances of float64 and float32 arrays), and the same normalised observations after."""
    script = load_script(name)
    args = script.Args(env_id="Pendulum-v1")
    envs, fresh = script.make_envs(args, NUM_ENVS), script.make_envs(args, NUM_ENVS)
    envs.reset(seed=0)
    envs.action_space.seed(0)
    for _ in range(30):
        envs.step(envs.action_space.sample())
    torch.save(script.NormalizationStats(envs).state_dict(), tmp_path / "stats.pt")
    script.NormalizationStats(fresh).load_state_dict(torch.load(tmp_path / "stats.pt", weights_only=True))
    for (count, mean, var), (count_f, mean_f, var_f) in zip(normalization(envs), normalization(fresh), strict=True):
        assert count_f == count > 30 and mean_f.dtype == mean.dtype
        np.testing.assert_array_equal(mean_f, mean)
        np.testing.assert_array_equal(var_f, var)
    obs, obs_f = envs.reset(seed=1)[0].copy(), fresh.reset(seed=1)[0]
    np.testing.assert_array_equal(obs_f, obs)
    envs.close()
    fresh.close()


@pytest.mark.parametrize("name", [BASE, FAST])
def test_resume_and_evaluate_use_the_saved_normalization(name, monkeypatch, capsys):
    """A resumed run goes on from the saved statistics (they count on, not from zero); --eval-checkpoint
    normalises with env 0's saved observation statistics and leaves them as they are."""
    script = load_script(name)
    made = []

    def recording_make_envs(*args, make=script.make_envs, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(script, "make_envs", recording_make_envs)
    first = TINY[:-1] + [str(2 * NUM_ENVS * NUM_STEPS), "--save-dir", "ck", "--no-tensorboard"]
    run_main(name, first, capsys)
    saved = torch.load(f"ck/{name}.pt", weights_only=True)["state"]["normalization"]
    # Observations of 200 steps and two resets (the first, and the autoreset after Pendulum's 200-step limit).
    assert [float(rms["count"]) for rms in saved[::2]] == [pytest.approx(1e-4 + 2 * NUM_STEPS + 2)] * NUM_ENVS
    run_main(name, ["--resume", "ck", "--total-timesteps", str(TOTAL), *TINY[:2], "--no-tensorboard"], capsys)
    resumed = torch.load(f"ck/{name}.pt", weights_only=True)["state"]["normalization"]
    # One more rollout on top of the saved counts, and the reset that restarts the episodes (an observation, no return).
    for i, (rms, rms_saved) in enumerate(zip(resumed, saved, strict=True)):
        assert float(rms["count"]) == pytest.approx(float(rms_saved["count"]) + NUM_STEPS + (i % 2 == 0))
    record = run_main_eval(name, ["--eval-checkpoint", "ck", "--eval-episodes", "1"], capsys)
    assert record["episodes"] == 1 and -16.3 * 200 <= record["mean"] <= 0
    obs_count, obs_mean, _ = normalization(made[-1])[0]
    assert obs_count == float(resumed[0]["count"])
    np.testing.assert_array_equal(obs_mean, resumed[0]["mean"].numpy())


def run_main_eval(name, argv, capsys):
    """--eval-checkpoint in this process: its record, the last stdout line."""
    record = load_script(name).main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    return record


BAD_INPUT = [
    (["--env-id", "NoSuchEnv-v0"], ["--env-id", "NoSuchEnv-v0"]),
    (["--env-id", "CartPole-v1"], ["--env-id", "CartPole-v1", "Box"]),
    (["--num-steps", "100", "--num-minibatches", "32"], ["--num-steps 100", "--num-minibatches 32"]),
    (["--num-steps", "8", "--num-minibatches", "8"], ["--num-minibatches 8", "--norm-adv"]),
    (["--num-envs", "0"], ["--num-envs"]),
    (["--num-steps", "-1"], ["--num-steps"]),
    (["--num-minibatches", "0"], ["--num-minibatches"]),
    (["--update-epochs", "0"], ["--update-epochs"]),
    (["--learning-rate", "0"], ["--learning-rate"]),
    (["--learning-rate", "-0.1"], ["--learning-rate"]),
    (["--gamma", "1.5"], ["--gamma"]),
    (["--gae-lambda", "0"], ["--gae-lambda"]),
    (["--gamma", "0"], ["--gamma"]),
    (["--clip-coef", "-1"], ["--clip-coef"]),
    (["--seed", "-1"], ["--seed"]),
    (["--total-timesteps", "1000"], ["--total-timesteps 1000", "2048"]),
    (["--target-kl", "-0.1"], ["--target-kl"]),
]


@pytest.mark.parametrize("name", [BASE, FAST])
@pytest.mark.parametrize("argv, fragments", BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input(name, argv, fragments, capsys):
    assert_one_line_error(run_bad_input(name, argv, capsys), *fragments)


@pytest.mark.parametrize("name", [BASE, FAST])
def test_bad_input_cli(name):
    """As a user sees it: exit code 2 and one line, no traceback."""
    assert_one_line_error(run_cli(name, "--num-steps", "100", "--num-minibatches", "32"), "--num-minibatches 32")


def test_cudagraphs_without_cuda_warns_once():
    assert_cudagraphs_fallback(FAST, *TINY)


def test_resume_with_another_num_envs_is_one_line(capsys):
    """--resume-anyway with another --num-envs: the observation statistics, one per env, cannot go on; one error line
    says so in the run's terms (it was Python's `zip() argument 2 is shorter than argument 1`)."""
    argv = ["--env-id", "Pendulum-v1", "--num-steps", "64", "--no-tensorboard"]
    run_main(BASE, [*argv, "--num-envs", "1", "--total-timesteps", "128", "--save-dir", "saved"], capsys)
    argv += ["--num-envs", "2", "--total-timesteps", "512", "--resume", "saved", "--resume-anyway"]
    assert_one_line_error(run_bad_input(BASE, argv, capsys), "does not fit this run", "another --num-envs?")
