"""checkpoint() and restore(): a shimmed process's device memory to a directory and back.

Checkpoint: the shim closes the gate, synchronizes, copies every allocation into a memfd this
process passes it (pinned staging, several lanes), reopens the gate and replies; only then are the
data hashed and written to disk, while the job runs on.  The freeze is the shim's part alone.

Restore: the manifest and every chunk's checksum are checked while copying the data into a memfd,
and the allocations compared with the live ones, before anything is asked of the process; the shim
then checks the allocations again under the closed gate (the process may have changed meanwhile),
copies the data back and reopens the gate.  A failed check changes nothing in the process.

One operation per process at a time: a lock file beside the shim's socket (flock, released when the
holder exits however it exits).
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gputrace.errors import (CheckpointBusy, CheckpointError, CheckpointMismatch, CorruptCheckpoint, ShimUnavailable,
                             TargetLost)
from gputrace.shim import client

from . import image, store

DEFAULT_LANES = 4
DEFAULT_CHUNK = 8 << 20


@dataclass(frozen=True)
class CheckpointReport:
    path: str
    pid: int
    allocations: int
    bytes: int
    image_bytes: int
    drain_ns: int
    sync_ns: int
    copy_ns: int
    freeze_ns: int  # gate closed to gate open
    write_ns: int  # hashing and writing, after the gate reopened
    total_ns: int
    direct: bool = False  # the copies went straight into the registered image (no staging)

    @property
    def copy_gbps(self) -> float:
        return self.bytes / self.copy_ns if self.copy_ns else 0.0

    @property
    def write_gbps(self) -> float:
        return self.image_bytes / self.write_ns if self.write_ns else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "copy_gbps": self.copy_gbps, "write_gbps": self.write_gbps}


@dataclass(frozen=True)
class RestoreReport:
    path: str
    pid: int
    allocations: int
    bytes: int
    verify_ns: int  # reading and checking the checkpoint, before the process is touched
    drain_ns: int
    sync_ns: int
    copy_ns: int
    freeze_ns: int
    total_ns: int
    direct: bool = False

    @property
    def verify_gbps(self) -> float:
        return self.bytes / self.verify_ns if self.verify_ns else 0.0

    @property
    def copy_gbps(self) -> float:
        return self.bytes / self.copy_ns if self.copy_ns else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "verify_gbps": self.verify_gbps, "copy_gbps": self.copy_gbps}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child, not yet reaped) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class _Session:
    """A connection to the target's shim holding the per-process operation lock."""

    def __init__(self, pid: int, what: str) -> None:
        self.pid, self.what = pid, what
        self.conn = client.Connection(pid)
        lock_path = self.conn.path.with_name(f"shim-{pid}.lock")
        self.lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise CheckpointBusy(f"another checkpoint or restore of process {pid} is in progress",
                                 "wait for it to finish, then try again") from None

    def request(self, command: str, fd: int | None = None, timeout_s: float | None = None) -> dict:
        try:
            return self.conn.request(command, fd=fd, timeout_s=timeout_s)
        except ShimUnavailable as exc:
            if not _alive(self.pid):
                raise TargetLost(f"process {self.pid} exited during the {self.what}",
                                 f"nothing was {'kept' if self.what == 'checkpoint' else 'restored'}") from None
            raise TargetLost(f"{exc.msg} during the {self.what}", exc.hint) from None

    def close(self) -> None:
        self.conn.close()
        os.close(self.lock_fd)

    def __enter__(self) -> "_Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shim_failure(reply: dict, pid: int, what: str) -> CheckpointError:
    err = str(reply.get("error", "unknown error"))
    detail = reply.get("detail")
    msg = f"the shim of process {pid} could not {what}: {err}" + (f" ({detail})" if detail else "")
    if err in ("busy", "already paused"):
        return CheckpointBusy(msg, "the job is running as before; try again (a `pause` held elsewhere must end first)")
    if err == "copy failed" and what.startswith("restore"):
        return CheckpointError(msg, "the job runs again, but its device memory may be partly restored: "
                                    "restore again before relying on it")
    return CheckpointError(msg, "the job's gate is open again and its memory unchanged by this attempt")


