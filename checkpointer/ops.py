"""checkpoint() and restore(): a shimmed process's device memory to a directory and back.

Checkpoint: the shim closes the gate, synchronizes, copies every allocation into a memfd this
process passes it (pinned staging, several lanes), reopens the gate and replies; only then are the
data hashed and written to disk, while the job runs on.  The freeze is the shim's part alone.
Chunks the shim copied into its kept pool (an incremental checkpoint's) reach the memfd after the
reply, a batch at each `writeback` command (a streamed dump), while this process hashes and writes
the batches before them (store.write's two threads): the write after the freeze is one pipeline,
shim's copy, hashing, writing and the storage's own writeback overlapped, with one fsync at the end.
GPUTRACE_CKPT_PIPELINE=0 takes the serial way instead (all written by the shim before its reply, then
hashed and written in turn, then fsynced), for bench/incremental_costs_gpu.py to compare.

Restore: the manifest and every chunk's checksum are checked while copying the data into a memfd,
and the allocations compared with the live ones, before anything is asked of the process; the shim
then checks the allocations again under the closed gate (the process may have changed meanwhile),
copies the data back and reopens the gate.  A failed check changes nothing in the process.

One operation per process at a time: a lock file beside the shim's socket (flock, released when the
holder exits however it exits).
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gputrace.base.errors import (CheckpointBusy, CheckpointError, CheckpointMismatch, CorruptCheckpoint, ShimUnavailable,
                             TargetLost, Untrusted)
from gputrace.base.procs import alive, boot_id, comm, require_running, start_time
from gputrace.shim import client

from . import chain, digest, image, store

DEFAULT_LANES = 4
DEFAULT_CHUNK = 8 << 20
WRITEBACK_BATCH = 64 << 20  # a streamed dump's chunks asked of the shim at a time
READERS = 4  # a selective restore's chunks read and checked at once


def pipelined() -> bool:
    """Whether a checkpoint's write is the pipeline (default) or the serial way (GPUTRACE_CKPT_PIPELINE=0)."""
    return os.environ.get("GPUTRACE_CKPT_PIPELINE", "1") != "0"


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
    digest_ns: int = 0    # hashing the device memory on the device, inside the freeze
    chunks: int = 0       # digests taken (0: none; then digest_why says why, where they were wanted)
    chunks_copied: int = 0
    bytes_copied: int = 0  # device memory copied out: all of it, or the chunks that changed since `parent`
    stored_bytes: int = 0  # written to the directory (the image, or a link's head and changed chunks)
    parent: str | None = None  # the checkpoint this one holds only the changes since
    digest_why: str | None = None
    durable_ns: int = 0    # from the call to data, manifest and directory fsynced and renamed into place
    fsync_ns: int = 0      # ... of which waiting for fsync
    setup_ns: int = 0      # the shim's preparation before the gate closed (pinning, the digest kernel)
    writeback_ns: int = 0  # the shim writing chunks kept in its pinned pool into the image, gate open
    kept_pinned_bytes: int = 0  # the shim's pinned pool, kept for the job's next checkpoints
    plan: str | None = None  # where the copies went under the gate: "pool" (kept, pinned), "image" (mapped and
    #                          pinned for this checkpoint), "staging" (lanes' buffers, written under the gate)
    staging_copied_bytes: int = 0  # ... of which through the lanes' staging buffers, under the gate
    attempts: int = 1  # tries: more than one where the changes outgrew the pool, or the job's allocations overtook the plan
    aborted_freeze_ns: int = 0  # the freezes before the last, ended without a copy (freeze_ns is the last's)
    # The write after the freeze (store.write): pipelined (hashing and writing on two threads, the storage's
    # writeback started as it goes, one fsync at the end) or serial (GPUTRACE_CKPT_PIPELINE=0).
    pipelined: bool = True
    streamed_bytes: int = 0     # of what the shim wrote from its pool after the reply (writeback_ns), in batches
    writeback_batches: int = 0  # ... asked for while the batches before them were hashed and written
    hash_ns: int = 0            # the hashing thread busy
    io_ns: int = 0              # the writing thread busy
    # Bytes whose hashing (writing) began before the shim had written the last streamed batch: the
    # overlap, from both sides' CLOCK_MONOTONIC times (0 where nothing was streamed)
    hashed_during_writeback_bytes: int = 0
    written_during_writeback_bytes: int = 0

    @property
    def copy_gbps(self) -> float | None:
        """None where nothing was copied: no rate was measured."""
        return self.bytes_copied / self.copy_ns if self.copy_ns and self.bytes_copied else None

    @property
    def write_gbps(self) -> float | None:
        return self.stored_bytes / self.write_ns if self.write_ns else None

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
    digest_ns: int = 0    # hashing the live device memory on the device, inside the freeze
    chunks: int = 0       # chunks compared (0: none compared, everything copied; digest_why says why)
    chunks_copied: int = 0  # ... of which differed from the checkpoint and were copied back
    bytes_copied: int = 0
    links: int = 1        # checkpoints read: this one and the earlier links of its chain
    digest_why: str | None = None
    verified: str = "all"  # "used": the manifests, heads and chunks copied; "all": every byte of the chain
    bytes_read: int = 0    # of the chain's data files
    prepass_ns: int = 0    # the live memory's digests taken before reading (gate closed for the kernel alone)
    verify_why: str | None = None  # why every byte was read, where fewer were asked for
    setup_ns: int = 0      # the shim's preparation before the gate closed (the chunks read into its pool)
    plan: str | None = None  # where the copies came from under the gate (CheckpointReport.plan)
    staging_copied_bytes: int = 0  # ... through the lanes' staging buffers, read under the gate

    @property
    def verify_gbps(self) -> float:
        """What was read of the checkpoint, over the time reading and checking it took."""
        return self.bytes_read / self.verify_ns if self.verify_ns else 0.0

    @property
    def copy_gbps(self) -> float | None:
        """None where nothing differed and nothing was copied: no rate was measured."""
        return self.bytes_copied / self.copy_ns if self.copy_ns and self.bytes_copied else None

    def to_dict(self) -> dict:
        return {**asdict(self), "verify_gbps": self.verify_gbps, "copy_gbps": self.copy_gbps}


