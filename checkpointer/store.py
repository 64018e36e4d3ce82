"""A checkpoint on disk: a directory that is valid only once complete.

    DIR/manifest.json   orjson, schema below; written last
    DIR/data.img        the shim's image (checkpointer/image.py), byte for byte

Manifest (schema 1): schema, format ("gputrace-checkpoint"), complete (true), created_unix, host,
  target {pid, comm}, driver {path, version}, devices [{ordinal, name, uuid}],
  registry {the status totals: device_bytes, contexts, allocations, modules, streams, events, ...},
  allocations [{base, size, device, kind, offset}] (offset: in data.img),
  data {file, bytes, chunk_bytes, hash ("xxh3_64"), chunks [hex digest of each chunk_bytes piece]},
  timings {setup_ns, drain_ns, sync_ns, copy_ns, freeze_ns, write_ns, total_ns}, shim {lanes, chunk}.

Writing goes to a hidden sibling `.NAME.partial-PID`: data, then the manifest, each fsynced, then the
directory, then one rename(2) to NAME and an fsync of the parent.  A crash at any point leaves at
most a `.partial` directory, never a NAME with a manifest that is not backed by its data.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import orjson
import xxhash

from gputrace.base.errors import CheckpointError, CorruptCheckpoint, DiskFull

from . import schema

SCHEMA = 1
FORMAT = "gputrace-checkpoint"
MANIFEST = "manifest.json"
DATA = "data.img"
HASH = "xxh3_64"
CHUNK_BYTES = 8 << 20

Progress = Callable[[str, int, int], None]


def _digest(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def _write_all(fd: int, mv: memoryview) -> None:
    done = 0
    while done < len(mv):
        with mv[done:] as rest:
            done += os.write(fd, rest)


def _fsync_dir(path: Path) -> None:
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


def check_target(out: Path) -> None:
    if out.exists():
        raise CheckpointError(f"{out} already exists", "give a new directory with -o; a checkpoint never overwrites")
    if not out.parent.is_dir():
        raise CheckpointError(f"{out.parent} is not a directory", "create it first, or choose another -o")


def write(out: Path, image_fd: int, image_bytes: int, manifest: dict, progress: Progress | None = None) -> dict:
    """Hashes and writes the image in `image_fd` and the manifest (completed here with the data
    section and write_ns) to `out`, atomically.  Returns the manifest as written."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    t0 = time.monotonic_ns()
    chunks: list[str] = []
    try:
        tmp.mkdir(mode=0o700)
    except FileExistsError:  # not ours: neither used nor removed
        raise CheckpointError(f"{tmp} exists already, and it is not this checkpoint's",
                              "a leftover of an interrupted checkpoint, or someone else's: remove it, or use another -o"
                              ) from None
    except OSError as exc:
        raise disk_error(exc, out) from None
    try:
        fd = os.open(tmp / DATA, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with mmap.mmap(image_fd, image_bytes, prot=mmap.PROT_READ) as mm:
                mv = memoryview(mm)
                try:
                    for off in range(0, image_bytes, CHUNK_BYTES):
                        with mv[off:off + CHUNK_BYTES] as piece:  # released even when a write fails
                            chunks.append(_digest(piece))
                            _write_all(fd, piece)
                        if progress:
                            progress("write", min(off + CHUNK_BYTES, image_bytes), image_bytes)
                finally:
                    mv.release()
            os.fsync(fd)
        finally:
            os.close(fd)
        manifest = dict(manifest)
        manifest["data"] = {"file": DATA, "bytes": image_bytes, "chunk_bytes": CHUNK_BYTES, "hash": HASH,
                            "chunks": chunks}
        manifest["timings"] = dict(manifest["timings"], write_ns=time.monotonic_ns() - t0)
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, memoryview(orjson.dumps(manifest, option=orjson.OPT_INDENT_2)))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(tmp)
        os.rename(tmp, out)  # fails if `out` appeared meanwhile (a non-empty directory): never clobbered
        _fsync_dir(out.parent)
        return manifest
    except OSError as exc:
        raise disk_error(exc, out) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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


def read_manifest(path: Path) -> dict:
    """The manifest of a complete checkpoint; CorruptCheckpoint for anything else."""
    m = load_manifest(path, "give the directory `gputrace checkpoint` wrote")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{path / MANIFEST} is not a gputrace checkpoint manifest", "give a checkpoint directory")
    if m.get("schema") != SCHEMA:
        raise CorruptCheckpoint(f"{path} has manifest schema {m.get('schema')}; this gputrace reads schema {SCHEMA}",
                                "restore it with the gputrace version that wrote it")
    data = m.get("data")
    if m.get("complete") is not True or not isinstance(data, dict) or data.get("hash") != HASH:
        raise CorruptCheckpoint(f"{path / MANIFEST} does not describe complete data", "take a new checkpoint")
    schema.device_checkpoint(m, path / MANIFEST)
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
