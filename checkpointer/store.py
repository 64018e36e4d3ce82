"""A checkpoint on disk: a directory that is valid only once complete.

    DIR/manifest.json   orjson, schema below; written last
    DIR/data.img        the shim's image (checkpointer/image.py), byte for byte (a link: parts of it)

Manifest (schema 1): schema, format ("gputrace-checkpoint"), complete (true), created_unix, host,
  target {pid, comm}, driver {path, version}, devices [{ordinal, name, uuid}],
  registry {the status totals: device_bytes, contexts, allocations, modules, streams, events, ...},
  allocations [{base, size, device, kind, offset}] (offset: in data.img),
  data {file, bytes, chunk_bytes, hash ("xxh3_64"), chunks [hex digest of each chunk_bytes piece of data.img],
        pieces {hash, head_bytes, xxh3 [hex digest of the image's head, then of each digest chunk data.img
        holds, in order]} (where the image has digests: what a restore checks of the chunks it reads)},
  timings {setup_ns, drain_ns, sync_ns, digest_ns, copy_ns, freeze_ns, write_ns, fsync_ns}, shim {lanes, chunk},
  digests {algorithm, chunk_bytes, chunks, chunks_copied} or null (the image's own digests are in its head).
Schema 2, a link of an incremental chain (chain.py): as schema 1, plus parent {path, relative,
  manifest_xxh3}, and data {image_bytes, runs [[offset, length] of the image that data.img holds, in order]}.

The data are hashed and written by two threads at once, each in the image's order (xxhash and the
writes release the GIL): the writer pwrites each piece at its place in data.img and starts the
storage's writeback every WRITEBACK_KICK bytes (sync_file_range), so that the disk writes while the
rest is hashed and written, and one fsync at the end waits for what is left.  Where the image is
still being written by the shim (a streamed dump: ops.checkpoint), `source` says how far it is whole
and asks for more; what is whole is hashed and written meanwhile.

Writing goes to a hidden sibling `.NAME.partial-PID`: data, then the manifest, each fsynced, then the
directory, then one rename(2) to NAME and an fsync of the parent.  A crash at any point leaves at
most a `.partial` directory, never a NAME with a manifest that is not backed by its data.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import orjson
import xxhash

from gputrace.base.errors import CheckpointError, CorruptCheckpoint, DiskFull

from . import schema

SCHEMA = 1
SCHEMA_LINK = 2  # a link of an incremental chain: data.img holds its changed chunks, the rest is its parent's
FORMAT = "gputrace-checkpoint"
MANIFEST = "manifest.json"
DATA = "data.img"
HASH = "xxh3_64"
CHUNK_BYTES = 8 << 20

Progress = Callable[[str, int, int], None]


@dataclass
class ReadStats:
    """What has been read of checkpoints' data files (never of manifests): every read goes through
    read_at, so a restore can say, and a test can hold it to, how much of a chain it read."""

    bytes: int = 0
    reads: int = 0

    def snapshot(self) -> tuple[int, int]:
        return self.bytes, self.reads


READS = ReadStats()
_READS_LOCK = threading.Lock()  # a restore reads on several threads (ops._selected_image)


def read_at(fd: int, n: int, off: int) -> bytes:
    b = os.pread(fd, n, off)
    with _READS_LOCK:
        READS.bytes += len(b)
        READS.reads += 1
    return b


def _digest(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def _write_all(fd: int, mv: memoryview) -> None:
    done = 0
    while done < len(mv):
        with mv[done:] as rest:
            done += os.write(fd, rest)


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    done = 0
    while done < len(mv):
        with mv[done:] as rest:
            done += os.pwrite(fd, rest, off + done)


WRITEBACK_KICK = 64 << 20  # bytes written between two starts of the storage's writeback
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_SFR = _sync_file_range()


def start_writeback(fd: int, off: int, n: int) -> None:
    """The storage asked to start writing [off, off+n) of `fd` now (not waited for): the final fsync
    then finds little left.  Nothing where the call is missing or the filesystem has no such thing."""
    if _SFR is not None and n > 0:
        _SFR(fd, off, n, _SYNC_FILE_RANGE_WRITE)


class Source:
    """Where write() learns how far an image still being written is whole: `written_to` (every byte
    below it is final), and `advance(end)`, which returns once it is at least `end` (the default: an
    image that is whole already).  `end_ns`: when the last of it was written (CLOCK_MONOTONIC)."""

    written_to: float = float("inf")
    end_ns: int = 0

    def advance(self, end: int) -> None:
        pass


@dataclass
class WriteStats:
    """How write() went: the threads' busy time, and what was hashed before its source was whole."""

    pipelined: bool = True
    segments: int = 0
    hash_ns: int = 0       # the hashing thread busy
    io_ns: int = 0         # the writing thread busy (pwrite)
    kicks: int = 0         # writebacks started before the fsync
    waits: int = 0         # times the source was asked for more
    hashed_before_source_end_bytes: int = 0  # hashing began before the source's last byte was written
    written_before_source_end_bytes: int = 0  # ... written into data.img before it