def _open_lock(conn: client.Connection, pid: int) -> int:
    """The per-process lock file beside the shim's socket, opened relative to the socket directory's
    checked descriptor, never through a symbolic link, and only if it is a plain file of the job's
    user or of ours: this process may be root, and the directory is the job's user's."""
    name = f"shim-{pid}.lock"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600,
                     dir_fd=conn.dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(f"{conn.path.with_name(name)} is a symbolic link: refusing to open it",
                            "the lock file is made by gputrace itself; remove the link and try again") from None
        raise CheckpointError(f"cannot open the lock file {conn.path.with_name(name)}: {exc.strerror}",
                              "check that directory's permissions") from None
    st = os.fstat(fd)
    owners = {os.geteuid(), client.euid(pid)}
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid not in owners:
        os.close(fd)
        raise Untrusted(f"{conn.path.with_name(name)} is not a lock file gputrace made (not a plain file of the job's "
                        "user with one link): refusing it", "remove it and try again")
    return fd


class ShimSession:
    """A connection to the target's shim holding the per-process operation lock."""

    def __init__(self, pid: int, what: str) -> None:
        self.pid, self.what = pid, what
        require_running(pid, what)
        self.conn = client.Connection(pid)
        self.lock_fd = -1
        try:
            self.lock_fd = _open_lock(self.conn, pid)
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise CheckpointBusy(f"another checkpoint or restore of process {pid} is in progress",
                                 "wait for it to finish, then try again") from None
        except BaseException:
            self.close()
            raise

    def request(self, command: str, fd: int | None = None, timeout_s: float | None = None) -> dict:
        try:
            return self.conn.request(command, fd=fd, timeout_s=timeout_s)
        except ShimUnavailable as exc:
            if not alive(self.pid):
                raise TargetLost(f"process {self.pid} exited during the {self.what}",
                                 f"nothing was {'kept' if self.what == 'checkpoint' else 'restored'}") from None
            raise TargetLost(f"{exc.msg} during the {self.what}", exc.hint) from None

    def close(self) -> None:
        self.conn.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def __enter__(self) -> "ShimSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shim_failure(reply: dict, pid: int, what: str) -> CheckpointError:
    err = str(reply.get("error", "unknown error"))
    detail = reply.get("detail")
    msg = f"the shim of process {pid} could not {what}: {err}" + (f" ({detail})" if detail else "")
    if err in ("busy", "already paused"):
        return CheckpointBusy(msg, "the job is running as before; try again (a `pause` held elsewhere must end first)")
    if err == "suspended":
        return CheckpointError(f"process {pid} is suspended: its device memory is off the GPU, so it cannot {what}",
                               f"bring it back first with `gputrace resume -p {pid}`; the job stays suspended, unchanged")
    if err == "unsupported" and detail and "does not carry" in str(detail):
        return CheckpointError(msg, "the job runs on, untouched; free that memory first, or checkpoint through NVIDIA's "
                                    f"driver, which carries all of it: `gputrace checkpoint --backend driver -p {pid}` "
                                    f"(in the process) or `gputrace checkpoint --full -p {pid}` (the whole job)")
    if err == "copy failed" and what.startswith("restore"):
        return CheckpointError(msg, "the job runs again, but its device memory may be partly restored: "
                                    "restore again before relying on it")
    return CheckpointError(msg, "the job's gate is open again and its memory unchanged by this attempt")


