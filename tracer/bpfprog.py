"""The compiled BPF program (bpf/counts.bpf.c) and typed access to its maps.

`mode` fixes how the programs attach: "multi" loads them for uprobe-multi links (expected attach type
BPF_TRACE_UPROBE_MULTI), "perf" for per-probe perf links; the kernel refuses to mix the two, so a
fallback means loading again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from gputrace.base.bccload import import_bcc
from gputrace.base.errors import BpfUnavailable

from . import links

HIST_SLOTS = 40  # GT_HIST_SLOTS in bpf/gputrace.h
MAX_DEPTH = 8
COOKIE_TIMED = 1 << 32
COOKIE_MARKER = 1 << 33
COOKIE_STEPPED = 1 << 34
COOKIE_WATCH = 1 << 35
CLOSED, OPEN, OUTSIDE = 0, 1, 2  # GT_CLOSED, GT_OPEN, GT_OUTSIDE
_BATCH = 1024  # rows per lookup-batch syscall
# struct gt_key and struct gt_stats (bpf/gputrace.h) as the batch read returns them, parsed in one C
# call a row rather than through ctypes' field accessors; checked against bcc's own layout at load.
_KEY = struct.Struct("=II")
_LEAF = struct.Struct(f"={8 + HIST_SLOTS}Q")  # calls, timed, total_ns, outer_ns, nested, closed, outside, watched, hist
ERROR_NAMES = ("stats_full", "threads_full", "depth", "unpaired", "stale")


@dataclass(frozen=True)
class RawStats:
    """One (process, function) row of the `stats` map: cumulative since the program loaded."""

    calls: int
    timed: int
    total_ns: int
    outer_ns: int
    nested: int
    closed: int
    hist: tuple[int, ...]
    outside: int = 0
    watched: int = 0   # hits on the watch link (functions no window probes), counted at any time

    def _zip(self, other: "RawStats", op) -> "RawStats":
        return RawStats(
            op(self.calls, other.calls), op(self.timed, other.timed), op(self.total_ns, other.total_ns),
            op(self.outer_ns, other.outer_ns), op(self.nested, other.nested), op(self.closed, other.closed),
            self.hist if other.hist is ZERO_HIST else tuple(map(op, self.hist, other.hist)),
            op(self.outside, other.outside), op(self.watched, other.watched),
        )

    # Spelled out rather than through _zip: run per process, function and interval by `top`.
    def __sub__(self, o: "RawStats") -> "RawStats":
        h, oh = self.hist, o.hist
        hist = h if oh is ZERO_HIST else (ZERO_HIST if len(h) == HIST_SLOTS else (0,) * len(h)) if h == oh \
            else tuple(map(int.__sub__, h, oh))
        return RawStats(self.calls - o.calls, self.timed - o.timed, self.total_ns - o.total_ns,
                        self.outer_ns - o.outer_ns, self.nested - o.nested, self.closed - o.closed, hist,
                        self.outside - o.outside, self.watched - o.watched)

    def __add__(self, o: "RawStats") -> "RawStats":
        h, oh = self.hist, o.hist
        hist = h if oh is ZERO_HIST else oh if h is ZERO_HIST else tuple(map(int.__add__, h, oh))
        return RawStats(self.calls + o.calls, self.timed + o.timed, self.total_ns + o.total_ns,
                        self.outer_ns + o.outer_ns, self.nested + o.nested, self.closed + o.closed, hist,
                        self.outside + o.outside, self.watched + o.watched)


ZERO_HIST = (0,) * HIST_SLOTS
ZERO = RawStats(0, 0, 0, 0, 0, 0, ZERO_HIST)


def source_dir() -> Path:
    return Path(str(resources.files("gputrace.bpf")))


class Program:
    def __init__(self, mode: str = "multi", *, max_stats: int = 16384, max_threads: int = 16384) -> None:
        if mode not in ("multi", "perf"):
            raise ValueError(mode)
        self.mode = mode
        bcc = import_bcc()
        src = source_dir() / "counts.bpf.c"
        cflags = [f"-I{source_dir()}", f"-DGT_MAX_STATS={max_stats}", f"-DGT_MAX_THREADS={max_threads}"]
        try:
            self.bpf = bcc.BPF(src_file=str(src).encode(), cflags=cflags)
            attach_type = links.BPF_TRACE_UPROBE_MULTI if mode == "multi" else -1
            self.entry_fd = self.bpf.load_func(b"gt_entry", bcc.BPF.KPROBE, attach_type=attach_type).fd
            self.return_fd = self.bpf.load_func(b"gt_return", bcc.BPF.KPROBE, attach_type=attach_type).fd
        except Exception as exc:  # bcc raises bare Exception for compile and load failures
            raise BpfUnavailable(
                f"the BPF program did not compile or load: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}",
                "run `gputrace doctor`: kernel headers, bcc and BPF support are checked there",
            ) from None
        self._stats = self.bpf[b"stats"]
        self._batch: object = True  # True: not tried yet; None: unsupported; else the buffers
        self._rows: dict[tuple[int, int], tuple[bytes, RawStats]] = {}  # (tgid, func) -> last bytes read
        self._errors = self.bpf[b"errors"]
        self._config = self.bpf[b"config"]
        self._seen = self.bpf[b"seen"]
        self._threads = None  # the `threads` table, looked up on first use
        # seen_hits() is polled 50 times a second per file: one bpf() lookup into kept buffers,
        # not bcc's table access (about 10x the cost).
        self._seen_key, self._seen_val = ctypes.c_int(0), ctypes.c_uint64(0)
        self.generation = 0
        self.hit_ns = (0, 0, 0, 0)

    def attach(self, path: str, offsets: Sequence[int], cookies: Sequence[int], *, retprobe: bool, pid: int = 0) -> links.Link:
        fd = self.return_fd if retprobe else self.entry_fd
        if self.mode == "multi":
            return links.attach_multi(fd, path, offsets, cookies, retprobe=retprobe, pid=pid)
        return links.attach_perf(fd, path, offsets, cookies, retprobe=retprobe, pid=pid if pid > 0 else -1)

    def _set_config(self, state: int) -> None:
        leaf = self._config[ctypes.c_int(0)]
        leaf.gen = self.generation
        leaf.open = state
        for i, ns in enumerate(self.hit_ns):
            leaf.hit_ns[i] = int(ns)
        self._config[ctypes.c_int(0)] = leaf

    def set_hit_costs(self, emulated_entry: float, emulated_timed: float, stepped_entry: float, stepped_timed: float) -> None:
        """Calibrated hit costs, taken out of the time of calls that contain traced calls."""
        self.hit_ns = (emulated_entry, emulated_timed, stepped_entry, stepped_timed)

    def next_generation(self) -> None:
        """Frames pushed before now can no longer be paired (threads drop them lazily); counting
        stays closed until open()."""
        self.generation += 1
        self._set_config(CLOSED)

    def open(self) -> None:
        self._set_config(OPEN)

    def close_counting(self) -> None:
        self._set_config(CLOSED)

    def outside(self) -> None:
        """Between windows: only the marker's link is attached; its hits count as `outside`."""
        self._set_config(OUTSIDE)

    def thread_ids(self) -> set[int]:
        """Thread ids in the `threads` map: every live thread that has made a timed call (entries go
        when the thread exits). Key by key (bcc's iteration): read only when a caller needs it."""
        if self._threads is None:
            self._threads = self.bpf[b"threads"]
        return {k.value for k in self._threads.keys()}

    def read_stats(self) -> dict[tuple[int, int], RawStats]:
        """Every row of the `stats` map, by (tgid, function)."""
        return {(tgid, f): st for tgid, rows in self.read_by_tgid().items() for f, st in rows.items()}

    def read_by_tgid(self) -> dict[int, dict[int, RawStats]]:
        """Every row of the `stats` map, by tgid then function. Read in batches (one syscall per 1024
        rows, not two per row) where the kernel has them (5.6+); a row whose bytes did not change
        since the last read comes back as the same RawStats object, so callers can skip it cheaply."""
        if self._batch is not None:
            try:
                return self._read_batched()
            except OSError:
                self._batch = None  # no batch ops here: read row by row from now on
        out: dict[int, dict[int, RawStats]] = {}
        for k, v in self._stats.items():
            key = (k.tgid, k.func)
            blob = bytes(v)
            cached = self._rows.get(key)
            if cached is None or cached[0] != blob:
                cached = self._rows[key] = (blob, RawStats(v.calls, v.timed, v.total_ns, v.outer_ns, v.nested,
                                                           v.closed, tuple(v.hist), v.outside, v.watched))
            out.setdefault(k.tgid, {})[k.func] = cached[1]
        return out

    def _read_batched(self) -> dict[int, dict[int, RawStats]]:
        from bcc.libbcc import lib

        if self._batch is True:
            if ctypes.sizeof(self._stats.Key) != _KEY.size or ctypes.sizeof(self._stats.Leaf) != _LEAF.size:
                raise OSError(errno.EINVAL, "unexpected stats layout")  # then the ctypes path reads it
            self._batch = ((self._stats.Key * _BATCH)(), (self._stats.Leaf * _BATCH)())
        keys, vals = self._batch
        size = _LEAF.size
        rows, unpack = self._rows, _LEAF.unpack
        token_in, token_out, count = ctypes.c_uint32(0), ctypes.c_uint32(0), ctypes.c_uint32(0)
        out: dict[int, dict[int, RawStats]] = {}
        first, n_rows = True, 0
        while True:
            count.value = _BATCH
            res = lib.bpf_lookup_batch(self._stats.map_fd, None if first else ctypes.byref(token_in),
                                       ctypes.byref(token_out), ctypes.byref(keys), ctypes.byref(vals),
                                       ctypes.byref(count))
            err = ctypes.get_errno()
            n = count.value
            n_rows += n
            raw = ctypes.string_at(vals, n * size)
            for i, key in enumerate(_KEY.iter_unpack(ctypes.string_at(keys, n * _KEY.size))):
                blob = raw[i * size:(i + 1) * size]
                cached = rows.get(key)
                if cached is None or cached[0] != blob:
                    v = unpack(blob)
                    cached = rows[key] = (blob, RawStats(v[0], v[1], v[2], v[3], v[4], v[5], v[8:], v[6], v[7]))
                tgid_rows = out.get(key[0])
                if tgid_rows is None:
                    tgid_rows = out[key[0]] = {}
                tgid_rows[key[1]] = cached[1]
            if res != 0:
                if err == errno.ENOENT:  # the end of the map
                    break
                raise OSError(err, os.strerror(err))
            token_in.value, first = token_out.value, False
        if len(rows) > 2 * n_rows + 64:  # rows forgotten or of exited processes
            self._rows = {k: v for k, v in rows.items() if k[1] in out.get(k[0], ())}
        return out

    def forget(self, keys: Sequence[tuple[int, int]]) -> None:
        for tgid, func in keys:
            key = self._stats.Key(tgid, func)
            try:
                del self._stats[key]
            except KeyError:
                pass

    def seen_hits(self) -> int:
        """Hits on watch links so far, all processes together: one lookup, polled while windows wait."""
        from bcc.libbcc import lib

        if lib.bpf_lookup_elem(self._seen.map_fd, ctypes.byref(self._seen_key), ctypes.byref(self._seen_val)) != 0:
            return int(self._seen[ctypes.c_int(0)].value)
        return self._seen_val.value

    def read_errors(self) -> dict[str, int]:
        return {name: int(self._errors[ctypes.c_int(i)].value) for i, name in enumerate(ERROR_NAMES)}

    def close(self) -> None:
        self.bpf.cleanup()
