#!/usr/bin/env python3
"""What taking a checkpoint costs, as opposed to running under the layer: how long the job is stopped
(freeze), how long until it runs again from the checkpoint (back), how many bytes go to storage and at
what rate, for one size and one kind of storage, along three paths on a fresh job each:

  gputrace  a PyTorch job (bench/ckpt_job.py) under `gputrace run --checkpointable --suspendable` holding
            SIZE of seeded tensors: `gputrace checkpoint -p PID -o DIR --json` (the shim's freeze: gate
            closed to gate open; then the image hashed and written, fsynced, while the job runs on), the
            tensors overwritten, `gputrace restore -p PID DIR --json` (verify, then a freeze that copies
            the image back), the checksum compared with the one taken before the checkpoint.
  driver    the same job without the shim: `gputrace checkpoint --backend driver -p PID --json` (NVIDIA's
            cuCheckpointProcessLock/Checkpoint/Restore/Unlock: the job is stopped from lock to unlock and
            its device memory goes to its own host memory, not to storage: no image, no write rate), the
            checksum compared; then `suspend --backend driver` / `resume --backend driver` with the GPU
            memory read (nvidia-smi) while suspended: the bytes are the device memory it released.
  full      a PyTorch job (bench/full_job.py) under the shim, started with setsid and its stdio on a file,
            paused after a few steps: `gputrace checkpoint --full -p PID -o DIR --json` (shim copy into
            DIR/gpu.img, driver lock + checkpoint, CRIU dump; the job is killed once its state is safe),
            `gputrace restore --full DIR --json` (CRIU restore, driver Restore + Unlock, shim resume), then
            the job goes on: its checksum after the restore must be the one it had when it paused.

Per path: freeze_s, back_s (from the restore's start to the job running again), bytes (the checkpoint
directory's files, summed; driver: device memory released), write_s and write_gb_s (the checkpoint's own
write phase where its JSON gives one; driver: null, with the reason), the pinned copy limit (device to host
and back, measured in the gputrace job's own process as bench/checkpoint_gpu.py does, else in a process
of its own as bench/full_checkpoint_gpu.py does), whether the data checked out, and the commands' raw JSON.
Anything not measured is null with `<field>_reason` beside it.  Before anything runs, each path's need
for storage (the image) and host memory (pinned staging of about the image's size; tmpfs images live in
memory too) is held against the filesystem's free space and MemAvailable: a path that cannot fit is
recorded as skipped with the numbers, and when no path fits the file says "skipped" at the top and the
exit status is 0.  The JSON is written (FILE.json.tmp, then renamed) only when complete; on a failure
the exit status is 1 and what was measured is left in FILE.json.partial.

On the GPU machine (CRIU from bench/make-criu-bundle in .gpu/criu, as bench/gpu-env.sh says):
    source bench/gpu-env.sh
    python3 bench/ckpt_costs_gpu.py --size 16 --storage disk --out /tmp/ckpt-16-disk.json
    python3 bench/ckpt_costs_gpu.py --size 16 --storage tmpfs --out /tmp/ckpt-16-tmpfs.json --paths gputrace,driver
Each path has --timeout seconds (default 200) and the whole run --budget-s (default 420): a path still
running then is ended (the guardians give the job back) and the run fails.
Here, without a GPU (simcuda in device mode, sizes in MiB; root and CRIU >= 4.0 for the full path):
    .venv/bin/python bench/ckpt_costs_gpu.py --simcuda --size 4 --storage tmpfs --out /tmp/ckpt-sim.json
--assume-free-space and --assume-mem-available lower what the fit check sees (to test the skipping).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import checkpoint_gpu as cg  # noqa: E402  (bench/, beside this file: Job, cli, log)
import full_checkpoint_gpu as fg  # noqa: E402  (TorchJob, SimJob, start, wait_for_text, wait_exit, reference)
from provenance import commit, device_name, nvsmi  # noqa: E402

SCHEMA = "gputrace.bench.ckpt_costs/1"
GIB, MIB = 1 << 30, 1 << 20
PATHS = ("gputrace", "driver", "full")
DEFAULT_ROOT = {"disk": Path("/var/tmp/gtckpt"), "tmpfs": Path("/dev/shm/gtckpt")}
MEMORY_FS = ("tmpfs", "ramfs")
LIMIT_CAP = 4 * GIB  # the pinned copy limit is measured on at most this much (the bus's rate is steady by then)
PROBE_CAP = 4 * GIB  # the storage's own write rate, measured on at most this much
log = cg.log


class PathTimeout(Exception):
    pass


class Failed(Exception):
    """A path did not complete: the message says what happened."""


def _alarm(_sig, _frame):
    raise PathTimeout()


# --- the host ---------------------------------------------------------------------------------------------------

def fmt(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of bytes, with K, M, G or T (powers of 1024)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def fstype(path: Path) -> str:
    """The type of the filesystem `path` is on (the longest mount point above it in /proc/self/mounts)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        f = v.split()
        if f and f[0].isdigit():
            out[k] = int(f[0]) * (1024 if len(f) > 1 and f[1] == "kB" else 1)
    return out


