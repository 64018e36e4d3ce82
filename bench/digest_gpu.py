#!/usr/bin/env python3
"""The chunk digest on the GPU: the PTX the shim loads, checked against the CPU definition, and its speed.

    python3 bench/digest_gpu.py --ptx PTX --out OUT.json [--gib 16]

1. Correctness: the PTX kernel (loaded as the shim loads it: JIT from PTX by the driver) against
   gputrace.checkpointer.digest on buffers of awkward lengths, and on sampled chunks of a large one.
2. Speed: hashing GIB GiB of device memory in chunks of 256 KiB to 8 MiB (GB/s of device memory
   read, median of 5), beside a device-to-device copy of the same bytes (what HBM gives a
   read-and-write) and a pinned device-to-host copy of 1 GiB (the bus: what a changed chunk costs).
3. Chunk size: the device-to-host copy of 10% of the chunks, chosen at random (none adjacent), into
   pinned memory, one cuMemcpyAsync per chunk from C-speed loops in cupy: GB/s per chunk size.
Needs cupy and numpy (the GPU machine has both).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

from gputrace.checkpointer import digest as ref  # the installed package (bench/gpu-env.sh)

SIZES = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def kernel(ptx: str):
    return cp.RawModule(path=ptx).get_function("gputrace_chunk_digest")


def gpu_digests(fn, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    t = cp.asarray(np.array(spans, dtype=np.uint64).reshape(-1))
    out = cp.zeros(2 * len(spans), dtype=cp.uint64)
    fn((len(spans),), (256,), (t, np.uint64(len(spans)), out))
    o = out.get()
    return [(int(o[2 * i]), int(o[2 * i + 1])) for i in range(len(spans))]


def check(fn) -> dict:
    rng = np.random.default_rng(7)
    lengths = [0, 1, 7, 8, 9, 255, 4096, 4099, 65536 + 3, 1 << 20, (2 << 20) + 5]
    bad = []
    for n in lengths:
        host = rng.integers(0, 256, size=max(n, 1), dtype=np.uint8)[:n]
        dev = cp.asarray(host) if n else cp.zeros(1, dtype=cp.uint8)
        got = gpu_digests(fn, [(dev.data.ptr, n)])[0]
        want = ref.digest(host.tobytes())
        if got != want:
            bad.append({"len": n, "gpu": [hex(x) for x in got], "cpu": [hex(x) for x in want]})
    # a large buffer, chunked, a sample checked; and one changed byte changes its chunk's digest only
    big = cp.asarray(rng.integers(0, 2**63, size=(256 << 20) // 8, dtype=np.uint64))
    chunk = 1 << 20
    spans = [(big.data.ptr + o, chunk) for o in range(0, big.nbytes, chunk)]
    d0 = gpu_digests(fn, spans)
    host = big.get().tobytes()
    for i in random.Random(1).sample(range(len(spans)), 8):
        if d0[i] != ref.digest(host[i * chunk:(i + 1) * chunk]):
            bad.append({"chunk": i, "of": "256 MiB"})
    view = big.view(cp.uint8)
    view[5 * chunk + 12345] ^= 1
    d1 = gpu_digests(fn, spans)
    changed = [i for i in range(len(spans)) if d0[i] != d1[i]]
    return {"lengths": lengths, "mismatches": bad, "one_bit_flip_changed_chunks": changed,
            "ok": not bad and changed == [5]}


def timed(f, reps=5) -> float:
    ts = []
    for _ in range(reps):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        f()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(ts)


def speed(fn, gib: int) -> dict:
    n = gib << 30
    buf = cp.empty(n // 8, dtype=cp.uint64)
    buf[:] = cp.arange(n // 8, dtype=cp.uint64) * np.uint64(0x9E3779B97F4A7C15)
    out = {}
    for c in SIZES:
        spans = np.array([(buf.data.ptr + o, min(c, n - o)) for o in range(0, n, c)], dtype=np.uint64).reshape(-1)
        t = cp.asarray(spans)
        res = cp.zeros(len(spans), dtype=cp.uint64)
        k = len(spans) // 2
        s = timed(lambda: fn((k,), (256,), (t, np.uint64(k), res)))
        out[str(c)] = {"chunks": k, "s": s, "gbps": n / s / 1e9}
    dst = cp.empty_like(buf[: (1 << 30) // 8])
    d2d = timed(lambda: dst.__setitem__(slice(None), buf[: (1 << 30) // 8]))
    pinned = cp.cuda.alloc_pinned_memory(1 << 30)
    stream = cp.cuda.Stream(non_blocking=True)

    def d2h():
        cp.cuda.runtime.memcpyAsync(pinned.ptr, buf.data.ptr, 1 << 30, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()

    d2h_s = timed(d2h)
    scattered = {}
    rng = random.Random(3)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    host = cp.cuda.alloc_pinned_memory(n // 10 + (8 << 20))
    for c in SIZES:
        nchunks = n // c
        pick = sorted(rng.sample(range(0, nchunks, 2), nchunks // 10))  # even indices: none adjacent

        def copy():
            for i, ch in enumerate(pick):
                cp.cuda.runtime.memcpyAsync(host.ptr + i * c, buf.data.ptr + ch * c, c,
                                            cp.cuda.runtime.memcpyDeviceToHost, streams[i % 4].ptr)
            for s in streams:
                s.synchronize()

        t0 = time.perf_counter()
        copy()
        el = time.perf_counter() - t0
        scattered[str(c)] = {"copies": len(pick), "s": el, "gbps": len(pick) * c / el / 1e9}
    return {"gib": gib, "digest": out, "d2d_1gib_gbps": 2 * (1 << 30) / d2d / 1e9,
            "d2h_pinned_1gib_gbps": (1 << 30) / d2h_s / 1e9, "d2h_scattered_10pct": scattered}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=int, default=16)
    a = ap.parse_args()
    fn = kernel(a.ptx)
    res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "driver": cp.cuda.runtime.driverGetVersion(), "check": check(fn)}
    print(json.dumps(res["check"]), flush=True)
    res["speed"] = speed(fn, a.gib)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["speed"], indent=1))
    return 0 if res["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
