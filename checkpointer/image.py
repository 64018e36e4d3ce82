"""The image the shim writes (`dump`) and reads (`restore`): see shim/image.c.

    header  {magic b"GPUTRACE-IMG-2\\n\\0", u64 count, u64 data_offset, u64 data_bytes, u64 chunk,
             u64 digest_chunk, u64 digest_offset, u64 digest_count, u64 held_offset, u64 flags}
    entries count x {u64 base, u64 size, u64 offset, i32 device, i32 kind}
    digests digest_count x {u64, u64} at digest_offset: each allocation's chunks of digest_chunk bytes
    held    flags & PARTIAL: digest_count bytes at held_offset, 1 where this image holds the chunk
    data    each allocation at its offset (4 KiB aligned)

Version 1 (b"GPUTRACE-IMG-1\\n\\0") ends its header after `chunk` and has no digests.  A full image is
a checkpoint's data file byte for byte, so restore hands the shim the verified file; a partial one
(an incremental checkpoint's link) holds only its changed chunks, the rest being its base's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"GPUTRACE-IMG-2\n\0"
MAGIC_V1 = b"GPUTRACE-IMG-1\n\0"
PARTIAL = 1
_HDR = struct.Struct("<16s9Q")
_HDR_V1 = struct.Struct("<16s4Q")
_ENT = struct.Struct("<3Q2i")

#: The shim's allocation kinds (shim_int.h: simcuda.h's numbering, then the kinds simcuda lacks).
KIND_NAMES = {1: "device", 2: "pitch", 3: "async", 4: "host", 5: "va_reserve", 6: "vmm_phys", 7: "vmm_map",
              8: "managed", 9: "host_registered"}
#: Kinds whose data a dump saves (vmm_map only where the program made the mapping readable).
SAVED_KINDS = ("device", "pitch", "async", "managed", "vmm_map")


@dataclass(frozen=True)
class Entry:
    base: int
    size: int
    offset: int
    device: int
    kind: str


@dataclass(frozen=True)
class Header:
    count: int
    data_offset: int
    data_bytes: int
    chunk: int
    entries: tuple[Entry, ...]
    digest_chunk: int = 0        # bytes each digest covers (0: the image has none)
    digest_offset: int = 0
    digest_count: int = 0
    held_offset: int = 0
    flags: int = 0
    digests: bytes = b""         # digest_count x 16 bytes
    held: bytes = b""            # partial: digest_count bytes, 1 where the image holds the chunk

    @property
    def image_bytes(self) -> int:
        return self.data_offset + self.data_bytes

    @property
    def partial(self) -> bool:
        return bool(self.flags & PARTIAL)

    def chunks(self, e: Entry) -> int:
        """How many digests entry `e` has."""
        return -(-e.size // self.digest_chunk) if self.digest_chunk else 0

    def chunk_spans(self) -> list[tuple[int, int, int]]:
        """(entry index, offset in the image, length) of every digest chunk, in the image's order."""
        out = []
        for i, e in enumerate(self.entries):
            for k in range(self.chunks(e)):
                at = k * self.digest_chunk
                out.append((i, e.offset + at, min(self.digest_chunk, e.size - at)))
        return out

    def pieces(self) -> list[tuple[int, int]]:
        """(offset, length) in the image of what a checkpoint checksums one by one, so that a restore
        reads and checks only the chunks it copies: the head, then each digest chunk the image holds
        (all of them for a full image), in order.  Empty without digests."""
        if not self.digest_chunk:
            return []
        spans = self.chunk_spans()
        return [(0, self.data_offset)] + [(off, n) for d, (_, off, n) in enumerate(spans)
                                          if not self.partial or self.held[d]]

    def held_runs(self) -> list[tuple[int, int]]:
        """(offset, length) in the image of the data it holds, in order, adjacent chunks merged:
        every allocation's whole data for a full image, its held chunks' for a partial one."""
        runs: list[tuple[int, int]] = []

        def add(off: int, n: int) -> None:
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((off, n))

        d = 0
        for e in self.entries:
            if not self.partial:
                add(e.offset, e.size)
                continue
            for k in range(self.chunks(e)):
                if self.held[d]:
                    at = k * self.digest_chunk
                    add(e.offset + at, min(self.digest_chunk, e.size - at))
                d += 1
        return runs


