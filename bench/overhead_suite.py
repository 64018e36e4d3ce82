#!/usr/bin/env python3
"""The overhead suite: the measurements behind docs/overhead-report.md, run on the GPU machine in a few
device calls, each stopping before its time is up and the next resuming where it left off.

Stages, in order (`--list` prints them with what each is estimated to take):

  steady:JOB   for each workload of bench/gpu_jobs.py (mlp: launch-bound small-model training; gpt2 and
               gpt2big: a transformer training step built from transformers' config classes at two
               sizes; matmul: GPU-bound bf16 matmuls; kvcache: inference with a KV cache; copies and
               copiesbig: small and large host-device copies; graph: CUDA-graph replay), three warm
               processes of the job at once, each idle while another runs (the alternations below
               come first, before any process is traced):
                 - a native one: the exact calls a step (every call counted, in this process's session),
                   the tracer at its default budget (`gputrace attach -p PID -d 5` from another
                   process, between untraced phases: its slowdown, its own accounted cost, its rates),
                   and last the GPU's own time a step (PyTorch's profiler: driver calls per GPU-ms);
                 - one under the shim (`gputrace run --checkpointable`): native and shim phases
                   alternated (N S N S ... N, each shim phase against the mean of its neighbours), then
                   the shim's emulated layer at each --costs, submission calls and every class
                   (audit_gpu.emulation_pairs; cost 0 is the layer's floor, its clock reads and counts);
                 - a second native one, alternated with the first the same way: what two processes of
                   one job differ by with no layer at all, the floor under the shim's figure.
  ckpt:SIZE:STORAGE   bench/ckpt_costs_gpu.py: freeze, time back, bytes and write throughput of this
               project's checkpoint, the driver API's and the whole-process one, SIZE GiB, images on
               the local disk or in tmpfs
  app:SIZE     bench/appckpt_gpu.py: torch.save, PyTorch Distributed Checkpoint (sync and async) and
               gputrace's checkpoint of one training job: time held, time to resume, size

Each stage writes DIR/<stage>.json when it is complete (attach reports beside it, xz-compressed); a
stage whose file is there is skipped, so running the same command again resumes. A stage that fails is
recorded as failed, with why, and the suite goes on (--retry-failed runs those again). Before a stage the
suite checks that it fits in what is left of --budget-s (its estimate, or what the same kind of stage
took in this DIR); if not, it stops with exit status 3 and says so. `bench/overhead_report.py DIR`
turns the files into docs/overhead-report.md and its plots, with the other committed GPU results beside
them (the whole command is in the report's header and in README).

On the GPU machine, one device call (repeat it until it exits 0; the results travel back as one file,
rewritten after every stage, and go into the repository so that the next call sends them and resumes):
    source bench/gpu-env.sh && python3 bench/overhead_suite.py --out bench/results/overhead-h200 --budget-s 500 \
        --pack $OUT/overhead-h200.tar.xz
and here, after each call: tar -C bench/results -xJf <files_at>/overhead-h200.tar.xz
Here, without a GPU (simcuda's launch_bound_py speaks the jobs' protocol; root for the tracer):
    .venv/bin/python bench/overhead_suite.py --sim --out /tmp/overhead-sim --only 'steady:*'
"""

from __future__ import annotations

import argparse
import fnmatch
import lzma
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import audit_gpu  # noqa: E402  (bench/, beside this file)
from provenance import commit, device_name  # noqa: E402

SCHEMA = "gputrace.bench.overhead_steady/1"
WORKLOADS = ("mlp", "gpt2", "gpt2big", "matmul", "kvcache", "copies", "copiesbig", "graph")
CKPT_SIZES_GIB = (1, 4, 16, 32, 64)
STORAGES = ("tmpfs", "disk")
APP_SIZES = ("small", "large")
# A stage's wall time before one of its kind has run in DIR (then that one's time is used): the
# three processes' start (PyTorch, transformers) and each part's phases, rounded up.
ESTIMATE_S = {"steady": 270.0, "app": 300.0}
EXIT_MORE = 3


@dataclass(frozen=True)
class Stage:
    name: str    # steady:mlp, ckpt:16:disk, app:large
    kind: str
    args: tuple = ()

    @property
    def file(self) -> str:
        return self.name.replace(":", "-") + ".json"


