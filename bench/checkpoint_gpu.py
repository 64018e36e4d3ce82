#!/usr/bin/env python3
"""Checkpoint, restore, suspend and resume on a real GPU, against the bus and the driver's own API.

For each size (GiB of live tensors), in one call:
  1. a PyTorch job (bench/ckpt_job.py) under `gputrace run --checkpointable --suspendable` measures
     the pinned copy limit in its own process (device to host and back, best of 3), then holds SIZE
     of tensors with seeded contents;
  2. for each mode (staging: pinned staging buffers, then the image; direct: the image itself pinned
     before the freeze): `gputrace checkpoint`, the tensors and weights overwritten, `gputrace
     restore`, the checksum compared with the one taken before the checkpoint;
  3. `gputrace suspend` (the driver's memory figure for the process, nvidia-smi, before and after)
     and `gputrace resume`, the checksum compared again;
  4. a second job of the same size without the shim: `gputrace checkpoint --backend driver` (NVIDIA's
     cuCheckpointProcessLock/Checkpoint/Restore/Unlock), checksum compared; then the job saves model,
     optimizer and tensors with torch.save to the same storage (application-level checkpoint).
Targets (issue 5): freeze <= 1.25 x bytes / D2H limit; restore freeze <= 1.25 x bytes / H2D limit;
both >= 10x faster than the driver's checkpoint and restore on the same job.

Also (--training, on the smallest size): a job trains 20 steps, is checkpointed, trains 20 more, is
overwritten and restored, seeks back to step 20 and trains 20 again, is suspended and resumed and
trains 20 more; the losses are compared with one uninterrupted 60-step run without the shim.

Run on the GPU machine, after `source bench/gpu-env.sh`:
  python3 bench/checkpoint_gpu.py --sizes 1,16,40 --out bench/results/checkpoint-h200.json --workdir /var/tmp/ck
Writes the JSON and a Markdown summary beside it (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "ckpt_job.py"
sys.path.insert(0, str(HERE))
from job_protocol import Client  # noqa: E402
from shim_gpu import nvml_used_bytes  # noqa: E402
GIB = 1 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gputrace() -> str:
    exe = shutil.which("gputrace")
    if not exe:
        sys.exit("checkpoint_gpu: `gputrace` is not on PATH (source bench/gpu-env.sh first)")
    return exe


class Job(Client):
    """bench/ckpt_job.py, alone or (shim) under `gputrace run --checkpointable [--suspendable]`."""

    def __init__(self, shim: bool, suspendable: bool = True) -> None:
        argv = [sys.executable, str(JOB)]
        if shim:
            argv = [gputrace(), "run", "--checkpointable"] + (["--suspendable"] if suspendable else []) + ["--"] + argv
        super().__init__(argv)
        self.pid = self.hello["pid"]


def results_main(ap, run, summary) -> tuple[int, dict | None]:
    """The benches' common end: `--report JSON` writes the Markdown of an earlier run; else
    run(args) makes the results, which go to --out (JSON) and OUT.md with the command, the device and
    the wall time. Returns (exit status, the results or None)."""
    ap.add_argument("--out", type=Path, help="the JSON to write (and OUT.md beside it)")
    ap.add_argument("--report", type=Path, help="only write the Markdown of an earlier run's JSON")
    a = ap.parse_args()
    if a.report:
        a.report.with_suffix(".md").write_text(summary(json.loads(a.report.read_text())))
        return 0, None
    if not a.out:
        ap.error("--out is required (or --report JSON)")
    t0 = time.time()
    r = run(a)
    r["command"] = f"python3 bench/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])
    try:
        r["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    except OSError:
        r["device"] = "?"
    r["wall_s"] = time.time() - t0
    a.out.write_text(json.dumps(r, indent=1))
    a.out.with_suffix(".md").write_text(summary(r))
    print(summary(r))
    return 0, r


def cli(*args: str) -> dict:
    """A gputrace subcommand with --json; {"error": ...} when it fails (the run goes on)."""
    t0 = time.perf_counter_ns()
    p = subprocess.run([gputrace(), *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter_ns() - t0
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip()[-800:], "rc": p.returncode, "wall_ns": wall}
    doc = json.loads(p.stdout)
    doc["wall_ns"] = wall
    return doc


def nvml_used(pid: int) -> int:
    return nvml_used_bytes(pid) or 0  # not listed: holds no GPU memory


def shim_size(size_gib: float, modes: list[str], work: Path, skip: set[str] = frozenset()) -> dict:
    nbytes = int(size_gib * GIB)
    res: dict = {"size_gib": size_gib, "modes": {}}
    log(f"{size_gib} GiB: shimmed job")
    job = Job(shim=True)
    try:
        res["limit"] = job.cmd(f"limit {nbytes}")
        held = job.cmd(f"hold {nbytes}")
        want = held["checksum"]
        job.cmd("train 5")
        for mode in modes:
            ck = work / f"ck-{mode}"
            shutil.rmtree(ck, ignore_errors=True)
            extra = ["--staging"] if mode == "staging" else []
            log(f"{size_gib} GiB: checkpoint ({mode})")
            c = cli("checkpoint", "-p", str(job.pid), "-o", str(ck), *extra)
            job.cmd("scribble")
            scribbled = job.cmd("checksum")["checksum"] != want
            log(f"{size_gib} GiB: restore ({mode})")
            r = cli("restore", "-p", str(job.pid), str(ck), "--device-only", "--force", *extra) if "error" not in c else {"error": "no checkpoint"}
            got = job.cmd("checksum")["checksum"]
            res["modes"][mode] = {"checkpoint": c, "restore": r, "scribble_changed_data": scribbled,
                                  "restored_equal": got == want}
            shutil.rmtree(ck, ignore_errors=True)
            if got != want:
                break  # the job's data is no longer what later steps compare against
        if "suspend" in skip:
            return res_with_driver(res, size_gib, nbytes, work, skip)
        log(f"{size_gib} GiB: suspend / resume")
        before = nvml_used(job.pid)
        s = cli("suspend", "-p", str(job.pid))
        during = nvml_used(job.pid)
        u = cli("resume", "-p", str(job.pid)) if "error" not in s else {"error": "not suspended"}
        after = nvml_used(job.pid)
        res["suspend"] = {"suspend": s, "resume": u, "nvml_before": before, "nvml_suspended": during,
                          "nvml_after": after, "resumed_equal": job.cmd("checksum")["checksum"] == want}
        job.cmd("train 5")  # the job goes on
    finally:
        job.close()
    return res_with_driver(res, size_gib, nbytes, work, skip)


def res_with_driver(res: dict, size_gib: float, nbytes: int, work: Path, skip: set[str]) -> dict:
    log(f"{size_gib} GiB: job without the shim (driver backend, torch.save)")
    job = Job(shim=False)
    try:
        held = job.cmd(f"hold {nbytes}")
        job.cmd("train 5")
        d = cli("checkpoint", "--backend", "driver", "-p", str(job.pid))
        res["driver"] = {**d, "restored_equal": job.cmd("checksum")["checksum"] == held["checksum"]}
        if "torch_save" not in skip:
            path = work / "app.pt"
            log(f"{size_gib} GiB: torch.save")
            res["torch_save"] = job.cmd(f"save {path}")
            path.unlink(missing_ok=True)
    finally:
        job.close()
    return res


def training(work: Path, hold_gib: float) -> dict:
    log("training: uninterrupted reference without the shim")
    ref = Job(shim=False)
    try:
        ref.cmd(f"hold {int(hold_gib * GIB)}")
        r = ref.cmd("train 60")["losses"]
    finally:
        ref.close()
    log("training: shimmed job, checkpoint / restore / suspend / resume")
    job = Job(shim=True)
    ck = work / "ck-train"
    shutil.rmtree(ck, ignore_errors=True)
    try:
        job.cmd(f"hold {int(hold_gib * GIB)}")
        a = job.cmd("train 20")["losses"]
        c1 = cli("checkpoint", "-p", str(job.pid), "-o", str(ck))
        b = job.cmd("train 20")["losses"]
        job.cmd("scribble")
        r1 = cli("restore", "-p", str(job.pid), str(ck), "--device-only", "--force")
        job.cmd("seek 20")
        c = job.cmd("train 20")["losses"]
        before = nvml_used(job.pid)
        s = cli("suspend", "-p", str(job.pid))
        during = nvml_used(job.pid)
        u = cli("resume", "-p", str(job.pid))
        d = job.cmd("train 20")["losses"]
    finally:
        job.close()
        shutil.rmtree(ck, ignore_errors=True)
    return {
        "reference_losses": r, "a": a, "b": b, "c_after_restore": c, "d_after_resume": d,
        "checkpoint": c1, "restore": r1, "suspend": s, "resume": u,
        "nvml_before_suspend": before, "nvml_suspended": during,
        "first_20_equal_reference": a == r[:20], "next_20_equal_reference": b == r[20:40],
        "after_restore_equal_first_time": c == b, "after_resume_equal_reference": d == r[40:60],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,40", help="GiB of live tensors, comma-separated (default 1,16,40)")
    ap.add_argument("--modes", default="staging,direct", help="shim copy modes (default staging,direct)")
    ap.add_argument("--large-modes", default="", help="modes for sizes above 16 GiB (default: --modes)")
    ap.add_argument("--skip", default="", help="parts to leave out, comma-separated: suspend, torch_save")
    ap.add_argument("--training", action="store_true", help="also the loss test (on 1 GiB of extra tensors)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/gputrace-bench"),
                    help="where checkpoints and torch.save files go (a disk, not tmpfs)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "checkpoint-h200.json")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="no run: merge results of several runs (device time comes in slices) into --out")
    a = ap.parse_args()
    if a.merge:
        return merge(a.merge, a.out)
    a.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    df = subprocess.run(["df", "-hT", str(a.workdir)], capture_output=True, text=True).stdout.strip()
    doc: dict = {"schema": 1, "bench": "checkpoint-gpu", "command": " ".join(["python3", "bench/checkpoint_gpu.py"] + sys.argv[1:]),
                 "host": {"gpu": gpu, "kernel": platform.release(), "cpus": os.cpu_count(), "storage": df},
                 "sizes": []}
    out_partial = a.out.with_suffix(".partial.json")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.training:
        doc["training"] = training(a.workdir, 1)
        out_partial.write_text(json.dumps(doc, indent=1))
    for s in [float(x) for x in a.sizes.split(",") if x]:
        modes = (a.large_modes if s > 16 and a.large_modes else a.modes).split(",")
        doc["sizes"].append(shim_size(s, modes, a.workdir, set(a.skip.split(",")) - {""}))
        out_partial.write_text(json.dumps(doc, indent=1))  # what was done survives a timeout
    doc["duration_s"] = round(time.time() - t0, 1)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    out_partial.unlink(missing_ok=True)
    a.out.with_suffix(".md").write_text(summary(doc))
    print(summary(doc))
    return 0


def merge(paths: list[Path], out: Path) -> int:
    docs = [json.loads(p.read_text()) for p in paths]
    doc = {**docs[0], "command": " ; ".join(d["command"] for d in docs), "runs": [d["command"] for d in docs],
           "sizes": [s for d in docs for s in d["sizes"]], "duration_s": sum(d.get("duration_s", 0) for d in docs)}
    for d in docs:
        if d.get("training"):
            doc["training"] = d["training"]
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(summary(doc))
    print(summary(doc))
    return 0


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.0f}"


def summary(d: dict) -> str:
    L = ["# Checkpoint, restore, suspend on the GPU", "",
         f"Command: `{d['command']}` on {d['host']['gpu']} ({d['host']['cpus']} CPUs, kernel {d['host']['kernel']}).",
         f"Storage for checkpoints and torch.save: `{d['host']['storage'].splitlines()[-1]}`.", "",
         "freeze: the job's gate closed to reopened (drain, synchronize, copy). limit: bytes / pinned copy rate "
         "measured in the job's own process in the same run. driver: cuCheckpointProcessCheckpoint / Restore "
         "on a job of the same size without the shim. torch.save: model, optimizer and tensors to the same "
         "storage, fsynced (the job stops for all of it).", "",
         "GiB: the live tensors asked for; ckpt GiB: what the shim checkpointed (all the job's device allocations: the "
         "tensors, torch's cached blocks and the training state). The job without the shim holds the tensors and the "
         "training state only.", "",
         "| GiB | ckpt GiB | mode | D2H GB/s | ckpt freeze ms | limit ms | freeze/limit | write GB/s | restore freeze ms | "
         "H2D limit ms | restore/limit | driver ckpt ms | driver restore ms | driver/ours ckpt | driver/ours restore "
         "| torch.save ms | data equal |",
         "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in d["sizes"]:
        lim, drv = s["limit"], s.get("driver", {})
        for mode, m in s["modes"].items():
            c, r = m["checkpoint"], m["restore"]
            if "error" in c or "error" in r:
                L.append(f"| {s['size_gib']:g} | {mode} | error: {(c.get('error') or r.get('error'))[:120]} |")
                continue
            lim_d = c["bytes"] / lim["d2h_gbps"]
            lim_h = r["bytes"] / lim["h2d_gbps"]
            L.append(
                f"| {s['size_gib']:g} | {c['bytes'] / GIB:.1f} | {mode} | {lim['d2h_gbps']:.1f} | {_ms(c['freeze_ns'])} | {_ms(lim_d)} | "
                f"{c['freeze_ns'] / lim_d:.2f} | {c['write_gbps']:.2f} | {_ms(r['freeze_ns'])} | {_ms(lim_h)} | "
                f"{r['freeze_ns'] / lim_h:.2f} | {_ms(drv.get('checkpoint_ns'))} | {_ms(drv.get('restore_ns'))} | "
                f"{drv.get('checkpoint_ns', 0) / c['freeze_ns']:.1f}x | {drv.get('restore_ns', 0) / r['freeze_ns']:.1f}x | "
                f"{_ms(s.get('torch_save', {}).get('save_ns'))} | {m['restored_equal'] and drv.get('restored_equal')} |")
    L += ["", "## Suspend and resume (shim, VMM-backed allocations)", "",
          "| GiB | suspend ms (copy / release) | GPU memory of the process before / suspended / after (MiB) | "
          "resume ms (remap / copy) | data equal |", "|---:|---|---|---|---|"]
    for s in d["sizes"]:
        x = s.get("suspend")
        if not x:
            L.append(f"| {s['size_gib']:g} | not measured in this run |")
            continue
        sp, rs = x.get("suspend", {}), x.get("resume", {})
        if "error" in sp or "error" in rs:
            L.append(f"| {s['size_gib']:g} | error: {(sp.get('error') or rs.get('error'))[:160]} |")
            continue
        mib = lambda v: "-" if v is None else f"{v >> 20}"  # noqa: E731
        L.append(f"| {s['size_gib']:g} | {_ms(sp['total_ns'])} ({_ms(sp['copy_ns'])} / {_ms(sp['release_ns'])}) | "
                 f"{mib(x['nvml_before'])} / {mib(x['nvml_suspended'])} / {mib(x['nvml_after'])} | "
                 f"{_ms(rs.get('total_ns'))} ({_ms(rs.get('remap_ns'))} / {_ms(rs.get('copy_ns'))}) | {x['resumed_equal']} |")
    t = d.get("training")
    if t:
        L += ["", "## Training through checkpoint, restore, suspend and resume", "",
              "A shimmed job trains 20 steps, is checkpointed, trains 20 more, is overwritten and restored, seeks back "
              "to step 20 and trains 20 again, is suspended and resumed, and trains 20 more; beside an uninterrupted "
              "60-step run without the shim:", "",
              f"- first 20 losses equal the reference: **{t['first_20_equal_reference']}**",
              f"- steps 21-40 equal the reference: **{t['next_20_equal_reference']}**",
              f"- steps 21-40 again after the restore equal the first time: **{t['after_restore_equal_first_time']}**",
              f"- steps 41-60 after suspend and resume equal the reference: **{t['after_resume_equal_reference']}**",
              f"- GPU memory of the job before suspend {t['nvml_before_suspend'] >> 20} MiB, suspended "
              f"{(t['nvml_suspended'] or 0) >> 20} MiB (nvidia-smi)", ""]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
