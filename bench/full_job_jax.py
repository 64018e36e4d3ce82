#!/usr/bin/env python3
"""The JAX job of bench/full_checkpoint_gpu.py (--framework jax): bench/full_job.py's protocol, in JAX.

    full_job_jax.py --hold BYTES --steps-before N --steps-after M

Trains a small MLP (jitted SGD step, fixed data) and holds BYTES of extra device memory in seeded random
arrays.  One JSON line per event on stdout (a file): {"ready"...}, {"step": K, "loss": "<float.hex>"},
{"paused": N, "checksum": [...]} (then it waits for SIGUSR1), {"resumed": ...}, {"done": true, ...}.
XLA's allocator as users run it, but not preallocating 75% of the GPU (the harness sets
XLA_PYTHON_CLIENT_PREALLOCATE=false: a whole-process checkpoint would copy all of that).
"""

import argparse
import os
import signal

# Before JAX starts its threads: they inherit the mask, so SIGUSR1 reaches only the protocol's sigwait.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from job_protocol import emit, pause_then_finish  # noqa: E402  (bench/, beside this file)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", type=int, default=0)
    ap.add_argument("--steps-before", type=int, default=20)
    ap.add_argument("--steps-after", type=int, default=20)
    a = ap.parse_args()
    key = jax.random.PRNGKey(0)
    k_w, k_x, k_y, k_h = jax.random.split(key, 4)
    params = [jax.random.normal(k, (512, 512), jnp.float32) * 0.04 for k in jax.random.split(k_w, 4)]
    xs = jax.random.normal(k_x, (32, 128, 512), jnp.float32)
    ys = jax.random.normal(k_y, (32, 128, 512), jnp.float32)
    chunk = 256 << 20
    held = [jax.random.bits(k, (min(chunk, a.hold - i) // 4,), jnp.uint32)
            for i, k in zip(range(0, a.hold, chunk), jax.random.split(k_h, max(1, -(-a.hold // chunk))))]

    def loss_fn(ps, x, y):
        h = x
        for w in ps[:-1]:
            h = jnp.tanh(h @ w)
        return jnp.mean((h @ ps[-1] - y) ** 2)

    @jax.jit
    def step(ps, x, y):
        loss, g = jax.value_and_grad(loss_fn)(ps, x, y)
        return [w - 1e-2 * gw for w, gw in zip(ps, g)], loss

    def checksum() -> list:
        return [[int(jnp.sum(t, dtype=jnp.uint32)), int(jnp.sum(t[::4099], dtype=jnp.uint32))] for t in held]

    jax.block_until_ready(held)
    emit(ready=True, pid=os.getpid(), jax=jax.__version__, held_bytes=a.hold,
         backend=jax.default_backend(), devices=[str(d) for d in jax.devices()])

    def train(k0: int, k1: int) -> None:
        nonlocal params
        for k in range(k0, k1):
            i = k % xs.shape[0]
            params, loss = step(params, xs[i], ys[i])
            emit(step=k + 1, loss=float(loss).hex())

    pause_then_finish(train, checksum, a.steps_before, a.steps_after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
