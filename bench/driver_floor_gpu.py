#!/usr/bin/env python3
"""What the driver's own checkpoint costs when there is almost nothing to copy: the floor under the "GPU part"
of a whole-process checkpoint once the shim has moved and released the device memory.

A PyTorch process initialises CUDA, runs one cuBLAS matmul (so the context has its modules loaded, as a
training job's does), frees its tensors and waits. This script then times cuCheckpointProcessLock,
Checkpoint, Restore and Unlock on it, ROUNDS times, and the process's GPU memory (nvidia-smi) before.

On the GPU machine (bench/gpu-env.sh first):
    python3 bench/driver_floor_gpu.py --out OUT/floor [--rounds 5]
Writes OUT/driver-floor.json and OUT/driver-floor.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

JOB = r"""
import os, signal, sys, torch
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
x = torch.randn(4096, 4096, device="cuda")
y = x @ x
torch.cuda.synchronize()
del x, y
torch.cuda.empty_cache()
print("ready", os.getpid(), flush=True)
signal.sigwait({signal.SIGUSR1})
x = torch.randn(256, 256, device="cuda")
print("after", float((x @ x).sum()) == float((x @ x).sum()), flush=True)
"""


def gpu_mib(pid: int) -> int | None:
    r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    for ln in r.stdout.splitlines():
        p, m = [x.strip() for x in ln.split(",")]
        if p == str(pid):
            return int(m)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from gputrace.checkpointer import driver

    p = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("ready"):
        raise SystemExit(f"the job did not start: {line!r}")
    mem = gpu_mib(p.pid)
    d = driver.Driver(p.pid)
    rounds = []
    for _ in range(a.rounds):
        r = {k: d.call(k, 10_000 if k == "Lock" else 0) / 1e9 for k in ("Lock", "Checkpoint")}
        r["gpu_mib_checkpointed"] = gpu_mib(p.pid)
        r.update({k: d.call(k) / 1e9 for k in ("Restore", "Unlock")})
        rounds.append(r)
    p.send_signal(signal.SIGUSR1)
    after = p.stdout.readline().strip()
    p.wait(timeout=120)
    med = {k: statistics.median(r[k] for r in rounds) for k in ("Lock", "Checkpoint", "Restore", "Unlock")}
    doc = {"schema": 1, "host": f"{platform.node()} ({platform.platform()})",
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "gpu_mib_before": mem, "rounds": rounds, "median_s": med, "job_after": after, "job_status": p.returncode}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver-floor.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = [f"# The driver's checkpoint with almost nothing to copy", "", f"{doc['host']}, {doc['when']}; "
          f"command: `{doc['command']}`", "", f"Process GPU memory before (nvidia-smi): {mem} MiB "
          "(context and modules; tensors freed).", "", "| round | lock s | checkpoint s | GPU MiB checkpointed | "
          "restore s | unlock s |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        md.append(f"| {i + 1} | {r['Lock']:.4f} | {r['Checkpoint']:.4f} | {r['gpu_mib_checkpointed']} | "
                  f"{r['Restore']:.4f} | {r['Unlock']:.4f} |")
    md += ["", f"Medians: lock {med['Lock']:.4f} s, checkpoint {med['Checkpoint']:.4f} s, restore "
           f"{med['Restore']:.4f} s, unlock {med['Unlock']:.4f} s. The job ran on afterwards: {after!r}."]
    (out / "driver-floor.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if p.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