def _refuse_suspended(status: dict, pid: int, what: str) -> None:
    if status.get("suspended"):
        raise shim_failure({"error": "suspended"}, pid, what)


def copy_timeout(nbytes: int) -> float:
    return 120.0 + nbytes / 100e6  # generous: at worst 100 MB/s, whatever the bus


BUSY_TRIES = 3  # a plan overtaken by the job's allocations: tried again, the last time through staging


def overtaken(r: dict) -> bool:
    """Whether the shim refused because the job allocated between the plan (made while it ran) and the
    freeze: the image mapped for the plan is too small for what the gate closed on. Nothing was copied
    and the gate is open again."""
    return r.get("error") == "busy" and "allocated device memory meanwhile" in str(r.get("detail", ""))


def checkpoint(pid: int, out: Path | str | None = None, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK,
               timeout_ms: int = 5000, direct: bool = True, progress: store.Progress | None = None,
               since: Path | str | None = None, digest_chunk: int | None = None) -> CheckpointReport:
    """Checkpoints the device memory of shimmed process `pid` into the new directory `out` (default
    PID-TIME under store.default_root(), where `top` finds it).  `progress(phase, done, total)` is called with phase "freeze" (once,
    before the gate closes) and "write" (per chunk written).  `direct`: the shim maps and pins the image
    before the freeze and the copies go straight into it (no staging, no CPU copy: on an H200 this
    is what makes the freeze the bus's time, see bench/results/checkpoint-h200.md); where the driver
    cannot pin it, the staging path is used and the report says direct=False.  direct=False: the
    staging path (pinned buffers per lane, then a CPU copy into the image).
    `since`: an earlier checkpoint of the same process; only the chunks whose digest differs from it
    are copied and stored, and the new directory is a link of its chain (chain.py).  Where it has no
    digests, the checkpoint is whole and says why.  `digest_chunk`: bytes each digest covers (the
    shim's default; 0: no digests, so no later checkpoint can be taken since this one)."""
    t0 = time.monotonic_ns()
    out = Path(out) if out is not None else store.default_out(pid)
    out = out.absolute()
    store.check_target(out)
    parent = base = base_link = None
    if since is not None:
        parent = Path(since).absolute()
        pm = store.read_manifest(parent)
        who = identity_differences(pm, pid)
        if who:
            raise CheckpointMismatch(f"{parent} is not a checkpoint of process {pid}: {'; '.join(who)}",
                                     "an incremental checkpoint is taken since an earlier checkpoint of the same "
                                     "process; leave out --since for a whole one")
        base_link = chain.Link(parent, pm)
        base = chain.head(base_link)
    with ShimSession(pid, "checkpoint") as s:
        status = s.request("status")
        _refuse_suspended(status, pid, "dump its device memory")
        held = sum(size for _, size, _ in image.saved_allocations(status))
        if progress:
            progress("freeze", 0, held)
        pipe = pipelined()
        memfd, r = _dump(s, pid, lanes, chunk, timeout_ms, direct, digest_chunk, base, base_link, held, pipe)
        try:
            if not r.get("ok"):
                raise shim_failure(r, pid, "dump its device memory")
            nbytes = os.fstat(memfd).st_size
            if nbytes != r["image_bytes"]:
                raise CheckpointError(f"the image is {nbytes} bytes, the shim said {r['image_bytes']}",
                                      "this is a bug; nothing was kept")
            hdr, manifest = manifest_of(pid, status, r, memfd, nbytes)
            runs = None
            if hdr.partial:
                manifest["schema"] = store.SCHEMA_LINK
                manifest["parent"] = chain.parent_ref(parent, out)
                runs = [(0, hdr.data_offset), *hdr.held_runs()]
            wb = _Writeback(s, pid, r)
            m = store.write(out, memfd, nbytes, manifest, progress, runs, hdr.pieces(), wb, pipe)
            wb.finish()
            durable = time.monotonic_ns() - t0
        finally:
            os.close(memfd)
    t, ws = m["timings"], m["write_stats"]
    return CheckpointReport(str(out), pid, len(hdr.entries), r["bytes"], nbytes, t["drain_ns"], t["sync_ns"],
                            t["copy_ns"], t["freeze_ns"], t["write_ns"], time.monotonic_ns() - t0, r.get("direct", False),
                            r.get("digest_ns", 0), r.get("chunks", 0), r.get("chunks_copied", 0),
                            r.get("bytes_copied", r["bytes"]), m["data"]["bytes"],
                            str(parent) if hdr.partial else None, _digest_why(r, since), durable, t["fsync_ns"],
                            r.get("setup_ns", 0), r.get("writeback_ns", 0) + wb.ns, r.get("kept_pinned_bytes", 0),
                            r.get("plan"), r.get("staging_copied_bytes", 0), r.get("attempts", 1),
                            r.get("aborted_freeze_ns", 0), ws.pipelined, wb.streamed, wb.batches, ws.hash_ns,
                            ws.io_ns, ws.hashed_before_source_end_bytes, ws.written_before_source_end_bytes)


