#!/usr/bin/env python3
"""Suspend, resume and rollback of real frameworks' own memory on a real GPU: the allocators that map
VMM memory themselves (PyTorch's expandable_segments, XLA's), and those that use the driver's
stream-ordered pools (PyTorch's cudaMallocAsync backend, XLA's cuda_async, CuPy's MemoryAsyncPool).

For each case, a job (bench/suspend_job.py) under `gputrace run --checkpointable --suspendable`:
  1. holds --mib of device arrays with seeded contents, by its framework's allocator, and checksums
     them on the device;
  2. `gputrace suspend -p PID --json`: the process's device memory per NVML (nvidia-smi) before and
     while suspended, and the time;
  3. `gputrace resume -p PID --json`: the checksum again, the arrays' addresses unchanged, and a few
     matmuls run (the device still computes);
  4. `gputrace checkpoint -p PID -o DIR`, every held byte changed in place, `gputrace restore -p PID
     DIR`: the checksum is the first one again.
Each step's outcome is recorded as it is (a refusal's message included) and the next case runs.

Run (root, GPU, from the repository root after `source bench/gpu-env.sh`):
  python3 bench/suspend_frameworks_gpu.py --out $OUT/suspend-fw
Writes OUT/suspend-frameworks.json and prints the table; `--report JSON` prints it again from a result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from shim_gpu import nvml_used_bytes  # noqa: E402

MIB = 1 << 20
CASES = {
    # name: (framework, --pool, environment)
    "torch": ("torch", "", {}),
    "torch-expseg": ("torch", "", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "torch-async": ("torch", "", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "jax": ("jax", "", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.05"}),
    "jax-noprealloc": ("jax", "", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
    "jax-async": ("jax", "", {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
    "cupy": ("cupy", "", {}),
    "cupy-async": ("cupy", "async", {}),
}


def gputrace(*args: str, timeout: float = 120) -> dict:
    t = time.monotonic()
    try:
        r = subprocess.run(["gputrace", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "s": time.monotonic() - t, "error": f"timed out after {timeout:g} s"}
    out: dict = {"rc": r.returncode, "s": time.monotonic() - t}
    try:
        out["json"] = json.loads(r.stdout) if r.stdout.strip() else None
    except ValueError:
        out["stdout"] = r.stdout[-2000:]
    if r.returncode:
        out["stderr"] = r.stderr.strip()[-2000:]
    return out


class Job:
    def __init__(self, fw: str, pool: str, env: dict, log: Path) -> None:
        argv = ["gputrace", "run", "--checkpointable", "--suspendable", "--", sys.executable,
                str(HERE / "suspend_job.py"), "--fw", fw] + (["--pool", pool] if pool else [])
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                  text=True, env=dict(os.environ, **env))
        self.ready = self.read()
        self.pid = self.ready["pid"]

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the job ended (rc {self.p.wait()}); see its log")
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.ask("quit")
            self.p.wait(timeout=30)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


def run_case(name: str, mib: int, work: Path) -> dict:
    fw, pool, env = CASES[name]
    res: dict = {"case": name, "fw": fw, "env": env, "mib": mib}
    job = Job(fw, pool, env, work / f"{name}.log")
    try:
        res["version"] = job.ready.get("version")
        held = job.ask(f"hold {mib}")
        if not held.get("ok"):
            res["error"] = held.get("error")
            return res
        want = held["checksum"]
        addrs = job.ask("addrs")["addrs"]
        res["nvml_before"] = nvml_used_bytes(job.pid)
        sus = gputrace("suspend", "-p", str(job.pid), "--json")
        res["suspend"] = sus
        if sus["rc"] == 0:
            res["nvml_suspended"] = nvml_used_bytes(job.pid)
            res["resume"] = gputrace("resume", "-p", str(job.pid), "--json")
            got = job.ask("checksum")
            res["resume_checksum_equal"] = got.get("checksum") == want
            res["addresses_kept"] = job.ask("addrs")["addrs"] == addrs
            w = job.ask("work")
            res["work_after_resume"] = w.get("ok", False)
            res["nvml_resumed"] = nvml_used_bytes(job.pid)
        ck = work / f"{name}.ck"
        shutil.rmtree(ck, ignore_errors=True)
        res["checkpoint"] = gputrace("checkpoint", "-p", str(job.pid), "-o", str(ck), "--json")
        if res["checkpoint"]["rc"] == 0:
            sc = job.ask("scribble")
            res["scribbled_in_place"] = sc.get("in_place")
            res["scribble_changed"] = job.ask("checksum").get("checksum") != want
            res["restore"] = gputrace("restore", "-p", str(job.pid), str(ck), "--device-only", "--force", "--json")
            if res["restore"]["rc"] == 0:
                res["restore_checksum_equal"] = job.ask("checksum").get("checksum") == want
                res["work_after_restore"] = job.ask("work").get("ok", False)
        shutil.rmtree(ck, ignore_errors=True)
    except Exception as e:  # recorded; the next case runs
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        job.close()
    return res


def all_right(r: dict) -> bool:
    """Data equal after resume and after the rollback (of bytes the scribble did change), addresses
    kept, and the device computing after both."""
    return all(r.get(k) for k in ("resume_checksum_equal", "addresses_kept", "work_after_resume",
                                  "scribble_changed", "restore_checksum_equal", "work_after_restore"))


HEAD = ("| case | framework | allocator settings | allocations | GiB suspended | NVML GiB before → suspended | "
        "suspend freeze, ms | resume, ms | checkpoint freeze, ms (copy) | restore freeze, ms | "
        "data, addresses, compute all right |\n|" + "---|" * 11)


def row(r: dict) -> str:
    """One Markdown row; a step that failed shows its exit status and the first line it printed."""
    def step(k: str) -> dict | str:
        s = r.get(k)
        if s is None:
            return "-"
        if s.get("rc") != 0:
            msg = (s.get("stderr") or s.get("error") or "").splitlines()
            return f"rc {s.get('rc')}: {msg[0][:90] if msg else ''}"
        return s.get("json") or {}

    def ms(k: str, field: str) -> str:
        v = step(k)
        return v if isinstance(v, str) else f"{v[field] / 1e6:.0f}"

    def gib(v) -> str:
        return "-" if v is None else f"{v / (1 << 30):.2f}"

    su, ck = step("suspend"), step("checkpoint")
    copy = f" ({ck['copy_gbps']:.1f} GB/s)" if isinstance(ck, dict) else ""
    env = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "(defaults)"
    ok = "yes" if all_right(r) else ("**no**: " + r["error"] if r.get("error") else "**no**")
    return (f"| {r['case']} | {r['fw']} {r.get('version')} | `{env}` | "
            f"{su['allocations'] if isinstance(su, dict) else '-'} | {gib(su.get('bytes')) if isinstance(su, dict) else su} | "
            f"{gib(r.get('nvml_before'))} → {gib(r.get('nvml_suspended'))} | {ms('suspend', 'freeze_ns')} | "
            f"{ms('resume', 'total_ns')} | {ms('checkpoint', 'freeze_ns')}{copy} | "
            f"{ms('restore', 'freeze_ns')} | {ok} |")


def table(results: list[dict]) -> str:
    return HEAD + "\n" + "\n".join(row(r) for r in results) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="directory for the jobs' logs and the JSON")
    ap.add_argument("--report", type=Path, metavar="JSON",
                    help="only print the table of a committed result (no GPU needed)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--mib", type=int, default=2048, help="MiB of arrays each job holds (default 2048)")
    args = ap.parse_args()
    if not args.report and not args.out:
        ap.error("--out DIR is needed (or --report JSON)")
    if args.report:
        print(table(json.loads(args.report.read_text())), end="")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.cases.split(","):
        t = time.monotonic()
        r = run_case(name, args.mib, args.out)
        r["wall_s"] = time.monotonic() - t
        results.append(r)
        print(row(r), flush=True)
        (args.out / "suspend-frameworks.json").write_text(json.dumps(results, indent=2))
    print(table(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