def dir_bytes(path: Path) -> int:
    """Every regular file under `path`, summed (links are not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if not os.path.islink(os.path.join(dirpath, f)):
                total += st.st_size
    return total


def storage_write(where: Path, nbytes: int) -> dict:
    """The storage's own rate: `nbytes` (a 64-MiB random block repeated) written to a new file, fsynced."""
    block = os.urandom(min(64 * MIB, nbytes))
    f = where / "storage-probe.bin"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        t = time.monotonic_ns()
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(block)[:min(len(block), nbytes - done)])
        os.fsync(fd)
        ns = time.monotonic_ns() - t
    finally:
        os.close(fd)
        f.unlink()
    return {"bytes": nbytes, "write_s": ns / 1e9, "write_gb_s": nbytes / ns,
            "method": "os.write of a 64-MiB random block repeated, then fsync, into a new file there"}


def set_subreaper() -> None:
    """Orphans below this process come to it: a job that `gputrace restore --full` brings back is this
    process's to wait for once that command exits."""
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise SystemExit("ckpt_costs: prctl(PR_SET_CHILD_SUBREAPER) failed")


def gputrace_cli(*args: str) -> dict:
    """A gputrace command with --json (checkpoint_gpu.cli: its JSON plus wall_ns); a failure raises."""
    doc = cg.cli(*args)
    if "error" in doc:
        raise Failed(f"`gputrace {' '.join(args)}` failed (status {doc.get('rc')}): {doc['error']}")
    return doc


