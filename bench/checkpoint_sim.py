#!/usr/bin/env python3
"""Checkpoint and restore on the simulated driver: freeze time and throughput against a plain copy.

SIMULATED: simcuda keeps "device" memory in host memory and a copy is a memcpy by a stream's worker
thread, so these figures measure the shim's pipeline (gate, sync, staging, lanes, image writes) and
the checkpointer's hashing and writing on this machine, not a bus.  The H200 figures come from a
run on the GPU machine (bench/checkpoint_gpu.py, not written yet).

For each size: a shimmed `pattern` workload holding that much device memory; `checkpoint` (freeze:
gate closed to open; copy: device to image; write: hash + write + fsync while the job runs), the
memory overwritten, `restore` (verify: read + hash before touching the job; freeze; copy), and the
checksum checked against the one before the checkpoint.  Beside it, in this process, the same
number of bytes copied with cuMemcpyDtoH_v2 / cuMemcpyHtoD_v2 between one device buffer and one
pinned buffer: the copy limit the freeze is compared with (target: freeze <= 1.25 x bytes / limit).

Run:  .venv/bin/python bench/checkpoint_sim.py --out bench/results/checkpoint-sim.json
Writes the JSON and a Markdown summary beside it (same name, .md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout

from gputrace import shim, simcuda  # noqa: E402
from gputrace.checkpointer import checkpoint, driver, restore  # noqa: E402


def copy_limit(nbytes: int, reps: int) -> dict:
    """Plain pinned copies on simcuda in a child process (the driver is per process)."""
    code = r"""
import ctypes, json, sys, time
n, reps = int(sys.argv[1]), int(sys.argv[2])
cu = ctypes.CDLL("libcuda.so.1")
def ok(r):
    assert r == 0, r
ok(cu.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0))
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
ok(cu.cuCtxSetCurrent(ctx))
d, h = ctypes.c_uint64(), ctypes.c_void_p()
ok(cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(n)))
ok(cu.cuMemAllocHost_v2(ctypes.byref(h), ctypes.c_size_t(n)))
ctypes.memset(h, 1, n)
ok(cu.cuMemcpyHtoD_v2(d, h, ctypes.c_size_t(n)))
out = {"d2h_ns": [], "h2d_ns": []}
for _ in range(reps):
    t = time.perf_counter_ns(); ok(cu.cuMemcpyDtoH_v2(h, d, ctypes.c_size_t(n))); out["d2h_ns"].append(time.perf_counter_ns() - t)
    t = time.perf_counter_ns(); ok(cu.cuMemcpyHtoD_v2(d, h, ctypes.c_size_t(n))); out["h2d_ns"].append(time.perf_counter_ns() - t)
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code, str(nbytes), str(reps)], env=simcuda.env(), check=True,
                       capture_output=True, text=True)
    return json.loads(r.stdout)


