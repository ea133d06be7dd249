"""--fused-rollout of ppo_classic_control_gpu_torchcompile.py: a whole rollout of torch_classic_control's envs as
one Triton kernel launch per iteration, policy (the actor, Gumbel-max sampling), env step, time limit, same-step
auto-reset and storage in one program per block of envs (docs/gpu_collection.md, "The fused rollout"):

    collect = make_fused_collect(net, envs, rollout)  # the twin's Rollout, filled as its make_collect fills it
    collect()  # one rollout, then one batched critic call for the values
"""

import torch

from harness import fail
from torch_classic_control import Acrobot, CartPole, MountainCar

try:  # torch's CUDA build brings Triton, its CPU build does not: only --fused-rollout needs it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# tl.dot's smallest size: the observations and the logits are padded to this many columns.
FUSED_PAD = 16


def fused_rollout_unavailable(cuda):
    """Why --fused-rollout cannot run here (an error line), or None. Triton chooses between compiling a kernel and
    interpreting it when the kernel is defined, at import, from TRITON_INTERPRET."""
    if triton is None:
        return "--fused-rollout needs Triton, which torch's CUDA build brings; install it: pip install triton"
    if not cuda and isinstance(fused_rollout_kernel, triton.runtime.JITFunction):
        return ("--fused-rollout runs a Triton kernel, which needs CUDA; on the CPU only Triton's interpreter runs it "
                "(slowly): set TRITON_INTERPRET=1 before starting")  # fmt: skip
    return None


