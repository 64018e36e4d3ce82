#!/usr/bin/env python3
"""Checkpoints that copy only what changed, on a real GPU: incremental checkpoints and rollback restores.

    python3 bench/incremental_gpu.py --out OUT.json [--gib 16] [--images /dev/shm/gtinc]

One PyTorch job (bench/ckpt_job.py) under `gputrace run --checkpointable` holds GIB GiB of seeded
tensors; in that one process:
  1. `gputrace checkpoint` (whole; digests of every 1 MiB chunk taken on the GPU in the freeze);
  2. 10% of the held bytes changed (the first tenth of each 1 GiB tensor), then
     `checkpoint --since` the first: its freeze, beside the first's (target: at most 0.2x);
  3. `restore` of the first (a rollback: hashes the live memory, copies back the chunks that differ):
     its freeze beside `restore --copy-all` of the same checkpoint and beside the driver API's
     restore of a job of the same size without the shim (target: at least 10x faster), the data
     checked each time;
  4. the worst case for the chunking: 10% changed as 64 KiB every 640 KiB (every 1 MiB chunk
     touched), restored the same way;
  5. an inference-style loop: the first 3/4 of the tensors static (weights), the last quarter a cache
     of which each step writes the next 256 MiB; `checkpoint --incremental` after each of 6 steps:
     each freeze beside hash time (the shim's digest_ns) plus the changed bytes over the bus (the
     pinned device-to-host rate measured in the job's own process);
  6. the restore of the last link of that chain (7 links), the data checked.
Then a job of the same size without the shim: `checkpoint --backend driver` (lock, checkpoint,
restore, unlock), its restore time the comparison for 3.
Writes OUT.json and OUT.md.  Run after `source bench/gpu-env.sh`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_gpu import Job, cli, log, results_main  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def _ms(ns) -> str:
    return f"{ns / 1e6:.1f}" if isinstance(ns, (int, float)) else "-"


def run(gib: int, images: Path) -> dict:
    n = gib * GIB
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    res: dict = {"gib": gib, "images": str(images)}
    job = Job(shim=True, suspendable=False)
    try:
        res["limit"] = job.cmd(f"limit {2 * GIB}")
        c0 = job.cmd(f"hold {n}")["checksum"]
        log("whole checkpoint")
        res["first"] = cli("checkpoint", "-p", str(job.pid), "-o", str(images / "a"))
        w = job.cmd(f"stripe {GIB} {GIB // 10}")  # the first tenth of each 1 GiB tensor
        c1 = w["checksum"]
        res["changed_10pct"] = w["changed_bytes"]
        log("incremental checkpoint (10% changed)")
        res["second"] = cli("checkpoint", "-p", str(job.pid), "-o", str(images / "b"), "--since", str(images / "a"))
        log("rollback restore of the first (10% differ)")
        res["rollback"] = cli("restore", "-p", str(job.pid), str(images / "a"), "--device-only", "--force")
        res["rollback"]["data_equal"] = job.cmd("checksum")["checksum"] == c0
        job.cmd(f"stripe {GIB} {GIB // 10}")
        res["rollback_copy_all"] = cli("restore", "-p", str(job.pid), str(images / "a"), "--device-only", "--force", "--copy-all")
        res["rollback_copy_all"]["data_equal"] = job.cmd("checksum")["checksum"] == c0
        log("restore of the incremental link")
        res["restore_link"] = cli("restore", "-p", str(job.pid), str(images / "b"), "--device-only", "--force")
        res["restore_link"]["data_equal"] = job.cmd("checksum")["checksum"] == c1
        log("worst case: 64 KiB of every 640 KiB changed")
        w = job.cmd(f"stripe {640 << 10} {64 << 10}")
        res["scattered_changed"] = w["changed_bytes"]
        res["rollback_scattered"] = cli("restore", "-p", str(job.pid), str(images / "a"), "--device-only", "--force")
        res["rollback_scattered"]["data_equal"] = job.cmd("checksum")["checksum"] == c0
        shutil.rmtree(images / "b", ignore_errors=True)
        # Inference-style: weights static, a cache written 256 MiB a step.
        cache_at, step_bytes = n * 3 // 4, 256 * MIB
        steps = []
        prev = images / "a"
        for k in range(6):
            w = job.cmd(f"write {cache_at + k * step_bytes} {step_bytes}")
            log(f"inference step {k + 1}: incremental checkpoint")
            c = cli("checkpoint", "-p", str(job.pid), "-o", str(images / f"i{k}"), "--since", str(prev))
            c["changed_bytes"] = w["changed_bytes"]
            steps.append(c)
            prev = images / f"i{k}"
        res["inference"] = steps
        want = job.cmd("checksum")["checksum"]
        job.cmd(f"stripe {GIB} {GIB // 10}")
        log("restore of the inference chain's last link")
        res["restore_chain"] = cli("restore", "-p", str(job.pid), str(prev), "--device-only", "--force")
        res["restore_chain"]["data_equal"] = job.cmd("checksum")["checksum"] == want
    finally:
        job.close()
        shutil.rmtree(images, ignore_errors=True)
    log("the driver API on a job of the same size without the shim")
    job = Job(shim=False)
    try:
        held = job.cmd(f"hold {n}")
        d = cli("checkpoint", "--backend", "driver", "-p", str(job.pid))
        res["driver"] = {**d, "data_equal": job.cmd("checksum")["checksum"] == held["checksum"]}
    finally:
        job.close()
    return res


def summary(r: dict) -> str:
    f = lambda d, k: d.get(k) if isinstance(d, dict) else None  # noqa: E731
    first, second = r["first"], r["second"]
    d2h = r["limit"]["d2h_gbps"]
    drv = f(r["driver"], "restore_ns")
    lines = [f"# Incremental checkpoints and rollback restores on the GPU ({r['gib']} GiB of tensors)", "",
             f"Command: `{r['command']}` on {r.get('device', '?')}.", "",
             "| operation | freeze ms | digest ms | copy ms | chunks copied / all | bytes copied | data right |",
             "|---|---:|---:|---:|---:|---:|---|"]

    def row(name, d):
        if "error" in d:
            lines.append(f"| {name} | error: {d['error'][:200]} | | | | | |")
            return
        lines.append(f"| {name} | {_ms(d.get('freeze_ns'))} | {_ms(d.get('digest_ns'))} | {_ms(d.get('copy_ns'))} | "
                     f"{d.get('chunks_copied', '-')} / {d.get('chunks', '-')} | "
                     f"{d.get('bytes_copied', 0) / GIB:.2f} GiB | {d.get('data_equal', '-')} |")

    row("checkpoint, whole", first)
    row("checkpoint --since (10% changed)", second)
    row("restore (rollback, 10% differ)", r["rollback"])
    row("restore --copy-all", r["rollback_copy_all"])
    row("restore of the link (2-link chain)", r["restore_link"])
    row("restore, 64 KiB of every 640 KiB differ", r["rollback_scattered"])
    for k, c in enumerate(r["inference"]):
        row(f"inference step {k + 1}: checkpoint --since", c)
    row("restore of the inference chain (7 links)", r["restore_chain"])
    lines.append("")
    if "freeze_ns" in first and "freeze_ns" in second:
        lines.append(f"- Second checkpoint's freeze / first's: **{second['freeze_ns'] / first['freeze_ns']:.3f}** "
                     "(target at most 0.2).")
    if drv and "freeze_ns" in r["rollback"]:
        lines.append(f"- Driver API restore of the same size without the shim: {_ms(drv)} ms; rollback restore "
                     f"freeze {_ms(r['rollback']['freeze_ns'])} ms: **{drv / r['rollback']['freeze_ns']:.1f}x** faster "
                     "(target at least 10x).")
    for k, c in enumerate(r["inference"]):
        if "freeze_ns" in c:
            model = c.get("digest_ns", 0) + c.get("bytes_copied", 0) / d2h
            lines.append(f"- Inference step {k + 1}: freeze {_ms(c['freeze_ns'])} ms against hash "
                         f"{_ms(c.get('digest_ns'))} ms + {c.get('bytes_copied', 0) / MIB:.0f} MiB at {d2h:.1f} GB/s "
                         f"= {_ms(model)} ms: **{c['freeze_ns'] / model:.2f}x**.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--images", type=Path, default=Path("/dev/shm/gtinc"))
    return results_main(ap, lambda a: run(a.gib, a.images), summary)[0]


if __name__ == "__main__":
    sys.exit(main())