def one_size(size: int, reps: int, lanes: int, chunk: int, work: Path, sock_dir: str, direct: bool = False) -> dict:
    env = shim.preload_env(simcuda.env())
    env["GPUTRACE_SHIM_DIR"] = sock_dir
    p = subprocess.Popen(simcuda.workload("pattern") + ["--size", str(size)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(p.stdout.readline())

        def cmd(line: str) -> dict:
            p.stdin.write(line + "\n")
            p.stdin.flush()
            return json.loads(p.stdout.readline())

        runs = []
        for i in range(reps):
            d = work / f"ck-{size}-{i}"
            c = checkpoint(p.pid, d, lanes=lanes, chunk=chunk, direct=direct)
            assert cmd(f"fill {i + 2}")["sum"] != ready["sum"]
            r = restore(p.pid, d, lanes=lanes, chunk=chunk, direct=direct)
            assert cmd("sum")["sum"] == ready["sum"], "restore did not bring the memory back"
            runs.append({"checkpoint": c.to_dict(), "restore": r.to_dict()})
            shutil.rmtree(d)
        drv = []
        for i in range(reps):  # the driver's own API on the same job (simcuda implements it)
            drv.append(driver.checkpoint(p.pid).to_dict())
            assert cmd("sum")["sum"] == ready["sum"], "the driver's round trip changed the memory"

        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    nbytes = ready["bytes"]
    lim = copy_limit(nbytes, reps)
    med = statistics.median

    def m(phase: str, key: str) -> float:
        return med(x[phase][key] for x in runs)

    d2h_ns, h2d_ns = med(lim["d2h_ns"]), med(lim["h2d_ns"])
    return {
        "bytes": nbytes, "lanes": lanes, "chunk": chunk, "runs": runs, "driver_runs": drv,
        "limit": {"d2h_gbps": nbytes / d2h_ns, "h2d_gbps": nbytes / h2d_ns, **lim},
        "summary": {
            "checkpoint_freeze_ms": m("checkpoint", "freeze_ns") / 1e6,
            "checkpoint_copy_gbps": m("checkpoint", "copy_gbps"),
            "checkpoint_write_gbps": m("checkpoint", "write_gbps"),
            "restore_verify_gbps": m("restore", "verify_gbps"),
            "restore_freeze_ms": m("restore", "freeze_ns") / 1e6,
            "restore_copy_gbps": m("restore", "copy_gbps"),
            "limit_d2h_ms": d2h_ns / 1e6, "limit_h2d_ms": h2d_ns / 1e6,
            "driver_checkpoint_ms": med(x["checkpoint_ns"] for x in drv) / 1e6,
            "driver_restore_ms": med(x["restore_ns"] for x in drv) / 1e6,
            "freeze_over_limit": m("checkpoint", "freeze_ns") / d2h_ns,
            "restore_freeze_over_limit": m("restore", "freeze_ns") / h2d_ns,
        },
    }


def markdown(doc: dict) -> str:
    lines = [
        "# Checkpoint and restore on simcuda (SIMULATED)",
        "",
        f"Command: `{doc['command']}` ({doc['machine']}).",
        "simcuda keeps device memory in host memory: these are the shim's and the checkpointer's own costs on",
        "this machine against a plain pinned memcpy-speed copy in the same driver, not bus figures.",
        f"Medians of {doc['reps']} runs; lanes {doc['lanes']}, chunk {doc['chunk'] >> 20} MiB, "
        f"{'direct (no staging)' if doc.get('direct') else 'staged'}; checkpoints written to {doc['dir_fs']}.",
        "",
        "| device memory | ckpt freeze ms | copy GB/s | write GB/s | limit D2H ms | freeze / limit | verify GB/s "
        "| restore freeze ms | restore copy GB/s | limit H2D ms | restore / limit | driver ckpt ms | driver restore ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["sizes"]:
        s = r["summary"]
        lines.append(
            f"| {r['bytes'] / 2**20:.0f} MiB | {s['checkpoint_freeze_ms']:.1f} | {s['checkpoint_copy_gbps']:.2f} "
            f"| {s['checkpoint_write_gbps']:.2f} | {s['limit_d2h_ms']:.1f} | {s['freeze_over_limit']:.2f} "
            f"| {s['restore_verify_gbps']:.2f} | {s['restore_freeze_ms']:.1f} | {s['restore_copy_gbps']:.2f} "
            f"| {s['limit_h2d_ms']:.1f} | {s['restore_freeze_over_limit']:.2f} | {s['driver_checkpoint_ms']:.1f} "
            f"| {s['driver_restore_ms']:.1f} |")
    lines += [
        "",
        "Why the freeze is several times the limit here: simcuda's \"DMA\" is a CPU memcpy by a stream thread, so a",
        "dump costs two CPU copies per byte (device to staging, staging to the image) on 2 CPUs shared with the",
        "lanes' threads, where the limit costs one.  On a GPU the first copy is the DMA engine's; whether the",
        "second keeps up with 55 GB/s is what the H200 run has to show.",
        "",
        "driver: simcuda's cuCheckpointProcessCheckpoint/Restore on the same job (a memcpy of every allocation to",
        "malloc'ed memory and back, giving the pages back in between): on simcuda a floor, not NVIDIA's figures.",
        "",
        "freeze: gate closed to gate open (drain + sync + copy); copy: device to image (or back) inside it;",
        "write: hashing (xxh3_64) and writing the checkpoint with fsync, after the job resumed; verify: reading and",
        "hashing the checkpoint before the job is touched.  Every restore was checked byte for byte (checksum).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint-sim.json"))
    ap.add_argument("--sizes", default="32,128,512", help="pattern --size values in MiB (memory held is ~2.1x)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--direct", action="store_true", help="copy straight into the pinned image (no staging)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckbench-", dir=args.dir))
    sock = tempfile.mkdtemp(prefix="ckbench-rt-")
    try:
        df = subprocess.run(["df", "--output=fstype", str(work)], capture_output=True, text=True).stdout.split()
        doc = {
            "schema": 1, "simulated": True,
            "command": "python bench/checkpoint_sim.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()}, kernel {platform.release()}, {os.cpu_count()} CPUs",
            "dir_fs": df[-1] if df else "?", "reps": args.reps, "lanes": args.lanes, "chunk": args.chunk_mib << 20,
            "direct": args.direct,
            "when_unix": time.time(), "sizes": [],
        }
        for mib in (int(x) for x in args.sizes.split(",")):
            r = one_size(mib << 20, args.reps, args.lanes, args.chunk_mib << 20, work, sock, args.direct)
            doc["sizes"].append(r)
            print(json.dumps({"bytes": r["bytes"], **r["summary"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
