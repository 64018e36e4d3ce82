"""What a uprobe tracer leaves in a process, and whether CRIU can carry the process anyway.

A process a uprobe has hit holds the kernel's `[uprobes]` page (the out-of-line area) for the rest of
its life. CRIU >= 4.2 can dump and restore such a process (`--allow-uprobes`); older ones refuse it.
Two traces of a tracer would still break the restored process, because CRIU copies them with it while
the kernel's probes that gave them meaning stay behind:

- live breakpoints: while a probe is attached, its function's first byte in the process's copy of the
  library is an int3 (the page is a private anonymous copy of the file's). Restored without the probe,
  the next call traps (SIGTRAP).
- pending returns: a call entered while a return probe was attached returns through a trampoline in
  the `[uprobes]` page (its return address on the stack points there) even after the probe is gone.
  Restored, that return jumps into a page that is no longer there (SIGSEGV).

`traces(pid)` finds both from /proc (pagemap, mem, each thread's stack); the whole-process checkpoint
refuses a job that has either, before it is frozen and again right before CRIU runs. A tracer can
still attach while CRIU copies the job (a windowed one opens and closes its probes in milliseconds):
`image_traces` looks for the same two in what CRIU wrote (its pagemap and pages images), so such a
checkpoint is refused before it is made valid.
"""

from __future__ import annotations

import bisect
import os
import struct
import time
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE")
INT3 = 0xCC
PM_PRESENT = 1 << 63
PM_FILE = 1 << 61  # file page or shared anonymous: set for a text page that is the file's own


@dataclass
class Mapping:
    lo: int
    hi: int
    perms: str
    offset: int
    path: str


@dataclass
class Traces:
    """What a uprobe tracer left in a process; `uprobes_page` alone is harmless to CRIU >= 4.2."""
    uprobes_page: int | None = None  # start of the [uprobes] mapping (the return trampoline's page)
    breakpoints: dict[str, int] = field(default_factory=dict)  # library -> int3s not in its file
    pending_returns: dict[int, int] = field(default_factory=dict)  # tid -> return addresses into the page

    @property
    def harmful(self) -> bool:
        return bool(self.breakpoints or self.pending_returns)

    def describe(self) -> str:
        parts = []
        if self.breakpoints:
            libs = ", ".join(f"{n} in {os.path.basename(lib)}" for lib, n in sorted(self.breakpoints.items()))
            parts.append(f"live uprobe breakpoints ({libs}): a tracer is attached to it now")
        if self.pending_returns:
            n = sum(self.pending_returns.values())
            parts.append(f"{n} call(s) in {len(self.pending_returns)} thread(s) still to return through the "
                         "kernel's uprobe trampoline")
        return "; ".join(parts)


def maps(pid: int) -> list[Mapping]:
    """The process's mappings (OSError if it cannot be read)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            p = ln.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in p[0].split("-"))
            out.append(Mapping(lo, hi, p[1], int(p[2], 16), p[5].strip() if len(p) > 5 else ""))
    return out


def _pagemap(pm, lo: int, hi: int) -> list[int]:
    pm.seek(lo // PAGE * 8)
    raw = pm.read((hi - lo) // PAGE * 8)
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def _text(layout: list[Mapping]) -> list[Mapping]:
    """Private executable mappings of files: where a uprobe writes its int3."""
    return [m for m in layout if "x" in m.perms and m.perms[3] == "p" and m.path.startswith("/")]


def _stacks(layout: list[Mapping]) -> list[Mapping]:
    """[stack], and the mappings that look like a thread's stack (anonymous, read-write, right above a
    guard page)."""
    return [m for prev, m in zip([None, *layout], layout)
            if m.path == "[stack]" or (not m.path and m.perms.startswith("rw") and prev is not None
                                       and prev.perms.startswith("---") and prev.hi == m.lo)]


def _int3s(ours: bytes, m: Mapping, va: int) -> int:
    """int3 bytes in `ours` (the process's copy of `m` at `va`) that the file does not have there (0 if
    the file cannot be read: nothing to compare with)."""
    try:
        with open(m.path, "rb") as f:
            f.seek(m.offset + va - m.lo)
            theirs = f.read(len(ours))
    except OSError:
        return 0
    return 0 if ours == theirs else sum(1 for a, b in zip(ours, theirs) if a != b and a == INT3)


def _words(data: bytes, word: int) -> int:
    """Occurrences of the aligned 8-byte `word` in `data` (aligned at its start)."""
    return sum(1 for (w,) in struct.iter_unpack("<Q", data[:len(data) // 8 * 8]) if w == word)


def _breakpoints(pid: int, layout: list[Mapping]) -> dict[str, int]:
    """int3 bytes in private copies of executable file pages that the file itself does not have."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/pagemap", "rb") as pm, open(f"/proc/{pid}/mem", "rb") as mem:
        for m in _text(layout):
            for i, e in enumerate(_pagemap(pm, m.lo, m.hi)):
                if not e & PM_PRESENT or e & PM_FILE:
                    continue  # not there, or the file's own page
                va = m.lo + i * PAGE
                mem.seek(va)
                n = _int3s(mem.read(PAGE), m, va)
                if n:
                    found[m.path] = found.get(m.path, 0) + n
    return found


