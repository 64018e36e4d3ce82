#!/usr/bin/env python3
"""The shim on a real GPU: ns per intercepted call, a PyTorch loop's slowdown, identical losses, and the
device memory it reports.

Needs: an NVIDIA GPU and driver, gcc, python3 with PyTorch.  Nothing else: no cffi, no gputrace
install (the shim and bench/shim_bench.c are compiled here with gcc from this checkout, the control
socket is spoken with the standard library).

  1. per call: bench/shim_bench.c under the shim, on the real libcuda, with a no-op PTX kernel:
     the same call through the driver's entry point and through the shim's wrapper in alternating
     blocks of one process (order flipped each round); added = wrapper - driver per round.
  2. loop: simcuda/workloads/torch_step.py --serve --mode launch (4 x Linear(256), Adam, batch 64) in
     two warm processes, one plain, one under the shim; timed phases alternate between them,
     rotating the order each round; slowdown = 1 - shim/plain steps/s per round.  Prediction beside
     it: the gated calls per second the shim counted x the added ns from (1) (the audit's upper
     bound A for a layer of that cost: `gputrace attach --preset shim --cost-ns X` computes the same).
  3. losses: a seeded, deterministic training run, plain and under the shim; the loss sequences must
     be bitwise identical.
  4. memory: in the shimmed run, the device memory the shim reports (totals.device_bytes) beside
     torch.cuda.memory_reserved() and what NVML reports for the process (which adds the context's
     own memory).

Run:  python3 bench/shim_gpu.py --out bench/results/shim-h200.json   (writes a .md summary beside it)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tables import served_async_rows, shim_cost_rows  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TORCH_STEP = ROOT / "simcuda" / "workloads" / "torch_step.py"


def _shim_sources() -> list[str]:
    """The shim's C sources as shim/__init__.py lists them (read, not imported: this script runs
    without gputrace installed); a list of its own here went stale once (emulate.c, digest.c)."""
    import ast
    tree = ast.parse((ROOT / "shim" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_SOURCES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    sys.exit("shim_gpu: shim/__init__.py has no _SOURCES")


SHIM_SOURCES = _shim_sources()

NOOP_PTX = textwrap.dedent("""\
    .version 7.0
    .target sm_50
    .address_size 64
    .visible .entry noop()
    {
        ret;
    }