def own_child(pid: int) -> bool:
    """Whether process `pid` is this process's child (a job restored under it, inherited as subreaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rpartition(")")[2].split()[1]) == os.getpid()


def kill_pid(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# --- the jobs: PyTorch on the GPU, simcuda here ---------------------------------------------------------------

class TorchInteractive:
    """bench/ckpt_job.py through checkpoint_gpu.Job (under the shim or not)."""

    def __init__(self, shim: bool) -> None:
        self.job = cg.Job(shim=shim)
        self.pid = self.job.pid

    def hold(self, nbytes: int):
        return self.job.cmd(f"hold {nbytes}")["checksum"]

    def checksum(self):
        return self.job.cmd("checksum")["checksum"]

    def scribble(self) -> None:
        self.job.cmd("scribble")

    def limit(self, nbytes: int) -> dict:
        r = self.job.cmd(f"limit {nbytes}")
        return {"d2h_gb_s": r["d2h_gbps"], "h2d_gb_s": r["h2d_gbps"], "copy_bytes": r["bytes"]}

    def close(self, kill: bool) -> None:
        if kill:
            if self.job.proc.poll() is None:
                self.job.proc.kill()
            self.job.proc.wait()
        else:
            self.job.close()


class PatternInteractive:
    """simcuda's `pattern` workload (--plain: two cuMemAlloc allocations, of SIZE and SIZE/2 + 4, seeded),
    in device mode: `sum` its checksum, `fill SEED` overwrites every byte."""

    def __init__(self, env: dict, nbytes: int) -> None:
        from gputrace import simcuda

        self.proc = subprocess.Popen(simcuda.workload("pattern") + ["--plain", "--size", str(nbytes)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise Failed(f"the pattern workload exited (status {self.proc.wait()})")
        return json.loads(line)

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if "error" in r:
            raise Failed(f"pattern: {line}: {r}")
        return r

    def hold(self, nbytes: int):
        return self.ready["sum"]  # held since its start

    def checksum(self):
        return self.cmd("sum")["sum"]

    def scribble(self) -> None:
        self.cmd("fill 7")

    def limit(self, nbytes: int) -> dict | None:
        return None

    def close(self, kill: bool) -> None:
        if not kill and self.proc.poll() is None:
            try:
                self.cmd("quit")
                self.proc.wait(timeout=30)
            except (Failed, OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class GpuStand:
    sim = False
    unit, unit_name = GIB, "GiB"
    limit_reason = None

    def __init__(self, work: Path, size: int) -> None:
        # the full path's job: a few steps before its pause and after the restore, enough to check it
        self.full = fg.TorchJob(SimpleNamespace(steps_before=2, steps_after=2))

    def interactive(self, shim: bool, nbytes: int):
        return TorchInteractive(shim)

    def device_bytes(self, pid: int) -> tuple[int | None, int | None]:
        """(the GPU memory the process holds, per nvidia-smi's process list: 0 where it is not listed, None
        where nvidia-smi lists no process at all; the device's memory.used)."""
        apps = nvsmi("--query-compute-apps=pid,used_memory")
        mine = None
        if apps:
            mine = 0
            for ln in apps:
                p, _, used = ln.partition(",")
                if p.strip() == str(pid) and used.strip().isdigit():
                    mine = int(used.strip()) * MIB
        used = nvsmi("--query-gpu=memory.used")
        return mine, (int(used[0]) * MIB if used and used[0].isdigit() else None)

    def separate_limit(self, nbytes: int) -> dict:
        r = self.full.limit(max(1, min(4, round(nbytes / GIB))))  # bench/full_job.py --limit, in its own process
        return {"d2h_gb_s": r["limit_d2h_gbps"], "h2d_gb_s": r["limit_h2d_gbps"], "copy_bytes": r["limit_bytes"]}

    def full_check(self, log_text: str, work: Path, size: int, timeout_s: float) -> tuple[bool, str]:
        lines = [json.loads(ln) for ln in log_text.splitlines() if ln.startswith("{")]
        paused = next((d["checksum"] for d in lines if "paused" in d), None)
        resumed = next((d["checksum"] for d in lines if d.get("resumed")), None)
        done = any(d.get("done") for d in lines)
        ok = paused is not None and paused == resumed and done
        return ok, ("the tensors' checksum after the restore equals the one at the pause, and the job trained on "
                    f"to its end: paused {paused is not None}, equal {paused == resumed}, done {done}")

    def close(self) -> None:
        pass


class SimStand(GpuStand):
    """simcuda in device mode (device memory in a daemon outside the job, as on a GPU), one device and a
    private copy of the driver (full_checkpoint_gpu.SimJob) for every path."""

    sim = True
    unit, unit_name = MIB, "MiB"
    limit_reason = "simcuda has no bus to measure: its copies are memcpy in host memory"

    def __init__(self, work: Path, size_mib: int) -> None:
        # Steps after the marker for about 2.5 s (a step takes about 10 ms + 0.6 ms a MiB here): the job must
        # still run when `checkpoint --full` (a new process) acts, and the reference run stays short.
        after = max(30, int(2.5 / (0.010 + 0.0006 * size_mib)))
        # The simulated device's memory and socket are the "GPU": not on the storage measured, and at a
        # short path (a unix socket's path has at most 107 bytes).
        self.home = Path(tempfile.mkdtemp(prefix="gtcc-sim-"))
        try:
            self.full = fg.SimJob(SimpleNamespace(images=str(self.home), steps_before=5, steps_after=after))
        except BaseException:
            shutil.rmtree(self.home, ignore_errors=True)
            raise

    def interactive(self, shim: bool, nbytes: int):
        return PatternInteractive(self.full.env(shim), nbytes)

    def device_bytes(self, pid: int) -> tuple[int | None, int | None]:
        held = sum(f.stat().st_size for f in self.full.device.files())  # one per allocation: this job's alone
        return held, held

    def separate_limit(self, nbytes: int) -> dict | None:
        return None

    def full_check(self, log_text: str, work: Path, size: int, timeout_s: float) -> tuple[bool, str]:
        ref = fg.reference(self.full, size, work, timeout_s)
        out = self.full.outcome(log_text)
        ok = out["done"] and out["losses"] == ref["losses"] and out["checksum"] == ref["checksum"]
        return ok, ("every step's device checksum and the final history checksum equal an uninterrupted run's: "
                    f"{ok} ({len(out['losses'])} of {len(ref['losses'])} steps, done {out['done']})")

    def close(self) -> None:
        try:
            self.full.close()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


# --- what fits --------------------------------------------------------------------------------------------------

def needs(path: str, nbytes: int, storage: str, sim: bool) -> dict:
    """What a path needs, in bytes, with the parts named: on the storage, and of host memory."""
    if sim:  # pattern holds 1.5x SIZE; train SIZE and a granule; CRIU's images of a small C program
        image, margin, criu_img, proc = 2 * nbytes + 16 * MIB, 16 * MIB, 64 * MIB, 128 * MIB
        lim = 0
    else:  # the tensors, torch's other allocations and the shim's rounding; a PyTorch process's CRIU images
        image, margin, criu_img, proc = nbytes + nbytes // 50 + 256 * MIB, 1 * GIB, 3 * GIB, 6 * GIB
        lim = min(nbytes, LIMIT_CAP)
    tmpfs = storage == "tmpfs"
    if path == "gputrace":
        disk = {"image": image, "margin": margin}
        mem = {"pinned image (memfd) to copy into and out of": image, "process and the CLI": proc}
        if tmpfs:
            mem["the image on tmpfs"] = image
        if lim:
            mem["the pinned copy limit's buffer, kept by torch"] = lim
    elif path == "driver":
        disk = {}
        mem = {"device memory moved into the job's host memory": nbytes, "process and the CLI": proc}
    else:
        disk = {"gpu.img": image, "CRIU images": criu_img, "margin": margin}
        mem = {"gpu.img's pages, pinned by the shim while the job holds them": image, "process and the CLI": proc}
        if tmpfs:
            mem["CRIU images on tmpfs"] = criu_img
    return {"storage_bytes": sum(disk.values()), "storage_parts": disk,
            "memory_bytes": sum(mem.values()), "memory_parts": mem}


def unfit(path: str, need: dict, root: Path, fs: str, free: int, avail: int, gpu_free: int | None,
          nbytes: int) -> str | None:
    why = []
    if need["storage_bytes"] > free:
        parts = ", ".join(f"{k} {fmt(v)}" for k, v in need["storage_parts"].items())
        why.append(f"it needs about {fmt(need['storage_bytes'])} on {root} ({fs}; estimated: {parts}) and "
                   f"{fmt(free)} are free")
    if need["memory_bytes"] > avail:
        parts = ", ".join(f"{k} {fmt(v)}" for k, v in need["memory_parts"].items())
        why.append(f"it needs about {fmt(need['memory_bytes'])} of host memory (estimated: {parts}) and "
                   f"MemAvailable is {fmt(avail)}")
    if gpu_free is not None and nbytes + min(nbytes, LIMIT_CAP) + GIB > gpu_free:
        why.append(f"the job needs about {fmt(nbytes + min(nbytes, LIMIT_CAP) + GIB)} of GPU memory and "
                   f"{fmt(gpu_free)} are free")
    return f"{path}: cannot fit: " + "; ".join(why) if why else None


# --- the paths --------------------------------------------------------------------------------------------------

def put(rec: dict, key: str, value, reason: str | None = None) -> None:
    rec[key] = value
    if value is None:
        rec[key + "_reason"] = reason or "not measured"


def copy_limit(rec: dict, limits: dict, nbytes: int | None) -> None:
    """The pinned copy limit beside the record, and the freeze's floor at it for `nbytes` copied."""
    if limits.get("d2h_gb_s"):
        rec["copy_limit"] = {"d2h_gb_s": limits["d2h_gb_s"], "h2d_gb_s": limits["h2d_gb_s"],
                             "measured_in": limits["measured_in"]}
        put(rec, "bus_floor_s", nbytes / (limits["d2h_gb_s"] * 1e9) if nbytes else None,
            "no bytes copied device to host")
    else:
        put(rec, "copy_limit", None, limits.get("d2h_gb_s_reason"))


def path_gputrace(stand, nbytes: int, run_dir: Path, limits: dict, own_limit: bool, rec: dict | None = None) -> dict:
    """Fills `rec` (the document's record, in place: what was measured before a failure stays in it)."""
    rec = {} if rec is None else rec
    log(f"gputrace: starting a job under the shim, holding {fmt(nbytes)}")
    job = stand.interactive(True, nbytes)
    ok = False
    try:
        if own_limit:
            log("gputrace: the pinned copy limit in the job's process")
            lim = job.limit(min(nbytes, LIMIT_CAP))
            limits.update(lim, measured_in="the gputrace path's job (bench/ckpt_job.py `limit`), before it held its "
                                           "tensors; best of 3 pinned copies")
        want = job.hold(nbytes)
        ck = run_dir / "gputrace-ck"
        log(f"gputrace: checkpoint -p {job.pid} -o {ck}")
        c = gputrace_cli("checkpoint", "-p", str(job.pid), "-o", str(ck))
        rec["raw"] = {"checkpoint": c}
        rec["freeze_s"] = c["freeze_ns"] / 1e9
        rec["freeze_source"] = ("checkpoint JSON freeze_ns: the shim's gate closed to reopened (drain, sync, digest, "
                                "copy)")
        rec["write_s"] = c["write_ns"] / 1e9
        put(rec, "write_gb_s", c.get("write_gbps"), "the checkpoint reported no write time")
        rec["write_source"] = ("checkpoint JSON write_ns and write_gbps (stored_bytes / write_ns): data.img hashed "
                               "(xxh3) and written, fsynced, after the gate reopened")
        put(rec, "copy_gb_s", c.get("copy_gbps"), "nothing copied")
        copy_limit(rec, limits, c.get("bytes_copied"))
        rec["bytes"] = dir_bytes(ck)
        rec["bytes_source"] = "the checkpoint directory's files (data.img and manifest.json), summed"
        job.scribble()
        rec["scribble_changed_data"] = job.checksum() != want
        log(f"gputrace: restore -p {job.pid} {ck}")
        r = gputrace_cli("restore", "-p", str(job.pid), str(ck), "--device-only", "--force")
        rec["raw"]["restore"] = r
        rec["back_s"] = r["total_ns"] / 1e9
        rec["back_source"] = ("restore JSON total_ns: from the restore's start (reading and checking the image, the "
                              "job running on) through its freeze (gate closed, image copied back) to the gate open")
        rec["restore_freeze_s"] = r["freeze_ns"] / 1e9
        rec["verify_s"] = r["verify_ns"] / 1e9
        rec["data_ok"] = job.checksum() == want
        rec["data_check"] = ("the held tensors' checksum after the restore equals the one before the checkpoint "
                             "(every byte was overwritten in between)")
        shutil.rmtree(ck, ignore_errors=True)
        ok = True
    finally:
        job.close(kill=not ok)
    return rec


def path_driver(stand, nbytes: int, run_dir: Path, limits: dict, rec: dict | None = None) -> dict:
    """Fills `rec` in place (see path_gputrace)."""
    rec = {} if rec is None else rec
    log(f"driver: starting a job without the shim, holding {fmt(nbytes)}")
    job = stand.interactive(False, nbytes)
    ok = False
    try:
        want = job.hold(nbytes)
        log(f"driver: checkpoint --backend driver -p {job.pid}")
        c = gputrace_cli("checkpoint", "--backend", "driver", "-p", str(job.pid))
        rec["raw"] = {"checkpoint": c}
        steps_ns = c["lock_ns"] + c["checkpoint_ns"] + c["restore_ns"] + c["unlock_ns"]
        rec["freeze_s"] = steps_ns / 1e9
        rec["freeze_source"] = ("checkpoint JSON lock_ns + checkpoint_ns + restore_ns + unlock_ns: the job is stopped "
                                "from the lock to the unlock, its restore included (the few Python calls between the "
                                "driver's are left out)")
        rec["freeze_reported_s"] = c["freeze_ns"] / 1e9  # also counts the guardian's exit, after the unlock
        rec["back_s"] = (c["restore_ns"] + c["unlock_ns"]) / 1e9
        rec["back_source"] = "checkpoint JSON restore_ns + unlock_ns (part of freeze_s)"
        for k in ("lock", "checkpoint", "restore", "unlock"):
            rec[f"{k}_s"] = c[f"{k}_ns"] / 1e9
        same = job.checksum() == want
        before = stand.device_bytes(job.pid)
        log(f"driver: suspend --backend driver -p {job.pid}, the GPU memory read, resume")
        s = gputrace_cli("suspend", "--backend", "driver", "-p", str(job.pid))
        rec["raw"]["suspend"] = s
        try:
            during = stand.device_bytes(job.pid)
        finally:
            u = gputrace_cli("resume", "--backend", "driver", "-p", str(job.pid))
        rec["raw"]["resume"] = u
        rec["data_ok"] = same and job.checksum() == want
        rec["data_check"] = "the held tensors' checksum after the checkpoint, and again after suspend and resume"
        rec["suspend_s"] = (s["lock_ns"] + s["checkpoint_ns"]) / 1e9  # lock + checkpoint: the GPU memory off
        rec["resume_s"] = (u["restore_ns"] + u["unlock_ns"]) / 1e9
        rec["device_bytes"] = {"process_before": before[0], "process_suspended": during[0],
                               "device_used_before": before[1], "device_used_suspended": during[1]}
        if before[0]:
            released, how = before[0] - (during[0] or 0), "the job's own GPU memory (nvidia-smi's process list)"
        elif before[1] is not None and during[1] is not None:
            released, how = before[1] - during[1], "the device's memory.used (no process listed by nvidia-smi)"
        else:
            released, how = None, "nvidia-smi gave no memory figures"
        if stand.sim:
            how = "simcuda-device's files, one per allocation it holds"
        put(rec, "bytes", released, how)
        rec["bytes_source"] = (f"device memory released: before the suspend less while suspended ({how}); the driver "
                               "keeps it in the job's host memory, so nothing goes to storage")
        reason = ("not applicable: the driver's checkpoint keeps the device state in the job's own host memory and "
                  "writes no image (a whole-process checkpoint writes it: the full path)")
        put(rec, "write_s", None, reason)
        put(rec, "write_gb_s", None, reason)
        copy_limit(rec, limits, rec["bytes"])
        ok = True
    finally:
        job.close(kill=not ok)
    return rec


def path_full(stand, size: int, nbytes: int, run_dir: Path, limits: dict, deadline: float,
              rec: dict | None = None) -> dict:
    """Fills `rec` in place (see path_gputrace): on a failure the job's log tail stays in it too."""
    rec = {} if rec is None else rec
    job = stand.full
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    lg = logs / "full.log"
    log(f"full: starting a job under the shim (setsid, stdio on {lg}), holding {fmt(nbytes)}")
    p = fg.start(job, job.argv(size), job.env(True), lg)
    restored = restoring = None
    ok = False
    try:
        fg.wait_for_text(lg, job.marker, p, left())
        ck = run_dir / "full-ck"
        log(f"full: checkpoint --full -p {p.pid} -o {ck}")
        c = gputrace_cli("checkpoint", "--full", "-p", str(p.pid), "-o", str(ck))
        rec["raw"] = {"checkpoint": c}
        rec["freeze_s"] = c["freeze_ns"] / 1e9
        rec["freeze_source"] = ("checkpoint --full JSON freeze_ns: from the first stop (the shim's gate closing) to "
                                "the end of the CRIU dump; the job is then killed, its state safe")
        for k, v in (("shim_s", "shim_ns"), ("lock_s", "lock_ns"), ("driver_checkpoint_s", "checkpoint_ns"),
                     ("dump_s", "dump_ns"), ("image_check_s", "image_check_ns")):
            rec[k] = c[v] / 1e9
        rec["criu_bytes"] = c["criu_bytes"]
        status = p.wait(timeout=left())
        if status != -signal.SIGKILL:
            raise Failed(f"the job was not ended by the checkpoint (status {status})")
        rec["bytes"] = dir_bytes(ck)
        rec["bytes_source"] = "the checkpoint directory's files (gpu.img, CRIU's images, manifest.json), summed"
        log(f"full: restore --full {ck}")
        restoring = c["pid"]  # CRIU brings the job back at its old pid
        r = gputrace_cli("restore", "--full", str(ck))
        rec["raw"]["restore"] = r
        restored = r["pid"]
        rec["back_s"] = (r["verify_ns"] + r["total_ns"]) / 1e9
        rec["back_source"] = ("restore --full JSON verify_ns (every file's checksum, before anything runs) + total_ns "
                              "(CRIU restore to the job running: driver Restore + Unlock, shim resume)")
        rec["back_after_verify_s"] = r["total_ns"] / 1e9
        for k, v in (("verify_s", "verify_ns"), ("criu_restore_s", "criu_ns"),
                     ("driver_restore_s", "driver_restore_ns"), ("unlock_s", "unlock_ns"),
                     ("shim_restore_s", "shim_ns")):
            rec[k] = r[v] / 1e9
        job.continue_(restored)
        st = fg.wait_exit(restored, left())
        restored = None
        rec["exit_status_after_restore"] = st
        rec["data_ok"], rec["data_check"] = stand.full_check(lg.read_text(), logs, size, left())
        if st not in (0, None):
            rec["data_ok"] = False
        shutil.rmtree(ck, ignore_errors=True)
        rec["shim_bytes"] = (c.get("shim") or {}).get("bytes")
        rec["write_s"] = c["write_ns"] / 1e9
        put(rec, "write_gb_s", c["image_bytes"] / c["write_ns"] if c["write_ns"] else None,
            "the checkpoint reported no write time")
        rec["write_source"] = ("checkpoint --full JSON image_bytes / write_ns: every file checksummed (xxh3) and "
                               "fsynced, the manifest written, the directory synced and renamed, after the freeze. "
                               "The shim wrote gpu.img and CRIU its images through the page cache inside the freeze: "
                               "what the kernel wrote back before write_ns began is not in it (on tmpfs fsync writes "
                               "nothing)")
        if not (c.get("shim") or {}).get("allocations"):
            rec["shim_fast_path"] = False
            rec["shim_fast_path_reason"] = (c.get("shim") or {}).get("skipped", "the shim did not run")
        copy_limit(rec, limits, rec["shim_bytes"])
        ok = True
    finally:
        if not ok:
            rec["job_log_tail"] = lg.read_text()[-2000:] if lg.exists() else None
        kill_pid(restored)
        if not ok and restoring is not None:
            # Ended (a timeout) while `restore --full` ran: what CRIU had brought back was that command's
            # child, and is this subreaper's now that the command is gone; its scratch directory stays.
            if own_child(restoring):
                kill_pid(restoring)
            for d in Path(tempfile.gettempdir()).glob(f"gputrace-restore-{restoring}-*"):
                shutil.rmtree(d, ignore_errors=True)
        if p.poll() is None:
            p.kill()
            p.wait()
    return rec


# --- the run ----------------------------------------------------------------------------------------------------

def criu_problem() -> str | None:
    from gputrace.checkpointer import criu

    bundle = REPO / ".gpu" / "criu" / "criu"
    if "GPUTRACE_CRIU" not in os.environ and bundle.exists():
        os.environ["GPUTRACE_CRIU"] = str(bundle)
    if os.geteuid() != 0:
        return "CRIU needs root"
    try:
        c = criu.find()
    except criu.CriuUnavailable as exc:
        return f"no CRIU: {exc.msg}"
    ok, line = criu.check(c)
    return None if ok else f"`criu check` fails ({c.path} {c.version_str}): {line}"


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.rename(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--size", type=int, required=True, help="GiB of live tensors (MiB with --simcuda)")
    ap.add_argument("--storage", choices=("disk", "tmpfs"), required=True,
                    help=f"where the images go: disk ({DEFAULT_ROOT['disk']}) or tmpfs ({DEFAULT_ROOT['tmpfs']})")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of gputrace,driver,full (default all)")
    ap.add_argument("--workdir", type=Path, help="the directory for the images instead of --storage's default; it "
                                                  "must be on that kind of storage")
    ap.add_argument("--timeout", type=float, default=200.0,
                    help="seconds a path may take (default 200; within --budget-s)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds the whole run may take; each path gets what is left, at most --timeout (default 420)")
    ap.add_argument("--simcuda", action="store_true", help="simcuda in device mode instead of a GPU (sizes in MiB)")
    ap.add_argument("--assume-free-space", type=parse_bytes, metavar="BYTES",
                    help="take at most this much as free on the storage (e.g. 2M, 10G): to test the skipping")
    ap.add_argument("--assume-mem-available", type=parse_bytes, metavar="BYTES",
                    help="take at most this much as MemAvailable: to test the skipping")
    a = ap.parse_args()
    t_start = time.monotonic()
    paths = [p for p in a.paths.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        ap.error(f"--paths: unknown {bad}; choose from {','.join(PATHS)}")
    if a.size <= 0:
        ap.error("--size must be positive")
    try:
        from gputrace import shim  # noqa: F401
    except ImportError:
        raise SystemExit("ckpt_costs: gputrace is not importable: source bench/gpu-env.sh (GPU machine) or use "
                         ".venv/bin/python")
    if not shutil.which("gputrace") and (Path(sys.executable).parent / "gputrace").exists():
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if not shutil.which("gputrace"):
        raise SystemExit("ckpt_costs: `gputrace` is not on PATH (source bench/gpu-env.sh first)")
    size = a.size
    nbytes = size * (MIB if a.simcuda else GIB)

    root = (a.workdir or DEFAULT_ROOT[a.storage]).absolute()
    root.mkdir(parents=True, exist_ok=True)
    fs = fstype(root)
    if (fs in MEMORY_FS) != (a.storage == "tmpfs"):
        raise SystemExit(f"ckpt_costs: --storage {a.storage} but {root} is on {fs}: give a --workdir on "
                         f"{'tmpfs' if a.storage == 'tmpfs' else 'a disk'}")
    st = os.statvfs(root)
    free_real = st.f_bavail * st.f_frsize
    free = min(free_real, a.assume_free_space) if a.assume_free_space is not None else free_real
    mi = meminfo()
    avail_real = mi.get("MemAvailable", 0)
    avail = min(avail_real, a.assume_mem_available) if a.assume_mem_available is not None else avail_real
    gpu_free = None
    if not a.simcuda:
        f = nvsmi("--query-gpu=memory.free")
        gpu_free = int(f[0]) * MIB if f else None

    doc: dict = {
        "schema": SCHEMA, "device": device_name(a.simcuda), "commit": commit(),
        "size_gib": nbytes / GIB, "size": size, "size_unit": "MiB" if a.simcuda else "GiB", "size_bytes": nbytes,
        "storage": a.storage, "simcuda": a.simcuda, "skipped": None, "complete": True,
        "command": " ".join(["python3", "bench/ckpt_costs_gpu.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {"node": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                 "mem_total_bytes": mi.get("MemTotal"), "mem_available_bytes": avail_real,
                 "gpu_free_bytes": gpu_free},
        "storage_dir": str(root),
        "filesystem": {"type": fs, "free_bytes": free_real, "total_bytes": st.f_blocks * st.f_frsize,
                       **({"assumed_free_bytes": free} if a.assume_free_space is not None else {}),
                       **({"assumed_mem_available_bytes": avail} if a.assume_mem_available is not None else {})},
        "timeout_s": a.timeout, "budget_s": a.budget_s,
        "paths": {}, "limits": {},
    }
    runnable = []
    for p in paths:
        need = needs(p, nbytes, a.storage, a.simcuda)
        why = unfit(p, need, root, fs, free, avail, gpu_free, nbytes)
        if why is None and p == "full":
            why = criu_problem()
            why = f"full: {why}" if why else None
        if why:
            doc["paths"][p] = {"skipped": why, "needs": need}
            log(f"skipped: {why}")
        else:
            runnable.append(p)
            doc["paths"][p] = {"needs": need}
    if not runnable:
        doc["skipped"] = "; ".join(doc["paths"][p]["skipped"] for p in paths)
        doc["limits"] = {"d2h_gb_s": None, "d2h_gb_s_reason": "no path ran", "h2d_gb_s": None,
                         "h2d_gb_s_reason": "no path ran"}
        doc["wall_s"] = time.monotonic() - t_start
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, doc)
        log(f"nothing fits: wrote {a.out} with the reasons")
        return 0

    run_dir = root / f"ckpt-costs-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    set_subreaper()
    signal.signal(signal.SIGALRM, _alarm)
    failures: list[str] = []
    limits = doc["limits"]
    stand = None
    try:
        probe = min(nbytes, PROBE_CAP)
        if probe + (16 * MIB if a.simcuda else GIB) <= free:
            log(f"storage: writing {fmt(probe)} to {root} ({fs}), fsynced")
            limits["storage_write"] = storage_write(run_dir, probe)
            log(f"storage: {limits['storage_write']['write_gb_s']:.2f} GB/s")
        else:
            put(limits, "storage_write", None, f"{fmt(probe)} would not fit in the {fmt(free)} free")
        log(f"{'simcuda device' if a.simcuda else 'GPU'}: {doc['device']}; {fmt(nbytes)} a job; paths {runnable}")
        try:
            stand = (SimStand if a.simcuda else GpuStand)(run_dir, size)
        except (RuntimeError, OSError) as exc:
            raise Failed(f"{'simcuda' if a.simcuda else 'the GPU job'} could not be set up: {exc}") from None
        own_limit = "gputrace" in runnable and not a.simcuda
        if a.simcuda:
            for k in ("d2h_gb_s", "h2d_gb_s"):
                put(limits, k, None, stand.limit_reason)
        for p in runnable:
            left_budget = a.budget_s - (time.monotonic() - t_start)
            allowed = min(a.timeout, left_budget)
            rec = doc["paths"][p]
            if left_budget < 5:
                rec["error"] = f"not run: {max(left_budget, 0):.0f} s of --budget-s {a.budget_s:.0f} were left"
                failures.append(f"{p}: {rec['error']}")
                continue
            t0 = time.monotonic()
            deadline = t0 + allowed
            signal.setitimer(signal.ITIMER_REAL, allowed)
            try:
                if p != "gputrace" and not a.simcuda and "d2h_gb_s" not in limits:
                    log("the pinned copy limit, in a process of its own (bench/full_job.py --limit)")
                    limits.update(stand.separate_limit(nbytes),
                                  measured_in="a process of its own (bench/full_job.py --limit), as "
                                              "bench/full_checkpoint_gpu.py does; best of 3 pinned copies")
                # Each path fills the document's record as it goes: a path that fails part way keeps
                # the figures it had (and the full path its job's log tail) beside its error.
                if p == "gputrace":
                    path_gputrace(stand, nbytes, run_dir, limits, own_limit, rec)
                elif p == "driver":
                    path_driver(stand, nbytes, run_dir, limits, rec)
                else:
                    path_full(stand, size, nbytes, run_dir, limits, deadline, rec)
                if not rec.get("data_ok"):
                    failures.append(f"{p}: the data did not check out after the restore ({rec.get('data_check')})")
            except PathTimeout:
                rec["error"] = f"timed out after {allowed:g} s (--timeout {a.timeout:g}, --budget-s {a.budget_s:g})"
                failures.append(f"{p}: {rec['error']}")
            except Exception as exc:  # one path's failure must not lose the others' figures
                rec["error"] = f"{type(exc).__name__}: {exc}"
                failures.append(f"{p}: {rec['error']}")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            rec["wall_s"] = time.monotonic() - t0
            for ck in ("gputrace-ck", "full-ck"):
                shutil.rmtree(run_dir / ck, ignore_errors=True)
            if "error" in rec:
                log(f"{p}: FAILED: {rec['error']}")
            else:
                w = rec.get("write_gb_s")
                log(f"{p}: freeze {rec['freeze_s']:.3f} s, back {rec['back_s']:.3f} s, "
                    f"{fmt(rec.get('bytes'))}, write {'n/a' if w is None else f'{w:.2f} GB/s'}, "
                    f"data {'ok' if rec['data_ok'] else 'DIFFERENT'} ({rec['wall_s']:.1f} s)")
        if not a.simcuda and "d2h_gb_s" not in limits:
            put(limits, "d2h_gb_s", None, "no path measured it")
            put(limits, "h2d_gb_s", None, "no path measured it")
    except (Failed, OSError) as exc:  # before any path: the storage probe, the simulated device
        failures.append(f"setup: {exc}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if stand is not None:
            stand.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    doc["wall_s"] = time.monotonic() - t_start
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if failures:
        doc["failures"], doc["complete"] = failures, False
        partial = a.out.with_name(a.out.name + ".partial")
        partial.write_text(json.dumps(doc, indent=1) + "\n")
        for f in failures:
            print(f"ckpt_costs: FAILED: {f}", file=sys.stderr, flush=True)
        print(f"ckpt_costs: no {a.out} written; what was measured is in {partial}", file=sys.stderr, flush=True)
        return 1
    write_json(a.out, doc)
    log(f"wrote {a.out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