@dataclass
class Config:
    phase_s: float = 1.0          # each phase of the shim's and the control's alternation
    cycles: int = 8               # shim (or control) phases, each between two native ones
    attaches: int = 4             # 5-s default-budget attaches, each between untraced phases
    untraced_s: float = 5.0
    costs: list[float] = field(default_factory=lambda: [0.0, 500.0, 2000.0, 10000.0])
    emulate_s: float = 6.0        # emulated seconds per cost and selection
    emulate_cycles: int = 6
    gputime_steps: int = 20
    sim: bool = False


def stages(ckpt_sizes=CKPT_SIZES_GIB, app_sizes=APP_SIZES) -> list[Stage]:
    out = [Stage(f"steady:{w}", "steady", (w,)) for w in WORKLOADS]
    out += [Stage(f"ckpt:{s}:{st}", "ckpt", (s, st)) for s in ckpt_sizes for st in STORAGES]
    out += [Stage(f"app:{s}", "app", (s,)) for s in app_sizes]
    return out


# --- the steady-state stage ---------------------------------------------------------------------------------


class Job(audit_gpu.Job):
    def gputime(self, steps: int) -> dict:
        self.proc.stdin.write(f"gputime {steps}\n")
        self.proc.stdin.flush()
        return orjson.loads(self.proc.stdout.readline())


def alternate(ref: Job, other: Job, seconds: float, cycles: int) -> dict:
    """R O R O ... R: each O phase against the mean rate of the R phases on either side (drift
    cancels to first order); the slowdown is time-based, ref rate over other rate, less one."""
    slows, o_rates, r_rates = [], [], []
    prev = ref.run(seconds)
    r_rates.append(prev["steps_per_s"])
    for _ in range(cycles):
        o = other.run(seconds)
        nxt = ref.run(seconds)
        base = (prev["steps_per_s"] + nxt["steps_per_s"]) / 2
        slows.append(base / o["steps_per_s"] - 1)
        o_rates.append(o["steps_per_s"])
        r_rates.append(nxt["steps_per_s"])
        prev = nxt
    return {"phase_s": seconds, "slowdowns": slows, "slowdown": audit_gpu.median_ci(slows),
            "ref_steps_per_s": r_rates, "other_steps_per_s": o_rates}


def steady(name: str, d: Path, cfg: Config) -> dict:
    t0 = time.monotonic()
    doc: dict = {"schema": SCHEMA, "job": name, "device": device_name(cfg.sim), "commit": commit(),
                 "config": {k: v for k, v in vars(cfg).items()}}
    # Started together, set up side by side (PyTorch and transformers load in each).
    native, shim, control = Job(name, shim=False, wait=False), Job(name, shim=True, wait=False), Job(name, shim=False, wait=False)
    try:
        for j in (native, shim, control):
            j.ready()
        doc["pids"] = {"native": native.pid, "shim": shim.pid, "control": control.pid}
        # The processes compared before any is traced: a uprobe leaves its page of libcuda copied in
        # the process, and the [uprobes] page mapped, after it is gone.
        doc["control"] = alternate(native, control, cfg.phase_s, cfg.cycles)
        doc["shim"] = alternate(native, shim, cfg.phase_s, cfg.cycles)
        for k in ("control", "shim"):
            m = doc[k]["slowdown"]
            print(f"  {name}: {k} {100 * m['median']:+.2f}% (95% CI {audit_gpu.fmt_pct(m['lo'])}.."
                  f"{audit_gpu.fmt_pct(m['hi'])})", flush=True)
        doc["exact"] = audit_gpu.exact_counts(native)
        per_step = doc["exact"]["calls_per_step"]
        print(f"  {name}: {sum(per_step.values()):.0f} driver calls a step", flush=True)
        doc["tracer_pairs"] = audit_gpu.tracer_pairs(native, 5.0, cfg.attaches, d, "5", cfg.untraced_s)
        doc["emulation"] = audit_gpu.emulation_pairs(shim, cfg.costs, cfg.emulate_s, cfg.emulate_cycles) if cfg.costs else []
        # Last: the profiler leaves CUPTI loaded in the process.
        doc["gpu"] = native.gputime(cfg.gputime_steps)
        doc["steps_per_s_at_gputime"] = native.run(cfg.phase_s)["steps_per_s"]
    finally:
        for j in (native, shim, control):
            try:
                j.close()
            except (OSError, ValueError):
                j.proc.kill()
    for raw in d.glob(f"{name}-attach-*.json"):  # committed compressed (audit_gpu.read_json reads them)
        raw.with_name(raw.name + ".xz").write_bytes(lzma.compress(raw.read_bytes()))
        raw.unlink()
    doc["wall_s"] = time.monotonic() - t0
    return doc


