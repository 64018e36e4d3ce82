#!/usr/bin/env python3
"""The GPU benchmarks' jobs: real frameworks, in one warm process that runs timed phases on request.

Jobs (--job):
  mlp      launch-bound training: 4 x Linear(256), Adam, batch 64, loss.item() each step
  gpt2     a transformer training step: transformers' GPT2LMHeadModel built from GPT2Config (6 layers,
           n_embd 512, 8 heads; random init, nothing downloaded), AdamW, batch 8 x 128 tokens
  graph    the mlp step captured once as a CUDA graph and replayed (one cuGraphLaunch a step)
  matmul   GPU-bound: 8 bf16 matmuls of 8192^2 a step; the CPU mostly waits
  copies   small host-device copies: 4 KiB pinned H2D, a tiny kernel, 4 KiB D2H, synchronize
  switch   mlp steps until the first `run` ends, then graph replays: calls that change mid-run

Protocol (stdout is one line per answer): after set-up and warm-up it prints `ready`; then each line
on stdin is `run SECONDS [stamps]` (run that long; answer {"steps", "seconds", "steps_per_s",
"cpu_s", "t0"} and with `stamps` "stamps": the end of every step; times are CLOCK_MONOTONIC
seconds, as the tracer's report gives them) or `quit`. cpu_s is the process's CPU time over the
phase, all threads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

JOBS = ("mlp", "gpt2", "graph", "matmul", "copies", "switch")


def make_mlp(torch, dev):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=dev)
    y = torch.randn(64, 256, device=dev)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step, (model, opt, x, y)


def make_graph(torch, dev):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    x = torch.randn(64, 256, device=dev)
    y = torch.randn(64, 256, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    def step() -> float:
        g.replay()
        torch.cuda.current_stream().synchronize()
        return 0.0

    return step, (model, opt, g, loss)


def make_gpt2(torch, dev):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=256)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (8, 128), device=dev)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step, (model, opt, ids)


def make_matmul(torch, dev):
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def step() -> float:
        c = a
        for _ in range(8):
            c = torch.matmul(c, b) * 1e-2
        return float(c[0, 0].item())

    return step, (a, b)


def make_copies(torch, dev):
    host_in = torch.randn(1024).pin_memory()
    host_out = torch.empty(1024).pin_memory()
    d = torch.empty(1024, device=dev)

    def step() -> float:
        d.copy_(host_in, non_blocking=True)
        d.mul_(1.0001)
        host_out.copy_(d, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return 0.0

    return step, (host_in, host_out, d)


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=JOBS, required=True)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_jobs: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    makers = {"mlp": make_mlp, "gpt2": make_gpt2, "graph": make_graph, "matmul": make_matmul,
              "copies": make_copies}
    if args.job == "switch":
        first, keep1 = make_mlp(torch, dev)
        second, keep2 = make_graph(torch, dev)
        steps = [first]
    else:
        step, keep = makers[args.job](torch, dev)
        steps = [step]
    for _ in range(args.warmup):
        steps[0]()
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        seconds = float(words[1])
        want_stamps = "stamps" in words[2:]
        step = steps[0]
        stamps: list[float] = []
        n, c0, t0 = 0, cpu_s(), time.monotonic()
        while True:
            step()
            n += 1
            now = time.monotonic()
            if want_stamps:
                stamps.append(now)
            if now - t0 >= seconds:
                break
        el = now - t0
        out = {"steps": n, "seconds": el, "steps_per_s": n / el, "cpu_s": cpu_s() - c0, "t0": t0}
        if want_stamps:
            out["stamps"] = [round(x, 6) for x in stamps]
        print(json.dumps(out), flush=True)
        if args.job == "switch":
            steps[0] = second
    return 0


if __name__ == "__main__":
    sys.exit(main())
