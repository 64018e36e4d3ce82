#!/usr/bin/env python3
"""The GPU benchmarks' jobs: real frameworks, in one warm process that runs timed phases on request.

Jobs (--job):
  mlp      launch-bound training: 4 x Linear(256), Adam, batch 64, loss.item() each step
  gpt2     a transformer training step: transformers' GPT2LMHeadModel built from GPT2Config (6 layers,
           n_embd 512, 8 heads; random init, nothing downloaded), AdamW, batch 8 x 128 tokens
  graph    the mlp step captured once as a CUDA graph and replayed (one cuGraphLaunch a step)
  matmul   GPU-bound: 8 bf16 matmuls of 8192^2 a step; the CPU mostly waits
  copies   small host-device copies: 4 KiB pinned H2D, a tiny kernel, 4 KiB D2H, synchronize
  copiesbig  large host-device copies: 64 MiB pinned H2D, a kernel over it, 64 MiB D2H, synchronize
  gpt2big  the gpt2 step at a second size: 12 layers, n_embd 1024, 16 heads, batch 8 x 512 tokens
  kvcache  inference with a KV cache: the gpt2 model (eval, no grad) decoding greedily one token a step
           for a batch of 4, its cache carried from step to step, a new 32-token prompt every 128 tokens
  switch   mlp steps until the first `run` ends, then graph replays: calls that change mid-run
  jax      a jitted JAX training step: the mlp's shape (4 x 256 tanh layers, batch 64) as one jitted
           function (grad and SGD update), its loss read to the host each step; PyTorch is not imported,
           and XLA_PYTHON_CLIENT_PREALLOCATE=false unless set (it shares the GPU with other jobs)
  conv     a small cuDNN conv net: 3 conv layers (32, 64, 64 channels, batch norm, ReLU) on batch 32 of
           3 x 32 x 32, a linear head, SGD with momentum, loss.item() each step

Protocol (stdout is one line per answer): after set-up and warm-up it prints `ready`; then each line
on stdin is `run SECONDS [stamps]` (run that long; answer {"steps", "seconds", "steps_per_s",
"cpu_s", "t0"} and with `stamps` "stamps": the end of every step; times are CLOCK_MONOTONIC
seconds, as the tracer's report gives them) or `quit`. cpu_s is the process's CPU time over the
phase, all threads. `gputime STEPS` runs STEPS steps under PyTorch's profiler (CUDA activity only)
and answers {"steps", "gpu_busy_s_per_step" (the union of the device's kernel, copy and set
intervals), "gpu_sum_s_per_step" (their sum), "device_events_per_step"}: the GPU time behind the
driver calls per GPU-millisecond. The profiler leaves CUPTI loaded, so a harness asks for it last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

JOBS = ("mlp", "gpt2", "gpt2big", "graph", "matmul", "copies", "copiesbig", "kvcache", "switch", "jax", "conv")


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


def make_gpt2(torch, dev, layers: int = 6, width: int = 512, heads: int = 8, tokens: int = 128):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=8192,
                                       n_positions=max(256, tokens))).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (8, tokens), device=dev)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step, (model, opt, ids)


def make_gpt2big(torch, dev):
    return make_gpt2(torch, dev, layers=12, width=1024, heads=16, tokens=512)


def make_kvcache(torch, dev):
    """Greedy decoding with the cache carried between steps, as a serving loop does; `.item()` on
    each step's tokens is the per-token check a generation loop makes (a stop token)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192, n_positions=256)).to(dev)
    model.eval()
    gen = torch.Generator(device=dev).manual_seed(1)
    state: dict = {"past": None, "tok": None, "n": 0}

    def prefill() -> None:
        prompt = torch.randint(0, 8192, (4, 32), device=dev, generator=gen)
        out = model(input_ids=prompt, use_cache=True)
        state["past"], state["n"] = out.past_key_values, 0
        state["tok"] = out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def step() -> float:
        if state["past"] is None or state["n"] >= 128:
            prefill()
        out = model(input_ids=state["tok"], past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        state["tok"] = out.logits[:, -1:].argmax(-1)
        state["n"] += 1
        return float(state["tok"][0, 0].item())

    with torch.no_grad():
        prefill()
    return step, (model, state)


def make_matmul(torch, dev):
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def step() -> float:
        c = a
        for _ in range(8):
            c = torch.matmul(c, b) * 1e-2
        return float(c[0, 0].item())

    return step, (a, b)


def make_copies(torch, dev, floats: int = 1024):
    host_in = torch.randn(floats).pin_memory()
    host_out = torch.empty(floats).pin_memory()
    d = torch.empty(floats, device=dev)

    def step() -> float:
        d.copy_(host_in, non_blocking=True)
        d.mul_(1.0001)
        host_out.copy_(d, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return 0.0

    return step, (host_in, host_out, d)


def make_copiesbig(torch, dev):
    return make_copies(torch, dev, floats=16 << 20)  # 64 MiB of float32


def make_conv(torch, dev):
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x = torch.randn(32, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step, (model, opt, x, y)


def make_jax():
    """The mlp's training step in JAX, jitted whole (forward, grad, SGD update); the loss read to
    the host each step, as the mlp's loss.item()."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    ws = [jax.random.normal(keys[i], (256, 256)) * 0.05 for i in range(4)]
    x = jax.random.normal(keys[4], (64, 256))
    y = jax.random.normal(keys[5], (64, 256))

    def loss_fn(ws, x, y):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    @jax.jit
    def update(ws, x, y):
        loss, g = jax.value_and_grad(loss_fn)(ws, x, y)
        return [w - 1e-3 * gw for w, gw in zip(ws, g)], loss

    state = {"ws": ws}

    def step() -> float:
        state["ws"], loss = update(state["ws"], x, y)
        return float(loss)

    return step, state


def gpu_time(torch, step, steps: int) -> dict:
    """The GPU's own time a step: `steps` steps under the profiler (two more first, its warm-up),
    every device event's interval (kernels, copies, sets), their union and their sum."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=steps)) as prof:
        for _ in range(steps + 2):
            step()
            torch.cuda.synchronize()
            prof.step()
    # Device events are Kineto's GPU_MEMCPY, GPU_MEMSET and CONCURRENT_KERNEL (kernels replayed from a
    # CUDA graph included: CUPTI reports each node), times in microseconds from the trace's start.
    # GPU_USER_ANNOTATION is a device event too (a record_function's span over its kernels, e.g.
    # "ProfilerStep#N"); torch registers no record_function callback without ProfilerActivity.CPU, so
    # none should come, but one would fill the gaps between kernels: kept out.
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start
                   and not getattr(e, "is_user_annotation", False) and not e.name.startswith("ProfilerStep"))
    busy, total, cur = 0.0, 0.0, None
    for a, b in spans:
        total += b - a
        if cur is None or a > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        busy += cur[1] - cur[0]
    return {"steps": steps, "gpu_busy_s_per_step": busy * 1e-6 / steps, "gpu_sum_s_per_step": total * 1e-6 / steps,
            "device_events_per_step": len(spans) / steps}


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=JOBS, required=True)
    ap.add_argument("--warmup", type=int, default=30)
    args = ap.parse_args()
    if args.job == "jax":  # no PyTorch in this process: JAX's own driver calls only
        torch = None
        step, keep = make_jax()
        steps = [step]
        sync = lambda: None  # noqa: E731 - each step reads its loss to the host
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_jobs: no CUDA device", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
        sync = torch.cuda.synchronize
        makers = {"mlp": make_mlp, "gpt2": make_gpt2, "gpt2big": make_gpt2big, "graph": make_graph,
                  "matmul": make_matmul, "copies": make_copies, "copiesbig": make_copiesbig, "kvcache": make_kvcache,
                  "conv": make_conv}
        if args.job == "switch":
            first, keep1 = make_mlp(torch, dev)
            second, keep2 = make_graph(torch, dev)
            steps = [first]
        else:
            step, keep = makers[args.job](torch, dev)
            steps = [step]
    for _ in range(args.warmup):
        steps[0]()
    sync()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "gputime":
            try:
                if torch is None:
                    raise RuntimeError("gputime uses PyTorch's profiler: not for this job")
                answer = gpu_time(torch, steps[0], int(words[1]))
            except Exception as exc:  # the profiler's API moves between releases: say so, keep the job
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
            continue
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