if triton is not None:  # the kernel and its parts, written as torch_classic_control's code, operation for operation,
    # the constants as literals (a kernel reads no Python globals)

    @triton.jit
    def tanh(x):
        # Through exp: tl.math has no tanh, and Triton's interpreter (the CPU tests) cannot run libdevice's.
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def cartpole_step(x, x_dot, theta, theta_dot, action, SUBSTEPS: tl.constexpr):
        force = tl.where(action == 1, 10.0, -10.0)
        tau = 0.02 / SUBSTEPS
        for _ in range(SUBSTEPS):
            costheta, sintheta = tl.cos(theta), tl.sin(theta)
            temp = (force + 0.05 * (theta_dot * theta_dot) * sintheta) / 1.1
            thetaacc = (9.8 * sintheta - costheta * temp) / (0.5 * (4.0 / 3.0 - 0.1 * (costheta * costheta) / 1.1))
            xacc = temp - 0.05 * thetaacc * costheta / 1.1
            x, x_dot = x + tau * x_dot, x_dot + tau * xacc
            theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        terminated = (tl.abs(x) > 2.4) | (tl.abs(theta) > 12 * 2 * 3.141592653589793 / 360)
        return x, x_dot, theta, theta_dot, terminated

    @triton.jit
    def acrobot_derivatives(theta1, theta2, dtheta1, dtheta2, torque):
        # Acrobot.derivatives with its constants (m1 = m2 = l1 = moi = 1, lc1 = lc2 = 0.5, g = 9.8) folded as
        # Python folds them there.
        d1 = 0.25 + (1.25 + tl.cos(theta2)) + 2.0
        d2 = (0.25 + 0.5 * tl.cos(theta2)) + 1.0
        phi2 = 4.9 * tl.cos(theta1 + theta2 - 3.141592653589793 / 2.0)
        phi1 = (
            -0.5 * (dtheta2 * dtheta2) * tl.sin(theta2)
            - 1.0 * dtheta2 * dtheta1 * tl.sin(theta2)
            + 14.700000000000001 * tl.cos(theta1 - 3.141592653589793 / 2)
            + phi2
        )
        ddtheta2 = (torque + d2 / d1 * phi1 - 0.5 * (dtheta1 * dtheta1) * tl.sin(theta2) - phi2) / (
            1.25 - (d2 * d2) / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return dtheta1, dtheta2, ddtheta1, ddtheta2

    @triton.jit
    def wrap(angle):
        turns = tl.where(angle > 3.141592653589793, tl.ceil((angle - 3.141592653589793) / 6.283185307179586), 0.0)
        turns = tl.where(angle < -3.141592653589793, -tl.ceil((-3.141592653589793 - angle) / 6.283185307179586), turns)
        return angle - turns * 6.283185307179586

    @triton.jit
    def clamp(x, bound):
        return tl.minimum(tl.maximum(x, -bound), bound)

    @triton.jit
    def acrobot_step(t1, t2, v1, v2, action):
        torque = (action - 1).to(tl.float32)
        a1, b1, c1, d1 = acrobot_derivatives(t1, t2, v1, v2, torque)
        a2, b2, c2, d2 = acrobot_derivatives(t1 + 0.1 * a1, t2 + 0.1 * b1, v1 + 0.1 * c1, v2 + 0.1 * d1, torque)
        a3, b3, c3, d3 = acrobot_derivatives(t1 + 0.1 * a2, t2 + 0.1 * b2, v1 + 0.1 * c2, v2 + 0.1 * d2, torque)
        a4, b4, c4, d4 = acrobot_derivatives(t1 + 0.2 * a3, t2 + 0.2 * b3, v1 + 0.2 * c3, v2 + 0.2 * d3, torque)
        t1 = wrap(t1 + 0.2 / 6 * (a1 + 2 * a2 + 2 * a3 + a4))
        t2 = wrap(t2 + 0.2 / 6 * (b1 + 2 * b2 + 2 * b3 + b4))
        v1 = clamp(v1 + 0.2 / 6 * (c1 + 2 * c2 + 2 * c3 + c4), 4 * 3.141592653589793)
        v2 = clamp(v2 + 0.2 / 6 * (d1 + 2 * d2 + 2 * d3 + d4), 9 * 3.141592653589793)
        terminated = -tl.cos(t1) - tl.cos(t2 + t1) > 1.0
        return t1, t2, v1, v2, terminated

    @triton.jit
    def mountaincar_step(position, velocity, action):
        velocity = velocity + (action - 1).to(tl.float32) * 0.001 + tl.cos(3 * position) * (-0.0025)
        velocity = clamp(velocity, 0.07)
        position = tl.minimum(tl.maximum(position + velocity, -1.2), 0.6)
        velocity = tl.where((position == -1.2) & (velocity < 0), 0.0, velocity)
        terminated = (position >= 0.5) & (velocity >= 0)
        return position, velocity, terminated

    @triton.jit
    def per_copy(x, COPIES: tl.constexpr):
        """A vector over envs, laid out as the state's components: as it is for one copy (the state's components are
        vectors: a [envs, 1] tile would cost about a fifth of the speed at 2^16 envs), a column for several."""
        if COPIES == 1:
            tiled = x
        else:
            tiled = x[:, None]
        return tiled

    @triton.jit
    def any_copy(x, COPIES: tl.constexpr):
        """Per env: whether any of its copies' flags is set."""
        if COPIES == 1:
            flag = x
        else:
            flag = tl.max(x.to(tl.int32), axis=1) > 0
        return flag

    @triton.jit
    def first_copy(x, COPIES: tl.constexpr):
        """Per env: copy 0's value."""
        if COPIES == 1:
            value = x
        else:
            value = tl.sum(tl.where(tl.arange(0, COPIES)[None, :] == 0, x, 0.0), axis=1)
        return value

    @triton.jit
    def env_step(ENV: tl.constexpr, s0, s1, s2, s3, action, COPIES: tl.constexpr, SUBSTEPS: tl.constexpr):
        """The physics of env number ENV (CartPole, Acrobot, MountainCar), on a state held as one vector or [envs,
        copies] tile per component (up to four): the next state, and each env's reward and termination (any copy's)."""
        action = per_copy(action, COPIES)
        if ENV == 0:
            s0, s1, s2, s3, terminated = cartpole_step(s0, s1, s2, s3, action, SUBSTEPS)
        elif ENV == 1:
            s0, s1, s2, s3, terminated = acrobot_step(s0, s1, s2, s3, action)
        else:
            s0, s1, terminated = mountaincar_step(s0, s1, action)
        terminated = any_copy(terminated, COPIES)
        if ENV == 0:
            reward = tl.full(terminated.shape, 1.0, tl.float32)
        elif ENV == 1:
            reward = tl.where(terminated, 0.0, -1.0)
        else:
            reward = tl.full(terminated.shape, -1.0, tl.float32)
        return s0, s1, s2, s3, reward, terminated

    @triton.jit
    def env_initial(ENV: tl.constexpr, u0, u1, u2, u3):
        """The env's initial(noise): a reset state from uniform numbers."""
        if ENV == 0:
            s0, s1, s2, s3 = u0 * 0.1 - 0.05, u1 * 0.1 - 0.05, u2 * 0.1 - 0.05, u3 * 0.1 - 0.05
        elif ENV == 1:
            s0, s1, s2, s3 = u0 * 0.2 - 0.1, u1 * 0.2 - 0.1, u2 * 0.2 - 0.1, u3 * 0.2 - 0.1
        else:
            s0, s1, s2, s3 = u0 * 0.2 - 0.6, tl.zeros_like(u0), tl.zeros_like(u0), tl.zeros_like(u0)
        return s0, s1, s2, s3

    @triton.jit
    def env_observe(ENV: tl.constexpr, s0, s1, s2, s3, col, COPIES: tl.constexpr):
        """The env's observe(state), of copy 0, as a tile of observations by `col`, zero in the padding."""
        s0, s1 = first_copy(s0, COPIES), first_copy(s1, COPIES)
        s2, s3 = first_copy(s2, COPIES), first_copy(s3, COPIES)
        if ENV == 1:
            o0, o1, o2, o3, o4, o5 = tl.cos(s0), tl.sin(s0), tl.cos(s1), tl.sin(s1), s2, s3
        else:
            o0, o1, o2, o3, o4, o5 = s0, s1, s2, s3, tl.zeros_like(s0), tl.zeros_like(s0)  # unused ones are zero
        obs = tl.where(col == 0, o0[:, None], 0.0)
        obs = tl.where(col == 1, o1[:, None], obs)
        obs = tl.where(col == 2, o2[:, None], obs)
        obs = tl.where(col == 3, o3[:, None], obs)
        obs = tl.where(col == 4, o4[:, None], obs)
        return tl.where(col == 5, o5[:, None], obs)

    @triton.jit
    def uniform(uniforms_ptr, seed, offset, mask, GIVEN_UNIFORMS: tl.constexpr):
        """Uniform numbers in [0, 1) for the draws numbered `offset`: the given ones, or Philox's of (seed, offset)."""
        if GIVEN_UNIFORMS:
            u = tl.load(uniforms_ptr + offset, mask=mask, other=0.5)
        else:
            # tl.rand rounds to 1.0 about once in 2^25 draws: kept below 1, as torch.rand's numbers are.
            u = tl.minimum(tl.rand(seed, offset), 0.99999994)
        return u

    @triton.jit(do_not_specialize=["seed"])
    def fused_rollout_kernel(
        state_ptr, elapsed_ptr, episode_return_ptr, ended_ptr,  # Envs' tensors: read at the start, written at the end
        w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr,  # the actor's three nn.Linear layers, weights [out, in]
        obs_ptr, actions_ptr, logprobs_ptr, rewards_ptr, dones_ptr,  # the Rollout's tensors
        uniforms_ptr, seed, num_envs, num_steps,
        ENV: tl.constexpr, N_STATE: tl.constexpr, N_OBS: tl.constexpr, N_ACT: tl.constexpr,
        N_NOISE: tl.constexpr, MAX_EPISODE_STEPS: tl.constexpr, HIDDEN: tl.constexpr, PAD: tl.constexpr,
        BLOCK: tl.constexpr, GIVEN_UNIFORMS: tl.constexpr, COPIES: tl.constexpr, SUBSTEPS: tl.constexpr,
    ):  # fmt: skip
        """num_steps steps of BLOCK envs: the twin's make_collect's step(t) for each t, one program a block of envs."""
        env = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = env < num_envs
        col, hid = tl.arange(0, PAD), tl.arange(0, HIDDEN)
        # The actor's weights, transposed and padded with zeros, loaded once for all steps.
        w1 = tl.load(w1_ptr + hid[None, :] * N_OBS + col[:, None], mask=col[:, None] < N_OBS, other=0.0)
        w2 = tl.load(w2_ptr + hid[None, :] * HIDDEN + hid[:, None])
        w3 = tl.load(w3_ptr + col[None, :] * HIDDEN + hid[:, None], mask=col[None, :] < N_ACT, other=0.0)
        b1, b2 = tl.load(b1_ptr + hid), tl.load(b2_ptr + hid)
        b3 = tl.load(b3_ptr + col, mask=col < N_ACT, other=0.0)
        # The envs in registers: the state one vector (or [envs, copies] tile) per component, the step counts,
        # returns and episode sums.
        if COPIES == 1:
            copy = tl.zeros_like(env)
        else:
            copy = tl.arange(0, COPIES)[None, :]
        # `copy < COPIES` holds everywhere: it spreads `live` to the state's shape.
        at, tile = per_copy(env * N_STATE, COPIES) + copy, per_copy(live, COPIES) & (copy < COPIES)
        s0 = tl.load(state_ptr + at, mask=tile, other=0.0)
        s1 = tl.load(state_ptr + at + COPIES, mask=tile, other=0.0)
        s2 = tl.load(state_ptr + at + 2 * COPIES, mask=tile & (N_STATE > 2 * COPIES), other=0.0)
        s3 = tl.load(state_ptr + at + 3 * COPIES, mask=tile & (N_STATE > 3 * COPIES), other=0.0)
        elapsed = tl.load(elapsed_ptr + env, mask=live, other=0)
        episode_return = tl.load(episode_return_ptr + env, mask=live, other=0.0)
        ended_count = tl.load(ended_ptr + env, mask=live, other=0.0)
        ended_return = tl.load(ended_ptr + num_envs + env, mask=live, other=0.0)
        ended_length = tl.load(ended_ptr + 2 * num_envs + env, mask=live, other=0.0)
        obs = env_observe(ENV, s0, s1, s2, s3, col[None, :], COPIES)
        obs_mask = live[:, None] & (col[None, :] < N_OBS)
        for t in range(num_steps):
            # The policy: the actor's logits (fp32 products, as torch's), a Gumbel-max action, its log-probability.
            h = tanh(tl.dot(obs, w1, input_precision="ieee") + b1[None, :])
            h = tanh(tl.dot(h, w2, input_precision="ieee") + b2[None, :])
            logits = tl.dot(h, w3, input_precision="ieee") + b3[None, :]
            logits = tl.where(col[None, :] < N_ACT, logits, float("-inf"))
            # Draws of step t: n_act for the action, then n_noise for the reset, per env (torch's order).
            row = env.to(tl.int64) + t * num_envs  # row t of the trajectory, in int64 as the biggest ones need
            draw = row * (N_ACT + N_NOISE)
            u = uniform(uniforms_ptr, seed, draw[:, None] + col[None, :], live[:, None] & (col[None, :] < N_ACT),
                        GIVEN_UNIFORMS)  # fmt: skip
            action = tl.argmax(logits - tl.log(-tl.log(u)), axis=1)
            top = tl.max(logits, axis=1)
            logsumexp = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            logprob = tl.sum(tl.where(col[None, :] == action[:, None], logits, 0.0), axis=1) - logsumexp
            # The env step, the time limit and the same-step auto-reset, as Envs.step.
            n0, n1, n2, n3, reward, terminated = env_step(ENV, s0, s1, s2, s3, action, COPIES, SUBSTEPS)
            elapsed += 1
            episode_return += reward
            done = terminated | (elapsed >= MAX_EPISODE_STEPS)
            noise = per_copy(draw, COPIES) + N_ACT + copy  # the reset's draws in the state's order
            u0 = uniform(uniforms_ptr, seed, noise, tile, GIVEN_UNIFORMS)
            u1 = uniform(uniforms_ptr, seed, noise + COPIES, tile & (N_NOISE > COPIES), GIVEN_UNIFORMS)
            u2 = uniform(uniforms_ptr, seed, noise + 2 * COPIES, tile & (N_NOISE > 2 * COPIES), GIVEN_UNIFORMS)
            u3 = uniform(uniforms_ptr, seed, noise + 3 * COPIES, tile & (N_NOISE > 3 * COPIES), GIVEN_UNIFORMS)
            f0, f1, f2, f3 = env_initial(ENV, u0, u1, u2, u3)
            reset = per_copy(done, COPIES)
            s0, s1 = tl.where(reset, f0, n0), tl.where(reset, f1, n1)
            s2, s3 = tl.where(reset, f2, n2), tl.where(reset, f3, n3)
            ended_count += tl.where(done, 1.0, 0.0)
            ended_return += tl.where(done, episode_return, 0.0)
            ended_length += tl.where(done, elapsed.to(tl.float32), 0.0)
            elapsed = tl.where(done, 0, elapsed)
            episode_return = tl.where(done, 0.0, episode_return)
            obs = env_observe(ENV, s0, s1, s2, s3, col[None, :], COPIES)
            # Row t of the trajectory; the observation and done flag after the step are row t + 1 of theirs.
            tl.store(actions_ptr + row, action.to(tl.int64), mask=live)
            tl.store(logprobs_ptr + row, logprob, mask=live)
            tl.store(rewards_ptr + row, reward, mask=live)
            tl.store(dones_ptr + row + num_envs, done.to(tl.float32), mask=live)
            tl.store(obs_ptr + (row + num_envs)[:, None] * N_OBS + col[None, :], obs, mask=obs_mask)
        tl.store(state_ptr + at, s0, mask=tile)
        tl.store(state_ptr + at + COPIES, s1, mask=tile)
        tl.store(state_ptr + at + 2 * COPIES, s2, mask=tile & (N_STATE > 2 * COPIES))
        tl.store(state_ptr + at + 3 * COPIES, s3, mask=tile & (N_STATE > 3 * COPIES))
        tl.store(elapsed_ptr + env, elapsed, mask=live)
        tl.store(episode_return_ptr + env, episode_return, mask=live)
        tl.store(ended_ptr + env, ended_count, mask=live)
        tl.store(ended_ptr + num_envs + env, ended_return, mask=live)
        tl.store(ended_ptr + 2 * num_envs + env, ended_length, mask=live)


def make_fused_collect(net, envs, rollout):
    """collect() as the twin's make_collect's, the rollout one Triton kernel launch, then one batched critic call for
    the values. Neither --compile nor --cudagraphs applies: the kernel is one launch already, and its seed changes at
    every call, which a captured launch would replay unchanged. The kernel's Philox draws are numbered as the torch
    rollout's (docs/gpu_collection.md), seeded by collect.seed, counted up from a draw of --seed's CPU generator (no
    device sync) and kept by a checkpoint. collect(uniforms) reads a [num_steps, num_envs, n_act + n_noise] tensor
    of uniforms instead (the tests)."""
    # Here, not in the twin's check_args, which it shares word for word with the baseline: before any training still.
    if unavailable := fused_rollout_unavailable(rollout.obs.device.type == "cuda"):
        fail(unavailable)
    physics, (num_steps, num_envs) = envs.physics, rollout.actions.shape
    layers = [net.actor[i] for i in (0, 2, 4)]
    # The kernel's env numbers; a subclass (CartPole's heavier variants) runs its base's physics, with its copies and
    # substeps.
    env_number = [issubclass(physics, base) for base in (CartPole, Acrobot, MountainCar)].index(True)
    copies, substeps = getattr(physics, "copies", 1), getattr(physics, "substeps", 1)
    # 64 envs a program from 2^14 envs on: the weights loaded once for more of them; but with several copies per env
    # their state no longer fits in registers at 64 (both measured, docs/gpu_collection.md).
    block = 64 if num_envs >= 2**14 and copies == 1 else 16

    def collect(uniforms=None):
        # The observation the last rollout ended in is the first of this one.
        rollout.obs[0] = rollout.obs[-1]
        rollout.dones[0] = rollout.dones[-1]
        fused_rollout_kernel[(triton.cdiv(num_envs, block),)](
            envs.state, envs.elapsed, envs.episode_return, envs.ended,
            *(p.detach() for layer in layers for p in (layer.weight, layer.bias)),
            rollout.obs, rollout.actions, rollout.logprobs, rollout.rewards, rollout.dones,
            rollout.rewards if uniforms is None else uniforms,  # unread when Philox draws
            int(collect.seed), num_envs, num_steps,
            ENV=env_number, N_STATE=envs.state.shape[1], N_OBS=physics.n_obs, N_ACT=physics.n_act,
            N_NOISE=physics.n_noise, MAX_EPISODE_STEPS=physics.max_episode_steps, HIDDEN=layers[0].out_features,
            PAD=FUSED_PAD, BLOCK=block, GIVEN_UNIFORMS=uniforms is not None, COPIES=copies, SUBSTEPS=substeps,
            num_warps=4,
        )  # fmt: skip
        collect.seed += 1
        with torch.no_grad():
            rollout.values.copy_(net.critic(rollout.obs[:-1]).squeeze(-1))

    collect.seed = torch.randint(2**30, ())  # a tensor, which a checkpoint restores in place
    return collect