# --- the stages run by a script of their own ----------------------------------------------------------------


class StageFailed(Exception):
    pass


def failed(path: Path) -> bool:
    try:
        return bool(orjson.loads(path.read_bytes()).get("failed"))
    except (OSError, orjson.JSONDecodeError):
        return False


def done(path: Path) -> bool:
    """The stage's file is there and complete (bench/appckpt_gpu.py rewrites its file after every
    method, "complete": false until the last)."""
    if not path.exists():
        return False
    try:
        return orjson.loads(path.read_bytes()).get("complete", True) is not False
    except (OSError, orjson.JSONDecodeError):
        return False


def script_stage(stage: Stage, d: Path, cfg: Config, left_s: float) -> dict | None:
    out = d / stage.file
    if stage.kind == "ckpt":
        size, storage = stage.args
        argv = [sys.executable, str(HERE / "ckpt_costs_gpu.py"), "--size", str(size), "--storage", storage,
                "--out", str(out), "--budget-s", f"{max(60.0, min(420.0, left_s - 15)):.0f}"] + (["--simcuda"] if cfg.sim else [])
    else:
        if cfg.sim:
            why = "not run on simcuda: it needs PyTorch on a GPU"
            print(f"{stage.name}: {why}", flush=True)
            write_atomic(out, {"schema": "gputrace.bench.appckpt/1", "size": stage.args[0], "skipped": why,
                               "complete": True, "device": device_name(True), "commit": commit(), "methods": {}})
            return None
        argv = [sys.executable, str(HERE / "appckpt_gpu.py"), "--size", stage.args[0],
                "--storage", "/var/tmp/gtapp", "--out", str(out), "--budget-s", f"{max(60.0, left_s - 15):.0f}"]
    r = subprocess.run(argv)
    if r.returncode:
        raise StageFailed(f"{Path(argv[1]).name} exited with status {r.returncode}")
    return None  # the script wrote its own file


def ckpt_scale(size_gib: float) -> float:
    """A checkpoint stage's time grows with its size: three jobs started (tens of seconds) and, per
    GiB, the copies, the driver's own checkpoint (about 0.5 s a GiB on the H200) and CRIU's dump."""
    return 40.0 + 6.0 * size_gib


