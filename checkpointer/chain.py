"""Incremental checkpoints: a chain of links, each holding only the chunks that changed since its parent.

A link is a checkpoint directory like any other (store.py) whose data.img holds parts of its image:
its head (header, entries, the digest of every chunk, which chunks it holds) and the chunks whose
digest differed from its parent's when it was taken (`data.runs` says where each part goes in the
image).  Its manifest names its parent by path (absolute, and relative to itself, so a chain moved
together still resolves) and by the xxh3 of the parent's manifest, so a parent replaced or changed
since makes the link invalid instead of restoring someone else's bytes.

Restoring reads what it copies (`Selective`): every link's manifest and head (header, entries,
digests, held map), each checked against its manifest, then only the chunks whose digest differs
from the live memory's, each from the newest link that holds it and checked against that link's
checksum of that very chunk (the manifest's `data.pieces`), into an image of those chunks alone.

With --verify-all, or for links written before `data.pieces`, a restore puts the whole image
together instead, before the job is touched: every link's data.img
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
        piece = store.read_at(fd, min(chunk, size - i * chunk), i * chunk)
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


def selectable(chain: list[Link]) -> bool:
    """Whether a restore can read only what it copies: every link checksums its head and its chunks
    one by one (`data.pieces`, written since such restores exist)."""
    return all(isinstance(link.manifest["data"].get("pieces"), dict) for link in chain)


class _Source:
    """One link's data.img as the place chunks are read from: its head read and checked, where each
    chunk of its image lies in the file, and which checksum holds it."""

    def __init__(self, link: Link) -> None:
        self.link = link
        pcs = link.manifest["data"]["pieces"]
        self.sums = pcs["xxh3"]
        self.fd, self.file = data_file(link)
        try:
            n = int(pcs["head_bytes"])
            raw = store.read_at(self.fd, n, 0)
            if len(raw) != n or xxhash.xxh3_64_hexdigest(raw) != self.sums[0]:
                raise CorruptCheckpoint(f"the head of {self.file} (its first {n} bytes) fails its {store.HASH} "
                                        "checksum", "the checkpoint is damaged; the process was not touched")
            try:
                self.head = image.parse(raw)
            except image.BadImage as exc:
                raise CorruptCheckpoint(f"{self.file}: {exc}", "the checkpoint is damaged; take a new one") from None
            h = self.head
            runs = link.runs
            if h.data_offset != n or not h.digest_chunk or runs[0][0] != 0 or runs[0][1] < n or \
                    (link.parent is not None) != h.partial or len(self.sums) != len(h.pieces()):
                raise CorruptCheckpoint(f"{link.path / store.MANIFEST} does not describe {self.file}'s image (its "
                                        "head, runs or checksums a chunk)", "the checkpoint is damaged; take a new one")
            self.run_at = [o for o, _ in runs]
            self.run_file, at = [], 0
            for o, k in runs:
                self.run_file.append(at)
                at += k
            self.runs = runs
            self.by_base = {e.base: i for i, e in enumerate(h.entries)}
            self.first = []  # each entry's first digest index
            d = 0
            for e in h.entries:
                self.first.append(d)
                d += h.chunks(e)
            self.rank = []  # digest index -> its piece's index (-1: not held here)
            k = 1
            for d in range(h.digest_count):
                if not h.partial or h.held[d]:
                    self.rank.append(k)
                    k += 1
                else:
                    self.rank.append(-1)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def locate(self, base: int, size: int, k: int) -> tuple[int, int, int] | None:
        """(file offset, length, piece index) of chunk k of the allocation at `base` of `size` bytes,
        where this link holds it."""
        i = self.by_base.get(base)
        if i is None or self.head.entries[i].size != size:
            return None
        d = self.first[i] + k
        if self.rank[d] < 0:
            return None
        h, e = self.head, self.head.entries[i]
        off, n = e.offset + k * h.digest_chunk, min(h.digest_chunk, e.size - k * h.digest_chunk)
        r = bisect.bisect_right(self.run_at, off) - 1
        if r < 0 or off + n > self.runs[r][0] + self.runs[r][1]:
            raise CorruptCheckpoint(f"{self.link.path / store.MANIFEST}'s data.runs do not hold a chunk its image "
                                    "says it holds", "the checkpoint is damaged; take a new one")
        return self.run_file[r] + off - self.runs[r][0], n, self.rank[d]

    def read(self, where: tuple[int, int, int], what: str) -> bytes:
        off, n, idx = where
        raw = store.read_at(self.fd, n, off)
        if len(raw) != n:
            raise CorruptCheckpoint(f"{self.file} ended early", "the checkpoint is damaged; take a new one")
        if xxhash.xxh3_64_hexdigest(raw) != self.sums[idx]:
            raise CorruptCheckpoint(f"{what} in {self.file} (bytes {off}-{off + n - 1}) fails its {store.HASH} "
                                    "checksum", "the checkpoint is damaged; the process was not touched")
        return raw


class Selective:
    """A chain (newest first) read for a restore of some chunks: every link's head now, each chunk
    when asked for, from the newest link that holds it."""

    def __init__(self, chain: list[Link]) -> None:
        self.sources: list[_Source] = []
        try:
            for link in chain:
                self.sources.append(_Source(link))
        except BaseException:
            self.close()
            raise
        self.final = self.sources[0].head
        if len(chain) > 1 and not self.final.partial:
            self.close()
            raise CorruptCheckpoint(f"{chain[0].path} names an earlier link but its image is whole",
                                    "the checkpoint is damaged or was not written by gputrace; take a new one")
        self.spans = self.final.chunk_spans()
        self.where = [(self.final.entries[i].base, self.final.entries[i].size) for i, _, _ in self.spans]
        self.first = self.sources[0].first

    def close(self) -> None:
        for src in self.sources:
            src.close()
        self.sources = []

    def __enter__(self) -> "Selective":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chunk(self, d: int) -> bytes:
        """Digest chunk d of the newest image, read from the newest link that holds it and checked."""
        i = self.spans[d][0]
        base, size = self.where[d]
        k = d - self.first[i]
        for src in self.sources:
            at = src.locate(base, size, k)
            if at is not None:
                return src.read(at, f"chunk {k} of the allocation at {base:#x}")
        raise CorruptCheckpoint(f"{self.sources[0].link.path}'s chain holds no data for chunk {k} of the allocation at "
                                f"{base:#x}", "the chain is incomplete; restore an earlier complete checkpoint")