class _Worker(threading.Thread):
    """One of write()'s two threads: `fn(i)` for each segment index queued, in order; the first
    exception kept (the rest of the queue is skipped).  `started`: segments begun."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.q, self.exc = fn, queue.SimpleQueue(), None
        self.started = 0
        self.cv = threading.Condition()
        self.begun_ns: list[int] = []

    def run(self) -> None:
        while (i := self.q.get()) is not None:
            if self.exc is not None:
                continue
            with self.cv:
                self.started += 1
                self.cv.notify_all()
            self.begun_ns.append(time.monotonic_ns())
            try:
                self.fn(i)
            except BaseException as exc:  # noqa: BLE001 (re-raised by write())
                self.exc = exc

    def wait_started(self, n: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.started >= n or self.exc is not None or not self.is_alive())


class _Flusher(threading.Thread):
    """Starts the storage's writeback of what the writer has written, WRITEBACK_KICK bytes at a time
    at least, on a thread of its own: sync_file_range can block while the device's queue is full, and
    the writer must not wait for the disk (the final fsync does)."""

    def __init__(self, fd: int, stats: "WriteStats") -> None:
        super().__init__(daemon=True)
        self.fd, self.stats = fd, stats
        self.cv = threading.Condition()
        self.written = self.kicked = 0
        self.done = False

    def note(self, end: int) -> None:
        with self.cv:
            self.written = end
            if end - self.kicked >= WRITEBACK_KICK:
                self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.done = True
            self.cv.notify()
        self.join()

    def run(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.done or self.written - self.kicked >= WRITEBACK_KICK)
                if self.done:
                    return
                start, end = self.kicked, self.written
                self.kicked = end
            try:
                start_writeback(self.fd, start, end - start)
            except Exception:  # noqa: BLE001 (only a head start for the fsync, which follows anyway)
                return
            self.stats.kicks += 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error(exc: OSError, where: Path) -> CheckpointError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on the device while writing {where}",
                        "free space there or write the checkpoint elsewhere with -o DIR; nothing was kept")
    return CheckpointError(f"cannot write {where}: {exc.strerror}", "check the directory's permissions and space")


def default_root() -> Path:
    """Where checkpoints go when no directory is given, for the CLI and `top` alike (each finds the
    other's): $GPUTRACE_CKPT_DIR, else $XDG_DATA_HOME (or ~/.local/share)/gputrace/checkpoints.
    Not /tmp: that is often memory, and a checkpoint is the size of the job's device memory."""
    if os.environ.get("GPUTRACE_CKPT_DIR"):
        return Path(os.environ["GPUTRACE_CKPT_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gputrace" / "checkpoints"


def default_out(pid: int, *, prefix: str = "") -> Path:
    """A new directory under default_root(), created if missing: PID-TIME (a whole process's:
    full-PID-TIME; a job's: job-PID-TIME, PID its first rank's)."""
    root = default_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {root}: {exc.strerror}",
                              "give a directory with -o, or set GPUTRACE_CKPT_DIR to a writable one") from None
    return fresh_dir(root, f"{prefix}{pid}")


def fresh_dir(root: Path, stem: str) -> Path:
    """root/STEM-TIME (to the second), or with -2, -3 ... after it where that is taken: a checkpoint
    never overwrites, and two taken within one second (top's c pressed twice) must not collide."""
    base = root / f"{stem}-{time.strftime('%Y%m%dT%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def check_target(out: Path) -> None:
    if out.exists():
        raise CheckpointError(f"{out} already exists", "give a new directory with -o; a checkpoint never overwrites")
    if not out.parent.is_dir():
        raise CheckpointError(f"{out.parent} is not a directory", "create it first, or choose another -o")


class _Empty:
    """Stands for the mmap of an empty image (mmap refuses length 0)."""

    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: object) -> None:
        pass


class PartialDir:
    """A checkpoint directory as it is written: .NAME.partial-PID beside `out`, ours alone (one that
    exists already is not ours to use or delete), renamed to `out` only once complete and synced,
    so that `out` is either absent or whole. `discard` removes what an interrupted write left."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out.parent / f".{out.name}.partial-{os.getpid()}"

    def create(self, *subdirs: str) -> Path:
        try:
            self.path.mkdir(mode=0o700)
        except FileExistsError:
            raise CheckpointError(f"{self.path} exists already, and it is not this checkpoint's",
                                  "a leftover of an interrupted checkpoint, or someone else's: remove it, or use "
                                  "another -o") from None
        except OSError as exc:
            raise disk_error(exc, self.out) from None
        try:
            for d in subdirs:
                (self.path / d).mkdir(mode=0o700)
        except OSError as exc:
            self.discard()
            raise disk_error(exc, self.out) from None
        return self.path

    def write_file(self, name: str, data: bytes) -> None:
        fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        fsync_dir(self.path)
        os.rename(self.path, self.out)  # fails if `out` appeared meanwhile (a non-empty directory): never clobbered
        fsync_dir(self.out.parent)

    def discard(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)


def _pieces(runs: list[tuple[int, int]]):
    """The runs cut so that no piece crosses a CHUNK_BYTES boundary of the file they are written to,
    each with whether it ends one of those chunks (the file's last counts)."""
    out_at = 0
    total = sum(n for _, n in runs)
    for off, n in runs:
        while n:
            take = min(n, CHUNK_BYTES - out_at % CHUNK_BYTES)
            out_at += take
            yield off, take, out_at % CHUNK_BYTES == 0 or out_at == total
            off += take
            n -= take


def _segments(runs: list[tuple[int, int]], cuts: list[int]):
    """_pieces(runs) cut again at each image offset in `cuts` (sorted): (offset, length, ends a
    CHUNK_BYTES chunk of the file)."""
    for off, n, ends in _pieces(runs):
        end = off + n
        i = bisect.bisect_right(cuts, off)
        while i < len(cuts) and cuts[i] < end:
            yield off, cuts[i] - off, False
            off = cuts[i]
            i += 1
        yield off, end - off, ends


def write(out: Path, image_fd: int, image_bytes: int, manifest: dict, progress: Progress | None = None,
          runs: list[tuple[int, int]] | None = None, pieces: list[tuple[int, int]] | None = None,
          source: Source | None = None, pipelined: bool = True) -> dict:
    """Hashes and writes the image in `image_fd` and the manifest (completed here with the data
    section, write_ns and fsync_ns) to `out`, atomically and durably: when it returns, data, manifest
    and directory are fsynced and renamed into place.  Returns the manifest as written, with
    `write_stats` (WriteStats, not in the file).
    `runs`: (offset, length) of the parts of the image to keep, in order (an incremental link's head
    and changed chunks); data.img is then their concatenation, and the data section says where each
    came from.  Default: the whole image, byte for byte.  `pieces`: (offset, length) in the image of
    what is also checksummed one by one (image.Header.pieces: the head and each digest chunk kept),
    each within the runs, in order.  `source`: how far the image is whole, where it is still being
    written (each part is read only once it is).  `pipelined` False: hashed and written in turn by
    this thread, then fsynced (as before the pipeline: what bench/incremental_costs_gpu.py compares)."""
    part = PartialDir(out)
    t0 = time.monotonic_ns()
    fsync_ns = 0
    chunks: list[str] = []
    whole = runs is None
    runs = [(0, image_bytes)] if whole else list(runs)
    size = sum(n for _, n in runs)
    pieces = list(pieces or [])
    cuts = sorted({x for o, n in pieces for x in (o, o + n)})
    sums: list[str] = []
    src = source or Source()
    segs = list(_segments(runs, cuts))
    stats = WriteStats(pipelined=pipelined, segments=len(segs))
    tmp = part.create()
    try:
        fd = os.open(tmp / DATA, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with mmap.mmap(image_fd, image_bytes, prot=mmap.PROT_READ) if image_bytes else _Empty() as mm:
                mv = memoryview(mm)
                h, ph = xxhash.xxh3_64(), xxhash.xxh3_64()
                at = [0]  # the file offset of each segment
                for _, n, _ in segs:
                    at.append(at[-1] + n)
                p = 0
                flusher = _Flusher(fd, stats) if pipelined and _SFR is not None else None

                def hash_one(i: int) -> None:
                    nonlocal p
                    off, n, ends = segs[i]
                    t = time.monotonic_ns()
                    with mv[off:off + n] as piece:
                        h.update(piece)
                        while p < len(pieces) and pieces[p][0] + pieces[p][1] <= off:
                            p += 1
                        inside = p < len(pieces) and pieces[p][0] <= off
                        if inside:
                            ph.update(piece)
                    if inside and off + n == pieces[p][0] + pieces[p][1]:
                        sums.append(ph.hexdigest())
                        ph.reset()
                    if ends:
                        chunks.append(h.hexdigest())
                        h.reset()
                    stats.hash_ns += time.monotonic_ns() - t

                def write_one(i: int) -> None:
                    off, n, _ = segs[i]
                    t = time.monotonic_ns()
                    with mv[off:off + n] as piece:  # released even when a write fails
                        _pwrite_all(fd, piece, at[i])
                    if flusher is not None:
                        flusher.note(at[i + 1])
                    stats.io_ns += time.monotonic_ns() - t
                    if progress and (i == len(segs) - 1 or at[i + 1] // CHUNK_BYTES != at[i] // CHUNK_BYTES):
                        progress("write", at[i + 1], size)

                try:
                    if flusher is not None:
                        flusher.start()
                    if pipelined:
                        _run_pipelined(segs, src, stats, hash_one, write_one)
                    else:
                        for i, (off, n, _) in enumerate(segs):
                            if off + n > src.written_to:
                                stats.waits += 1
                                src.advance(off + n)
                            hash_one(i)
                            write_one(i)
                finally:
                    if flusher is not None and flusher.is_alive():
                        flusher.stop()
                    mv.release()
            ts = time.monotonic_ns()
            os.fsync(fd)
            fsync_ns += time.monotonic_ns() - ts
        finally:
            os.close(fd)
        if len(sums) != len(pieces) or len(chunks) != -(-size // CHUNK_BYTES):
            raise CheckpointError(f"{len(sums)} of {len(pieces)} pieces of the image were checksummed",
                                  "this is a bug; nothing was kept")
        manifest = dict(manifest)
        manifest["data"] = {"file": DATA, "bytes": size, "chunk_bytes": CHUNK_BYTES, "hash": HASH,
                            "chunks": chunks}
        if pieces:
            manifest["data"]["pieces"] = {"hash": HASH, "head_bytes": pieces[0][1], "xxh3": sums}
        if not whole:
            manifest["data"].update(image_bytes=image_bytes, runs=[[o, n] for o, n in runs])
        ts = time.monotonic_ns()
        manifest["timings"] = dict(manifest["timings"], write_ns=ts - t0)
        part.write_file(MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        part.commit()
        manifest["timings"]["fsync_ns"] = fsync_ns + time.monotonic_ns() - ts  # (not in the file: after it)
        manifest["write_stats"] = stats
        return manifest
    except OSError as exc:
        raise disk_error(exc, out) from None
    finally:
        part.discard()


def _run_pipelined(segs: list, src: Source, stats: WriteStats, hash_one, write_one) -> None:
    """Every segment hashed (one thread) and written (another), each in order, as soon as `src` says
    it is whole.  Before asking the source for more, this waits until the hasher has begun a segment
    handed since it last asked: so the source's next part is written while earlier ones are hashed
    (and the report's counts of what was hashed before the source's end say so, whatever the timing)."""
    hasher, writer = _Worker(hash_one), _Worker(write_one)
    hasher.start()
    writer.start()
    mark = 0  # segments handed before the source was last asked for more
    try:
        for i, (off, n, _) in enumerate(segs):
            if hasher.exc is not None or writer.exc is not None:
                break
            if off + n > src.written_to:
                if i > mark:
                    hasher.wait_started(mark + 1)
                mark = i
                stats.waits += 1
                src.advance(off + n)
            hasher.q.put(i)
            writer.q.put(i)
    finally:
        hasher.q.put(None)
        writer.q.put(None)
        hasher.join()
        writer.join()
    for w in (hasher, writer):
        if w.exc is not None:
            raise w.exc
    if src.end_ns:
        stats.hashed_before_source_end_bytes = sum(segs[i][1] for i, t in enumerate(hasher.begun_ns) if t < src.end_ns)
        stats.written_before_source_end_bytes = sum(segs[i][1] for i, t in enumerate(writer.begun_ns)
                                                    if t < src.end_ns)


def load_manifest(path: Path, hint: str) -> object:
    """DIR/manifest.json parsed, whatever it holds; CorruptCheckpoint when there is none to parse.
    `hint`: what to give instead when `path` is no directory."""
    if not path.is_dir():
        raise CorruptCheckpoint(f"{path} is not a checkpoint directory", hint)
    try:
        os.lstat(path / MANIFEST)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} has no {MANIFEST}: it is not a complete checkpoint",
                                "an interrupted checkpoint never gets one; take a new checkpoint") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"cannot read {path / MANIFEST}: {exc.strerror}", "check its permissions") from None
    raw = schema.read_small(path / MANIFEST, "manifest")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise CorruptCheckpoint(f"{path / MANIFEST} is not valid JSON", "the checkpoint is damaged; take a new one") from None


@dataclass(frozen=True)
class Kind:
    """A kind of checkpoint directory, as its manifest says: what `read_manifest` checks."""

    format: str
    schema: int
    what: str                            # for messages: "a GPU-memory checkpoint"
    wrote: str                           # the command that writes it
    restore: str                         # the command that restores it
    complete: Callable[[dict], bool]     # its data section is there and says what it holds
    check: Callable[[dict, Path], None]  # every field restore reads (schema.py)
    reads: tuple[int, ...] = ()          # other schemas of the same format this gputrace reads


DEVICE = Kind(FORMAT, SCHEMA, "a GPU-memory checkpoint", "gputrace checkpoint", "gputrace restore -p PID DIR",
              lambda m: isinstance(m.get("data"), dict) and m["data"].get("hash") == HASH, schema.device_checkpoint,
              (SCHEMA_LINK,))
FULL = Kind("gputrace-full-checkpoint", 1, "a whole-process checkpoint", "gputrace checkpoint --full",
            "gputrace restore --full DIR",
            lambda m: m.get("hash") == HASH and isinstance(m.get("files"), list) and bool(m["files"]),
            schema.full_checkpoint)
FULL_JOB = Kind("gputrace-full-job-checkpoint", 1, "a whole-job checkpoint", "gputrace checkpoint --full --tree PID",
                "gputrace restore --full DIR",
                lambda m: m.get("hash") == HASH and isinstance(m.get("files"), list) and bool(m["files"]),
                schema.full_job_checkpoint)
KINDS = (DEVICE, FULL, FULL_JOB)


def read_manifest(path: Path, kind: Kind = DEVICE) -> dict:
    """The manifest of a complete checkpoint of `kind`; CorruptCheckpoint for anything else (with
    the command that restores it, where it is a checkpoint of another kind)."""
    path = Path(path)
    m = load_manifest(path, f"give the directory `{kind.wrote}` wrote")
    if not isinstance(m, dict) or m.get("format") != kind.format:
        other = next((k for k in KINDS if isinstance(m, dict) and m.get("format") == k.format), None)
        raise CorruptCheckpoint(f"{path} is not {kind.what}",
                                f"it is {other.what}: restore it with `{other.restore}`" if other else
                                f"give the directory `{kind.wrote}` wrote")
    if m.get("schema") not in (kind.schema, *kind.reads):
        raise CorruptCheckpoint(f"{path} has manifest schema {m.get('schema')}; this gputrace reads schema {kind.schema}",
                                "restore it with the gputrace version that wrote it")
    if m.get("complete") is not True or not kind.complete(m):
        raise CorruptCheckpoint(f"{path / MANIFEST} does not describe a complete checkpoint", "take a new checkpoint")
    kind.check(m, path / MANIFEST)
    return m


def verified_copy(path: Path, manifest: dict, out_fd: int, progress: Progress | None = None) -> int:
    """Copies DIR/data.img into `out_fd`, checking its size and every chunk's checksum on the way.
    Returns the bytes copied; CorruptCheckpoint at the first fault (out_fd then holds garbage)."""
    data = manifest["data"]
    size, chunk, sums = int(data["bytes"]), int(data["chunk_bytes"]), list(data["chunks"])
    f = path / data["file"]
    fd, actual = schema.open_regular(f, what="data file")
    with os.fdopen(fd, "rb", buffering=0) as src:
        if actual != size:
            raise CorruptCheckpoint(f"{f} is {actual} bytes, the manifest says {size}: the file is "
                                    f"{'truncated' if actual < size else 'too long'}",
                                    "the checkpoint is damaged; take a new one")
        if size:
            os.posix_fallocate(out_fd, 0, size)  # its pages allocated once, up front
        buf = bytearray(chunk)
        for i, want in enumerate(sums):
            n = src.readinto(buf)
            READS.bytes += n
            READS.reads += 1
            piece = memoryview(buf)[:n]
            if n != min(chunk, size - i * chunk):
                raise CorruptCheckpoint(f"{f} ended early at chunk {i}", "the checkpoint is damaged; take a new one")
            if _digest(piece) != want:
                raise CorruptCheckpoint(
                    f"chunk {i} of {f} (bytes {i * chunk}-{i * chunk + n - 1}) fails its {HASH} checksum",
                    "the checkpoint is damaged; the process was not touched")
            os.pwrite(out_fd, piece, i * chunk)
            if progress:
                progress("verify", i * chunk + n, size)
    return size
