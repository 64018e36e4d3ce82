#!/usr/bin/env python3
"""A PyTorch job for the checkpoint benchmarks on a real GPU, driven line by line on stdin.

It trains a small deterministic model and holds extra device memory ("live tensors") of a given
size with known contents, and answers each command with one JSON line on stdout:

  hold BYTES     allocate BYTES of uint8 tensors (1 GiB each, the last one smaller), fill them from a
                 seeded generator on the device; reply with their checksum
  checksum       the held tensors' checksum (int64 sums of the data and of a stride, per tensor)
  scribble       overwrite the held tensors and the model's weights (every byte changes)
  write OFF N    add 1 to each of the N bytes at byte OFF of the held tensors (taken end to end): a
                 part of the device memory changes, the rest stays (incremental checkpoints)
  stripe P N     the same for N bytes at the start of every P bytes of the held tensors
  train K        K training steps from the current step; reply with the losses (float.hex)
  seek S         set the step counter to S (the only training state on the CPU side, see below)
  save PATH      torch.save of model, optimizer and held tensors to PATH, flushed and fsynced:
                 the application-level checkpoint; reply with its time
  limit BYTES    the pinned copy limit in this process: BYTES (at most 8 GiB) copied device to host
                 and host to device between a device tensor and a pinned one, 3 times each; best GB/s
  mem            torch's allocated and reserved bytes
  quit

Why the training survives a device-memory rollback: every piece of training state lives on the
device (weights, Adam(capturable=True) moments and step counts, the dataset), except the step
counter, which only picks the batch.  After `gputrace restore`, the harness says `seek N` for the
step the checkpoint was taken at; the rest of the CPU side (this interpreter) is the whole-process
checkpoint's business.  Deterministic: torch.use_deterministic_algorithms and a fixed cuBLAS
workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, set by the harness), so two runs give bitwise equal losses.
"""

import json
import os
import sys
import time

import torch

GIB = 1 << 30


def fill(nbytes: int, dev, g) -> list:
    """nbytes of uint8 tensors (1 GiB each, the last one smaller) filled from generator g."""
    held = []
    while nbytes > 0:
        t = torch.empty(min(GIB, nbytes), dtype=torch.uint8, device=dev)
        t.view(torch.int64).random_(generator=g)
        held.append(t)
        nbytes -= t.numel()
    torch.cuda.synchronize()
    return held


def checksums(held: list) -> list[list[int]]:
    """Per tensor: int64 sums of the data and of a stride of it."""
    return [[int(t.view(torch.int64).sum()), int(t.view(torch.int64)[::4099].sum())] for t in held]


def copy_limit(n: int, dev) -> tuple[float, float]:
    """Best of 3 pinned copies of n bytes, device to host and host to device, in GB/s (bytes per ns)."""
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    best = [0.0, 0.0]
    for _ in range(3):
        for i, (dst, src) in enumerate(((h, d), (d, h))):
            torch.cuda.synchronize()
            t = time.perf_counter_ns()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best[i] = max(best[i], n / (time.perf_counter_ns() - t))
    del d, h, dst, src  # the loop's names hold them too
    torch.cuda.empty_cache()
    return best[0], best[1]


def main() -> int:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    g = torch.Generator(device=dev).manual_seed(1)
    data_x = torch.randn(64, 64, 256, device=dev, generator=g)
    data_y = torch.randn(64, 64, 256, device=dev, generator=g)
    held: list[torch.Tensor] = []
    step = 0

    def checksum() -> list[list[int]]:
        return checksums(held)

    def reply(**kw) -> None:
        print(json.dumps(kw), flush=True)

    reply(ready=True, pid=os.getpid(), torch=torch.__version__)
    for line in sys.stdin:
        cmd, *arg = line.split()
        t0 = time.perf_counter_ns()
        if cmd == "hold":
            held += fill(int(arg[0]), dev, g)
            reply(ok=True, tensors=len(held), bytes=sum(t.numel() for t in held), checksum=checksum())
        elif cmd == "checksum":
            reply(ok=True, checksum=checksum())
        elif cmd == "scribble":
            with torch.no_grad():
                for t in held:
                    t.add_(1)
                for p in model.parameters():
                    p.add_(1.0)
            torch.cuda.synchronize()
            reply(ok=True)
        elif cmd in ("write", "stripe"):
            spans, flat_at = [], 0
            if cmd == "write":
                spans = [(int(arg[0]), int(arg[1]))]
            else:
                period, n = int(arg[0]), int(arg[1])
                total = sum(t.numel() for t in held)
                spans = [(o, n) for o in range(0, total, period)]
            changed = 0
            with torch.no_grad():
                for t in held:  # each tensor's share of every span
                    for off, n in spans:
                        a, b = max(off, flat_at), min(off + n, flat_at + t.numel())
                        if a < b:
                            t[a - flat_at:b - flat_at].add_(1)
                            changed += b - a
                    flat_at += t.numel()
            torch.cuda.synchronize()
            reply(ok=True, changed_bytes=changed, checksum=checksum(), ns=time.perf_counter_ns() - t0)
        elif cmd == "train":
            losses = []
            for _ in range(int(arg[0])):
                i = step % data_x.shape[0]
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(data_x[i]), data_y[i])
                loss.backward()
                opt.step()
                losses.append(loss.item().hex())
                step += 1
            reply(ok=True, step=step, losses=losses)
        elif cmd == "seek":
            step = int(arg[0])
            reply(ok=True, step=step)
        elif cmd == "save":
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "held": held, "step": step}
            with open(arg[0], "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            ns = time.perf_counter_ns() - t0
            reply(ok=True, save_ns=ns, file_bytes=os.path.getsize(arg[0]))
        elif cmd == "limit":
            n = min(int(arg[0]), 8 * GIB)
            d2h, h2d = copy_limit(n, dev)
            reply(ok=True, bytes=n, d2h_gbps=d2h, h2d_gbps=h2d)
        elif cmd == "mem":
            reply(ok=True, allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())
        elif cmd == "quit":
            reply(ok=True)
            return 0
        else:
            reply(ok=False, error=f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
