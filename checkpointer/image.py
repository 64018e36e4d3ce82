"""The image the shim writes (`dump`) and reads (`restore`): see shim/dump.c.

    header  {magic b"GPUTRACE-IMG-1\\n\\0", u64 count, u64 data_offset, u64 data_bytes, u64 chunk}
    entries count x {u64 base, u64 size, u64 offset, i32 device, i32 kind}
    data    each allocation at its offset (4 KiB aligned)

A checkpoint's data file is the image byte for byte, so restore hands the shim the verified file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"GPUTRACE-IMG-1\n\0"
_HDR = struct.Struct("<16s4Q")
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

    @property
    def image_bytes(self) -> int:
        return self.data_offset + self.data_bytes


class BadImage(ValueError):
    pass


def parse(buf: bytes | memoryview) -> Header:
    """Parses the header and entries at the start of `buf` (at least data_offset bytes of an image)."""
    if len(buf) < _HDR.size:
        raise BadImage("shorter than an image header")
    magic, count, data_offset, data_bytes, chunk = _HDR.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadImage("not a gputrace image (bad magic)")
    if data_offset < _HDR.size + count * _ENT.size or len(buf) < _HDR.size + count * _ENT.size:
        raise BadImage("image header inconsistent")
    entries = []
    for i in range(count):
        base, size, offset, device, kind = _ENT.unpack_from(buf, _HDR.size + i * _ENT.size)
        entries.append(Entry(base, size, offset, device, KIND_NAMES.get(kind, f"kind{kind}")))
    return Header(count, data_offset, data_bytes, chunk, tuple(entries))


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
