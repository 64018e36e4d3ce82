"""Incremental checkpoints: a chain of links, each holding only the chunks that changed since its parent.

A link is a checkpoint directory like any other (store.py) whose data.img holds parts of its image:
its head (header, entries, the digest of every chunk, which chunks it holds) and the chunks whose
digest differed from its parent's when it was taken (`data.runs` says where each part goes in the
image).  Its manifest names its parent by path (absolute, and relative to itself, so a chain moved
together still resolves) and by the xxh3 of the parent's manifest, so a parent replaced or changed
since makes the link invalid instead of restoring someone else's bytes.

Restoring a link puts its whole image together, before the job is touched: every link's data.img
read once and each piece checked against its checksum, oldest link first, each chunk written where
the newest image keeps that allocation (a link's chunk is used only for an allocation of the same
address and size), and every chunk of the result accounted for.  A damaged or missing earlier link
makes every later one invalid, with the link named.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from gputrace.base.errors import CorruptCheckpoint

from . import image, schema, store

MAX_LINKS = 1000
_FLAGS_AT = 16 + 8 * 8  # the header's `flags` field


@dataclass(frozen=True)
class Link:
    path: Path
    manifest: dict

    @property
    def runs(self) -> list[tuple[int, int]]:
        d = self.manifest["data"]
        return [(o, n) for o, n in d["runs"]] if "runs" in d else [(0, int(d["bytes"]))]

    @property
    def parent(self) -> dict | None:
        return self.manifest.get("parent")


def manifest_digest(path: Path) -> str:
    return xxhash.xxh3_64_hexdigest(schema.read_small(path / store.MANIFEST, "manifest"))


def parent_ref(parent: Path, child: Path) -> dict:
    """How a link names its parent."""
    return {"path": str(parent), "relative": os.path.relpath(parent, child),
            "manifest_xxh3": manifest_digest(parent)}


def _parent_of(link: Link) -> Path:
    ref = link.parent
    for p in ((link.path / ref["relative"]).resolve(), Path(ref["path"])):
        if (p / store.MANIFEST).exists():
            return p
    raise CorruptCheckpoint(f"{link.path} is an incremental checkpoint whose earlier link {ref['path']} is gone",
                            "restore needs every link of the chain; keep the earlier checkpoints beside it, or "
                            "restore an earlier complete one")


def links(path: Path, manifest: dict) -> list[Link]:
    """The chain ending at `path`, newest first, each link's manifest read and checked, and each parent
    the very checkpoint its child was taken against."""
    out = [Link(path, manifest)]
    seen = {path.resolve()}
    while out[-1].parent is not None:
        child = out[-1]
        p = _parent_of(child)
        if p.resolve() in seen or len(out) >= MAX_LINKS:
            raise CorruptCheckpoint(f"{path}'s chain of earlier checkpoints loops or is longer than {MAX_LINKS}",
                                    "the checkpoint is damaged; restore an earlier complete one")
        seen.add(p.resolve())
        if manifest_digest(p) != child.parent["manifest_xxh3"]:
            raise CorruptCheckpoint(f"{p}, an earlier link of {path}'s chain, is not the checkpoint {child.path} was "
                                    "taken against (its manifest differs)",
                                    "the chain is broken; restore an earlier complete checkpoint")
        try:
            m = store.read_manifest(p)
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(f"an earlier link of {path}'s chain is damaged: {exc.msg}", exc.hint) from None
        if m["target"].get("pid") != manifest["target"].get("pid") or \
                m["target"].get("start_time") != manifest["target"].get("start_time"):
            raise CorruptCheckpoint(f"{p}, an earlier link of {path}'s chain, is a checkpoint of another process",
                                    "the chain is broken; restore an earlier complete checkpoint")
        out.append(Link(p, m))
    return out


def data_file(link: Link) -> tuple[int, Path]:
    """A link's data.img, opened and its size held to the manifest's."""
    d = link.manifest["data"]
    f = link.path / d["file"]
    fd, actual = schema.open_regular(f, what="data file")
    if actual != int(d["bytes"]):
        os.close(fd)
        raise CorruptCheckpoint(f"{f} is {actual} bytes, the manifest says {d['bytes']}: the file is "
                                f"{'truncated' if actual < int(d['bytes']) else 'too long'}",
                                "the checkpoint is damaged; take a new one")
    return fd, f


def _checked_pieces(link: Link, fd: int, f: Path, stop: int | None = None):
    """(offset in data.img, bytes) of each checksummed piece of a link's data file, checked, in order
    (up to the piece holding byte `stop`)."""
    d = link.manifest["data"]
    size, chunk = int(d["bytes"]), int(d["chunk_bytes"])
    for i, want in enumerate(d["chunks"]):
        if stop is not None and i * chunk >= stop:
            return
        piece = os.pread(fd, min(chunk, size - i * chunk), i * chunk)
        if len(piece) != min(chunk, size - i * chunk):
            raise CorruptCheckpoint(f"{f} ended early at chunk {i}", "the checkpoint is damaged; take a new one")
        if xxhash.xxh3_64_hexdigest(piece) != want:
            raise CorruptCheckpoint(f"chunk {i} of {f} (bytes {i * chunk}-{i * chunk + len(piece) - 1}) fails its "
                                    f"{store.HASH} checksum", "the checkpoint is damaged; the process was not touched")
        yield i * chunk, piece


def head(link: Link) -> image.Header:
    """A link's image header, entries and digests: the start of its data.img, checked."""
    fd, f = data_file(link)
    try:
        buf = b""
        want = None
        for _, piece in _checked_pieces(link, fd, f):
            buf += piece
            if want is None and len(buf) >= 48:
                want = image.head_bytes(buf)
            if want is not None and len(buf) >= want:
                break
        return image.parse(buf)
    except image.BadImage as exc:
        raise CorruptCheckpoint(f"{f}: {exc}", "the checkpoint is damaged; take a new one") from None
    finally:
        os.close(fd)