class _Writeback(store.Source):
    """A streamed dump's chunks still in the shim's pool, asked for a batch at a time as store.write
    needs them (the shim writes each into the memfd while the batches before it are hashed and
    written here).  Nothing pending: the image is whole already."""

    def __init__(self, s: ShimSession, pid: int, r: dict) -> None:
        self.s, self.pid = s, pid
        self.streamed = int(r.get("writeback_pending_bytes", 0) or 0)
        self.written_to = int(r.get("written_to", 0)) if self.streamed else math.inf
        self.batches = self.ns = self.end_ns = 0

    def advance(self, end: int) -> None:
        while self.written_to < end:
            r = self.s.request(f"writeback bytes={WRITEBACK_BATCH}", timeout_s=copy_timeout(WRITEBACK_BATCH))
            if not r.get("ok"):
                raise CheckpointError(f"the shim of process {self.pid} could not write its image: "
                                      f"{r.get('error')} ({r.get('detail')})",
                                      "the job runs on, untouched; nothing was kept: try again")
            self.batches += 1
            self.ns = int(r.get("writeback_ns", 0))
            self.end_ns = int(r.get("batch_end_ns", 0)) or self.end_ns
            self.written_to = math.inf if r.get("done") else int(r["written_to"])

    def finish(self) -> None:
        """Whatever store.write did not need written too (nothing, where the runs cover every chunk
        the pool held), so that the shim holds nothing of this dump."""
        if self.written_to != math.inf:
            self.advance(math.inf)


