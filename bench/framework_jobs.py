#!/usr/bin/env python3
"""Jobs of the real frameworks for bench/frameworks_gpu.py: each runs steps until killed (or for
--seconds), counting them in a shared file the bench reads while it traces.

Jobs (--job):
  torch      PyTorch eager: 4 x Linear(256), Adam, batch 64, loss.item() each step
  expseg     the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the bench) and a
             tensor of a different size each step, so the allocator maps and unmaps VMM memory
  graph      the torch step captured once as a CUDA graph and replayed
  gpt2       transformers' GPT2LMHeadModel from GPT2Config (6 layers, n_embd 512), AdamW, 8 x 128 tokens
  jax        bench/gpu_jobs.py's jitted JAX MLP step (XLA_PYTHON_CLIENT_PREALLOCATE=false), its loss read
             to the host each step
  cupy       CuPy elementwise kernels and a reduction on 1M floats, a host read each step
  switch     torch eager steps for --switch-after seconds, then graph replays: calls that change mid-run

Counter file (--counter PATH): 16 bytes, u64 steps then f64 CLOCK_MONOTONIC seconds of the last step,
rewritten after every step. Prints `ready` on stdout once warmed up. The C++ job (static cudart) is
bench/framework_job.cu, with the same counter file.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def torch_steps(kind: str):
    import torch

    import gpu_jobs

    dev = torch.device("cuda")
    if kind == "graph":
        step, _keep = gpu_jobs.make_graph(torch, dev)
    elif kind == "gpt2":
        step, _keep = gpu_jobs.make_gpt2(torch, dev)
    else:
        step, _keep = gpu_jobs.make_mlp(torch, dev)
    if kind == "expseg":
        sizes = [1 << k for k in range(18, 26)]
        inner = step

        def step():  # noqa: F811 - a different size each step: the allocator maps and unmaps segments
            n = sizes[step.i % len(sizes)]
            step.i += 1
            t = torch.empty(n, device=dev)
            t.fill_(1.0)
            del t
            torch.cuda.empty_cache()
            return inner()

        step.i = 0
    step._keep = _keep
    return step


def cupy_step():
    import cupy as cp

    a = cp.random.random(1 << 20, dtype=cp.float32)
    b = cp.random.random(1 << 20, dtype=cp.float32)

    def step():
        c = a * b + 1.0
        d = cp.sin(c) * cp.cos(a)
        return float(d.sum().get())

    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True, choices=["torch", "expseg", "graph", "gpt2", "jax", "cupy", "switch"])
    ap.add_argument("--counter", required=True)
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: until killed)")
    ap.add_argument("--switch-after", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    fd = os.open(args.counter, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 16)
    mm = mmap.mmap(fd, 16)
    if args.job == "jax":
        from gpu_jobs import make_jax  # the one JAX step of the benches (rates_gpu's, audit_gpu's)

        step = make_jax()[0]
    elif args.job == "cupy":
        step = cupy_step()
    elif args.job == "switch":
        eager, graph = torch_steps("torch"), torch_steps("graph")
        state = {"t": None}

        def step():
            if state["t"] is None:
                state["t"] = time.monotonic()
            return (eager if time.monotonic() - state["t"] < args.switch_after else graph)()
    else:
        step = torch_steps(args.job)
    for _ in range(args.warmup if args.job != "switch" else 0):
        step()
    print("ready", flush=True)
    n, t0 = 0, time.monotonic()
    while not args.seconds or time.monotonic() - t0 < args.seconds:
        step()
        n += 1
        mm[:16] = struct.pack("<Qd", n, time.monotonic())
    return 0


if __name__ == "__main__":
    sys.exit(main())