def assemble(chain: list[Link], out_fd: int, progress: store.Progress | None = None) -> int:
    """The newest link's whole image put together in `out_fd` from the chain (newest first); its size."""
    newest = chain[0]
    final = head(newest)
    if not final.partial and len(chain) > 1:
        raise CorruptCheckpoint(f"{newest.path} names an earlier link but its image is whole",
                                "the checkpoint is damaged or was not written by gputrace; take a new one")
    size = final.image_bytes
    os.ftruncate(out_fd, size)
    if size:
        os.posix_fallocate(out_fd, 0, size)
    where = {e.base: e for e in final.entries}
    g = {e.base: final.digest_chunk or max(e.size, 1) for e in final.entries}  # what coverage is counted in
    covered = {e.base: bytearray(-(-e.size // g[e.base])) for e in final.entries}
    total = sum(int(link.manifest["data"]["bytes"]) for link in chain)
    done = 0
    for link in reversed(chain):  # oldest first: a newer link's chunk overwrites an older one's
        h = final if link is newest else head(link)
        offs = [e.offset for e in h.entries]
        runs = link.runs
        starts, at = [], 0  # where each run begins in data.img
        for _, n in runs:
            starts.append(at)
            at += n
        got = {e.base: [0] * len(covered[e.base]) for e in final.entries}  # bytes of each chunk this link wrote
        fd, f = data_file(link)
        try:
            for pos, piece in _checked_pieces(link, fd, f):
                done += len(piece)
                r = max(bisect.bisect_right(starts, pos) - 1, 0)
                p = 0
                while p < len(piece) and r < len(runs):
                    img_off = runs[r][0] + (pos + p - starts[r])
                    n = min(len(piece) - p, starts[r] + runs[r][1] - (pos + p))
                    _scatter(h, offs, img_off, memoryview(piece)[p:p + n], where, got, g, out_fd, link is newest)
                    p += n
                    r += 1
                if progress:
                    progress("verify", done, total)
        finally:
            os.close(fd)
        for base, counts in got.items():  # a chunk counts once this link wrote all of it
            size, step = where[base].size, g[base]
            for k, c in enumerate(counts):
                if c and c >= min(step, size - k * step):
                    covered[base][k] = 1
    for e in final.entries:
        if not all(covered[e.base]):
            k = covered[e.base].index(0)
            raise CorruptCheckpoint(f"{newest.path}'s chain holds no data for chunk {k} of the allocation at "
                                    f"{e.base:#x}", "the chain is incomplete; restore an earlier complete checkpoint")
    if final.partial:  # what the shim gets is whole
        os.pwrite(out_fd, (final.flags & ~image.PARTIAL).to_bytes(8, "little"), _FLAGS_AT)
    return size


def _scatter(h: image.Header, offs: list[int], img_off: int, data: memoryview, where: dict, got: dict, g: dict,
             out_fd: int, is_newest: bool) -> None:
    """Writes the bytes at `img_off` of link image `h` where the final image keeps them, counting
    them in `got` (bytes per chunk of `g[base]` bytes of each final allocation)."""
    while len(data):
        i = bisect.bisect_right(offs, img_off) - 1
        e = h.entries[i] if i >= 0 else None
        if e is None or img_off >= e.offset + e.size:  # the head, or padding between allocations
            nxt = offs[i + 1] if i + 1 < len(offs) else img_off + len(data)
            n = min(len(data), nxt - img_off)
            if is_newest and e is None:
                os.pwrite(out_fd, data[:n], img_off)  # the newest link's own head
            data, img_off = data[n:], img_off + n
            continue
        n = min(len(data), e.offset + e.size - img_off)
        f = where.get(e.base)
        if f is not None and f.size == e.size:
            rel = img_off - e.offset
            os.pwrite(out_fd, data[:n], f.offset + rel)
            step, counts = g[e.base], got[e.base]
            a = rel
            while a < rel + n:  # the bytes counted in each chunk they fall in
                k = a // step
                b = min(rel + n, (k + 1) * step)
                counts[k] += b - a
                a = b
        data, img_off = data[n:], img_off + n