def _copy_timeout(nbytes: int) -> float:
    return 120.0 + nbytes / 100e6  # generous: at worst 100 MB/s, whatever the bus


def checkpoint(pid: int, out: Path | str | None = None, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK,
               timeout_ms: int = 5000, direct: bool = True, progress: store.Progress | None = None) -> CheckpointReport:
    """Checkpoints the device memory of shimmed process `pid` into the new directory `out` (default
    ./gputrace-ckpt-PID-TIME).  `progress(phase, done, total)` is called with phase "freeze" (once,
    before the gate closes) and "write" (per chunk written).  `direct`: the shim maps and pins the image
    before the freeze and the copies go straight into it (no staging, no CPU copy: on an H200 this
    is what makes the freeze the bus's time, see bench/results/checkpoint-h200.md); where the driver
    cannot pin it, the staging path is used and the report says direct=False.  direct=False: the
    staging path (pinned buffers per lane, then a CPU copy into the image)."""
    t0 = time.monotonic_ns()
    out = Path(out) if out is not None else Path.cwd() / f"gputrace-ckpt-{pid}-{time.strftime('%Y%m%dT%H%M%S')}"
    out = out.absolute()
    store.check_target(out)
    with _Session(pid, "checkpoint") as s:
        status = s.request("status")
        held = sum(size for _, size, _ in image.saved_allocations(status))
        memfd = os.memfd_create(f"gputrace-ckpt-{pid}", os.MFD_CLOEXEC)
        try:
            if progress:
                progress("freeze", 0, held)
            r = s.request(f"dump lanes={lanes} chunk={chunk} timeout={timeout_ms} direct={int(direct)}", fd=memfd,
                          timeout_s=_copy_timeout(held))
            if not r.get("ok"):
                raise _shim_failure(r, pid, "dump its device memory")
            nbytes = os.fstat(memfd).st_size
            if nbytes != r["image_bytes"]:
                raise CheckpointError(f"the image is {nbytes} bytes, the shim said {r['image_bytes']}",
                                      "this is a bug; nothing was kept")
            hdr, manifest = manifest_of(pid, status, r, memfd, nbytes)
            m = store.write(out, memfd, nbytes, manifest, progress)
        finally:
            os.close(memfd)
    t = m["timings"]
    return CheckpointReport(str(out), pid, len(hdr.entries), r["bytes"], nbytes, t["drain_ns"], t["sync_ns"],
                            t["copy_ns"], t["freeze_ns"], t["write_ns"], time.monotonic_ns() - t0, r.get("direct", False))


def manifest_of(pid: int, status: dict, r: dict, memfd: int, nbytes: int) -> tuple[image.Header, dict]:
    """The image's header and the manifest for it, from the shim's status and its dump (or suspend) reply."""
    hdr = image.parse(os.pread(memfd, min(nbytes, 64 + 32 * r["allocations"] + 4096), 0))
    manifest = {
        "schema": store.SCHEMA, "format": store.FORMAT, "complete": True, "created_unix": time.time(),
        "host": os.uname().nodename, "target": {"pid": pid, "comm": client.comm(pid)},
        "driver": {"path": status.get("driver", ""), "version": r.get("driver_version", 0)},
        "devices": r.get("devices", []),
        "registry": status.get("totals", {}),
        "allocations": [{"base": e.base, "size": e.size, "device": e.device, "kind": e.kind, "offset": e.offset}
                        for e in hdr.entries],
        "bytes": r["bytes"],
        "timings": {k: r[k] for k in ("setup_ns", "drain_ns", "sync_ns", "copy_ns", "freeze_ns")},
        "shim": {"lanes": r["lanes"], "chunk": r["chunk"], "direct": r.get("direct", False),
                 "skipped_unmapped_vmm": r.get("skipped", 0)},
    }
    return hdr, manifest