def estimate(stage: Stage, d: Path) -> float:
    """What the stage should take: from the stages of its kind already run in d (checkpoint stages
    scaled to this one's size), else ESTIMATE_S (checkpoint stages: ckpt_scale)."""
    took = []
    for f in d.glob(f"{stage.kind}-*.json"):
        try:
            doc = orjson.loads(f.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        w = doc.get("wall_s")
        if not isinstance(w, (int, float)) or doc.get("skipped") or doc.get("failed"):
            continue
        if stage.kind == "ckpt" and isinstance(doc.get("size_gib"), (int, float)):
            w *= ckpt_scale(stage.args[0]) / ckpt_scale(doc["size_gib"])
        took.append(float(w))
    if took:
        return max(took)
    return ckpt_scale(stage.args[0]) if stage.kind == "ckpt" else ESTIMATE_S[stage.kind]


def write_atomic(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    tmp.rename(path)


def pack(d: Path, to: Path) -> None:
    """DIR as a .tar.xz at `to` (written aside, then renamed): after every stage, so that a device call
    cut off at its time limit still brings back every stage it finished."""
    import tarfile

    tmp = to.with_name(to.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as tar:
        tar.add(d, arcname=d.name)
    tmp.rename(to)


def setup_sim() -> None:
    """simcuda in place of the GPU: its Python launch-bound workload serves the jobs' protocol."""
    from gputrace import simcuda

    os.environ.update(simcuda.env())
    os.environ.setdefault("SIMCUDA_LAUNCH_NS", "2000")
    os.environ["GPUTRACE_BENCH_JOB_CMD"] = " ".join([*simcuda.workload("launch_bound_py"), "--serve"])
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory of the results (a stage done there is skipped)")
    ap.add_argument("--only", default="*", help="stages to run, shell patterns, comma-separated (e.g. 'steady:*')")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="stop before a stage that would end past this many seconds from the start (default 520)")
    ap.add_argument("--costs", default="0,500,2000,10000",
                    help="the emulated layer's ns a call; 0 is its floor, which the report takes off the others ('none': no emulated layer)")
    ap.add_argument("--attaches", type=int, default=4, help="5-s default-budget attaches a workload")
    ap.add_argument("--ckpt-sizes", default=",".join(map(str, CKPT_SIZES_GIB)), help="GiB (with --sim: MiB)")
    ap.add_argument("--sim", action="store_true", help="simcuda instead of a GPU: a dry run of the harness")
    ap.add_argument("--retry-failed", action="store_true", help="run again the stages recorded as failed")
    ap.add_argument("--pack", metavar="FILE.tar.xz", help="after every stage, the results directory packed there "
                    "(on the GPU machine: $OUT/overhead-h200.tar.xz, so a call cut off still brings back what it finished)")
    ap.add_argument("--list", action="store_true", help="print the stages, done or not, and exit")
    a = ap.parse_args(argv)
    d = Path(a.out)
    cfg = Config(costs=[] if a.costs == "none" else [float(c) for c in a.costs.split(",")],
                 attaches=a.attaches, sim=a.sim)
    if a.sim:
        cfg.untraced_s, cfg.emulate_s, cfg.cycles = 2.0, 3.0, 4
    pats = a.only.split(",")
    todo = [s for s in stages(tuple(int(x) for x in a.ckpt_sizes.split(",")))
            if any(fnmatch.fnmatchcase(s.name, p) for p in pats)]
    if a.list:
        for s in todo:
            state = ("failed" if failed(d / s.file) else "done") if done(d / s.file) else f"~{estimate(s, d):.0f} s"
            print(f"{s.name:18} {state}")
        return 0
    if a.sim:
        setup_sim()
    elif shutil.which("gputrace") is None:
        raise SystemExit("overhead_suite: gputrace is not on PATH: source bench/gpu-env.sh first")
    d.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    for s in todo:
        path = d / s.file
        if done(path) and not (a.retry_failed and failed(path)):
            continue
        left = a.budget_s - (time.monotonic() - start)
        need = estimate(s, d)
        if need > left:
            rest = sum(not done(d / x.file) for x in todo)
            print(f"stopping before {s.name}: it takes about {need:.0f} s and {max(left, 0):.0f} s of the budget "
                  f"are left; {rest} stage(s) to go: run the same command again", flush=True)
            return EXIT_MORE
        print(f"{s.name}: starting ({left:.0f} s of the budget left, about {need:.0f} s needed)", flush=True)
        t0 = time.monotonic()
        try:
            if s.kind == "steady":
                write_atomic(path, steady(s.args[0], d, cfg))
            else:
                script_stage(s, d, cfg, left)
        except (StageFailed, SystemExit, OSError, ValueError, KeyError, orjson.JSONDecodeError) as exc:
            # Recorded, and the suite goes on: a stage that fails every time (a size that never fits
            # its time) must not stop the others. --retry-failed runs such stages again.
            why = f"{type(exc).__name__}: {exc}"[:2000]
            write_atomic(path, {"stage": s.name, "failed": why, "complete": True, "device": device_name(cfg.sim),
                                "commit": commit(), "wall_s": time.monotonic() - t0})
            print(f"{s.name}: FAILED after {time.monotonic() - t0:.0f} s ({why}); recorded, going on", flush=True)
        else:
            print(f"{s.name}: done in {time.monotonic() - t0:.0f} s", flush=True)
        if a.pack:
            pack(d, Path(a.pack))
    bad = [s.name for s in todo if failed(d / s.file)]
    print(f"all {len(todo)} stage(s) run in {d}" + (f", {len(bad)} failed ({', '.join(bad)}: --retry-failed runs "
          "them again)" if bad else "") + f"; next: bench/overhead_report.py {d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
