"""Reading CRIU's pagemap and pages images for a tracer's traces (checkpointer/uprobes.py), on images
written here in CRIU's format: the whole-process test with real CRIU covers what CRIU writes."""

from __future__ import annotations

import struct

import pytest

from gputrace.checkpointer import full, uprobes
from gputrace.checkpointer.uprobes import PAGE, Mapping

PID = 4242
LIB_LO = 0x7F0000000000
STACK_LO = 0x7FFF00000000
UPROBES = 0x7FFFF7FF0000


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def message(**fields: int) -> bytes:
    nums = {"pages_id": 1, "vaddr": 1, "compat_nr_pages": 2, "in_parent": 3, "flags": 4, "nr_pages": 5}
    body = b"".join(varint(nums[k] << 3) + varint(v) for k, v in fields.items())
    return struct.pack("<I", len(body)) + body


def write_images(d, entries: list[tuple[int, int, int]], pages: bytes) -> None:
    """entries: (vaddr, nr_pages, flags), as CRIU 4 writes them (nr_pages in field 5, field 2 zero)."""
    head = struct.pack("<II", uprobes.IMG_COMMON_MAGIC, uprobes.PAGEMAP_MAGIC) + message(pages_id=7)
    body = b"".join(message(vaddr=va, compat_nr_pages=0, flags=fl, nr_pages=n) for va, n, fl in entries)
    (d / f"pagemap-{PID}.img").write_bytes(head + body)
    (d / "pages-7.img").write_bytes(pages)


@pytest.fixture
def lib(tmp_path):
    """A 'library' of two text pages, with int3 padding of its own (which is no breakpoint)."""
    code = bytearray(b"\x55\x48\x89\xe5" * (PAGE // 4)) + bytearray(b"\x90" * PAGE)
    code[100:104] = b"\xcc\xcc\xcc\xcc"
    p = tmp_path / "libcuda.so.1"
    p.write_bytes(bytes(code))
    return p, bytes(code)


def layout(lib_path, with_uprobes: bool) -> list[Mapping]:
    maps = [Mapping(LIB_LO, LIB_LO + 2 * PAGE, "r-xp", 0, str(lib_path)),
            Mapping(STACK_LO - PAGE, STACK_LO, "---p", 0, ""),
            Mapping(STACK_LO, STACK_LO + 4 * PAGE, "rw-p", 0, "")]
    if with_uprobes:
        maps.append(Mapping(UPROBES, UPROBES + PAGE, "r-xp", 0, "[uprobes]"))
    return maps


def test_a_breakpoint_and_a_pending_return_in_the_images_are_found(tmp_path, lib):
    path, code = lib
    text = bytearray(code[PAGE:])
    text[16] = 0xCC  # a probe's int3 on the second page
    stack = bytearray(PAGE)
    struct.pack_into("<Q", stack, 64, UPROBES)  # a return address into the trampoline
    zero = bytes(PAGE)
    # A page not present (no bytes), the library's second page, a present stack page after a lazy one.
    write_images(tmp_path, [(STACK_LO, 1, 0), (LIB_LO + PAGE, 1, uprobes.PE_PRESENT),
                            (STACK_LO + PAGE, 1, 1 << 1), (STACK_LO + 2 * PAGE, 2, uprobes.PE_PRESENT)],
                 bytes(text) + bytes(stack) + zero)
    t = uprobes.image_traces(tmp_path, PID, layout(path, True))
    assert t.breakpoints == {str(path): 1}  # the library's own int3 padding is not counted
    assert t.pending_returns == {PID: 1}
    with pytest.raises(full.CheckpointError, match="images CRIU wrote"):
        full._check_images(tmp_path, PID, layout(path, True))


def test_clean_images_pass_and_unreadable_ones_are_said_to_be_unchecked(tmp_path, lib):
    path, code = lib
    write_images(tmp_path, [(LIB_LO, 2, uprobes.PE_PRESENT)], code)  # copied pages, as the file has them
    assert not uprobes.image_traces(tmp_path, PID, layout(path, True)).harmful
    assert full._check_images(tmp_path, PID, layout(path, False)) == "clean"
    (tmp_path / f"pagemap-{PID}.img").write_bytes(b"not an image")
    assert full._check_images(tmp_path, PID, layout(path, False)).startswith("skipped: ")
    (tmp_path / f"pagemap-{PID}.img").unlink()
    assert full._check_images(tmp_path, PID, layout(path, False)).startswith("skipped: ")
    assert full._check_images(tmp_path, PID, None).startswith("skipped: ")
