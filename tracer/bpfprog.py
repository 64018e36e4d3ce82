"""The compiled BPF program (bpf/counts.bpf.c) and typed access to its maps.

`mode` fixes how the programs attach: "multi" loads them for uprobe-multi links (expected attach type
BPF_TRACE_UPROBE_MULTI), "perf" for per-probe perf links; the kernel refuses to mix the two, so a
fallback means loading again.

The program comes one of two ways, the same programs and maps either way (bpf/compat.h):
  object  the precompiled ELF object (bpf/__init__.py: built into the wheel, or at first use by
          clang in a checkout), loaded with raw syscalls by tracer/bpfobj.py: no bcc, no compiler,
          no kernel headers needed
  bcc     compiled here at run time by bcc, against the kernel's headers
$GPUTRACE_BPF picks: "auto" (the default: the object, and bcc where the object is missing or the
kernel refuses it), "object" or "bcc" (that one only). $GPUTRACE_BPF_OBJECT names an object file
to load instead of the built one. `Program.origin` says which came and why.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from gputrace.base.bccload import import_bcc
from gputrace.base.errors import BpfUnavailable, BuildError, PermissionDenied

from . import links
from .bpfmaps import Map

BPF_ENV = "GPUTRACE_BPF"
OBJECT_ENV = "GPUTRACE_BPF_OBJECT"
LOADERS = ("auto", "object", "bcc")
MAP_NAMES = ("stats", "threads", "errors", "config", "seen", "tstats")

def source_dir() -> Path:
    return Path(str(resources.files("gputrace.bpf")))


def header_constants(text: str) -> dict[str, int]:
    """The `#define GT_*` numbers and the `enum gt_error` members of bpf/gputrace.h, evaluated: the
    header is the one definition, user space reads it instead of repeating it."""
    out: dict[str, int] = {}
    for name, value in re.findall(r"^#define\s+(GT_\w+)\s+([^/\n]+?)\s*(?:/\*.*)?$", text, re.M):
        expr = re.sub(r"(?<=[0-9a-fA-F])U?LL\b|(?<=[0-9])U\b", "", value)
        if re.fullmatch(r"[0-9a-fA-FxX()<\s]+", expr):
            out[name] = int(eval(expr, {"__builtins__": {}}))  # digits, shifts and parentheses only
    enum = re.search(r"enum gt_error\s*{(.*?)}", text, re.S)
    for i, name in enumerate(re.findall(r"^\s*(GT_ERR_\w+)", enum.group(1), re.M) if enum else ()):
        out[name] = i
    return out


_H = header_constants((source_dir() / "gputrace.h").read_text())
HIST_SLOTS = _H["GT_HIST_SLOTS"]
MAX_DEPTH = _H["GT_MAX_DEPTH"]
COOKIE_TIMED = _H["GT_COOKIE_TIMED"]
COOKIE_MARKER = _H["GT_COOKIE_MARKER"]
COOKIE_STEPPED = _H["GT_COOKIE_STEPPED"]
COOKIE_WATCH = _H["GT_COOKIE_WATCH"]
COOKIE_KEPT = _H["GT_COOKIE_KEPT"]
CLOSED, OPEN, OUTSIDE, ARMED = _H["GT_CLOSED"], _H["GT_OPEN"], _H["GT_OUTSIDE"], _H["GT_ARMED"]
ERROR_NAMES = tuple(n.removeprefix("GT_ERR_").lower()
                    for n, _ in sorted(((k, v) for k, v in _H.items() if k.startswith("GT_ERR_") and k != "GT_ERR_COUNT"),
                                       key=lambda kv: kv[1]))
_BATCH = 1024  # rows per lookup-batch syscall
# The integer types the loaders give struct fields (u32, u64, ...), under whichever alias ctypes uses.
_CTYPE_CODES = {ctypes.c_uint32: "I", ctypes.c_int32: "i", ctypes.c_uint64: "Q", ctypes.c_int64: "q",
                ctypes.c_ulonglong: "Q", ctypes.c_longlong: "q"}


@dataclass(frozen=True)
class Layout:
    """A map's key or value as its loader typed it (bcc from the C definition, the object loader
    from the object's BTF), for reading batches of rows in one C call a row (struct.unpack) rather
    than through ctypes' field accessors: the format and, per field, its slice of the unpacked tuple. Checked field by field (offset and type) against the
    ctypes type, so a change to the header that user space does not follow fails at load."""

    struct: struct.Struct
    fields: dict[str, slice]

    @classmethod
    def of(cls, ctype: type) -> "Layout":
        fmt, fields, at = "=", {}, 0
        for name, t in ctype._fields_:
            base, n = (t._type_, t._length_) if issubclass(t, ctypes.Array) else (t, 1)
            code = _CTYPE_CODES.get(base)
            offset = getattr(ctype, name).offset
            if code is None or offset != struct.calcsize(fmt):
                raise BpfUnavailable(f"the BPF map layout has a field gputrace cannot read: {ctype.__name__}.{name} "
                                     f"({t.__name__} at offset {offset})", "reinstall gputrace: its BPF program and "
                                     "its reader are out of step")
            fmt += f"{n}{code}"
            fields[name] = slice(at, at + n) if issubclass(t, ctypes.Array) else slice(at, at + 1)
            at += n
        s = struct.Struct(fmt)
        if s.size != ctypes.sizeof(ctype):
            raise BpfUnavailable(f"the BPF map layout of {ctype.__name__} has padding gputrace does not expect",
                                 "reinstall gputrace: its BPF program and its reader are out of step")
        return cls(s, fields)

    def index(self, name: str) -> int:
        return self.fields[name].start


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
    kept_open: int = 0  # of a kept function's, those while a window was open

    def _zip(self, other: "RawStats", op) -> "RawStats":
        return RawStats(
            op(self.calls, other.calls), op(self.timed, other.timed), op(self.total_ns, other.total_ns),
            op(self.outer_ns, other.outer_ns), op(self.nested, other.nested), op(self.closed, other.closed),
            self.hist if other.hist is ZERO_HIST else tuple(map(op, self.hist, other.hist)),
            op(self.outside, other.outside), op(self.watched, other.watched), op(self.kept_open, other.kept_open),
        )

    # Spelled out rather than through _zip: run per process, function and interval by `top`.
    def __sub__(self, o: "RawStats") -> "RawStats":
        h, oh = self.hist, o.hist
        hist = h if oh is ZERO_HIST else (ZERO_HIST if len(h) == HIST_SLOTS else (0,) * len(h)) if h == oh \
            else tuple(map(int.__sub__, h, oh))
        return RawStats(self.calls - o.calls, self.timed - o.timed, self.total_ns - o.total_ns,
                        self.outer_ns - o.outer_ns, self.nested - o.nested, self.closed - o.closed, hist,
                        self.outside - o.outside, self.watched - o.watched, self.kept_open - o.kept_open)

    def __add__(self, o: "RawStats") -> "RawStats":
        h, oh = self.hist, o.hist
        hist = h if oh is ZERO_HIST else oh if h is ZERO_HIST else tuple(map(int.__add__, h, oh))
        return RawStats(self.calls + o.calls, self.timed + o.timed, self.total_ns + o.total_ns,
                        self.outer_ns + o.outer_ns, self.nested + o.nested, self.closed + o.closed, hist,
                        self.outside + o.outside, self.watched + o.watched, self.kept_open + o.kept_open)


ZERO_HIST = (0,) * HIST_SLOTS
ZERO = RawStats(0, 0, 0, 0, 0, 0, ZERO_HIST)


@dataclass(frozen=True)
class Origin:
    """Where the loaded program came from: `loader` "object" or "bcc", `detail` a sentence for
    doctor (which object, or why bcc); `fallback` the reason the object was not used and
    `fallback_hint` what would make it load (auto only)."""

    loader: str
    detail: str
    fallback: str = ""
    fallback_hint: str = ""


class MultiUnsupported(BpfUnavailable):
    """The kernel loads the program, but not for uprobe-multi links: bcc would fare no better."""


def loader_choice() -> str:
    want = os.environ.get(BPF_ENV, "").strip().lower() or "auto"
    if want not in LOADERS:
        raise BpfUnavailable(f"{BPF_ENV}={os.environ[BPF_ENV]!r} is not one of {', '.join(LOADERS)}",
                             f"unset {BPF_ENV} (auto: the precompiled object, bcc where it cannot load), or set it "
                             "to object or bcc")
    return want


def object_file() -> tuple[Path, str]:
    """The BPF object to load and how it came: $GPUTRACE_BPF_OBJECT, the wheel's prebuilt copy, or
    built here by clang (cached). BpfUnavailable says why there is none."""
    from gputrace import bpf as bpfsrc
    from gputrace.base import native

    env = os.environ.get(OBJECT_ENV)
    if env:
        return Path(env), f"{OBJECT_ENV}={env}"
    if native.is_prebuilt(bpfsrc.OBJECT):
        return native.build(**bpfsrc.OBJECT), "came built with the wheel"
    try:
        path = native.build(**bpfsrc.OBJECT)
    except BuildError as exc:
        reason = exc.msg.splitlines()[0] if exc.msg.startswith("no clang") else \
            next((ln.strip() for ln in exc.msg.splitlines() if "error" in ln), exc.msg.splitlines()[-1])
        raise BpfUnavailable(f"no precompiled BPF object in this install, and it cannot be built here: {reason}",
                             "install gputrace from its platform wheel (it carries the object), or install clang "
                             "(apt-get install clang) to build it at first use") from None
    return path, "built here by clang at first use, cached"


@dataclass(frozen=True)
class StepState:
    """An armed step window, as the program left it (Program.step_state)."""

    state: int                  # ARMED: not opened yet; OPEN: opened, not closed; CLOSED: done (or closed by user space)
    steps: int                  # calls of the step function between its opening and closing ones (0: not closed by it)
    t0: float | None            # CLOCK_MONOTONIC seconds: the opening call (None: not opened)
    t1: float | None            # ... the closing call


class Program:
    def __init__(self, mode: str = "multi", *, max_stats: int = 16384, max_threads: int = 16384) -> None:
        if mode not in ("multi", "perf"):
            raise ValueError(mode)
        self.mode = mode
        self._bcc_prog = None   # bcc's BPF object, on the bcc path
        self._loaded = None     # bpfobj.Loaded, on the object path
        choice = loader_choice()
        sizes = dict(max_stats=max_stats, max_threads=max_threads)
        if choice == "bcc":
            self._load_bcc(**sizes)
            self.origin = Origin("bcc", f"bcc run-time compile ({BPF_ENV}=bcc)")
        else:
            try:
                where = self._load_object(**sizes)
                self.origin = Origin("object", f"precompiled object {where}")
            except (PermissionDenied, MultiUnsupported):
                raise  # bcc would be refused the same way
            except BpfUnavailable as exc:
                if choice == "object":
                    raise BpfUnavailable(f"{exc.msg} ({BPF_ENV}=object: no bcc fallback)", exc.hint) from None
                try:
                    self._load_bcc(**sizes)
                except BpfUnavailable as bcc_exc:
                    raise BpfUnavailable(f"the BPF program did not load: the precompiled object: {exc.msg}; "
                                         f"bcc: {bcc_exc.msg}", exc.hint) from None
                self.origin = Origin("bcc", f"bcc run-time compile, because the precompiled object did not load: "
                                     f"{exc.msg}", fallback=exc.msg, fallback_hint=exc.hint)
        self.loader = self.origin.loader
        self._stats = self.maps["stats"]
        # The stats rows as the loader built their types (bcc from the C structs, the object loader
        # from the object's BTF); RawStats takes exactly these fields.
        self._key_layout, self._leaf_layout = Layout.of(self._stats.key_type), Layout.of(self._stats.value_type)
        want = {f.name for f in dataclasses.fields(RawStats)}
        if set(self._leaf_layout.fields) != want or set(self._key_layout.fields) != {"tgid", "func"}:
            self.close()
            raise BpfUnavailable(f"the BPF stats map holds {sorted(self._leaf_layout.fields)}, gputrace reads {sorted(want)}",
                                 "reinstall gputrace: its BPF program and its reader are out of step")
        self._batch: object = True  # True: not tried yet; None: unsupported; else the buffers
        self._tbatch: object = True  # the same, for `tstats`
        self._rows: dict[tuple[int, int], tuple[bytes, RawStats]] = {}  # (tgid, func) -> last bytes read
        self._errors = self.maps["errors"]
        self._config = self.maps["config"]
        self._seen = self.maps["seen"]
        self._threads = self.maps["threads"]
        self._thread_ids: frozenset[int] | None = None  # its keys as of the last stats read (thread_ids)
        self._tstats_now: dict[int, dict] | None = None  # `tstats` as of the last stats read (thread_stats_now)
        # seen_hits() is polled 50 times a second per file: one bpf() lookup into kept buffers.
        self._seen_key, self._seen_val = self._seen.key_type(0), self._seen.value_type(0)
        self._kept_key, self._kept_val = self._seen.key_type(1), self._seen.value_type(0)
        self.generation = 0
        self.hit_ns = (0, 0, 0, 0)

    def _load_object(self, *, max_stats: int, max_threads: int) -> str:
        from . import bpfobj

        path, how = object_file()
        try:
            obj = bpfobj.BpfObject(path)
        except bpfobj.ObjectInvalid as exc:
            if os.environ.get(OBJECT_ENV):
                raise bpfobj.ObjectInvalid(exc.msg, f"{OBJECT_ENV} names it: point it at a good object, or unset "
                                           "it") from None
            raise
        missing = [n for n in ("gt_entry", "gt_return") if n not in obj.programs]
        missing += [n for n in MAP_NAMES if n not in obj.maps]
        if missing:
            raise bpfobj.ObjectInvalid(f"{path} lacks {', '.join(missing)}: not gputrace's counting program",
                                       f"reinstall gputrace, or unset {OBJECT_ENV}")
        attach_type = links.BPF_TRACE_UPROBE_MULTI if self.mode == "multi" else 0
        try:
            loaded = obj.load(expected_attach_type=attach_type,
                              max_entries={"stats": max_stats, "threads": max_threads})
        except bpfobj.ProgramRefused as exc:
            if self.mode == "multi" and self._loads_for_perf(obj, bpfobj):
                raise MultiUnsupported(f"the kernel does not load programs for uprobe-multi links: {exc.msg}",
                                       "multi-uprobe links need Linux 6.6 or later; perf links are used instead") from None
            raise
        self._loaded = loaded
        self.maps = loaded.maps
        self.entry_fd, self.return_fd = loaded.progs["gt_entry"], loaded.progs["gt_return"]
        return f"{path} ({how})"

    @staticmethod
    def _loads_for_perf(obj, bpfobj) -> bool:
        """Whether the object's programs load without the multi attach type: then only that was refused."""
        try:
            obj.load(expected_attach_type=0, attach_raw_tracepoints=False).close()
            return True
        except BpfUnavailable:
            return False

    def _load_bcc(self, *, max_stats: int, max_threads: int) -> None:
        bcc = import_bcc()
        src = source_dir() / "counts.bpf.c"
        cflags = [f"-I{source_dir()}", f"-DGT_MAX_STATS={max_stats}", f"-DGT_MAX_THREADS={max_threads}"]
        try:
            self._bcc_prog = bcc.BPF(src_file=str(src).encode(), cflags=cflags)
            attach_type = links.BPF_TRACE_UPROBE_MULTI if self.mode == "multi" else -1
            self.entry_fd = self._bcc_prog.load_func(b"gt_entry", bcc.BPF.KPROBE, attach_type=attach_type).fd
            self.return_fd = self._bcc_prog.load_func(b"gt_return", bcc.BPF.KPROBE, attach_type=attach_type).fd
        except Exception as exc:  # bcc raises bare Exception for compile and load failures
            if self._bcc_prog is not None:
                self._bcc_prog.cleanup()
                self._bcc_prog = None
            raise BpfUnavailable(
                f"the BPF program did not compile or load: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}",
                "run `gputrace doctor`: kernel headers, bcc and BPF support are checked there",
            ) from None
        # bcc's tables, read through the same raw map access as the object's maps (bcc owns the fds).
        tables = {name: self._bcc_prog[name.encode()] for name in MAP_NAMES}
        self.maps = {name: Map(name, t.map_fd, t.Key, t.Leaf) for name, t in tables.items()}

    def map_infos(self) -> dict:
        """What the kernel says of each map (type, sizes, max_entries, flags), by name."""
        return {name: m.info() for name, m in self.maps.items()}

    def attach(self, path: str, offsets: Sequence[int], cookies: Sequence[int], *, retprobe: bool, pid: int = 0) -> links.Link:
        fd = self.return_fd if retprobe else self.entry_fd
        if self.mode == "multi":
            return links.attach_multi(fd, path, offsets, cookies, retprobe=retprobe, pid=pid)
        return links.attach_perf(fd, path, offsets, cookies, retprobe=retprobe, pid=pid if pid > 0 else -1)

    def _set_config(self, state: int, step: tuple[int, int, int] | None = None) -> None:
        leaf = self._config.lookup(0)
        leaf.gen = self.generation
        leaf.open = state
        for i, ns in enumerate(self.hit_ns):
            leaf.hit_ns[i] = int(ns)
        if step is not None:
            if (leaf.sync_func, leaf.sync_tgid) != step[:2]:
                leaf.step_last_t = leaf.gap_n = leaf.gap_sum = leaf.gap_sq = 0
            leaf.sync_func, leaf.sync_tgid, leaf.sync_steps = step
            leaf.sync_calls = leaf.sync_start = leaf.sync_end = leaf.sync_t0 = leaf.sync_t1 = 0
        else:
            leaf.sync_steps = 0  # what it recorded stays readable (step_state) until the next arm
        self._config.update(0, leaf)

    def watch_step(self, func: int, tgid: int) -> None:
        """Notes the time of process `tgid`'s calls of `func` (a kept function) from now on
        (step_last), so that a step window can be armed just before its next call is due."""
        leaf = self._config.lookup(0)
        if (leaf.sync_func, leaf.sync_tgid) != (func, tgid):
            self._set_config(int(leaf.open), (func, tgid, 0))

    def step_last(self) -> float | None:
        """CLOCK_MONOTONIC seconds of the last call `watch_step` or `arm` named (None: none seen)."""
        t = self._config.lookup(0).step_last_t
        return t * 1e-9 if t else None

    def step_gaps(self) -> tuple[int, float, float]:
        """The gaps between the calls `watch_step` named, since it did: (count, mean seconds,
        coefficient of variation)."""
        leaf = self._config.lookup(0)
        n = int(leaf.gap_n)
        if n < 2:
            return n, 0.0, 0.0
        mean = leaf.gap_sum / n
        var = max(0.0, leaf.gap_sq / n - mean * mean)
        return n, mean * 1e-6, (var ** 0.5 / mean) if mean > 0 else 0.0

    def arm(self, func: int, tgid: int, steps: int) -> None:
        """A step window: counting opens at process `tgid`'s next call of `func` (a kept function,
        on the watch link) and closes `steps` calls of it later, in the program (gt_step)."""
        self._set_config(ARMED, (func, tgid, max(1, int(steps))))
        # (The last call's time stays: arming moves no edge.)

    def step_state(self) -> StepState:
        """Where the armed step window stands: its state and what the program recorded."""
        leaf = self._config.lookup(0)
        return StepState(int(leaf.open), int(leaf.sync_end - leaf.sync_start) if leaf.sync_end else 0,
                         leaf.sync_t0 * 1e-9 if leaf.sync_t0 else None, leaf.sync_t1 * 1e-9 if leaf.sync_t1 else None)

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
        when the thread exits). Key by key (one syscall a thread): read only when a caller needs
        it, and once per read of the stats (every process of a host session asks after the same
        read: with 50 processes, iterating the map for each was a tenth of top's CPU)."""
        if self._thread_ids is None:
            self._thread_ids = frozenset(k.value for k in self._threads.keys())
        return self._thread_ids

    def read_thread_stats(self, tgid: int) -> dict[tuple[int, int], tuple[int, int, int]]:
        """The `tstats` rows of process `tgid`: (thread id, function) -> (calls in windows, calls on
        the kept link, paired outer ns), cumulative since the program loaded (who makes the calls:
        tracer/threads.py). Key by key: read once, at the end of a session."""
        out = {}
        for k, v in self.maps["tstats"].items():
            if k.tgid == tgid:
                out[(k.tid, k.func)] = (int(v.calls), int(v.kept), int(v.outer_ns))
        return out

    def thread_stats_now(self) -> dict[int, dict[tuple[int, int], tuple[int, int, int]]]:
        """read_thread_stats_by_tgid, once per read of the stats: every process of a host session
        asks after the same read (Tracee's `_apart`), and the map is read once for all of them."""
        if self._tstats_now is None:
            self._tstats_now = self.read_thread_stats_by_tgid()
        return self._tstats_now

    def read_thread_stats_by_tgid(self) -> dict[int, dict[tuple[int, int], tuple[int, int, int]]]:
        """Every process's `tstats` rows at once, by tgid (as read_thread_stats gives one process's):
        for a host session, which reads them every interval. In batches where the kernel has them,
        key by key where not."""
        m = self.maps["tstats"]
        out: dict[int, dict[tuple[int, int], tuple[int, int, int]]] = {}
        if self._tbatch is not None:
            try:
                if self._tbatch is True:
                    self._tbatch = ((m.key_type * _BATCH)(), (m.value_type * _BATCH)(), Layout.of(m.key_type),
                                    Layout.of(m.value_type))
                keys, vals, kl, vl = self._tbatch
                ka, kb, kc = kl.index("tgid"), kl.index("tid"), kl.index("func")
                va, vb, vc = vl.index("calls"), vl.index("kept"), vl.index("outer_ns")
                token_in, token_out = ctypes.c_uint32(0), ctypes.c_uint32(0)
                first = True
                while True:
                    n, err = m.lookup_batch(None if first else token_in, token_out, keys, vals, _BATCH)
                    ks = kl.struct.iter_unpack(ctypes.string_at(keys, n * kl.struct.size))
                    vs = vl.struct.iter_unpack(ctypes.string_at(vals, n * vl.struct.size))
                    for k, v in zip(ks, vs):
                        out.setdefault(k[ka], {})[(k[kb], k[kc])] = (v[va], v[vb], v[vc])
                    if err:
                        if err == errno.ENOENT:
                            return out
                        raise OSError(err, os.strerror(err))
                    token_in.value, first = token_out.value, False
            except OSError:
                self._tbatch, out = None, {}  # no batch ops here: key by key from now on
        for k, v in m.items():
            out.setdefault(k.tgid, {})[(k.tid, k.func)] = (int(v.calls), int(v.kept), int(v.outer_ns))
        return out

    def outside_calls(self, tgid: int, func: int) -> int:
        """Process tgid's calls of func counted on the marker's link between windows (`outside`),
        cumulative: one map lookup, for a reference span's share read as it ends."""
        key = self._stats.key_type()
        key.tgid, key.func = tgid, func
        v = self._stats.lookup(key)
        return 0 if v is None else int(v.outside)

    def read_stats(self) -> dict[tuple[int, int], RawStats]:
        """Every row of the `stats` map, by (tgid, function)."""
        return {(tgid, f): st for tgid, rows in self.read_by_tgid().items() for f, st in rows.items()}

    def read_by_tgid(self) -> dict[int, dict[int, RawStats]]:
        """Every row of the `stats` map, by tgid then function. Read in batches (one syscall per 1024
        rows, not two per row) where the kernel has them (5.6+); a row whose bytes did not change
        since the last read comes back as the same RawStats object, so callers can skip it cheaply."""
        self._thread_ids = None  # read again when next asked: threads come and go between reads
        self._tstats_now = None
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
                                                           v.closed, tuple(v.hist), v.outside, v.watched,
                                                           v.kept_open))
            out.setdefault(k.tgid, {})[k.func] = cached[1]
        return out

    def _read_batched(self) -> dict[int, dict[int, RawStats]]:
        if self._batch is True:
            self._batch = ((self._stats.key_type * _BATCH)(), (self._stats.value_type * _BATCH)())
        keys, vals = self._batch
        key_l, leaf_l = self._key_layout, self._leaf_layout
        size, key_size = leaf_l.struct.size, key_l.struct.size
        rows, unpack = self._rows, leaf_l.struct.unpack
        ka, kb = key_l.index("tgid"), key_l.index("func")
        c, t, tn, on, ne, cl, ou, wa, ko = (leaf_l.index(n) for n in ("calls", "timed", "total_ns", "outer_ns",
                                                                       "nested", "closed", "outside", "watched",
                                                                       "kept_open"))
        hist = leaf_l.fields["hist"]
        token_in, token_out = ctypes.c_uint32(0), ctypes.c_uint32(0)
        out: dict[int, dict[int, RawStats]] = {}
        first, n_rows = True, 0
        while True:
            n, err = self._stats.lookup_batch(None if first else token_in, token_out, keys, vals, _BATCH)
            n_rows += n
            raw = ctypes.string_at(vals, n * size)
            for i, k in enumerate(key_l.struct.iter_unpack(ctypes.string_at(keys, n * key_size))):
                key = (k[ka], k[kb])
                blob = raw[i * size:(i + 1) * size]
                cached = rows.get(key)
                if cached is None or cached[0] != blob:
                    v = unpack(blob)
                    cached = rows[key] = (blob, RawStats(v[c], v[t], v[tn], v[on], v[ne], v[cl], v[hist], v[ou], v[wa],
                                                           v[ko]))
                tgid_rows = out.get(key[0])
                if tgid_rows is None:
                    tgid_rows = out[key[0]] = {}
                tgid_rows[key[1]] = cached[1]
            if err:
                if err == errno.ENOENT:  # the end of the map
                    break
                raise OSError(err, os.strerror(err))
            token_in.value, first = token_out.value, False
        if len(rows) > 2 * n_rows + 64:  # rows forgotten or of exited processes
            self._rows = {k: v for k, v in rows.items() if k[1] in out.get(k[0], ())}
        return out

    def forget(self, keys: Sequence[tuple[int, int]]) -> None:
        for tgid, func in keys:
            self._stats.delete(self._stats.key_type(tgid, func))

    def seen_hits(self) -> int:
        """Hits on watch links so far, all processes together: one lookup, polled while windows wait."""
        if not self._seen.lookup_into(self._seen_key, self._seen_val):
            v = self._seen.lookup(0)
            return int(v.value) if v is not None else 0
        return self._seen_val.value

    def kept_hits(self) -> int:
        """Hits of kept functions so far, all processes together (one lookup)."""
        if not self._seen.lookup_into(self._kept_key, self._kept_val):
            v = self._seen.lookup(1)
            return int(v.value) if v is not None else 0
        return self._kept_val.value

    def read_errors(self) -> dict[str, int]:
        out = {}
        for i, name in enumerate(ERROR_NAMES):
            v = self._errors.lookup(i)
            out[name] = int(v.value) if v is not None else 0
        return out

    def close(self) -> None:
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None
        if self._bcc_prog is not None:
            self._bcc_prog.cleanup()
            self._bcc_prog = None