class BadImage(ValueError):
    pass


def head_bytes(buf: bytes | memoryview) -> int:
    """How many bytes of an image come before its data (what `parse` needs), from its first 128."""
    if len(buf) < _HDR_V1.size:
        raise BadImage("shorter than an image header")
    return _HDR_V1.unpack_from(buf, 0)[2]


def parse(buf: bytes | memoryview) -> Header:
    """Parses the header, entries, digests and held map at the start of `buf` (at least data_offset
    bytes of an image)."""
    if len(buf) < _HDR_V1.size:
        raise BadImage("shorter than an image header")
    magic = bytes(buf[:16])
    if magic == MAGIC_V1:
        _, count, data_offset, data_bytes, chunk = _HDR_V1.unpack_from(buf, 0)
        dchunk = doff = dcount = hoff = flags = 0
        hsize = _HDR_V1.size
    elif magic == MAGIC and len(buf) >= _HDR.size:
        _, count, data_offset, data_bytes, chunk, dchunk, doff, dcount, hoff, flags = _HDR.unpack_from(buf, 0)
        hsize = _HDR.size
    else:
        raise BadImage("not a gputrace image (bad magic)")
    if data_offset < hsize + count * _ENT.size or len(buf) < hsize + count * _ENT.size:
        raise BadImage("image header inconsistent")
    entries = []
    for i in range(count):
        base, size, offset, device, kind = _ENT.unpack_from(buf, hsize + i * _ENT.size)
        entries.append(Entry(base, size, offset, device, KIND_NAMES.get(kind, f"kind{kind}")))
    digests = held = b""
    if dchunk:
        if dcount != sum(-(-e.size // dchunk) for e in entries) or doff < hsize + count * _ENT.size \
                or doff + 16 * dcount > min(data_offset, len(buf)):
            raise BadImage("image digests inconsistent with its entries")
        digests = bytes(buf[doff:doff + 16 * dcount])
        if flags & PARTIAL:
            if hoff < doff + 16 * dcount or hoff + dcount > min(data_offset, len(buf)):
                raise BadImage("image held map inconsistent")
            held = bytes(buf[hoff:hoff + dcount])
    elif flags & PARTIAL:
        raise BadImage("a partial image without digests")
    return Header(count, data_offset, data_bytes, chunk, tuple(entries), dchunk, doff, dcount, hoff, flags,
                  digests, held)


def saved_allocations(status: dict) -> list[tuple[int, int, int]]:
    """(base, size, device) of what a dump of a process with this status would save, by address."""
    out = []
    for a in status.get("allocations", []):
        if a["kind"] not in SAVED_KINDS:
            continue
        if a["kind"] == "vmm_map" and not a.get("access", 0) & 1:
            continue
        out.append((a["base"], a["size"], a["device"]))
    return sorted(out)


KIND_NUMBERS = {v: k for k, v in KIND_NAMES.items()}


def partial_head(h: Header, held: bytes) -> tuple[bytes, list[int], int]:
    """The head of an image of some of `h`'s chunks (`held`: 1 where it holds the chunk), laid out as
    the shim lays out a partial image: (head bytes, each entry's offset, the image's size).  The
    shim restores from it what differs from its digests, and refuses where a chunk it lacks does."""
    n, nd = len(h.entries), h.digest_count
    doff = -(-(_HDR.size + n * _ENT.size) // 16) * 16
    hoff = doff + 16 * nd
    data_offset = -(-(hoff + nd) // 4096) * 4096
    offs, at = [], data_offset
    for e in h.entries:
        offs.append(at)
        at = -(-(at + e.size) // 4096) * 4096
    buf = bytearray(data_offset)
    _HDR.pack_into(buf, 0, MAGIC, n, data_offset, at - data_offset, h.chunk, h.digest_chunk, doff, nd, hoff, PARTIAL)
    for i, e in enumerate(h.entries):
        kind = KIND_NUMBERS.get(e.kind) or int(e.kind[4:])
        _ENT.pack_into(buf, _HDR.size + i * _ENT.size, e.base, e.size, offs[i], e.device, kind)
    buf[doff:doff + 16 * nd] = h.digests
    buf[hoff:hoff + nd] = held
    return bytes(buf), offs, at
