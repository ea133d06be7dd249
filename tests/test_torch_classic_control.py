"""torch_classic_control's batched envs against gymnasium's own: physics, rewards, terminations, the time limit,
same-step auto-reset, episode sums, reset distributions."""

import math

import gymnasium as gym
import pytest
import torch

from torch_classic_control import ENVS, Envs

ENV_IDS = ("CartPole-v1", "Acrobot-v1", "MountainCar-v0")
NUM_ENVS = 8
CPU = torch.device("cpu")

# gymnasium's reset distributions (its reset() code): uniform per state component in [low, high).
RESET_BOUNDS = {
    "CartPole-v1": ([-0.05] * 4, [0.05] * 4),
    "Acrobot-v1": ([-0.1] * 4, [0.1] * 4),
    "MountainCar-v0": ([-0.6, 0.0], [-0.4, 0.0]),
}
# Actions that drive episodes to their ends sooner than random ones: CartPole's balances the pole (long episodes,
# which meet the time limit), Acrobot's and MountainCar's pump energy in until the goal is reached.
DRIVERS = {
    "CartPole-v1": lambda state: (3 * state[:, 2] + state[:, 3] > 0).long(),
    "Acrobot-v1": lambda state: torch.where(state[:, 2] < 0, 2, 0),
    "MountainCar-v0": lambda state: torch.where(state[:, 1] >= 0, 2, 0),
}
# Our envs compute in float32, gymnasium's in float64, both from the same state each step (errors never build
# up): along trajectories a step's results differ by float32 rounding, a few ulps of the largest intermediate (at
# most 1e-6 seen, in Acrobot, whose RK4 step sums dozens of terms). 1e-5 is well above that and far below what a
# change in the physics does (a constant off by 1% moves a step's result by 1e-4 or more).
FLOAT32_TOL = 1e-5
# Our physics run in float64 gives gymnasium's numbers up to float64 rounding (1e-14 seen).
FLOAT64_TOL = 1e-9
# The states episodes live in, velocity bounds and MountainCar's walls included, which trajectories seldom reach.
# At Acrobot's highest velocities float32 rounding alone reaches 3e-4: this box is checked in float64.
STATE_BOX = {
    "CartPole-v1": ([-2.4, -3.0, -0.21, -3.5], [2.4, 3.0, 0.21, 3.5]),
    "Acrobot-v1": ([-math.pi, -math.pi, -4 * math.pi, -9 * math.pi], [math.pi, math.pi, 4 * math.pi, 9 * math.pi]),
    "MountainCar-v0": ([-1.2, -0.07], [0.6, 0.07]),
}
envs_ids = pytest.mark.parametrize("env_id", ENV_IDS)


def assert_reset_states(env_id, states):
    low, high = (torch.tensor(bound, dtype=states.dtype) for bound in RESET_BOUNDS[env_id])
    assert ((low <= states) & (states <= high)).all(), states


def gym_step(ref, state, action, elapsed):
    """gymnasium's own step (its env under its TimeLimit, as gym.make builds it) from our state, made float64, and
    our count of steps into the episode: (state, observation, terminated, truncated, reward)."""
    ref.unwrapped.state = state.double().numpy()
    # CartPole's count of steps past a termination: each step starts from a state of a live episode.
    ref.unwrapped.steps_beyond_terminated = None
    ref._elapsed_steps = int(elapsed)
    obs, reward, terminated, truncated, _ = ref.step(int(action))
    return *map(torch.tensor, (ref.unwrapped.state, obs, terminated, truncated)), torch.tensor(reward).float()