def _dump(s: ShimSession, pid: int, lanes: int, chunk: int, timeout_ms: int, direct: bool,
          digest_chunk: int | None, base, base_link, held: int, stream: bool = True) -> tuple[int, dict]:
    """The shim's dump into a new memfd: the descriptor (the caller closes it) and the reply. A job that
    allocates and frees every step (a training loop's temporaries) can hold more at the freeze than at
    the plan, made a moment before while it ran: the shim then refuses, busy, having copied nothing and
    reopened the gate. That is tried again on a fresh plan, the last time through the staging buffers,
    which take any size (a direct copy maps the image for the plan's)."""
    refused = aborted_ns = 0  # the tries overtaken before this one: counted in the report's attempts
    for attempt in range(BUSY_TRIES):
        staged = not direct or attempt == BUSY_TRIES - 1
        words = f"dump lanes={lanes} chunk={chunk} timeout={timeout_ms} direct={int(not staged)}"
        if stream:
            words += " stream=1"  # the pool's chunks written at our `writeback` commands, after the reply
        if digest_chunk is not None:
            words += f" digest={digest_chunk}"
        memfd = os.memfd_create(f"gputrace-ckpt-{pid}", os.MFD_CLOEXEC)
        try:
            if base is not None:
                _write_head(memfd, base, base_link)
                words += " base=1"
            r = s.request(words, fd=memfd, timeout_s=copy_timeout(held))
            if stream and str(r.get("error", "")).startswith("usage:"):  # a shim without streamed dumps
                stream = False
                os.ftruncate(memfd, 0)
                if base is not None:
                    _write_head(memfd, base, base_link)
                r = s.request(words.replace(" stream=1", ""), fd=memfd, timeout_s=copy_timeout(held))
        except BaseException:
            os.close(memfd)
            raise
        if not overtaken(r) or attempt == BUSY_TRIES - 1:
            if refused and r.get("ok"):
                r = {**r, "attempts": int(r.get("attempts", 1)) + refused,
                     "aborted_freeze_ns": int(r.get("aborted_freeze_ns", 0)) + aborted_ns}
            return memfd, r
        refused += int(r.get("attempts", 1))
        aborted_ns += int(r.get("freeze_ns", 0)) + int(r.get("aborted_freeze_ns", 0))
        os.close(memfd)
    raise AssertionError("unreachable")


def _checked_pause(s: ShimSession, pid: int, path: Path, manifest: dict, timeout_ms: int, quiet_s: float) -> bool:
    """The gate closed through `s` once the process's status shows nothing that makes a device-only
    rollback unsafe (checkpointer/rollback.py); the gate is open again and UnsafeRollback raised
    otherwise. True: the gate is held, for the restore to use and then reopen."""
    from . import rollback

    before = s.request("status")
    time.sleep(quiet_s)  # a window in which a job that is running work shows it
    r = s.request(f"pause {timeout_ms}")
    if not r.get("ok"):
        raise shim_failure(r, pid, "stop for the rollback")
    try:
        now = s.request("status")
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        found = rollback.hazards(manifest, before, now, maps)
        diffs = compare(manifest, now)
        if diffs:  # (its allocations moved since: a reason to refuse, with the others seen)
            found = [rollback.changed_allocations(_describe(diffs[:4], len(diffs))), *found]
    except BaseException:
        s.request("resume")
        raise
    if found:
        s.request("resume")
        raise rollback.refusal(pid, path, found)
    return True


