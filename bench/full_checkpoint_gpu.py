#!/usr/bin/env python3
"""Whole-process checkpoint on the GPU: this project's path against the driver API + CRIU baseline.

For each size (GiB of live tensors held by a PyTorch training job, bench/full_job.py):
  reference  the job run uninterrupted: its losses and the held tensors' checksums
  baseline   the job without the shim: `checkpoint_full` = driver Lock + Checkpoint (the driver copies all
             device memory), CRIU dump; killed; `restore_full` = CRIU restore, driver Restore + Unlock
  gputrace   the job under the shim (--checkpointable --suspendable): the shim copies device memory to host
             memory at bus speed and releases it first, then the same driver + CRIU steps with little left
Both are checkpointed whole while paused after N steps, killed, restored, and continued: their losses
and checksums must equal the reference's bit for bit (the script exits 1 otherwise).  Reported per
case: freeze (first stop to end of dump), its GPU part (shim + lock + checkpoint) beside the pinned copy
limit (bytes / D2H GB/s measured in a separate process), CRIU dump, write, and the way back (CRIU restore
to the job running).  Targets (issue 7): freeze >= 2x faster than the baseline; GPU part <= 1.25 x limit.

On the GPU machine (see bench/gpu-env.sh; CRIU from bench/make-criu-bundle in .gpu/criu):
    source bench/gpu-env.sh
    python3 bench/full_checkpoint_gpu.py --out bench/results/full-h200 --sizes 4,16 --images /dev/shm/gtfull
The `traced` path (--paths traced): the gputrace path for a job that `gputrace attach --exact` traced while it
spun; checkpointing it under the live tracer must be refused, and after the tracer has gone (the kernel's
[uprobes] page stays in the job) it must checkpoint, restore and train on as the others (CRIU >= 4.2).
A JAX job (bench/full_job_jax.py: XLA's allocator, its many threads and fds) instead of PyTorch's:
    python3 bench/full_checkpoint_gpu.py --framework jax --out bench/results/full-jax-h200 --sizes 1,4 --images /dev/shm/gtfull
With --pre-dump each path runs a second time as PATH+pre: a pre-dump (`checkpoint --full --pre-dump`: CRIU's
pre-dump --track-mem, no driver lock) while the job trains, then the checkpoint at the pause dumps only the
host pages written since; the table sets its freeze, CRIU dump and pages written beside the whole dump's.
It needs a kernel that tracks written pages (`criu check --feature mem_dirty_track`); where CRIU cannot
pre-dump the live job (its device mappings), the case records the refusal and its checkpoint is whole:
    python3 bench/full_checkpoint_gpu.py --pre-dump --out bench/results/full-predump-h100 --sizes 4 --images /dev/shm/gtfull
Here, without a GPU (simcuda's train workload in device mode, sizes in MiB):
    .venv/bin/python bench/full_checkpoint_gpu.py --simcuda --out /tmp/full-sim --sizes 4,64
    .venv/bin/python bench/full_checkpoint_gpu.py --dry-run --out /tmp/x     checks only, runs nothing
Writes OUT/full-checkpoint.json and OUT/full-checkpoint.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB, MIB = 1 << 30, 1 << 20


def _imports():
    try:
        from gputrace import shim, simcuda  # noqa: F401
        from gputrace.checkpointer import criu, full  # noqa: F401
    except ImportError:
        raise SystemExit("gputrace is not importable: source bench/gpu-env.sh (GPU machine) or use .venv/bin/python")


# --- awaiting the job -------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen | None, timeout_s: float) -> str:
    """Waits (inotify on the job's log) until it contains `text`; fails early if the job ended."""
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0 or _libc.inotify_add_watch(fd, str(path).encode(), 0x2) < 0:  # IN_MODIFY
        raise SystemExit(f"inotify on {path} failed")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            content = path.read_text()
            if text in content:
                return content
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the job ended (status {proc.returncode}) before {text!r}: {content[-600:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {text!r} in {path} after {timeout_s:.0f} s: {content[-600:]}")
            if select.select([fd], [], [], min(left, 5.0))[0]:  # 5 s cap only to notice a dead job
                os.read(fd, 4096)
    finally:
        os.close(fd)


def wait_exit(pid: int, timeout_s: float) -> int | None:
    """The exit status of `pid` (our child: the original job, or a restored one we are subreaper of)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        if not select.select([fd], [], [], timeout_s)[0]:
            raise RuntimeError(f"process {pid} still runs after {timeout_s:.0f} s")
    finally:
        os.close(fd)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except ChildProcessError:
        return None


# --- the two kinds of job ---------------------------------------------------------------------------------------

class TorchJob:
    unit = GIB
    unit_name = "GiB"

    def __init__(self, args) -> None:
        self.args = args

    def env(self, shimmed: bool) -> dict:
        from gputrace import shim

        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
        return {**shim.preload_env(env), "GPUTRACE_SHIM_VMM": "1"} if shimmed else env

    def argv(self, size: int, spin: bool = False) -> list[str]:
        return [sys.executable, str(REPO / "bench" / "full_job.py"), "--hold", str(size * self.unit),
                "--steps-before", str(self.args.steps_before), "--steps-after", str(self.args.steps_after),
                *(["--spin"] if spin else [])]

    marker = '"paused"'
    running = '"step": 1,'  # a step done, the job training on: when --pre-dump takes its pre-dump
    spinning = '"spinning"'  # with argv(spin=True): a phase of driver calls for a tracer, ended by end_spin

    def continue_(self, pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)

    def end_spin(self, pid: int) -> None:
        os.kill(pid, signal.SIGUSR2)

    def outcome(self, log: str) -> dict:
        lines = [json.loads(ln) for ln in log.splitlines() if ln.startswith("{")]
        return {"losses": [d["loss"] for d in lines if "step" in d],
                "checksum": next((d["checksum"] for d in lines if d.get("done")), None),
                "done": any(d.get("done") for d in lines)}

    def limit(self, size: int) -> dict:
        r = subprocess.run([sys.executable, str(REPO / "bench" / "full_job.py"), "--limit",
                            str(min(size, 4) * self.unit)], env=self.env(False), capture_output=True, text=True,
                           timeout=600)
        if r.returncode:
            raise RuntimeError(f"the pinned copy limit could not be measured: {r.stderr[-600:]}")
        return json.loads(r.stdout.splitlines()[-1])

    def close(self) -> None:
        pass


class JaxJob(TorchJob):
    """bench/full_job_jax.py: the same protocol, XLA's allocator (not preallocating) and its many threads."""

    def env(self, shimmed: bool) -> dict:
        return dict(super().env(shimmed), XLA_PYTHON_CLIENT_PREALLOCATE="false",
                    XLA_FLAGS="--xla_gpu_deterministic_ops=true")

    def argv(self, size: int, spin: bool = False) -> list[str]:
        if spin:
            raise SystemExit("--framework jax runs the baseline and gputrace paths only")
        return [sys.executable, str(REPO / "bench" / "full_job_jax.py"), "--hold", str(size * self.unit),
                "--steps-before", str(self.args.steps_before), "--steps-after", str(self.args.steps_after)]

    def limit(self, size: int) -> dict:
        return super().limit(size)  # PyTorch's pinned copies: the bus is the same


class SimJob:
    """simcuda's train workload in device mode: the harness's every step, without a GPU."""

    unit = MIB
    unit_name = "MiB"

    def __init__(self, args) -> None:
        from gputrace.simcuda.device import Device

        self.args = args
        self.steps = args.steps_before + args.steps_after
        from gputrace import simcuda

        self.device = Device(Path(args.images) / "simcuda-device").start()
        # A private copy of the driver: a uprobe that a tracer elsewhere on this host puts on the shared
        # build must not reach these jobs (CRIU cannot dump the kernel's [uprobes] page).
        self.driver = Path(args.images) / "simcuda-driver"
        self.driver.mkdir(parents=True, exist_ok=True)
        shutil.copy2(simcuda.library_path(), self.driver / "libcuda.so.1")

    def env(self, shimmed: bool) -> dict:
        from gputrace import shim, simcuda

        env = simcuda.env()
        env["LD_LIBRARY_PATH"] = f"{self.driver}:{env['LD_LIBRARY_PATH']}"
        env = self.device.env(env)
        return {**shim.preload_env(env), "GPUTRACE_SHIM_VMM": "1"} if shimmed else env

    def argv(self, size: int, kernel_ns: int = 5_000_000, spin: bool = False) -> list[str]:
        from gputrace import simcuda

        if spin:  # long enough for a tracer to start and see it before the step it is checkpointed at
            kernel_ns = 500_000_000
        host_mib = getattr(self.args, "host_mib", 0)  # (bench/ckpt_costs_gpu.py names no --host-mib)
        host = ["--host", str(host_mib * MIB)] if host_mib else []
        return simcuda.workload("train") + ["--size", str(size * self.unit), "--steps", str(self.steps),
                                            "--kernel-ns", str(kernel_ns), "--vmm", "0", *host]

    @property
    def marker(self) -> str:
        return f"step {self.args.steps_before} "

    running = "step 1 "

    spinning = "step 1 "  # its steps are driver calls enough; argv(spin=True) makes them last

    def continue_(self, pid: int) -> None:
        pass  # it never stopped

    def end_spin(self, pid: int) -> None:
        pass

    def outcome(self, log: str) -> dict:
        steps = [ln for ln in log.splitlines() if ln.startswith("step ")]
        done = [ln for ln in log.splitlines() if ln.startswith("done ")]
        return {"losses": steps, "checksum": done[0] if done else None, "done": bool(done)}

    def limit(self, size: int) -> dict:
        return {"limit_bytes": 0, "limit_d2h_gbps": None, "limit_h2d_gbps": None}

    def close(self) -> None:
        self.device.stop()
        shutil.rmtree(self.driver, ignore_errors=True)


# --- one run ----------------------------------------------------------------------------------------------------

def start(job, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # setsid, stdio on files: what CRIU needs
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(REPO))


def reference(job, size: int, work: Path, timeout_s: float) -> dict:
    log = work / f"reference-{size}.log"
    argv = job.argv(size, kernel_ns=0) if isinstance(job, SimJob) else job.argv(size)
    p = start(job, argv, job.env(False), log)
    wait_for_text(log, job.marker, p, timeout_s)
    job.continue_(p.pid)
    status = wait_exit(p.pid, timeout_s)
    out = job.outcome(log.read_text())
    if status != 0 or not out["done"]:
        raise RuntimeError(f"the reference run failed (status {status}): {log.read_text()[-600:]}")
    return out


def traced_first(job, p: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    """The "traced" path: while the job spins (driver calls), `gputrace attach` traces it. A checkpoint
    under the live tracer must be refused with the job running on; once the tracer has exited, the job
    (with the kernel's [uprobes] page) goes on to its pause and is checkpointed like the others."""
    from gputrace.checkpointer import uprobes
    from gputrace.checkpointer.full import checkpoint_full
    from gputrace.base.errors import CheckpointError

    wait_for_text(log, job.spinning, p, timeout_s)
    tracer = subprocess.Popen([sys.executable, "-m", "gputrace", "attach", "-p", str(p.pid), "--exact",
                               "--interval", "0.5", "-d", str(int(timeout_s))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd="/")  # not the repository's root, whose gputrace/ is not the installed package
    found: dict = {"tracer_said": []}
    try:
        for line in tracer.stderr:  # its first interval: the probes are in place
            if line.startswith("[") and f"pid {p.pid}" in line:
                found["tracer_line"] = line.strip()
                break
            found["tracer_said"].append(line.rstrip()[:300])
        t = time.monotonic_ns()
        live = uprobes.traces(p.pid)
        found["traces_ms"] = (time.monotonic_ns() - t) / 1e6
        found["live"] = {"breakpoints": live.breakpoints, "pending_returns": len(live.pending_returns)}
        try:
            checkpoint_full(p.pid, log.parent / "refused", use_shim=True)
            found["refused"] = False
        except CheckpointError as exc:
            found["refused"], found["refusal"] = True, exc.msg
        found["running_after_refusal"] = p.poll() is None
        # The job must have hit a probe (the kernel's [uprobes] page) before the tracer goes: a
        # simcuda job blocked in a 0.5 s kernel when the probes went in makes its next call only then.
        deadline = time.monotonic() + 30
        while "[uprobes]" not in Path(f"/proc/{p.pid}/maps").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tracer.send_signal(signal.SIGINT)
        found["tracer_said"] += [ln[:300] for ln in tracer.communicate(timeout=120)[1].splitlines()[-5:]]
        found["tracer_status"] = tracer.returncode
    left = uprobes.settle(p.pid)
    found["after_tracer"] = {"uprobes_page": left.uprobes_page is not None, "harmful": left.harmful}
    if not found.get("refused") or left.harmful or left.uprobes_page is None:
        raise RuntimeError(f"traced path: {found}")
    job.end_spin(p.pid)
    return found


def gpu_of(pid: int) -> str | None:
    """The UUID of the GPU a process uses, as nvidia-smi lists it (None without nvidia-smi or the process)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((ln.split(",")[1].strip() for ln in r.stdout.splitlines() if ln.split(",")[0].strip() == str(pid)),
                None)


def top_first(job, p: subprocess.Popen, log: Path, timeout_s: float):
    """The "top" path: `gputrace top`'s live source (host-wide tracing of every libcuda file) traces the job
    while it spins; returns the source, still tracing, and what it saw. The checkpoint is then taken the way
    top's `w` takes it: inside LiveSource.hold_tracing, once calls under a return probe have returned."""
    from gputrace.tracer.session import Options
    from gputrace.hostview.live import LiveSource

    wait_for_text(log, job.spinning, p, timeout_s)
    src = LiveSource(Options(interval_s=0.5), refresh_s=0.5)
    deadline = time.monotonic() + min(timeout_s, 120)
    for frame in src.frames():
        row = next((r for r in frame.processes if r.pid == p.pid), None)
        if row is not None and row.snapshot.calls_hz > 0:
            seen = {"calls_hz": row.snapshot.calls_hz, "comm": row.comm, "processes": len(frame.processes),
                    "uprobes_page": "[uprobes]" in Path(f"/proc/{p.pid}/maps").read_text()}
            break
        if time.monotonic() > deadline:
            src.close()
            raise RuntimeError("top never showed the job with calls")
    job.end_spin(p.pid)
    return src, seen


def one(job, size: int, path: str, work: Path, images: Path, timeout_s: float,
        gpu_map: list[tuple[str, str]] | None = None) -> dict:
    from gputrace.base.errors import CheckpointError
    from gputrace.checkpointer.full import checkpoint_full, pre_dump, restore_full

    log = work / f"{path}-{size}.log"
    from gputrace.checkpointer import uprobes

    path, pre = path.removesuffix("+pre"), path.endswith("+pre")
    pre_report: dict | None = None
    shimmed = path in ("gputrace", "traced", "top")
    traced, src = None, None
    argv = job.argv(size, spin=path in ("traced", "top"))
    p = start(job, argv, job.env(shimmed), log)
    try:
        if path == "traced":
            traced = traced_first(job, p, log, timeout_s)
        if path == "top":
            src, traced = top_first(job, p, log, timeout_s)
        ck = images / f"{path}{'+pre' if pre else ''}-{size}"
        shutil.rmtree(ck, ignore_errors=True)
        if pre:  # while the job trains: CRIU's pre-dump, no driver lock; the checkpoint at the pause comes after it
            wait_for_text(log, job.running, p, timeout_s)
            try:
                pre_report = pre_dump(p.pid, ck).to_dict()
            except CheckpointError as exc:  # e.g. a live CUDA job's device mappings: the checkpoint is whole
                pre_report = {"refused": exc.msg, "hint": exc.hint}
        wait_for_text(log, job.marker, p, timeout_s)
        gpu_before = gpu_of(p.pid) if gpu_map else None
        with src.hold_tracing(p.pid) if src is not None else contextlib.nullcontext(True) as quiet:
            if src is not None:
                left = uprobes.settle(p.pid)
                traced.update(held=quiet, breakpoints_while_held=left.breakpoints,
                              pending_returns_while_held=len(left.pending_returns))
            c = checkpoint_full(p.pid, ck, use_shim=shimmed, timeout_ms=int(timeout_s * 1000))
        if src is not None:
            src.close()
            src = None
        status = p.wait(timeout=timeout_s)
        if status != -signal.SIGKILL:
            raise RuntimeError(f"the job was not ended by the checkpoint (status {status})")
        r = restore_full(ck, gpu_map=gpu_map)
        gpu_after = gpu_of(r.pid) if gpu_map else None  # where the restored job's context is now
        job.continue_(r.pid)
        status = wait_exit(r.pid, timeout_s)
        shutil.rmtree(ck, ignore_errors=True)
    finally:
        if src is not None:
            src.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    out = job.outcome(log.read_text())
    if shimmed and not (c.shim or {}).get("allocations"):
        raise RuntimeError(f"the shim's fast path did not run: {c.shim}")
    gpu_ns = c.shim_ns + c.lock_ns + c.checkpoint_ns
    if pre:
        path += "+pre"
    return {"size": size, "path": path, "pid": c.pid, "freeze_s": c.freeze_ns / 1e9, "gpu_s": gpu_ns / 1e9,
            "shim_s": c.shim_ns / 1e9, "lock_s": c.lock_ns / 1e9, "driver_checkpoint_s": c.checkpoint_ns / 1e9,
            "dump_s": c.dump_ns / 1e9, "write_s": c.write_ns / 1e9, "image_bytes": c.image_bytes,
            "image_check": c.image_check, "image_check_s": c.image_check_ns / 1e9,
            "criu_bytes": c.criu_bytes,
            "shim_bytes": (c.shim or {}).get("bytes", 0), "back_s": r.total_ns / 1e9,
            "criu_restore_s": r.criu_ns / 1e9, "driver_restore_s": r.driver_restore_ns / 1e9,
            "unlock_s": r.unlock_ns / 1e9, "shim_restore_s": r.shim_ns / 1e9, "verify_s": r.verify_ns / 1e9,
            "pages_scanned": c.pages_scanned, "pages_written": c.pages_written,
            "pages_in_pre_dumps": c.pages_in_pre_dumps, "page_bytes": c.page_bytes, "pre_dumps": c.pre_dumps,
            "pre_dump_unused": c.pre_dump_unused, **({"pre_dump": pre_report} if pre else {}),
            "exit_status": status, "outcome": out, **({"traced": traced} if traced else {}),
            **({"gpu_map": gpu_map, "gpu_before": gpu_before, "gpu_after": gpu_after} if gpu_map else {})}


# --- reports ----------------------------------------------------------------------------------------------------

def markdown(doc: dict) -> str:
    u = doc["unit"]
    rows = ["| size | path | freeze s | GPU part s | bus limit s | CRIU dump s | back s | CRIU images | all files "
            "| same losses |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cases"]:
        lim = c.get("bus_limit_s")
        rows.append(f"| {c['size']} {u} | {c['path']} | {c['freeze_s']:.3f} | {c['gpu_s']:.3f} | "
                    f"{'-' if lim is None else f'{lim:.3f}'} | {c['dump_s']:.3f} | {c['back_s']:.3f} | "
                    f"{c['criu_bytes'] / GIB:.2f} GiB | {c['image_bytes'] / GIB:.2f} GiB | {c['same_as_reference']} |")
    lines = [f"# Whole-process checkpoint: gputrace vs driver API + CRIU ({doc['mode']})", "",
             f"{doc['host']}, {doc['criu']}, {doc['when']}; command: `{doc['command']}`", "", *rows, ""]
    pre = [c for c in doc["cases"] if "pre_dump" in c]
    if pre:
        lines += ["Pre-dumps (`--pre-dump`): the dump in the freeze after a pre-dump taken while the job trained, "
                  "beside the whole dump of the same path and size.", "",
                  "| size | path | pre-dump s | its frozen s | its pages | freeze s | whole's freeze s | CRIU dump s "
                  "| whole's dump s | pages written / scanned | whole's pages written |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in pre:
            w = next((x for x in doc["cases"] if x["size"] == c["size"] and x["path"] == c["path"][:-4]), {})
            pd = c["pre_dump"]
            if "refused" in pd:
                first = f"refused: {pd['refused'][:120]} | - | -"
            else:
                first = f"{pd['ns'] / 1e9:.3f} | {pd['frozen_ns'] / 1e9:.3f} | {pd['pages_written']:,}"
            lines.append(f"| {c['size']} {u} | {c['path']} | {first} | {c['freeze_s']:.3f} | "
                         f"{w.get('freeze_s', float('nan')):.3f} | {c['dump_s']:.3f} | {w.get('dump_s', float('nan')):.3f} | "
                         f"{c['pages_written']:,} / {c['pages_scanned']:,} | {w.get('pages_written', 0):,} |")
        lines.append("")
    for t in doc["targets"]:
        lines.append(f"- {t}")
    lines += ["", "freeze: from the first step that stops the job (shim copy or driver lock) to the end of the "
              "CRIU dump; GPU part: shim copy + driver lock + driver checkpoint; bus limit: device bytes / "
              "pinned D2H GB/s measured in a separate process; back: CRIU restore to the job running "
              "(driver Restore + Unlock, shim resume)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, help="directory for full-checkpoint.json and .md")
    ap.add_argument("--sizes", default="4,16", help="comma-separated GiB of live tensors (MiB with --simcuda)")
    ap.add_argument("--images", help="where checkpoints go while a case runs (default OUT/images); /dev/shm is fine")
    ap.add_argument("--steps-before", type=int, default=20)
    ap.add_argument("--steps-after", type=int, default=20)
    ap.add_argument("--paths", default="baseline,gputrace",
                    help="which paths to run (default baseline,gputrace); `traced` is the gputrace path for a job "
                         "that `gputrace attach` traced first, refused while the tracer is live; `top` the same for a job "
                         "that top's live source traces, checkpointed as `w` does (GPU only)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one step may take (default 600)")
    ap.add_argument("--gpu-map", action="append", default=[], metavar="OLD=NEW",
                    help="restore onto another GPU (restore --full --gpu-map); repeat for several")
    ap.add_argument("--simcuda", action="store_true", help="simcuda's train workload instead of PyTorch (no GPU)")
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch",
                    help="the GPU job: PyTorch (bench/full_job.py) or JAX (bench/full_job_jax.py)")
    ap.add_argument("--pre-dump", action="store_true",
                    help="run each path again as PATH+pre: a pre-dump while the job trains, then the checkpoint, "
                         "whose freeze is set beside the whole dump's (needs `criu check --feature mem_dirty_track`)")
    ap.add_argument("--host-mib", type=int, default=0,
                    help="with --simcuda: host memory the job holds besides (train --host), a step writing one word")
    ap.add_argument("--dry-run", action="store_true", help="check the prerequisites and print the plan only")
    args = ap.parse_args()
    _imports()
    from gputrace.checkpointer import criu

    bundle = REPO / ".gpu" / "criu" / "criu"
    if "GPUTRACE_CRIU" not in os.environ and bundle.exists():
        os.environ["GPUTRACE_CRIU"] = str(bundle)
    out = Path(args.out)
    args.images = str(Path(args.images or out / "images").absolute())
    sizes = [int(s) for s in args.sizes.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    problems = []
    try:
        c = criu.find()
        ok, line = criu.check(c)
        criu_text = f"criu {c.version_str} ({c.path}): check {'passes' if ok else 'FAILS: ' + line}"
        if not ok:
            problems.append(criu_text)
    except criu.CriuUnavailable as exc:
        criu_text = f"no CRIU: {exc.msg}"
        problems.append(f"{exc.msg} ({exc.hint}; on the GPU machine: bench/make-criu-bundle here, carry .gpu)")
    if os.geteuid() != 0:
        problems.append("CRIU needs root")
    if args.pre_dump and "c" in locals():
        ok, said = criu.check(c, criu.DIRTY_TRACK)
        criu_text += f"; {criu.DIRTY_TRACK} {'passes' if ok else 'FAILS: ' + said}"
        if not ok:  # run all the same: each +pre case records the refusal, its checkpoint whole
            print(f"warning: --pre-dump: `criu check --feature {criu.DIRTY_TRACK}` fails here ({said}): every "
                  "pre-dump will be refused and the +pre cases' checkpoints whole", file=sys.stderr)
        paths = [q for p in paths for q in (p, f"{p}+pre") if not p.endswith("+pre")]
    if not args.simcuda:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available(), "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"],
                           capture_output=True, text=True)
        if r.returncode or not r.stdout.startswith("True"):
            problems.append(f"no PyTorch with a GPU here ({(r.stderr or r.stdout).strip()[-200:]}); use --simcuda")
    unit = "MiB" if args.simcuda else "GiB"
    print(f"plan: sizes {sizes} {unit}, paths {paths} + an uninterrupted reference each; {criu_text}; "
          f"images under {args.images}")
    if problems:
        print("cannot run: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.dry_run:
        print("dry run: prerequisites met")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    images = Path(args.images)
    images.mkdir(parents=True, exist_ok=True)
    work = out / "logs"
    work.mkdir(exist_ok=True)
    job = SimJob(args) if args.simcuda else JaxJob(args) if args.framework == "jax" else TorchJob(args)
    cases, failures = [], []
    try:
        for size in sizes:
            ref = reference(job, size, work, args.timeout)
            lim = job.limit(size)
            for path in paths:
                try:
                    c = one(job, size, path, work, images, args.timeout,
                            [tuple(m.split("=", 1)) for m in args.gpu_map] or None)
                except Exception as exc:  # one failed case must not hide the others' numbers
                    failures.append(f"{size} {unit} {path}: {type(exc).__name__}: {exc}")
                    print(f"FAILED {size} {unit} {path}: {exc}", file=sys.stderr)
                    continue
                o = c.pop("outcome")
                c["same_as_reference"] = o["losses"] == ref["losses"] and o["checksum"] == ref["checksum"]
                if not c["same_as_reference"]:
                    failures.append(f"{size} {unit} {path}: losses or checksums differ from the uninterrupted run")
                gbps = lim.get("limit_d2h_gbps")
                c["bus_limit_s"] = size * job.unit / (gbps * 1e9) if gbps else None
                c["limit"] = lim
                cases.append(c)
                print(f"{size} {unit} {path}: freeze {c['freeze_s']:.3f} s (GPU {c['gpu_s']:.3f} s, dump "
                      f"{c['dump_s']:.3f} s), back {c['back_s']:.3f} s, same as reference: {c['same_as_reference']}")
    finally:
        job.close()
    targets = []
    for size in sizes:
        by = {c["path"]: c for c in cases if c["size"] == size}
        if "baseline" in by and "gputrace" in by:
            sp = by["baseline"]["freeze_s"] / by["gputrace"]["freeze_s"]
            targets.append(f"{size} {unit}: freeze {sp:.2f}x faster than the baseline (target >= 2x): "
                           f"{'met' if sp >= 2 else 'NOT met'}")
            lim = by["gputrace"]["bus_limit_s"]
            if lim:
                ratio = by["gputrace"]["gpu_s"] / lim
                targets.append(f"{size} {unit}: GPU part {ratio:.2f}x the bus limit (target <= 1.25x): "
                               f"{'met' if ratio <= 1.25 else 'NOT met'}")
        for path in [q for q in by if q.endswith("+pre") and q[:-4] in by]:
            w, i = by[path[:-4]], by[path]
            targets.append(f"{size} {unit} {path[:-4]}: freeze after a pre-dump {i['freeze_s']:.3f} s against "
                           f"{w['freeze_s']:.3f} s whole (CRIU dump {i['dump_s']:.3f} s against {w['dump_s']:.3f} s; "
                           f"{i['pages_written']:,} pages written against {w['pages_written']:,})"
                           + (f"; the pre-dump was refused: {i['pre_dump']['refused']}" if "refused" in i["pre_dump"]
                              else ""))
    doc = {"schema": 1, "mode": "simcuda" if args.simcuda else "gpu", "unit": unit,
           "host": f"{platform.node()} ({platform.platform()})", "criu": criu_text,
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "steps_before": args.steps_before, "steps_after": args.steps_after, "cases": cases,
           "targets": targets, "failures": failures}
    (out / "full-checkpoint.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "full-checkpoint.md").write_text(markdown(doc))
    print(f"wrote {out / 'full-checkpoint.json'} and {out / 'full-checkpoint.md'}")
    for t in targets:
        print(t)
    for f in failures:
        print(f"FAILURE: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