def _stack_pointers(pid: int) -> dict[int, int | None]:
    """Each thread's user stack pointer, from /proc/PID/task/TID/syscall (None while it runs)."""
    out: dict[int, int | None] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:
            continue  # exited
        out[int(tid)] = int(fields[-2], 16) if len(fields) >= 3 else None
    return out


def _scan(pm, mem, lo: int, hi: int, word: int) -> int:
    """Occurrences of the aligned 8-byte `word` in the present pages of [lo, hi)."""
    hits = 0
    start = lo & ~(PAGE - 1)
    entries = _pagemap(pm, start, (hi + PAGE - 1) & ~(PAGE - 1))
    va = start
    for e in entries:
        if e & PM_PRESENT:
            a, b = max(va, lo & ~7), min(va + PAGE, hi)
            mem.seek(a)
            hits += _words(mem.read(b - a), word)
        va += PAGE
    return hits


def _pending_returns(pid: int, layout: list[Mapping], page: int) -> dict[int, int]:
    """Return addresses into the trampoline page on the threads' stacks: from each blocked thread's
    stack pointer up; for a thread that is running (no stack pointer to read), every mapping that
    looks like a thread stack (anonymous, read-write, above a guard page) and [stack]."""
    sps = _stack_pointers(pid)
    found: dict[int, int] = {}
    with open(f"/proc/{pid}/pagemap", "rb") as pm, open(f"/proc/{pid}/mem", "rb") as mem:
        scanned: set[int] = set()
        for tid, sp in sps.items():
            if sp is None:
                continue
            m = next((m for m in layout if m.lo <= sp < m.hi), None)
            if m is None:
                continue
            scanned.add(m.lo)
            n = _scan(pm, mem, sp, m.hi, page)
            if n:
                found[tid] = n
        if any(sp is None for sp in sps.values()):
            running = [t for t, sp in sps.items() if sp is None]
            for m in _stacks(layout):
                if m.lo not in scanned:
                    n = _scan(pm, mem, m.lo, m.hi, page)
                    if n:
                        found[running[0]] = found.get(running[0], 0) + n
    return found


# CRIU's image files (criu/image.c, images/pagemap.proto): every image opens with IMG_COMMON_MAGIC and
# its own magic (LE u32s); a pagemap then holds (u32 size, protobuf) records: a pagemap_head {1:
# pages_id}, then pagemap_entry {1: vaddr, 2: compat_nr_pages, 3: in_parent, 4: flags, 5: nr_pages}.
# pages-<pages_id>.img holds the bytes of the entries flagged PE_PRESENT, in their order.
IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PRESENT = 1 << 2


class ImageError(Exception):
    """CRIU's images are not as this reader expects them."""


def _fields(buf: bytes) -> dict[int, int]:
    """The varint fields of one protobuf message (the only kind a pagemap record has)."""
    out: dict[int, int] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        if key & 7 != 0:
            raise ImageError(f"pagemap record with a field of wire type {key & 7}")
        out[key >> 3], i = _varint(buf, i)
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ImageError("truncated varint in a pagemap record")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