def latest(pid: int, where: Path) -> Path | None:
    """The newest complete checkpoint of process `pid` (this very process: its start time too) directly
    in directory `where`; None when there is none."""
    best, when = None, -1.0
    try:
        entries = [e for e in os.scandir(where) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return None
    for e in entries:
        try:
            m = store.read_manifest(Path(e.path))
        except CorruptCheckpoint:
            continue
        if not identity_differences(m, pid) and float(m.get("created_unix", 0)) > when:
            best, when = Path(e.path), float(m.get("created_unix", 0))
    return best


def _write_head(memfd: int, base: image.Header, link: chain.Link) -> None:
    """The base checkpoint's image head (header, entries, digests) into the memfd the shim reads it from."""
    fd, f = chain.data_file(link)
    try:
        head = os.pread(fd, base.data_offset, 0)  # checked by chain.head() just before
    finally:
        os.close(fd)
    if len(head) != base.data_offset:
        raise CorruptCheckpoint(f"{f} ended early", "the checkpoint is damaged; take a whole one")
    os.pwrite(memfd, head, 0)


def _digest_why(r: dict, since: object) -> str | None:
    if r.get("digests"):
        return None
    why = r.get("digest_why")
    if since is not None and not why:
        why = "no digests were taken"
    return why


def manifest_of(pid: int, status: dict, r: dict, memfd: int, nbytes: int) -> tuple[image.Header, dict]:
    """The image's header and the manifest for it, from the shim's status and its dump (or suspend) reply."""
    try:
        hdr = image.parse(os.pread(memfd, image.head_bytes(os.pread(memfd, 64, 0)), 0))
    except image.BadImage as exc:
        raise CheckpointError(f"the shim wrote an image this gputrace cannot read: {exc}",
                              "the shim and gputrace are of different versions; nothing was kept") from None
    manifest = {
        "schema": store.SCHEMA, "format": store.FORMAT, "complete": True, "created_unix": time.time(),
        "host": os.uname().nodename,
        "target": {"pid": pid, "comm": comm(pid), "start_time": start_time(pid), "boot_id": boot_id()},
        "driver": {"path": status.get("driver", ""), "version": r.get("driver_version", 0)},
        "devices": r.get("devices", []),
        "registry": status.get("totals", {}),
        # The shim's call counts as the dump began: what a device-only rollback compares its allocations
        # and frees since with (checkpointer/rollback.py). Read before the gate closed, so a call made
        # in between shows as one made since: the check errs towards refusing.
        "calls": status.get("calls", {}),
        "allocations": [{"base": e.base, "size": e.size, "device": e.device, "kind": e.kind, "offset": e.offset}
                        for e in hdr.entries],
        "bytes": r["bytes"],
        "timings": {k: r.get(k, 0) for k in ("setup_ns", "drain_ns", "sync_ns", "digest_ns", "copy_ns", "freeze_ns",
                                             "writeback_ns", "aborted_freeze_ns")},
        "shim": {"lanes": r["lanes"], "chunk": r["chunk"], "direct": r.get("direct", False),
                 "skipped_unmapped_vmm": r.get("skipped", 0)},
        "digests": {"algorithm": digest.ALGO, "chunk_bytes": hdr.digest_chunk, "chunks": hdr.digest_count,
                    "chunks_copied": r.get("chunks_copied", 0)} if hdr.digest_chunk else None,
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


def identity_differences(manifest: dict, pid: int) -> list[str]:
    """How process `pid` differs from the one the checkpoint was taken of (empty: the same one)."""
    t = manifest["target"]
    out = []
    if t["pid"] != pid:
        out.append(f"it was taken of process {t['pid']} ({t.get('comm', '?')}), not {pid} ({comm(pid)})")
    elif t.get("start_time") is not None and (t.get("boot_id") in (None, boot_id())) \
            and t["start_time"] != start_time(pid):
        out.append(f"it was taken of an earlier process {pid} ({t.get('comm', '?')}): this one started later")
    elif t.get("boot_id") and t["boot_id"] != boot_id():
        out.append(f"it was taken before this host last booted, of process {pid} then")
    return out


def verified_image(path: Path, manifest: dict, fd: int, progress: store.Progress | None = None,
                   links: list | None = None) -> int:
    """The checkpoint's image copied into `fd` (an incremental one's put together from its chain),
    every chunk's checksum checked, and its header held against the manifest's allocations; its size
    in bytes."""
    if manifest.get("parent") is not None:
        nbytes = chain.assemble(links or chain.links(path, manifest), fd, progress)
    else:
        nbytes = store.verified_copy(path, manifest, fd, progress)
    try:
        hdr = image.parse(os.pread(fd, image.head_bytes(os.pread(fd, 64, 0)), 0))
    except image.BadImage as exc:
        raise CorruptCheckpoint(f"{path / store.DATA}: {exc}", "take a new checkpoint") from None
    if [(e.base, e.size) for e in hdr.entries] != [(a["base"], a["size"]) for a in manifest["allocations"]]:
        raise CorruptCheckpoint(f"{path / store.DATA} and its manifest list different allocations",
                                "the checkpoint is inconsistent; take a new one")
    return nbytes


def _live_digests(s: ShimSession, dchunk: int, timeout_ms: int) -> tuple[bytes | None, int]:
    """The live memory's digests (16 bytes a chunk, in address order) and how long the gate was
    closed for them; None where the shim cannot take them (the restore then reads everything).
    A job that allocated between the command's preparation (its digester, made while the job ran)
    and its gate is refused busy, nothing run and the gate open again (overtaken): asked again, up
    to BUSY_TRIES times in all, each prepared for what the job then holds."""
    for _ in range(BUSY_TRIES):
        fd = os.memfd_create("gputrace-digests", os.MFD_CLOEXEC)
        try:
            r = s.request(f"digest digest={dchunk} timeout={timeout_ms}", fd=fd, timeout_s=copy_timeout(0))
            if r.get("ok"):
                return os.pread(fd, 16 * int(r["chunks"]), 0), int(r.get("freeze_ns", 0))
        finally:
            os.close(fd)
        if not overtaken(r):
            break
    return None, 0


def _selected_image(sel: chain.Selective, live: bytes, fd: int, progress: store.Progress | None) -> int:
    """An image of the chunks of `sel`'s newest checkpoint whose digest differs from `live`'s, each
    read from its link and checked, in `fd` (image.partial_head's layout); its size."""
    final = sel.final
    nd, dc = final.digest_count, final.digest_chunk
    want = [d for d in range(nd) if live[16 * d:16 * d + 16] != final.digests[16 * d:16 * d + 16]]
    held = bytearray(nd)
    for d in want:
        held[d] = 1
    head, offs, size = image.partial_head(final, bytes(held))
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    os.pwrite(fd, head, 0)
    total = sum(sel.spans[d][2] for d in want)
    done = 0

    def one(d: int) -> int:
        i = sel.spans[d][0]
        data = sel.chunk(d)
        os.pwrite(fd, data, offs[i] + (d - sel.first[i]) * dc)
        return len(data)

    if not pipelined() or len(want) < 2:
        for d in want:
            done += one(d)
            if progress:
                progress("verify", done, total)
        return size
    # Several chunks read, checked and put in place at once (pread, xxh3 and pwrite release the GIL):
    # reading one overlaps hashing another, and a disk gets more than one request at a time.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(READERS, thread_name_prefix="gputrace-verify") as ex:
        pending = []
        try:
            for k, d in enumerate(want):
                pending.append(ex.submit(one, d))
                if len(pending) >= 4 * READERS or k == len(want) - 1:
                    while pending and (len(pending) >= 2 * READERS or k == len(want) - 1):
                        done += pending.pop(0).result()  # the first failure, in order, raised here
                        if progress:
                            progress("verify", done, total)
        finally:
            for f in pending:
                f.cancel()
    return size


def restore(pid: int, path: Path | str, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK,
            timeout_ms: int = 5000, direct: bool = True, progress: store.Progress | None = None,
            other_process: bool = False, diff: bool = True, checked: bool = False,
            quiet_s: float = 0.2, verify_all: bool = False) -> RestoreReport:
    """Rolls the device memory of shimmed process `pid` back to the checkpoint in `path`.
    `checked`: refuse (rollback.UnsafeRollback) wherever the process shows that a rollback of its
    device memory alone is unsafe (checkpointer/rollback.py): its status is read, then again `quiet_s`
    later under the gate this restore holds, and the restore happens under that same gate or not at
    all. Unchecked (the default of this function; the CLI and top check unless forced), the rollback
    is the caller's risk.
    `progress(phase, done, total)`: "verify" per chunk checked, "freeze" once before the gate closes.
    A checkpoint of another process (pid and start time) is refused unless `other_process`: the
    allocations may match by chance, and the data are that process's.  `diff`: where the checkpoint
    has digests, the shim hashes the live memory under the gate and copies back only the chunks that
    differ (False: every byte).
    What is read and checked: with `diff` and a chain whose links checksum each chunk (chain.selectable),
    the manifests, every link's head and the chunks whose digest differs from the live memory's (taken
    by the shim under a gate closed for its kernel alone), each checked against its own checksum
    before the process is touched; should a chunk change between those digests and the restore's
    own, under its gate, the shim refuses (nothing copied) and this is done again, then whole.
    `verify_all` (or a chain without those checksums, or `diff` False): every byte of every link read
    and checked, the whole image put together."""
    t0 = time.monotonic_ns()
    path = Path(path).absolute()
    manifest = store.read_manifest(path)
    if not other_process:
        who = identity_differences(manifest, pid)
        if who:
            raise CheckpointMismatch(f"{path} is not a checkpoint of process {pid}: {'; '.join(who)}",
                                     "restore it into the process it was taken of, or pass --into-other-process to "
                                     "put that process's data into this one (its allocations must match); "
                                     "nothing was changed")
    links = chain.links(path, manifest)  # an incremental checkpoint's earlier links, each checked
    read0 = store.READS.bytes
    why = None if diff and not verify_all and chain.selectable(links) and manifest.get("digests") else \
        "asked to" if verify_all else "every byte is copied" if not diff else "its chain checksums no chunk alone"
    with ShimSession(pid, "restore") as s:
        status = s.request("status")
        _refuse_suspended(status, pid, "restore its device memory")
        diffs = compare(manifest, status)
        if diffs and checked and not other_process:
            # A checked rollback refuses as unsafe, with the whole-process way as its hint: a job whose
            # allocations moved since is the case the check is for (a training loop between its
            # allocations and frees), not a wrong checkpoint.
            from . import rollback

            raise rollback.refusal(pid, path, [rollback.changed_allocations(_describe(diffs[:4], len(diffs)))])
        if diffs:
            raise _mismatch(pid, path, diffs)
        memfd = os.memfd_create(f"gputrace-restore-{pid}", os.MFD_CLOEXEC)
        paused = False
        verify_ns = prepass_ns = 0
        r: dict = {}
        try:
            sel = chain.Selective(links) if why is None else None
            try:
                for attempt in (1, 2, 3):
                    tv = time.monotonic_ns()
                    if sel is not None and why is None and attempt < 3:  # (why: whole from here on)
                        live, pre = _live_digests(s, sel.final.digest_chunk, timeout_ms)
                        prepass_ns += pre
                        if live is None or len(live) != 16 * sel.final.digest_count:
                            why = "the shim could not take the live memory's digests"
                            continue
                        nbytes = _selected_image(sel, live, memfd, progress)
                    else:
                        if sel is not None and why is None:
                            why = "chunks kept changing between the digests and the restore"
                        os.ftruncate(memfd, 0)
                        nbytes = verified_image(path, manifest, memfd, progress, links)
                    verify_ns += time.monotonic_ns() - tv
                    if checked:
                        paused = _checked_pause(s, pid, path, manifest, timeout_ms, quiet_s)
                    if progress:
                        progress("freeze", 0, manifest["bytes"])
                    r = s.request(f"restore lanes={lanes} chunk={chunk} timeout={timeout_ms} direct={int(direct)} "
                                  f"diff={int(diff)}", fd=memfd, timeout_s=copy_timeout(nbytes))
                    if paused:
                        s.request("resume")  # the restore found the gate held and left it so
                        paused = False
                    if r.get("error") not in ("stale", "cannot compare") or why is not None:
                        break
                    if r.get("error") == "cannot compare":
                        why = f"the shim cannot compare: {r.get('detail')}"
            finally:
                if sel is not None:
                    sel.close()
        finally:
            os.close(memfd)
            if paused:
                s.request("resume")
        if not r.get("ok"):
            if r.get("error") == "mismatch":
                d = [f"{x['what']} allocation at {x['base']:#x} (checkpoint {x['checkpoint_size']} bytes, "
                     f"live {x['live_size']})" for x in r.get("differences", [])]
                raise _mismatch(pid, path, d or ["its allocations changed"])
            raise shim_failure(r, pid, "restore its device memory")
    return RestoreReport(str(path), pid, r["allocations"], r["bytes"], verify_ns, r["drain_ns"], r["sync_ns"],
                         r["copy_ns"], r["freeze_ns"], time.monotonic_ns() - t0, r.get("direct", False),
                         r.get("digest_ns", 0), r.get("chunks", 0), r.get("chunks_copied", 0),
                         r.get("bytes_copied", r["bytes"]), len(links),
                         None if r.get("digests") or not diff else r.get("digest_why"),
                         "used" if why is None else "all", store.READS.bytes - read0, prepass_ns,
                         None if why is None or why == "asked to" else why, r.get("setup_ns", 0), r.get("plan"),
                         r.get("staging_copied_bytes", 0))
