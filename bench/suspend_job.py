#!/usr/bin/env python3
"""A job of one framework's memory for the suspend benchmark on a real GPU, driven line by line on
stdin, one JSON line of reply to each command (bench/suspend_frameworks_gpu.py drives it):

  hold MIB     allocate MIB of device arrays (256 MiB each) filled from a seeded generator on the
               device, by the framework's own allocator; reply with their checksum
  checksum     the held arrays' checksum, computed on the device afresh (JAX keeps a host copy of
               an array it has read: a fresh reduction each time reads the device's bytes)
  scribble     change every held byte in place (JAX: a donated update, which XLA writes into the
               same buffer; the reply says whether every array kept its address)
  work         a few matmuls and a reduction: the device still computes; reply with the result
  addrs        the device address of every held array
  quit

--fw: torch (the allocator PYTORCH_CUDA_ALLOC_CONF picks: expandable_segments maps its own VMM
memory, backend:cudaMallocAsync uses the driver's stream-ordered pool), jax (XLA_PYTHON_CLIENT_*
pick preallocation and the allocator, cuda_async among them), cupy (--pool async: its
MemoryAsyncPool, cuMemAllocAsync).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MIB = 1 << 20
CHUNK = 256 * MIB


class Torch:
    def __init__(self, pool: str) -> None:
        import torch
        self.t = torch
        self.dev = torch.device("cuda")
        self.g = torch.Generator(device=self.dev).manual_seed(1)
        self.version = torch.__version__

    def fill(self, n: int):
        a = self.t.empty(n // 8, dtype=self.t.int64, device=self.dev)
        a.random_(generator=self.g)
        return a

    def checksum(self, a) -> list[int]:
        return [int(a.sum()), int(a[::4099].sum())]

    def scribble(self, a):
        a.add_(1)
        return a

    def addr(self, a) -> int:
        return a.data_ptr()

    def work(self) -> float:
        x = self.t.randn(1024, 1024, device=self.dev, generator=self.g)
        for _ in range(4):
            x = self.t.tanh(x @ x / 32)
        return float(x.double().sum())

    def sync(self) -> None:
        self.t.cuda.synchronize()


class Cupy:
    def __init__(self, pool: str) -> None:
        import cupy
        self.cp = cupy
        if pool == "async":
            cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
        self.rs = cupy.random.RandomState(1)
        self.version = cupy.__version__

    def fill(self, n: int):
        return self.rs.randint(-(1 << 62), 1 << 62, size=n // 8, dtype=self.cp.int64)

    def checksum(self, a) -> list[int]:
        return [int(a.sum()), int(a[::4099].sum())]

    def scribble(self, a):
        a += 1
        return a

    def addr(self, a) -> int:
        return int(a.data.ptr)

    def work(self) -> float:
        x = self.rs.standard_normal((1024, 1024), dtype=self.cp.float32)
        for _ in range(4):
            x = self.cp.tanh(x @ x / 32)
        return float(x.astype(self.cp.float64).sum())

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()


class Jax:
    def __init__(self, pool: str) -> None:
        import jax
        import jax.numpy as jnp
        self.jax, self.jnp = jax, jnp
        self.key = jax.random.PRNGKey(1)
        self._sum = jax.jit(lambda a: (jnp.sum(a, dtype=jnp.uint32), jnp.sum(a[::4099], dtype=jnp.uint32)))
        self._inc = jax.jit(lambda a: a + jnp.uint32(1), donate_argnums=0)
        self.version = jax.__version__

    def fill(self, n: int):
        self.key, k = self.jax.random.split(self.key)
        return self.jax.random.bits(k, (n // 4,), dtype=self.jnp.uint32)

    def checksum(self, a) -> list[int]:
        s, t = self._sum(a)
        return [int(s), int(t)]

    def scribble(self, a):
        return self._inc(a)

    def addr(self, a) -> int:
        return a.unsafe_buffer_pointer()

    def work(self) -> float:
        self.key, k = self.jax.random.split(self.key)
        x = self.jax.random.normal(k, (1024, 1024))
        for _ in range(4):
            x = self.jnp.tanh(x @ x / 32)
        return float(x.sum())

    def sync(self) -> None:
        (self.jnp.zeros(1) + 1).block_until_ready()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fw", required=True, choices=["torch", "jax", "cupy"])
    ap.add_argument("--pool", default="", help="cupy: 'async' for MemoryAsyncPool")
    args = ap.parse_args()
    fw = {"torch": Torch, "jax": Jax, "cupy": Cupy}[args.fw](args.pool)
    held: list = []

    def reply(**kw) -> None:
        print(json.dumps(kw), flush=True)

    def sums() -> list[list[int]]:
        return [fw.checksum(a) for a in held]

    reply(ready=True, pid=os.getpid(), fw=args.fw, version=fw.version)
    for line in sys.stdin:
        cmd, *arg = line.split()
        try:
            if cmd == "hold":
                n = int(arg[0]) * MIB
                while n > 0:
                    held.append(fw.fill(min(CHUNK, n)))
                    n -= CHUNK
                fw.sync()
                reply(ok=True, arrays=len(held), checksum=sums())
            elif cmd == "checksum":
                reply(ok=True, checksum=sums())
            elif cmd == "scribble":
                before = [fw.addr(a) for a in held]
                held[:] = [fw.scribble(a) for a in held]
                fw.sync()
                reply(ok=True, in_place=before == [fw.addr(a) for a in held])
            elif cmd == "work":
                reply(ok=True, result=fw.work())
            elif cmd == "addrs":
                reply(ok=True, addrs=[fw.addr(a) for a in held])
            elif cmd == "quit":
                reply(ok=True)
                return 0
            else:
                reply(ok=False, error=f"unknown command {cmd!r}")
        except Exception as e:  # the harness records it and goes on with the next case
            reply(ok=False, error=f"{type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
