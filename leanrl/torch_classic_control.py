"""gymnasium's classic-control envs CartPole-v1, Acrobot-v1 and MountainCar-v0 as batched torch tensors on the device,
with gymnasium's time limit and same-step auto-reset (docs/gpu_collection.md). The GPU classic-control scripts import
it as they import gymnasium:

    envs = Envs(env_id, num_envs, device)  # ENVS[env_id]'s physics, num_envs copies
    next_obs, reward, done = envs.step(action)  # done: terminated or truncated, the env already reset
    ended, return_sum, length_sum = envs.ended_episodes()  # the episodes that ended since the last call
"""

import math

import torch


class CartPole:
    """gymnasium's CartPole-v1: state (x, x_dot, theta, theta_dot), Euler integration, reward 1 per step, ended
    when the cart leaves [-2.4, 2.4] or the pole tilts past 12 degrees; reset uniform in [-0.05, 0.05).

    A heavier simulator for data-collection studies (collect_bench.py --sweep sc, docs/gpu_collection.md) is a
    subclass with `copies` carts per env (the state holds each component for every copy, component after
    component; n_noise is 4 per copy; the policy sees copy 0; the episode ends when any copy does) and `substeps`
    Euler steps of tau / substeps per env step. With one of each it is gymnasium's CartPole, operation for
    operation."""

    n_obs, n_act, n_noise, max_episode_steps = 4, 2, 4, 500
    gravity, masspole, total_mass, length, force_mag, tau = 9.8, 0.1, 1.1, 0.5, 10.0, 0.02
    polemass_length = masspole * length
    x_threshold, theta_threshold = 2.4, 12 * 2 * math.pi / 360
    copies, substeps = 1, 1

    @staticmethod
    def initial(noise):
        return noise * 0.1 - 0.05

    @classmethod
    def observe(cls, state):
        return state[:, :: cls.copies]

    @classmethod
    def substep(cls, x, x_dot, theta, theta_dot, force, costheta, sintheta):
        """One Euler step of tau / substeps: arithmetic only, so any array library's arrays step through it."""
        tau = cls.tau / cls.substeps
        temp = (force + cls.polemass_length * theta_dot**2 * sintheta) / cls.total_mass
        thetaacc = (cls.gravity * sintheta - costheta * temp) / (
            cls.length * (4.0 / 3.0 - cls.masspole * costheta**2 / cls.total_mass)
        )
        xacc = temp - cls.polemass_length * thetaacc * costheta / cls.total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        return x, x_dot, theta, theta_dot

    @classmethod
    def step(cls, state, action):
        x, x_dot, theta, theta_dot = state.unflatten(-1, (4, cls.copies)).unbind(-2)
        force = torch.where(action == 1, cls.force_mag, -cls.force_mag)[:, None]
        for _ in range(cls.substeps):
            x, x_dot, theta, theta_dot = cls.substep(x, x_dot, theta, theta_dot, force, theta.cos(), theta.sin())
        terminated = ((x.abs() > cls.x_threshold) | (theta.abs() > cls.theta_threshold)).any(-1)
        return torch.cat((x, x_dot, theta, theta_dot), -1), torch.ones_like(x[:, 0]), terminated