def check_physics_step(env_id, ref, state, action, elapsed, tol=FLOAT32_TOL):
    """One step of our physics from a batch of states against gymnasium's from each: the same next state (within
    tol), observation (gymnasium's are float32) and the same rewards and terminations. Returns our next
    observation and gymnasium's rewards, terminations and truncations."""
    physics = ENVS[env_id]
    steps = [gym_step(ref, *x) for x in zip(state, action, elapsed, strict=True)]
    gym_state, gym_obs, terminated, truncated, gym_reward = map(torch.stack, zip(*steps))
    next_state, reward, our_terminated = physics.step(state, action)
    next_obs = physics.observe(next_state)
    torch.testing.assert_close(next_obs.float(), gym_obs, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    if env_id == "Acrobot-v1":
        # The angles, which the observation holds as cosines and sines, are wrapped into [-pi, pi] as gymnasium's
        # are; where one is within rounding of pi, ours and gymnasium's may lie a turn apart.
        angles = next_state[:, :2]
        assert (angles.abs() <= math.pi).all()
        gym_state[:, :2] += torch.round((angles - gym_state[:, :2]) / (2 * math.pi)) * 2 * math.pi
    torch.testing.assert_close(next_state, gym_state.to(state.dtype), atol=tol, rtol=tol)
    assert torch.equal(reward, gym_reward) and torch.equal(our_terminated, terminated)
    return next_obs, gym_reward, terminated, truncated


@envs_ids
def test_physics_matches_gymnasium_over_the_state_space(env_id):
    """One step from each of 2000 states spread uniformly over STATE_BOX, with random actions, in float64: the
    same formulas as gymnasium's, bounds, walls and terminations included."""
    physics = ENVS[env_id]
    low, high = (torch.tensor(bound, dtype=torch.float64) for bound in STATE_BOX[env_id])
    torch.manual_seed(0)
    state = low + (high - low) * torch.rand(2000, len(low), dtype=torch.float64)
    action = torch.randint(0, physics.n_act, (2000,))
    ref = gym.make(env_id, disable_env_checker=True)
    ref.reset(seed=0)
    _, _, terminated, _ = check_physics_step(env_id, ref, state, action, torch.zeros(2000), FLOAT64_TOL)
    assert 0 < terminated.float().mean() < 1


@envs_ids
def test_envs_match_gymnasium(env_id):
    """8 envs, 400 steps each, from episodes already under way (some near the time limit), acting at random in
    env 0 to as DRIVERS say in env 7: each step of the physics is gymnasium's (check_physics_step); Envs ends
    episodes where gymnasium terminates or truncates them, resets them in the same step (an observation of a fresh
    reset state, the step count and the return zeroed), and sums what ended as a hand-kept tally does."""
    physics = ENVS[env_id]
    assert physics.max_episode_steps == gym.spec(env_id).max_episode_steps
    ref = gym.make(env_id, disable_env_checker=True)
    ref.reset(seed=0)
    torch.manual_seed(0)
    envs = Envs(env_id, NUM_ENVS, CPU)
    elapsed = torch.randint(0, physics.max_episode_steps, (NUM_ENVS,), dtype=torch.int32)
    envs.elapsed.copy_(elapsed)
    episode_return, tally = torch.zeros(NUM_ENVS), torch.zeros(3)  # tally: episodes ended, returns, lengths
    driven = torch.linspace(0, 1, NUM_ENVS)  # how often each env acts as DRIVERS says
    terminations = truncations = 0
    for t in range(400):
        state = envs.state.clone()
        random_action = torch.randint(0, physics.n_act, (NUM_ENVS,))
        action = torch.where(torch.rand(NUM_ENVS) < driven, DRIVERS[env_id](state), random_action)
        next_obs, gym_reward, terminated, truncated = check_physics_step(env_id, ref, state, action, elapsed)
        obs, reward, done = envs.step(action)
        assert torch.equal(done, terminated | truncated) and torch.equal(reward, gym_reward)
        assert torch.equal(obs, envs.observe())
        assert torch.equal(obs[~done], next_obs[~done])
        assert_reset_states(env_id, envs.state[done])
        elapsed += 1
        episode_return += gym_reward
        tally += torch.stack((done.float(), episode_return, elapsed.float()))[:, done].sum(1)
        elapsed[done], episode_return[done] = 0, 0.0
        assert torch.equal(envs.elapsed, elapsed) and torch.equal(envs.episode_return, episode_return)
        if t % 50 == 49:
            assert torch.equal(envs.ended_episodes(), tally)
            tally.zero_()
        terminations += int(terminated.sum())
        truncations += int((truncated & ~terminated).sum())
    # Seen: CartPole 38 and 5, Acrobot 16 and 4, MountainCar 8 and 11.
    assert terminations >= 5 and truncations >= 3, (terminations, truncations)


@envs_ids
def test_reset_distribution(env_id):
    """Reset states are uniform over gymnasium's bounds: within them, spread over them, centred; gymnasium's own
    resets keep to the same bounds. A new Envs starts in reset states, at step 0 of its episodes."""
    physics = ENVS[env_id]
    torch.manual_seed(0)
    states = physics.initial(torch.rand(10000, physics.n_noise))
    assert_reset_states(env_id, states)
    low, high = (torch.tensor(bound) for bound in RESET_BOUNDS[env_id])
    width = (high - low).max()
    torch.testing.assert_close(states.amin(0), low, atol=0.01 * width, rtol=0)
    torch.testing.assert_close(states.amax(0), high, atol=0.01 * width, rtol=0)
    torch.testing.assert_close(states.mean(0), (low + high) / 2, atol=0.02 * width, rtol=0)
    ref = gym.make(env_id, disable_env_checker=True)
    gym_states = []
    for seed in range(1000):
        ref.reset(seed=seed)
        gym_states.append(torch.tensor(ref.unwrapped.state, dtype=torch.float64))
    gym_states = torch.stack(gym_states)
    assert_reset_states(env_id, gym_states)
    torch.testing.assert_close(gym_states.amin(0), low.double(), atol=0.02 * width, rtol=0)
    torch.testing.assert_close(gym_states.amax(0), high.double(), atol=0.02 * width, rtol=0)
    envs = Envs(env_id, 1000, CPU)
    assert_reset_states(env_id, envs.state)
    assert not envs.elapsed.any() and not envs.episode_return.any() and not envs.ended_episodes().any()
