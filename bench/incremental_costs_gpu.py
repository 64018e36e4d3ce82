#!/usr/bin/env python3
"""What an incremental checkpoint and its restore cost beyond the freeze: for a job holding SIZE, a
whole checkpoint, then for each share changed (1%, 10%, 100% by default) an incremental checkpoint
`--since` the whole one and a restore of it, to disk and to tmpfs, beside a plain fsynced write and a
cold read of the same bytes on the same storage, and beside the driver's own checkpoint and restore
(cuCheckpointProcess*, `gputrace checkpoint --backend driver`) of the same job.

Per measurement: freeze_s (gate closed to gate open), durable_s (the checkpoint's start to its data,
manifest and directory fsynced and renamed), total_s, back_s (the restore's start to the job running
again with the data back), the bytes copied, stored and read, and whether the job's checksum after the
restore is the one it had at the checkpoint.  The targets they are held to (the issue's): an
incremental checkpoint's total within 0.3 s of changed bytes / the storage's write rate, its restore's
within 0.3 s of changed bytes / its read rate; `within_0_3s` says whether each was.

The job: bench/ckpt_job.py under `gputrace run --checkpointable` (a PyTorch process holding SIZE of
seeded tensors; `write OFF N` changes N bytes), on the GPU; simcuda's `pattern` workload here (sizes in
MiB; `touch` changes them).  The restore is `restore --device-only --force` of the incremental after
the same bytes were changed again (so exactly the changed chunks differ).

Suspend and resume (`--parts suspend`): the job started with `--suspendable` (its memory served through the
VMM API) and `$GPUTRACE_SHIM_PIN_CAP` raised to hold its image (the shim keeps a suspension's image mapped and
pinned between suspensions only within that cap), then `--cycles` times: data changed, `gputrace suspend`,
`gputrace resume`, the checksum compared.  Per cycle: each command's total and its copy (the bus's part), the
set-up (the image made and pinned: the first cycle only, where it was kept), the freeze, and whether suspend's
and resume's totals together are within 0.3 s of their copies (issue 42's done-when; the first cycle, which
makes the image, is reported apart).  `--prepare`: `gputrace suspend --prepare` first, while the job runs (the
image made ahead, its time recorded as `prepare`), so that the first cycle too should make nothing.

The write after the freeze (`--modes`, issue 42 part 3): `pipelined` (the default: the shim's pool
written out in batches while the batches before are hashed and written on two threads, the storage's
writeback started as it goes, one fsync) and `serial` (GPUTRACE_CKPT_PIPELINE=0: as before it, each
stage after the last), each with its own change, checkpoint and restore, and beside them a plain
fsynced write (and cold read) of the same stored bytes on the same storage, measured right after
(`plain_same`).  Per mode, `after_freeze_s` is the time to durable less the set-up and the freezes
(what the pipeline changes: the pool's growth before the freeze is paid by whichever mode comes first
at a new size of change, so compare that, or run the modes twice).  On simcuda the "device" copies are
host memcpy and the digests the CPU's, so the freezes are long and the copies no bus's.

OUT/incremental-costs.json is rewritten (tmp, then renamed) after every measurement, so a run ended by
its time limit keeps what it measured; --budget-s (default 480) stops starting new parts once passed.

On the GPU machine (one call of at most 9 minutes; the sizes and parts are flags):
    source bench/gpu-env.sh
    python3 bench/incremental_costs_gpu.py --sizes 4,16 --storage disk,tmpfs --out /tmp/inc-costs
    python3 bench/incremental_costs_gpu.py --parts suspend --sizes 16,4 --out /tmp/suspend-costs
    python3 bench/incremental_costs_gpu.py --parts suspend --prepare --sizes 16,4 --out /tmp/suspend-prepared
    python3 bench/incremental_costs_gpu.py --sizes 16 --storage disk,tmpfs --modes serial,pipelined --no-driver --out /tmp/pipe
Here (simcuda, sizes in MiB):
    .venv/bin/python bench/incremental_costs_gpu.py --simcuda --sizes 4,16 --out /tmp/inc-costs-sim
    .venv/bin/python bench/incremental_costs_gpu.py --simcuda --sizes 1024 --storage disk,tmpfs --changed 10,100 \
        --modes serial,pipelined,serial,pipelined --no-driver --out /tmp/pipe-sim
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import provenance  # noqa: E402
from job_protocol import Client  # noqa: E402

SCHEMA = "gputrace.bench.incremental_costs/1"
GIB, MIB = 1 << 30, 1 << 20
ROOTS = {"disk": Path("/var/tmp/gtinc"), "tmpfs": Path("/dev/shm/gtinc")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gputrace_argv() -> list[str]:
    exe = shutil.which("gputrace")
    return [exe] if exe else [sys.executable, "-m", "gputrace"]


def cli(*args: str, env_add: dict | None = None) -> dict:
    """A gputrace command with --json: its report, with wall_s; {"error": ...} where it failed."""
    t0 = time.monotonic()
    p = subprocess.run([*gputrace_argv(), *args, "--json"], capture_output=True, text=True,
                       env=dict(os.environ, **env_add) if env_add else None)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip()[-800:], "rc": p.returncode, "wall_s": wall}
    d = json.loads(p.stdout)
    d["wall_s"] = wall
    return d


class TorchJob(Client):
    """bench/ckpt_job.py under the shim."""

    def __init__(self, nbytes: int, env_add: dict | None = None) -> None:
        flags = ["--checkpointable"] + (["--suspendable"] if env_add and env_add.get("GPUTRACE_SHIM_VMM") else [])
        super().__init__([*gputrace_argv(), "run", *flags, "--", sys.executable, str(HERE / "ckpt_job.py")], env_add)
        self.pid = self.hello["pid"]
        self.cmd(f"hold {nbytes}")

    def change(self, n: int, rnd: int) -> None:
        self.cmd(f"write 0 {n}")  # adds 1 to each byte: changed again by the next call

    def checksum(self) -> str:
        return json.dumps(self.cmd("checksum")["checksum"])


class PatternJob:
    """simcuda's pattern workload (--plain: SIZE and SIZE/2 + 4 bytes) under the shim."""

    def __init__(self, nbytes: int, env_add: dict | None = None) -> None:
        from gputrace import shim, simcuda

        self.size = nbytes
        self.proc = subprocess.Popen(simcuda.workload("pattern") + ["--plain", "--size", str(nbytes)],
                                     env=dict(shim.preload_env(simcuda.env()), **(env_add or {})), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.ready = json.loads(self.proc.stdout.readline())

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def change(self, n: int, rnd: int) -> None:
        self.cmd(f"touch 0 0 {min(n, self.size)} {100 + rnd}")

    def checksum(self) -> str:
        return self.cmd("sum")["sum"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def plain_io(root: Path, nbytes: int) -> dict:
    """A plain write of `nbytes` fsynced, then read back cold (its pages dropped): the storage's own
    rates, on the same filesystem as the checkpoints."""
    f = root / "plain.bin"
    buf = os.urandom(1 << 20) * 8
    t0 = time.monotonic()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, memoryview(buf)[:min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    w = time.monotonic() - t0
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.monotonic()
        while os.read(fd, len(buf)):
            pass
        r = time.monotonic() - t0
    finally:
        os.close(fd)
        f.unlink()
    return {"bytes": nbytes, "write_s": w, "write_gb_s": nbytes / w / 1e9, "read_s": r,
            "read_gb_s": nbytes / r / 1e9 if r else None}


def s(ns) -> float | None:
    return ns / 1e9 if isinstance(ns, (int, float)) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,16", help="GiB a job holds, comma-separated (MiB with --simcuda)")
    ap.add_argument("--changed", default="1,10,100", help="percent of it changed, comma-separated")
    ap.add_argument("--storage", default="disk,tmpfs", help="disk, tmpfs or both")
    ap.add_argument("--parts", default="incremental", help="incremental, suspend or both, comma-separated")
    ap.add_argument("--cycles", type=int, default=4, help="suspend/resume cycles a size (the first makes the image)")
    ap.add_argument("--prepare", action="store_true",
                    help="--parts suspend: `gputrace suspend --prepare` before the first cycle, so that the image is "
                         "made while the job runs (timed apart) and no cycle makes it")
    ap.add_argument("--no-driver", action="store_true", help="leave out the driver's checkpoint of the job")
    ap.add_argument("--simcuda", action="store_true", help="simcuda instead of a GPU (sizes in MiB)")
    ap.add_argument("--modes", default="pipelined",
                    help="the write after the freeze, comma-separated, in this order for each change: pipelined, "
                         "serial (GPUTRACE_CKPT_PIPELINE=0); with more than one, a plain fsynced write of the same "
                         "bytes is measured beside them")
    ap.add_argument("--budget-s", type=float, default=480, help="start no new part after this many seconds")
    ap.add_argument("--out", type=Path, required=True, help="directory for incremental-costs.json")
    a = ap.parse_args()
    unit = MIB if a.simcuda else GIB
    sizes = [int(x) for x in a.sizes.split(",")]
    pcts = [float(x) for x in a.changed.split(",")]
    storages = [x for x in a.storage.split(",") if x]
    for st in storages:
        if st not in ROOTS:
            ap.error(f"--storage {st}: disk or tmpfs")
    modes = [x for x in a.modes.split(",") if x]
    for x in modes:
        if x not in MODES:
            ap.error(f"--modes {x}: pipelined or serial")
    parts = [x for x in a.parts.split(",") if x]
    for x in parts:
        if x not in ("incremental", "suspend"):
            ap.error(f"--parts {x}: incremental or suspend")
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    doc = {"schema": SCHEMA, "command": "python3 bench/incremental_costs_gpu.py " + " ".join(sys.argv[1:]),
           "simcuda": a.simcuda, "unit": "MiB" if a.simcuda else "GiB", "started_unix": time.time(),
           "commit": provenance.commit(),
           "device": None, "parts": []}
    try:
        doc["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip() or None
    except OSError:
        pass
    if a.simcuda:
        doc["device"] = "simcuda"

    def save() -> None:
        doc["wall_s"] = time.monotonic() - t_start
        tmp = a.out / "incremental-costs.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.rename(a.out / "incremental-costs.json")

    def over() -> bool:
        if time.monotonic() - t_start > a.budget_s:
            doc["stopped"] = f"--budget-s {a.budget_s} passed"
            return True
        return False

    for size in sizes if "suspend" in parts else []:
        if over():
            break
        part = {"size": size, "size_bytes": size * unit}
        doc.setdefault("suspend", []).append(part)
        try:
            suspend_part(part, size * unit, a, save)
        except Exception as exc:  # noqa: BLE001 (recorded; the next size runs)
            part["error"] = f"{type(exc).__name__}: {exc}"
            log(part["error"])
        save()
    for size in sizes if "incremental" in parts else []:
        nbytes = size * unit
        for st in storages:
            if over():
                break
            root = Path(tempfile.mkdtemp(prefix=f"{size}-", dir=_root(st, a.simcuda)))
            part = {"size": size, "size_bytes": nbytes, "storage": st, "root": str(root), "changes": []}
            doc["parts"].append(part)
            job = None
            try:
                log(f"{size} {doc['unit']} to {st}: plain write and read")
                part["plain"] = plain_io(root, max(nbytes // 10, 64 * MIB if not a.simcuda else MIB))
                job = (PatternJob if a.simcuda else TorchJob)(nbytes)
                base = root / "base"
                log("whole checkpoint")
                part["whole"] = cli("checkpoint", "-p", str(job.pid), "-o", str(base))
                save()
                for i, pct in enumerate(pcts):
                    if over() or "error" in part["whole"]:
                        break
                    n = max(4096, int(nbytes * pct / 100))
                    c = {"pct": pct, "changed_bytes": n}
                    for k, mode in enumerate(modes):
                        run = measure_change(job, root, part, n, 2 * (i * len(modes) + k), i, mode, log)
                        if k == 0:
                            c.update(run)  # the first mode's, where a single-mode run has always put them
                        if len(modes) > 1:
                            c.setdefault("modes", []).append(run)
                        save()
                    if len(modes) > 1 and any("summary" in r for r in c["modes"]):
                        stored = max(r["checkpoint"].get("stored_bytes", 0) for r in c["modes"])
                        c["plain_same"] = plain_io(root, stored)
                        for r in c["modes"]:
                            if "summary" in r:
                                r["summary"]["plain_same_write_s"] = c["plain_same"]["write_s"]
                                r["summary"]["over_plain_write_s"] = r["summary"]["total_s"] - c["plain_same"]["write_s"]
                    part["changes"].append(c)
                    save()
                if not a.no_driver and not over():
                    log("the driver's checkpoint and restore of the same job")
                    before = job.checksum()
                    part["driver"] = cli("checkpoint", "-p", str(job.pid), "--backend", "driver")
                    part["driver"]["data_right"] = job.checksum() == before
                    save()
            except Exception as exc:  # noqa: BLE001 (recorded; the next part runs)
                part["error"] = f"{type(exc).__name__}: {exc}"
                log(part["error"])
            finally:
                if job is not None:
                    job.close()
                shutil.rmtree(root, ignore_errors=True)
                save()
    save()
    print(summary(doc))
    return 0


def suspend_part(part: dict, nbytes: int, a: argparse.Namespace, save) -> None:
    """--cycles suspend/resume cycles of a job holding `nbytes`, its pin cap raised to keep the image."""
    cap = nbytes + nbytes // 4 + (2 * GIB if not a.simcuda else 64 * MIB)
    env = {"GPUTRACE_SHIM_VMM": "1", "GPUTRACE_SHIM_PIN_CAP": str(cap)}
    part["pin_cap"] = cap
    part["cycles"] = []
    log(f"{part['size']} {'MiB' if a.simcuda else 'GiB'}: suspend and resume, {a.cycles} cycles")
    job = (PatternJob if a.simcuda else TorchJob)(nbytes, env)
    try:
        if a.prepare:  # the image made ahead, while the job runs: no cycle should make it
            pr = cli("suspend", "--prepare", "-p", str(job.pid))
            part["prepare"] = pr
            part["prepare_summary"] = {"setup_s": s(pr.get("setup_ns")), "total_s": s(pr.get("total_ns")),
                                       "image_bytes": pr.get("image_bytes"), "made": pr.get("made")}
            save()
        for i in range(a.cycles):
            job.change(nbytes, 40 + i)  # every byte: what the copies carry is the same either way
            want = job.checksum()
            sp = cli("suspend", "-p", str(job.pid))
            rs = cli("resume", "-p", str(job.pid))
            c = {"cycle": i, "suspend": sp, "resume": rs, "data_right": job.checksum() == want}
            if "error" not in sp and "error" not in rs:
                copies = sp["copy_ns"] + rs["copy_ns"]
                total = sp["total_ns"] + rs["total_ns"]
                c["summary"] = {
                    "suspend_total_s": s(sp["total_ns"]), "suspend_copy_s": s(sp["copy_ns"]),
                    "suspend_setup_s": s(sp.get("setup_ns")), "suspend_freeze_s": s(sp.get("freeze_ns")),
                    "release_s": s(sp["release_ns"]), "resume_total_s": s(rs["total_ns"]),
                    "resume_copy_s": s(rs["copy_ns"]), "remap_s": s(rs["remap_ns"]),
                    "image_kept": sp.get("image_kept"), "image_allocs": sp.get("image_allocs"),
                    "resume_kept": rs.get("image_kept"), "bytes": sp["bytes"], "reserved_bytes": sp["reserved_bytes"],
                    "total_s": s(total), "copies_s": s(copies), "over_copies_s": s(total - copies),
                    "within_0_3s": total - copies <= 0.3e9}
            part["cycles"].append(c)
            save()
    finally:
        job.close()


MODES = {"pipelined": {"GPUTRACE_CKPT_PIPELINE": "1"}, "serial": {"GPUTRACE_CKPT_PIPELINE": "0"}}


def measure_change(job, root: Path, part: dict, n: int, rnd: int, i: int, mode: str, log) -> dict:
    """`n` bytes of the job changed, an incremental checkpoint since the whole one and its restore, the
    write after the freeze done the `mode` way: the reports, whether the data came back right, the summary."""
    base = root / "base"
    job.change(n, rnd)
    want = job.checksum()
    d = root / f"inc-{i}-{mode}"
    log(f"{n} bytes changed: incremental checkpoint ({mode})")
    ck = cli("checkpoint", "-p", str(job.pid), "-o", str(d), "--since", str(base), env_add=MODES[mode])
    job.change(n, rnd + 1)  # the same bytes changed again: exactly those differ
    log(f"{n} bytes changed: restore ({mode})")
    rs = cli("restore", "-p", str(job.pid), str(d), "--device-only", "--force", env_add=MODES[mode])
    ok = job.checksum() == want
    c = {"mode": mode, "checkpoint": ck, "restore": rs, "data_right": ok}
    if "error" not in ck and "error" not in rs:
        wr, rd = part["plain"]["write_gb_s"], part["plain"]["read_gb_s"]
        c["summary"] = {
            "mode": mode,
            "freeze_s": s(ck["freeze_ns"]), "durable_s": s(ck["durable_ns"]),
            "total_s": s(ck["total_ns"]), "bytes_copied": ck["bytes_copied"],
            "stored_bytes": ck["stored_bytes"], "setup_s": s(ck.get("setup_ns")),
            # the time to durable after the set-up and the freezes: the write the pipeline overlaps
            "after_freeze_s": s(ck["durable_ns"] - ck.get("setup_ns", 0) - ck["freeze_ns"] -
                                ck.get("aborted_freeze_ns", 0)),
            "writeback_s": s(ck.get("writeback_ns", 0)), "write_s": s(ck["write_ns"]), "fsync_s": s(ck["fsync_ns"]),
            "hash_s": s(ck.get("hash_ns", 0)), "io_s": s(ck.get("io_ns", 0)),
            "streamed_bytes": ck.get("streamed_bytes"), "writeback_batches": ck.get("writeback_batches"),
            "hashed_during_writeback_bytes": ck.get("hashed_during_writeback_bytes"),
            "restore_freeze_s": s(rs["freeze_ns"]), "back_s": s(rs["total_ns"]), "verify_s": s(rs["verify_ns"]),
            "bytes_read": rs.get("bytes_read"), "restore_bytes_copied": rs["bytes_copied"],
            # where the shim copied (pool, image, staging), how much through staging under
            # the gate, and the freezes before the last that found more changed than planned
            "plan": ck.get("plan"), "attempts": ck.get("attempts", 1),
            "aborted_freeze_s": s(ck.get("aborted_freeze_ns", 0)),
            "staging_copied_bytes": ck.get("staging_copied_bytes"),
            "restore_plan": rs.get("plan"), "restore_setup_s": s(rs.get("setup_ns", 0)),
            "restore_staging_copied_bytes": rs.get("staging_copied_bytes"),
            "target_checkpoint_s": ck["stored_bytes"] / (wr * 1e9),
            "target_restore_s": rs.get("bytes_read", 0) / (rd * 1e9) if rd else None,
        }
        sm = c["summary"]
        sm["within_0_3s"] = {
            "checkpoint": sm["total_s"] <= sm["target_checkpoint_s"] + 0.3,
            "restore": sm["target_restore_s"] is not None and
            sm["back_s"] <= sm["target_restore_s"] + 0.3}
    shutil.rmtree(d, ignore_errors=True)
    return c


def _root(storage: str, sim: bool) -> Path:
    r = ROOTS[storage]
    r.mkdir(parents=True, exist_ok=True)
    return r


def summary(doc: dict) -> str:
    out = [f"incremental checkpoint costs on {doc['device']} ({doc['command']})",
           "size storage changed | freeze durable total (target) | restore freeze back (target) | "
           "copied stored read | right"]
    for p in doc.get("suspend", []):
        if "prepare" in p:
            pr, ps = p["prepare"], p["prepare_summary"]
            out.append(f"{p['size']}{doc['unit']} suspend --prepare: failed: {pr['error']}" if "error" in pr else
                       f"{p['size']}{doc['unit']} suspend --prepare | {ps['image_bytes']} bytes pinned in "
                       f"{ps['setup_s']:.3f} s ({ps['total_s']:.3f} s in all), job running")
        for c in p.get("cycles", []):
            sm = c.get("summary")
            if not sm:
                out.append(f"{p['size']}{doc['unit']} suspend cycle {c['cycle']}: failed: "
                           f"{c['suspend'].get('error') or c['resume'].get('error')}")
                continue
            out.append(f"{p['size']}{doc['unit']} suspend cycle {c['cycle']} | suspend {sm['suspend_total_s']:.3f} "
                       f"(copy {sm['suspend_copy_s']:.3f}, setup {sm['suspend_setup_s']:.3f}, kept {sm['image_kept']}, "
                       f"made {sm['image_allocs']}) | resume {sm['resume_total_s']:.3f} (copy {sm['resume_copy_s']:.3f}) | "
                       f"over the copies {sm['over_copies_s']:.3f} s, within 0.3 s {sm['within_0_3s']} | "
                       f"right {c['data_right']}")
        if "error" in p:
            out.append(f"{p['size']}{doc['unit']} suspend: {p['error']}")
    for p in doc["parts"]:
        for c in p["changes"]:
            if len(c.get("modes", [])) > 1:
                ps = c.get("plain_same", {})
                out.append(f"{p['size']}{doc['unit']} {p['storage']} {c['pct']}% | plain fsynced write of "
                           f"{ps.get('bytes')} bytes: {ps.get('write_s', float('nan')):.3f} s")
                for r in c["modes"]:
                    sm = r.get("summary")
                    if not sm:
                        out.append(f"    {r['mode']}: failed: {r['checkpoint'].get('error') or r['restore'].get('error')}")
                        continue
                    out.append(f"    {r['mode']:9} total {sm['total_s']:.3f} durable {sm['durable_s']:.3f} (setup "
                               f"{sm['setup_s']:.3f}, freezes {sm['freeze_s'] + sm['aborted_freeze_s']:.3f}, after "
                               f"them {sm['after_freeze_s']:.3f}: shim writeback {sm['writeback_s']:.3f}, write "
                               f"{sm['write_s']:.3f} of which fsync {sm['fsync_s']:.3f}) | over the plain write "
                               f"{sm['over_plain_write_s']:+.3f} s | restore {sm['back_s']:.3f} (verify "
                               f"{sm['verify_s']:.3f}) | right {r['data_right']}")
                continue
            sm = c.get("summary")
            if not sm:
                out.append(f"{p['size']}{doc['unit']} {p['storage']} {c['pct']}%: failed: "
                           f"{c['checkpoint'].get('error') or c['restore'].get('error')}")
                continue
            out.append(f"{p['size']}{doc['unit']} {p['storage']} {c['pct']}% | {sm['freeze_s']:.4f} "
                       f"{sm['durable_s']:.3f} {sm['total_s']:.3f} ({sm['target_checkpoint_s']:.3f}) | "
                       f"{sm['restore_freeze_s']:.4f} {sm['back_s']:.3f} "
                       f"({sm['target_restore_s'] if sm['target_restore_s'] is None else round(sm['target_restore_s'], 3)}) | "
                       f"{sm['bytes_copied']} {sm['stored_bytes']} {sm['bytes_read']} | {c['data_right']} | "
                       f"plan {sm.get('plan')}/{sm.get('restore_plan')}, freezes {sm.get('attempts')} "
                       f"(before the last {sm.get('aborted_freeze_s')} s), staging "
                       f"{sm.get('staging_copied_bytes')}/{sm.get('restore_staging_copied_bytes')}")
        if "driver" in p:
            d = p["driver"]
            out.append(f"{p['size']}{doc['unit']} driver: " + (d.get("error", "")[:200] if "error" in d else
                       f"freeze {s(d.get('freeze_ns'))} s, wall {d['wall_s']:.3f} s, right {d.get('data_right')}"))
        if "error" in p:
            out.append(f"{p['size']}{doc['unit']} {p['storage']}: {p['error']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