class Acrobot:
    """gymnasium's Acrobot-v1 ("book" dynamics, no torque noise): state (theta1, theta2, dtheta1, dtheta2), one
    RK4 step of 0.2 s per action (torque -1, 0, 1), angles wrapped to [-pi, pi], velocities bounded; reward -1
    per step until the tip swings above the bar; reset uniform in [-0.1, 0.1)."""

    n_obs, n_act, n_noise, max_episode_steps = 6, 3, 4, 500
    dt, m1, m2, l1, lc1, lc2, moi, g = 0.2, 1.0, 1.0, 1.0, 0.5, 0.5, 1.0, 9.8
    max_vel_1, max_vel_2 = 4 * math.pi, 9 * math.pi

    @staticmethod
    def initial(noise):
        return noise * 0.2 - 0.1

    @staticmethod
    def observe(state):
        theta1, theta2, dtheta1, dtheta2 = state.unbind(-1)
        return torch.stack((theta1.cos(), theta1.sin(), theta2.cos(), theta2.sin(), dtheta1, dtheta2), -1)

    @classmethod
    def derivatives(cls, state, torque):
        m1, m2, l1, lc1, lc2, moi, g = cls.m1, cls.m2, cls.l1, cls.lc1, cls.lc2, cls.moi, cls.g
        theta1, theta2, dtheta1, dtheta2 = state.unbind(-1)
        d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * torch.cos(theta2)) + 2 * moi
        d2 = m2 * (lc2**2 + l1 * lc2 * torch.cos(theta2)) + moi
        phi2 = m2 * lc2 * g * torch.cos(theta1 + theta2 - math.pi / 2.0)
        phi1 = (
            -m2 * l1 * lc2 * dtheta2**2 * torch.sin(theta2)
            - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * torch.sin(theta2)
            + (m1 * lc1 + m2 * l1) * g * torch.cos(theta1 - math.pi / 2)
            + phi2
        )
        ddtheta2 = (torque + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * torch.sin(theta2) - phi2) / (
            m2 * lc2**2 + moi - d2**2 / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return torch.stack((dtheta1, dtheta2, ddtheta1, ddtheta2), -1)

    @classmethod
    def step(cls, state, action):
        torque = (action - 1).to(state.dtype)
        k1 = cls.derivatives(state, torque)
        k2 = cls.derivatives(state + cls.dt / 2 * k1, torque)
        k3 = cls.derivatives(state + cls.dt / 2 * k2, torque)
        k4 = cls.derivatives(state + cls.dt * k3, torque)
        theta1, theta2, dtheta1, dtheta2 = (state + cls.dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)).unbind(-1)
        state = torch.stack(
            (
                cls.wrap(theta1),
                cls.wrap(theta2),
                dtheta1.clamp(-cls.max_vel_1, cls.max_vel_1),
                dtheta2.clamp(-cls.max_vel_2, cls.max_vel_2),
            ),
            -1,
        )
        terminated = -torch.cos(state[:, 0]) - torch.cos(state[:, 1] + state[:, 0]) > 1.0
        return state, torch.where(terminated, 0.0, -1.0), terminated

    @staticmethod
    def wrap(angle):
        """Into [-pi, pi] by whole turns, as gymnasium's wrap: an angle already inside stays as it is."""
        turns = torch.where(angle > math.pi, torch.ceil((angle - math.pi) / (2 * math.pi)), 0.0)
        turns = torch.where(angle < -math.pi, -torch.ceil((-math.pi - angle) / (2 * math.pi)), turns)
        return angle - turns * (2 * math.pi)


class MountainCar:
    """gymnasium's MountainCar-v0: state (position, velocity), push left, none or right; reward -1 per step until
    the car reaches position 0.5; reset position uniform in [-0.6, -0.4), velocity 0."""

    n_obs, n_act, n_noise, max_episode_steps = 2, 3, 1, 200
    min_position, max_position, max_speed, goal_position, force, gravity = -1.2, 0.6, 0.07, 0.5, 0.001, 0.0025

    @staticmethod
    def initial(noise):
        return torch.cat((noise * 0.2 - 0.6, torch.zeros_like(noise)), -1)

    @staticmethod
    def observe(state):
        return state

    @classmethod
    def step(cls, state, action):
        position, velocity = state.unbind(-1)
        velocity = velocity + (action - 1).to(state.dtype) * cls.force + torch.cos(3 * position) * (-cls.gravity)
        velocity = velocity.clamp(-cls.max_speed, cls.max_speed)
        position = (position + velocity).clamp(cls.min_position, cls.max_position)
        velocity = torch.where((position == cls.min_position) & (velocity < 0), 0.0, velocity)
        terminated = (position >= cls.goal_position) & (velocity >= 0)
        return torch.stack((position, velocity), -1), torch.full_like(position, -1.0), terminated


ENVS = {"CartPole-v1": CartPole, "Acrobot-v1": Acrobot, "MountainCar-v0": MountainCar}


class Envs:
    """num_envs copies of one of ENVS as device tensors, with gymnasium's time limit and same-step auto-reset: the
    step that ends an episode returns its reward and the first observation of the next episode. The returns and
    lengths of the episodes that end are summed on the device until ended_episodes() reads them."""

    def __init__(self, env_id, num_envs, device):
        self.physics = ENVS[env_id]
        self.num_envs, self.device = num_envs, device
        self.state = self.physics.initial(self.noise())
        self.elapsed = torch.zeros(num_envs, dtype=torch.int32, device=device)
        self.episode_return = torch.zeros(num_envs, device=device)
        # Per env: episodes ended, and the sums of their returns and lengths.
        self.ended = torch.zeros(3, num_envs, device=device)

    def noise(self):
        return torch.rand(self.num_envs, self.physics.n_noise, device=self.device)

    def observe(self):
        return self.physics.observe(self.state)

    def step(self, action):
        """(next observation, reward, done), done where an episode ended by termination or the time limit."""
        state, reward, terminated = self.physics.step(self.state, action)
        self.elapsed += 1
        self.episode_return += reward
        done = terminated | (self.elapsed >= self.physics.max_episode_steps)
        # Reset noise for every env, every step: the same random stream whichever envs end.
        self.state.copy_(torch.where(done[:, None], self.physics.initial(self.noise()), state))
        self.ended += torch.stack((done.float(), self.episode_return, self.elapsed.float())) * done
        self.elapsed.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return self.observe(), reward, done

    def ended_episodes(self):
        """(episodes ended, sum of their returns, sum of their lengths) since the last call, device scalars."""
        ended = self.ended.sum(1)
        self.ended.zero_()
        return ended
