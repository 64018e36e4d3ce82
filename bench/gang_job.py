#!/usr/bin/env python3
"""A torch.distributed job of N ranks on one GPU (gloo), driven line by line on stdin: the target for
bench/gang_gpu.py.

The process started is the launcher: it spawns --ranks N processes (torch.multiprocessing, spawn) and
never touches CUDA itself; each rank joins a gloo process group, builds the same small model on
cuda:0, wraps it in DistributedDataParallel (gradients all-reduced through gloo every step) and holds
--hold-mib MiB of seeded tensors. Every command goes to every rank; the launcher answers with one
JSON line, {"ok": true, "ranks": [each rank's reply]}:

  hello          each rank's pid
  train K        K steps of DDP training from the current step: the losses (float.hex)
  seek S         set the step counter (the one piece of training state on the CPU) to S
  checksum       checksums of the held tensors and the model's weights, computed on the device
  scribble       overwrite the held tensors and the weights (every byte changes)
  quit

Deterministic (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG set by the harness,
gloo's sum of two ranks is exact in order): two runs give bitwise equal losses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def rank_main(rank: int, world: int, port: int, hold_mib: int, conn) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    g = torch.Generator(device=dev).manual_seed(100 + rank)  # each rank its own data
    xs = torch.randn(32, 64, 512, device=dev, generator=g)
    ys = torch.randn(32, 64, 512, device=dev, generator=g)
    held = torch.empty(hold_mib << 20, dtype=torch.uint8, device=dev)
    held.view(torch.int64).random_(generator=g)
    torch.cuda.synchronize()
    step = 0
    conn.send({"pid": os.getpid(), "rank": rank})
    while True:
        cmd, *arg = conn.recv().split()
        if cmd == "hello":
            conn.send({"pid": os.getpid(), "rank": rank})
        elif cmd == "train":
            losses = []
            for _ in range(int(arg[0])):
                i = step % xs.shape[0]
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(ddp(xs[i]), ys[i])
                loss.backward()
                opt.step()
                losses.append(loss.item().hex())
                step += 1
            conn.send({"step": step, "losses": losses})
        elif cmd == "seek":
            step = int(arg[0])
            conn.send({"step": step})
        elif cmd == "checksum":
            w = sum(int(p.detach().double().sum().item() * 1e6) for p in model.parameters())
            conn.send({"held": int(held.view(torch.int64).sum()), "weights": w})
        elif cmd == "scribble":
            with torch.no_grad():
                held.add_(1)
                for p in model.parameters():
                    p.add_(1.0)
            torch.cuda.synchronize()
            conn.send({"ok": True})
        elif cmd == "quit":
            conn.send({"ok": True})
            break
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--hold-mib", type=int, default=256)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for r in range(a.ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(r, a.ranks, a.port, a.hold_mib, child))
        p.start()
        conns.append(parent)
        procs.append(p)
    ranks = [c.recv() for c in conns]
    print(json.dumps({"ready": True, "launcher": os.getpid(), "ranks": ranks}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        for c in conns:
            c.send(line)
        print(json.dumps({"ok": True, "ranks": [c.recv() for c in conns]}), flush=True)
        if line == "quit":
            break
    for p in procs:
        p.join(timeout=60)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
