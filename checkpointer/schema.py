"""Checks of what a checkpoint directory holds, before any of it is used.

A checkpoint comes from disk, and disk is anyone's who can write there: every field a reader uses is
checked for its type and range here first, so that a damaged or hostile manifest ends in one
CorruptCheckpoint naming the field, never in an exception, an unbounded read or a bad offset handed
to the job.  Files are opened without following symbolic links and must be regular files of a
bounded size (a FIFO, a device or a directory in their place is refused before it is read).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from gputrace.base.errors import CorruptCheckpoint

U64 = (1 << 64) - 1
MAX_MANIFEST = 256 << 20  # about 2 million allocations' entries; what gputrace writes is far smaller
MAX_ALLOCATIONS = 1 << 24  # what the shim's image reader accepts
MAX_CHUNK = 1 << 30

_HINT = "the checkpoint is damaged or was not written by gputrace; take a new one"


class Checker:
    """Field checks of one manifest; each failure is a CorruptCheckpoint that names the field."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def fail(self, field: str, what: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.where}: {field} {what}", _HINT)

    def obj(self, v: object, field: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(field, "is missing or not an object")
        return v

    def int(self, d: dict, key: str, field: str, lo: int = 0, hi: int = U64) -> int:
        v = d.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(f"{field}.{key}", "is missing or not an integer")
        if not lo <= v <= hi:
            raise self.fail(f"{field}.{key}", f"is {v}, outside {lo}..{hi}")
        return v

    def str(self, d: dict, key: str, field: str, *, optional: bool = False) -> str | None:
        v = d.get(key)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise self.fail(f"{field}.{key}", "is missing or not a string")
        return v

    def list(self, d: dict, key: str, field: str, limit: int) -> list:
        v = d.get(key)
        if not isinstance(v, list):
            raise self.fail(f"{field}.{key}", "is missing or not a list")
        if len(v) > limit:
            raise self.fail(f"{field}.{key}", f"has {len(v)} items, more than {limit}")
        return v

    def name(self, d: dict, key: str, field: str) -> str:
        """A path inside the checkpoint directory: relative, without `..`."""
        v = self.str(d, key, field)
        p = PurePosixPath(v)
        if not v or p.is_absolute() or ".." in p.parts or "\0" in v:
            raise self.fail(f"{field}.{key}", f"({v!r}) names a file outside the checkpoint directory")
        return v


def open_regular(path: Path, *, limit: int | None = None, what: str = "file") -> tuple[int, int]:
    """(descriptor, size) of `path` opened read-only, not through a symbolic link, without blocking
    on a FIFO, and only if it is a regular file (of at most `limit` bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is missing", "the checkpoint is incomplete; take a new one") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCheckpoint(f"{path} is a symbolic link; a checkpoint's {what} is a plain file", _HINT) from None
        raise CorruptCheckpoint(f"cannot read {path}: {exc.strerror}", "check its permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise CorruptCheckpoint(f"{path} is {kind}; a checkpoint's {what} is a plain file", _HINT)
    if limit is not None and st.st_size > limit:
        os.close(fd)
        raise CorruptCheckpoint(f"{path} is {st.st_size} bytes, more than a {what} can be ({limit})", _HINT)
    os.set_blocking(fd, True)
    return fd, st.st_size


def read_small(path: Path, what: str) -> bytes:
    fd, size = open_regular(path, limit=MAX_MANIFEST, what=what)
    try:
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            return f.read(MAX_MANIFEST + 1)
    finally:
        os.close(fd)


def device_checkpoint(m: dict, where: Path) -> None:
    """A GPU-memory checkpoint's manifest (checkpointer/store.py): every field restore reads."""
    c = Checker(where)
    target = c.obj(m.get("target"), "target")
    c.int(target, "pid", "target", 1, 1 << 31)
    if "start_time" in target:
        c.int(target, "start_time", "target")
    c.str(target, "boot_id", "target", optional=True)
    data = c.obj(m.get("data"), "data")
    if PurePosixPath(c.name(data, "file", "data")).name != c.str(data, "file", "data"):
        raise c.fail("data.file", "must name a file directly in the checkpoint directory")
    size = c.int(data, "bytes", "data", 0, 1 << 62)
    chunk = c.int(data, "chunk_bytes", "data", 4096, MAX_CHUNK)
    sums = c.list(data, "chunks", "data", (size + chunk - 1) // chunk)
    if len(sums) != (size + chunk - 1) // chunk:
        raise c.fail("data.chunks", f"lists {len(sums)} checksums for {size} bytes in chunks of {chunk}")
    for i, h in enumerate(sums):
        if not _hex16(h):
            raise c.fail(f"data.chunks[{i}]", "is not an xxh3_64 digest")
    if "pieces" in data:  # the head and each digest chunk checksummed alone (chain.Selective reads them)
        pcs = c.obj(data["pieces"], "data.pieces")
        if c.str(pcs, "hash", "data.pieces") != "xxh3_64":
            raise c.fail("data.pieces.hash", "is not xxh3_64")
        c.int(pcs, "head_bytes", "data.pieces", 48, size)
        for i, h in enumerate(c.list(pcs, "xxh3", "data.pieces", size // 4096 + 1)):
            if not _hex16(h):
                raise c.fail(f"data.pieces.xxh3[{i}]", "is not an xxh3_64 digest")
    if "runs" in data or "parent" in m:  # a link of an incremental chain: data.img holds parts of the image
        size = _link(c, m, data, size)
    c.int(m, "bytes", "manifest", 0, 1 << 62)
    allocs = c.list(m, "allocations", "manifest", MAX_ALLOCATIONS)
    prev_end, prev_off = -1, 0
    for i, a in enumerate(allocs):
        f = f"allocations[{i}]"
        a = c.obj(a, f)
        base, n = c.int(a, "base", f), c.int(a, "size", f, 1)
        off = c.int(a, "offset", f)
        c.int(a, "device", f, -1, 1 << 16)
        c.str(a, "kind", f)
        if base + n - 1 > U64:
            raise c.fail(f, "runs past the end of the address space")
        if base <= prev_end:
            raise c.fail(f, "overlaps the allocation before it or is out of order")
        if off < prev_off or off + n > size:
            raise c.fail(f"{f}.offset", f"({off}, {n} bytes) is not within the data file's {size} bytes in order")
        prev_end, prev_off = base + n - 1, off + n


def _hex16(h: object) -> bool:
    return isinstance(h, str) and len(h) == 16 and all(ch in "0123456789abcdef" for ch in h)


def _link(c: Checker, m: dict, data: dict, stored: int) -> int:
    """An incremental link's runs (the parts of its image data.img holds, in order) and its parent;
    returns the size of its whole image."""
    image_size = c.int(data, "image_bytes", "data", 0, 1 << 62)
    runs = c.list(data, "runs", "data", MAX_ALLOCATIONS)
    end = total = 0
    for i, r in enumerate(runs):
        if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise c.fail(f"data.runs[{i}]", "is not an [offset, length] pair")
        off, n = r
        if off < end or n < 1 or off + n > image_size:
            raise c.fail(f"data.runs[{i}]", f"({off}, {n}) overlaps the run before it or runs past the image's "
                                            f"{image_size} bytes")
        end, total = off + n, total + n
    if total != stored:
        raise c.fail("data.runs", f"cover {total} bytes; data.bytes says {stored}")
    parent = c.obj(m.get("parent"), "parent")
    c.str(parent, "path", "parent")
    c.str(parent, "relative", "parent")
    if not _hex16(parent.get("manifest_xxh3")):
        raise c.fail("parent.manifest_xxh3", "is not an xxh3_64 digest")
    return image_size


def full_checkpoint(m: dict, where: Path) -> None:
    """A whole-process checkpoint's manifest (checkpointer/full.py): every field restore reads."""
    c = Checker(where)
    target = c.obj(m.get("target"), "target")
    c.int(target, "pid", "target", 1, 1 << 31)
    gpu = c.obj(m.get("gpu"), "gpu")
    c.str(gpu, "libcuda", "gpu")
    shim = gpu.get("shim")
    if shim is not None:
        shim = c.obj(shim, "gpu.shim")
        at = c.str(shim, "image_path", "gpu.shim", optional=True)
        if at is not None and not PurePosixPath(at).is_absolute():
            raise c.fail("gpu.shim.image_path", "is not an absolute path")
    c.obj(m.get("criu"), "criu")
    _files(c, m)


def full_job_checkpoint(m: dict, where: Path) -> None:
    """A whole-job checkpoint's manifest (checkpointer/fulljob.py): every field restore reads."""
    c = Checker(where)
    root = c.obj(m.get("root"), "root")
    c.int(root, "pid", "root", 1, 1 << 31)
    pids = set()
    for i, p in enumerate(c.list(m, "processes", "manifest", 1 << 16)):
        pids.add(c.int(c.obj(p, f"processes[{i}]"), "pid", f"processes[{i}]", 1, 1 << 31))
    if root["pid"] not in pids:
        raise c.fail("processes", "does not list the root")
    ranks = c.list(m, "ranks", "manifest", 1 << 16)
    if not ranks:
        raise c.fail("ranks", "is empty")
    for i, r in enumerate(ranks):
        field = f"ranks[{i}]"
        r = c.obj(r, field)
        if c.int(r, "rank", field, 0, 1 << 16) != i:
            raise c.fail(f"{field}.rank", f"is {r['rank']}, not {i}")
        if c.int(r, "pid", field, 1, 1 << 31) not in pids:
            raise c.fail(f"{field}.pid", "is not one of the processes")
        c.str(r, "libcuda", field)
        shim = r.get("shim")
        if shim is not None:
            shim = c.obj(shim, f"{field}.shim")
            at = c.str(shim, "image_path", f"{field}.shim", optional=True)
            if at is not None:
                if not PurePosixPath(at).is_absolute():
                    raise c.fail(f"{field}.shim.image_path", "is not an absolute path")
                c.name(shim, "file", f"{field}.shim")  # the data file in the checkpoint, linked at image_path
    c.obj(m.get("criu"), "criu")
    _files(c, m)


def _files(c: Checker, m: dict) -> None:
    files = c.list(m, "files", "manifest", 1 << 20)
    if not files:
        raise c.fail("files", "is empty")
    for i, f in enumerate(files):
        field = f"files[{i}]"
        f = c.obj(f, field)
        c.name(f, "path", field)
        c.int(f, "bytes", field, 0, 1 << 62)
        h = c.str(f, "xxh3_64", field)
        if len(h) != 16:
            raise c.fail(f"{field}.xxh3_64", "is not an xxh3_64 digest")