def _describe(diffs: list[str], total: int) -> str:
    more = f" and {total - len(diffs)} more" if total > len(diffs) else ""
    return "; ".join(diffs) + more


def compare(manifest: dict, status: dict) -> list[str]:
    """What differs between the checkpoint's allocations and the ones the process holds."""
    want = {a["base"]: (a["size"], a["device"]) for a in manifest["allocations"]}
    have = {base: (size, dev) for base, size, dev in image.saved_allocations(status)}
    out = []
    for base in sorted(want.keys() | have.keys()):
        w, h = want.get(base), have.get(base)
        if h is None:
            out.append(f"{w[0]} bytes at {base:#x} are in the checkpoint but not in the process")
        elif w is None:
            out.append(f"the process holds {h[0]} bytes at {base:#x} that the checkpoint lacks")
        elif w != h:
            out.append(f"at {base:#x} the checkpoint has {w[0]} bytes on device {w[1]}, the process {h[0]} on device {h[1]}")
    return out


def _mismatch(pid: int, path: Path, diffs: list[str]) -> CheckpointMismatch:
    return CheckpointMismatch(
        f"{path} does not match what process {pid} holds: {_describe(diffs[:4], len(diffs))}",
        "restore into the process the checkpoint was taken of, holding the same allocations; it was not touched")


def restore(pid: int, path: Path | str, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK,
            timeout_ms: int = 5000, direct: bool = True, progress: store.Progress | None = None) -> RestoreReport:
    """Rolls the device memory of shimmed process `pid` back to the checkpoint in `path`.
    `progress(phase, done, total)`: "verify" per chunk checked, "freeze" once before the gate closes."""
    t0 = time.monotonic_ns()
    path = Path(path).absolute()
    manifest = store.read_manifest(path)
    with _Session(pid, "restore") as s:
        diffs = compare(manifest, s.request("status"))
        if diffs:
            raise _mismatch(pid, path, diffs)
        memfd = os.memfd_create(f"gputrace-restore-{pid}", os.MFD_CLOEXEC)
        try:
            tv = time.monotonic_ns()
            nbytes = store.verified_copy(path, manifest, memfd, progress)
            try:
                hdr = image.parse(os.pread(memfd, min(nbytes, 1 << 24), 0))
            except image.BadImage as exc:
                raise CorruptCheckpoint(f"{path / store.DATA}: {exc}", "take a new checkpoint") from None
            if [(e.base, e.size) for e in hdr.entries] != [(a["base"], a["size"]) for a in manifest["allocations"]]:
                raise CorruptCheckpoint(f"{path / store.DATA} and its manifest list different allocations",
                                        "the checkpoint is inconsistent; take a new one")
            verify_ns = time.monotonic_ns() - tv
            if progress:
                progress("freeze", 0, manifest["bytes"])
            r = s.request(f"restore lanes={lanes} chunk={chunk} timeout={timeout_ms} direct={int(direct)}", fd=memfd,
                          timeout_s=_copy_timeout(nbytes))
        finally:
            os.close(memfd)
        if not r.get("ok"):
            if r.get("error") == "mismatch":
                d = [f"{x['what']} allocation at {x['base']:#x} (checkpoint {x['checkpoint_size']} bytes, "
                     f"live {x['live_size']})" for x in r.get("differences", [])]
                raise _mismatch(pid, path, d or ["its allocations changed"])
            raise _shim_failure(r, pid, "restore its device memory")
    return RestoreReport(str(path), pid, r["allocations"], r["bytes"], verify_ns, r["drain_ns"], r["sync_ns"],
                         r["copy_ns"], r["freeze_ns"], time.monotonic_ns() - t0, r.get("direct", False))
