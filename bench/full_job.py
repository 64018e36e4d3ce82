#!/usr/bin/env python3
"""The PyTorch job of bench/full_checkpoint_gpu.py, started the way CRIU needs (setsid, stdio on files).

    full_job.py --hold BYTES --steps-before N --steps-after M
    full_job.py --limit BYTES        only the pinned copy limit, in a process of its own: one JSON line

Trains a small deterministic model and holds BYTES of extra device memory ("live tensors", seeded random
contents).  Prints one JSON line per event on stdout (a file):
  {"ready": ..., "allocated": ..., "reserved": ...}               after allocating
  {"step": K, "loss": "<float.hex>"}                               each training step
  {"spinning": true}                    with --spin: before training, it runs matmuls on a tensor of its
                                        own (driver calls for a tracer to see) until SIGUSR2
  {"paused": N, "checksum": [...]}                                 after N steps: it then waits for SIGUSR1
  {"resumed": true, "checksum": [...]}                             on SIGUSR1, then M more steps
  {"done": true, "checksum": [...]}
The harness checkpoints the whole process while it is paused (holding all its memory), kills it,
restores it, and sends SIGUSR1: the losses after that must equal an uninterrupted run's bit for bit
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8 set by the harness).
"""

import argparse
import os
import signal

import torch
from ckpt_job import checksums, copy_limit, fill  # bench/, beside this file
from job_protocol import emit, pause_then_finish


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--steps-before", type=int, default=20)
    ap.add_argument("--steps-after", type=int, default=20)
    ap.add_argument("--spin", action="store_true")
    a = ap.parse_args()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # taken by sigwait below, never lost
    go_on = []  # SIGUSR2 ends --spin: a handler, since no thread waits for it (torch's would take it and die)
    signal.signal(signal.SIGUSR2, lambda *_: go_on.append(True))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator(device=dev).manual_seed(1)
    xs = torch.randn(32, 128, 512, device=dev, generator=g)
    ys = torch.randn(32, 128, 512, device=dev, generator=g)
    held = fill(a.hold, dev, g)

    def checksum() -> list:
        return checksums(held)

    def limit() -> tuple[float, float]:
        return copy_limit(a.limit, dev)

    if a.limit:  # pinned host memory stays cached by torch: measured in a process that is not checkpointed
        d2h, h2d = limit()
        emit(limit_bytes=a.limit, limit_d2h_gbps=d2h, limit_h2d_gbps=h2d)
        return 0
    emit(ready=True, pid=os.getpid(), torch=torch.__version__, held_bytes=a.hold,
         allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())

    def train(k0: int, k1: int) -> None:
        for k in range(k0, k1):
            i = k % xs.shape[0]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
            loss.backward()
            opt.step()
            emit(step=k + 1, loss=float(loss.item()).hex())

    if a.spin:  # no random numbers, nothing of the model's: the losses stay the reference's
        w = torch.ones(1024, 1024, device=dev)
        emit(spinning=True)
        while not go_on:
            for _ in range(20):
                w = torch.tanh(w @ w)
            torch.cuda.synchronize()
        del w
    pause_then_finish(train, checksum, a.steps_before, a.steps_after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