def dumped_pages(images: str | os.PathLike, pid: int) -> tuple[str, list[tuple[int, int, int]]]:
    """The pages CRIU wrote for `pid`: (pages image path, [(vaddr, pages, offset in it)])."""
    path = os.path.join(images, f"pagemap-{pid}.img")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise ImageError(f"{path} does not start with CRIU's pagemap magic")
    records, i = [], 8
    while i < len(data):
        if i + 4 > len(data):
            raise ImageError(f"{path} ends inside a record")
        (n,) = struct.unpack_from("<I", data, i)
        records.append(_fields(data[i + 4:i + 4 + n]))
        i += 4 + n
    if not records or 1 not in records[0]:
        raise ImageError(f"{path} has no pagemap head")
    pages = os.path.join(images, f"pages-{records[0][1]}.img")
    out, offset = [], 0
    for r in records[1:]:
        n = r.get(5) or r.get(2, 0)
        if r.get(4, 0) & PE_PRESENT:
            out.append((r.get(1, 0), n, offset))
            offset += n * PAGE
    return pages, out


def image_traces(images: str | os.PathLike, pid: int, layout: list[Mapping]) -> Traces:
    """What `traces` looks for, in the pages CRIU wrote for `pid` (`maps`: the process's mappings as
    CRIU found them, read just before it ran). Of a file's mapping CRIU writes only the pages that are
    the process's own copies (a breakpoint's page is one), and an int3 there that the file lacks at the
    same offset is a breakpoint; pending returns are looked for in the stacks' pages."""
    page = next((m.lo for m in layout if m.path == "[uprobes]"), None)
    t = Traces(uprobes_page=page)
    pages_path, entries = dumped_pages(images, pid)
    # (lo, hi, mapping, is text) sorted by address: each dumped run is matched by bisection, not
    # against every mapping (a PyTorch job has hundreds of mappings and thousands of runs).
    spans = sorted([(m.lo, m.hi, m, True) for m in _text(layout)]
                   + ([(m.lo, m.hi, m, False) for m in _stacks(layout)] if page else []), key=lambda x: x[0])
    starts = [x[0] for x in spans]
    with open(pages_path, "rb") as pages:
        for va, n, off in entries:
            hi = va + n * PAGE
            i = max(0, bisect.bisect_right(starts, va) - 1)
            while i < len(spans) and spans[i][0] < hi:
                m_lo, m_hi, m, is_text = spans[i]
                i += 1
                lo, top = max(va, m_lo), min(hi, m_hi)
                if lo >= top:
                    continue
                pages.seek(off + lo - va)
                ours = pages.read(top - lo)
                if is_text:
                    k = _int3s(ours, m, lo)
                    if k:
                        t.breakpoints[m.path] = t.breakpoints.get(m.path, 0) + k
                else:
                    k = _words(ours, page)
                    if k:
                        t.pending_returns[pid] = t.pending_returns.get(pid, 0) + k
    return t


def settle(pid: int, timeout_s: float = 2.0, every_s: float = 0.02) -> Traces:
    """Once the tracers have let go: waits up to `timeout_s` for the calls entered under a return probe
    to return (nothing signals it, so it looks every `every_s`); returns what is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            t = traces(pid)
        except OSError:
            return Traces()  # gone, or not ours: the checkpoint says which
        if not t.harmful or time.monotonic() >= deadline:
            return t
        time.sleep(every_s)


def traces(pid: int) -> Traces:
    """What uprobe tracers left in `pid` (OSError if it cannot be read: gone, or not ours)."""
    layout = maps(pid)
    page = next((m.lo for m in layout if m.path == "[uprobes]"), None)
    t = Traces(uprobes_page=page)
    # A probe attached to a function the process has not called yet leaves an int3 and no page.
    t.breakpoints = _breakpoints(pid, layout)
    if page is not None:  # else no return ever went through a trampoline
        t.pending_returns = _pending_returns(pid, layout, page)
    return t