""")

DETERMINISTIC = textwrap.dedent("""\
    import json, os, sys, torch
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for step in range(int(sys.argv[1])):
        x = torch.randn(64, 256, generator=g).to(dev)
        y = torch.randn(64, 256, generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    hold = [torch.empty(int(n), dtype=torch.uint8, device=dev) for n in (64 << 20, 200 << 20)]  # more state
    torch.cuda.synchronize()
    def state():
        return {"pid": os.getpid(), "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}
    print(json.dumps({**state(), "losses": losses}), flush=True)
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "grow":  # one more allocation the caching allocator must get from the driver
            hold.append(torch.empty(int(arg[0]), dtype=torch.uint8, device=dev))
            torch.cuda.synchronize()
            print(json.dumps(state()), flush=True)
        elif cmd == "free":  # everything back to the driver that torch can give back
            hold.clear()
            model = opt = None
            import gc
            gc.collect()
            torch.cuda.empty_cache()
            print(json.dumps(state()), flush=True)
        elif cmd == "ranges":  # the driver's own view of each allocation the shim lists
            out = []
            for base in json.loads(open(arg[0]).read()):
                b, n = ctypes.c_uint64(), ctypes.c_size_t()
                rc = cu.cuMemGetAddressRange_v2(ctypes.byref(b), ctypes.byref(n), ctypes.c_uint64(base))
                out.append([rc, b.value, n.value])
            print(json.dumps(out), flush=True)
        else:
            break
""")


def build(workdir: Path) -> tuple[Path, Path]:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        sys.exit("shim_gpu: needs gcc")
    lib = workdir / "libgputrace_shim.so"
    subprocess.run([cc, "-O2", "-g", "-Wall", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
                    f"-I{ROOT / 'simcuda'}", "-Wno-unused-parameter", "-Wl,-soname,libgputrace_shim.so", "-o", str(lib),
                    *(str(ROOT / "shim" / s) for s in SHIM_SOURCES), "-pthread", "-ldl"], check=True)
    exe = workdir / "shim_bench"
    subprocess.run([cc, "-O2", "-Wall", "-o", str(exe), str(HERE / "shim_bench.c"), "-ldl"], check=True)
    reg = workdir / "shim_registry_bench"
    subprocess.run([cc, "-O2", "-Wall", "-pthread", f"-I{ROOT / 'shim'}", f"-I{ROOT / 'simcuda'}", "-o", str(reg),
                    str(HERE / "shim_registry_bench.c"), str(ROOT / "shim" / "registry.c")], check=True)
    return lib, exe


def shim_env(lib: Path, sock_dir: Path) -> dict:
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([str(lib)] + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env["GPUTRACE_SHIM_DIR"] = str(sock_dir)
    return env


def shim_request(sock_dir: Path, pid: int, command: str) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock_dir / f"shim-{pid}.sock"))
    s.sendall(command.encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
    s.close()
    return json.loads(buf)


def per_call(exe: Path, lib: Path, sock_dir: Path, workdir: Path, rounds: int) -> dict:
    ptx = workdir / "noop.ptx"
    ptx.write_text(NOOP_PTX)
    out = subprocess.run([str(exe), "--rounds", str(rounds), "--calls", "20000", "--image", str(ptx)],
                         env=shim_env(lib, sock_dir), check=True, capture_output=True, text=True).stdout
    d = json.loads(out)
    # The same stream-ordered pair with the shim serving it through the VMM API, as under --suspendable.
    served = subprocess.run([str(exe), "--rounds", str(rounds), "--calls", "20000", "--image", str(ptx), "--only",
                             "alloc_free_async"], env={**shim_env(lib, sock_dir), "GPUTRACE_SHIM_VMM": "1"}, check=True,
                            capture_output=True, text=True).stdout
    d["served_through_vmm"] = json.loads(served)["cases"]["alloc_free_async"]
    return d


class Loop:
    """torch_step.py --serve: warm once, then timed phases on request."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, str(TORCH_STEP), "--serve", "--mode", "launch"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            sys.exit(f"shim_gpu: torch_step did not start: {line!r}")

    def phase(self, seconds: float) -> float:
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["steps_per_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _pin(pid: int, cpus: list[int]) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, cpus)), str(pid)], check=False, capture_output=True)


def loop(lib: Path, sock_dir: Path, rounds: int, seconds: float, added_ns: float, concurrent: bool = False) -> dict:
    """Alternating (default): one process runs at a time, both on the same CPUs, order flipped each round.
    Concurrent: both run each phase at the same time, each on CPUs of its own, the CPU sets swapped each
    round: the machine's noise, which moves from second to second, then hits both alike."""
    plain, shimmed = Loop(dict(os.environ)), Loop(shim_env(lib, sock_dir))
    mine = sorted(os.sched_getaffinity(0))
    cpus = mine[2:6] or mine
    sets = [cpus[: len(cpus) // 2] or cpus, cpus[len(cpus) // 2:] or cpus]
    if not concurrent:
        for w in (plain, shimmed):
            _pin(w.proc.pid, cpus)
    try:
        before = shim_request(sock_dir, shimmed.proc.pid, "status")["calls"]
        rows, shim_time = [], 0.0
        for r in range(rounds):
            row = {}
            if concurrent:
                _pin(plain.proc.pid, sets[r % 2])
                _pin(shimmed.proc.pid, sets[1 - r % 2])
                for w in (plain, shimmed):
                    w.proc.stdin.write(f"{seconds}\n")
                    w.proc.stdin.flush()
                row["plain"] = json.loads(plain.proc.stdout.readline())["steps_per_s"]
                row["shim"] = json.loads(shimmed.proc.stdout.readline())["steps_per_s"]
                shim_time += seconds
            else:
                order = [("plain", plain), ("shim", shimmed)] if r % 2 == 0 else [("shim", shimmed), ("plain", plain)]
                for name, w in order:
                    row[name] = w.phase(seconds)
                    if name == "shim":
                        shim_time += seconds
            row["slowdown"] = 1 - row["shim"] / row["plain"]
            rows.append(row)
        after = shim_request(sock_dir, shimmed.proc.pid, "status")
    finally:
        plain.close()
        shimmed.close()
    calls = {k: v - before.get(k, 0) for k, v in after["calls"].items() if v - before.get(k, 0)}
    gated_per_s = sum(v for k, v in calls.items() if not k.startswith("cuGetProcAddress")) / shim_time
    slow = [r["slowdown"] for r in rows]
    return {
        "rounds": rows, "seconds_per_phase": seconds,
        "plain_steps_per_s_median": statistics.median(r["plain"] for r in rows),
        "shim_steps_per_s_median": statistics.median(r["shim"] for r in rows),
        "slowdown_median": statistics.median(slow), "slowdown_min": min(slow), "slowdown_max": max(slow),
        "slowdown_pooled": 1 - sum(r["shim"] for r in rows) / sum(r["plain"] for r in rows),
        "slowdown_p25": statistics.quantiles(slow, n=4)[0], "slowdown_p75": statistics.quantiles(slow, n=4)[2],
        "cpus": sets if concurrent else cpus, "concurrent": concurrent,
        "intercepted_calls_per_s": gated_per_s, "intercepted_calls": calls,
        "predicted_slowdown_max": gated_per_s * added_ns * 1e-9,
        "note": "" if calls else "the shim counted no calls: PyTorch did not reach the driver through it",
    }


def nvml_used_bytes(pid: int) -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return int(parts[1]) << 20
    return None


def losses_and_memory(lib: Path, sock_dir: Path, steps: int, workdir: Path) -> dict:
    """Losses plain and shimmed; then, in the shimmed process, the shim's device bytes beside the driver's.

    The driver reports per process only the total (NVML), which adds the context's own memory and the
    modules' code to the allocations; so the comparison is (a) each allocation the shim lists is one
    the driver knows at exactly that base and size (cuMemGetAddressRange in the process), and (b) every
    change of the driver's total equals the change of the shim's: one more allocation (grow), then
    everything freed that torch can free (free).  NVML counts in MiB; allocations are 2 MiB multiples."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    runs = {}
    for name, e in (("plain", env), ("shim", {**shim_env(lib, sock_dir), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})):
        p = subprocess.Popen([sys.executable, "-c", DETERMINISTIC, str(steps)], env=e, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        doc = json.loads(p.stdout.readline())
        doc["nvml_used_bytes"] = nvml_used_bytes(p.pid)
        if name == "shim":
            def point(label: str, reply: dict) -> dict:
                st = shim_request(sock_dir, p.pid, "status")
                dev = [a for a in st["allocations"] if a["kind"] != "host"]
                return {"at": label, "nvml": nvml_used_bytes(p.pid), "shim_device_bytes": st["totals"]["device_bytes"],
                        "torch_reserved": reply["reserved"], "allocations": dev, "totals": st["totals"],
                        "kinds": sorted({a["kind"] for a in st["allocations"]})}

            def ask(line: str) -> dict:
                p.stdin.write(line + "\n")
                p.stdin.flush()
                return json.loads(p.stdout.readline())

            pts = [point("trained", doc)]
            bases = workdir / "bases.json"
            bases.write_text(json.dumps([a["base"] for a in pts[0]["allocations"]]))
            ranges = ask(f"ranges {bases}")
            pts[0]["driver_ranges_match"] = all(rc == 0 and b == a["base"] and n == a["size"]
                                                for (rc, b, n), a in zip(ranges, pts[0]["allocations"]))
            pts.append(point("grow 1 GiB", ask(f"grow {1 << 30}")))
            pts.append(point("freed", ask("free")))
            for q in pts:
                q.pop("allocations")
            doc["points"] = pts
            doc["shim_totals"] = pts[0]["totals"]
        p.stdin.write("quit\n")
        p.stdin.close()
        p.wait()
        runs[name] = doc
    s = runs["shim"]
    pts = s["points"]
    deltas = []
    for x, y in zip(pts, pts[1:]):
        dn = None if x["nvml"] is None or y["nvml"] is None else y["nvml"] - x["nvml"]
        deltas.append({"from": x["at"], "to": y["at"], "driver_delta": dn,
                       "shim_delta": y["shim_device_bytes"] - x["shim_device_bytes"]})
    return {
        "steps": steps,
        "losses_identical": runs["plain"]["losses"] == s["losses"],
        "first_loss": float.fromhex(s["losses"][0]), "last_loss": float.fromhex(s["losses"][-1]),
        "shim_device_bytes": pts[0]["shim_device_bytes"], "torch_reserved_bytes": s["reserved"],
        "torch_allocated_bytes": s["allocated"], "nvml_used_bytes": s["nvml_used_bytes"],
        "nvml_used_bytes_plain": runs["plain"]["nvml_used_bytes"],
        "points": pts, "deltas": deltas,
        "driver_ranges_match": pts[0]["driver_ranges_match"],
        "deltas_equal": all(d["driver_delta"] == d["shim_delta"] for d in deltas),
        "residual_bytes": [None if q["nvml"] is None else q["nvml"] - q["shim_device_bytes"] for q in pts],
        "shim_kinds": pts[0]["kinds"], "shim_totals": s["shim_totals"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="per-call rounds (default 300)")
    ap.add_argument("--loop-rounds", type=int, default=10, help="paired loop rounds (default 10)")
    ap.add_argument("--concurrent", action="store_true",
                    help="run the two loop processes at the same time on separate CPUs (swapped each round)")
    ap.add_argument("--loop-only", action="store_true", help="only the loop (per-call figures not measured: "
                    "the prediction uses --added-ns)")
    ap.add_argument("--added-ns", type=float, default=15.0, help="added ns per call for --loop-only (default 15)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per loop phase (default 3)")
    ap.add_argument("--steps", type=int, default=200, help="steps of the deterministic run (default 200)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "shim-h200.json")
    a = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as td:
        workdir = Path(td)
        sock_dir = workdir / "rt"
        sock_dir.mkdir(mode=0o700)
        lib, exe = build(workdir)
        if a.loop_only:
            micro, registry, mem, added = None, None, None, a.added_ns
        else:
            print("shim_gpu: per-call cost ...", file=sys.stderr)
            micro = per_call(exe, lib, sock_dir, workdir, a.rounds)
            added = max(0.0, micro["cases"]["launch"]["added_ns_median"])
            registry = json.loads(subprocess.run([str(workdir / "shim_registry_bench"), "200000", "1", "2", "4", "8",
                                                  "16"], check=True, capture_output=True, text=True).stdout)
        print("shim_gpu: PyTorch loop, paired ...", file=sys.stderr)
        lp = loop(lib, sock_dir, a.loop_rounds, a.seconds, added, a.concurrent)
        lp["added_ns"] = added
        if not a.loop_only:
            print("shim_gpu: losses and memory ...", file=sys.stderr)
            mem = losses_and_memory(lib, sock_dir, a.steps, workdir)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else "?"
    doc = {
        "schema": 1, "bench": "shim-gpu", "driver": "system libcuda",
        "command": " ".join(["python3", "bench/shim_gpu.py"] + sys.argv[1:]),
        "host": {"gpu": gpu, "machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "duration_s": round(time.time() - t0, 1),
        "per_call": micro, "registry": registry, "loop": lp, "losses_and_memory": mem,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    text = summary(doc) if not a.loop_only else loop_summary(doc)
    a.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def loop_summary(d: dict) -> str:
    return "\n".join(["# The shim on a real GPU: the launch-bound loop alone", "",
                      f"Command: `{d['command']}` on {d['host']['gpu']} ({d['host']['cpus']} CPUs).", ""]
                     + _loop_lines(d["loop"])) + "\n"


def _loop_lines(lp: dict) -> list[str]:
    how = (f"both processes at once, on CPU sets {lp['cpus']} swapped each round" if lp.get("concurrent") else
           f"both processes on CPUs {lp['cpus']}, one running at a time")
    return [
        "## Launch-bound PyTorch loop, paired phases of two warm processes",
        "",
        f"plain {lp['plain_steps_per_s_median']:.0f} steps/s, shim {lp['shim_steps_per_s_median']:.0f} steps/s; "
        f"slowdown median {lp['slowdown_median']:+.2%} (min {lp['slowdown_min']:+.2%}, max {lp['slowdown_max']:+.2%}) "
        f"over {len(lp['rounds'])} rounds of {lp['seconds_per_phase']} s (interquartile {lp['slowdown_p25']:+.2%}.."
        f"{lp['slowdown_p75']:+.2%}; pooled over all rounds {lp['slowdown_pooled']:+.2%}); {how}.",
        f"Predicted at most {lp['predicted_slowdown_max']:.3%}: {lp['intercepted_calls_per_s']:.0f} intercepted calls/s "
        f"x {lp.get('added_ns', 0.0):.1f} ns. {lp['note']}",
    ]


def summary(d: dict) -> str:
    c, lp, m = d["per_call"]["cases"], d["loop"], d["losses_and_memory"]
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:.1f} MiB"  # noqa: E731
    lines = [
        "# The shim on a real GPU",
        "",
        f"Command: `{d['command']}` on {d['host']['gpu']} ({d['host']['cpus']} CPUs, kernel {d['host']['kernel']}).",
        "",
        "## Added cost per intercepted call (paired blocks in one process, medians)",
        "",
        *shim_cost_rows(c),
    ]
    lines += served_async_rows(d["per_call"])
    lines += ["", "Registry alone, ns per operation per thread: " + ", ".join(
        f"{t['threads']} thread(s) {t['put_take_pair_ns']:.0f} record+remove / {t['lookup_miss_ns']:.0f} miss"
        for t in d["registry"]["threads"]) + "."]
    lines += [
        "",
        *_loop_lines(lp),
        "",
        "## Losses and device memory",
        "",
        f"Losses over {m['steps']} steps identical with and without the shim: **{m['losses_identical']}** "
        f"(first {m['first_loss']:.6f}, last {m['last_loss']:.6f}).",
        f"Device memory: the shim lists {mib(m['shim_device_bytes'])} (torch reserved {mib(m['torch_reserved_bytes'])}; "
        f"the shim also sees allocations outside torch's caching allocator); each listed allocation is the driver's "
        f"own at that base and size (cuMemGetAddressRange): **{m['driver_ranges_match']}**.",
        "Changes of the process's GPU memory as the driver reports it (NVML) against the shim's figure: "
        + "; ".join(f"{x['from']} -> {x['to']}: driver {mib(x['driver_delta'])}, shim {mib(x['shim_delta'])}"
                    for x in m["deltas"]) + f"; all equal: **{m['deltas_equal']}**.",
        "NVML minus the shim at each point (the context's own memory and module code, which no allocation call "
        "makes): " + ", ".join(mib(r) for r in m["residual_bytes"]) + f"; a plain run's NVML total: "
        f"{mib(m['nvml_used_bytes_plain'])}, the shimmed one's {mib(m['nvml_used_bytes'])}.",
        f"Also recorded: {m['shim_totals']['contexts']} context(s), {m['shim_totals']['modules']} module(s)/"
        f"librar(ies) ({mib(m['shim_totals']['module_image_bytes'])} of images), {m['shim_totals']['streams']} "
        f"stream(s), {m['shim_totals']['events']} event(s), pinned host {mib(m['shim_totals']['host_bytes'])}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
