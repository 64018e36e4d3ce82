"""Attaching one BPF program to many uprobes at once, with a cookie per probe.

Primary path: a BPF_TRACE_UPROBE_MULTI link (kernel >= 6.6): one bpf(BPF_LINK_CREATE) call attaches every
offset in one file, and closing the link's file descriptor detaches them all in one RCU grace period.
Fallback: one perf_event uprobe per offset, each linked with its cookie (BPF_LINK_CREATE on a perf event,
kernel >= 5.15); it works where multi links do not, but closing N of them takes N grace periods.

Either way the probes live exactly as long as our file descriptors, so they vanish when the process
holding them dies, even by SIGKILL.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import time
from dataclasses import dataclass
from typing import Sequence

from gputrace.base.arch import syscall_number
from gputrace.base.errors import BpfUnavailable, NoSuchProcess, PermissionDenied

BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
_ATTR_SIZE = 128
_PERF_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7 and later all fit

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def bpf(cmd: int, attr: bytearray) -> int:
    """bpf(2) with `attr`; the new fd (or 0), or -errno. Commands that answer in `attr` write it back."""
    buf = ctypes.create_string_buffer(bytes(attr), len(attr))
    fd = _libc.syscall(syscall_number("bpf"), cmd, buf, len(attr))
    if fd < 0:
        return -ctypes.get_errno()
    attr[:] = buf.raw  # commands that answer in attr (BPF_*_GET_NEXT_ID, ...) are readable by the caller
    return fd


def _raise_for(err: int, what: str) -> None:
    if err == errno.ESRCH:  # the pid filter names a process that has exited
        raise NoSuchProcess(f"{what}: the process has exited", "it ended before its probes were attached")
    if err in (errno.EPERM, errno.EACCES):
        raise PermissionDenied(
            f"{what}: {os.strerror(err)}",
            "run as root, or grant CAP_BPF and CAP_PERFMON (e.g. sudo setcap cap_bpf,cap_perfmon+ep on the interpreter)",
        )
    raise BpfUnavailable(f"{what}: {os.strerror(err)} (errno {err})", "run `gputrace doctor` to see what this kernel supports")


@dataclass
class Link:
    """Owns the kernel objects of one attachment; close() detaches."""

    fds: list[int]
    kind: str  # "multi" or "perf"
    count: int
    attach_s: float

    def close(self) -> float:
        t0 = time.perf_counter()
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        return time.perf_counter() - t0

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach_multi(
    prog_fd: int,
    path: str,
    offsets: Sequence[int],
    cookies: Sequence[int],
    *,
    retprobe: bool = False,
    pid: int = 0,
) -> Link:
    """One uprobe-multi link over `offsets` of the file `path`; pid 0 means every process."""
    n = len(offsets)
    if n == 0 or n != len(cookies):
        raise ValueError("offsets and cookies must be non-empty and the same length")
    c_path = ctypes.create_string_buffer(os.fsencode(path))
    c_offs = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into("IIII", attr, 0, prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0)
    struct.pack_into(
        "QQQQIII", attr, 16,
        ctypes.addressof(c_path), ctypes.addressof(c_offs), 0, ctypes.addressof(c_cookies),
        n, BPF_F_UPROBE_MULTI_RETURN if retprobe else 0, pid,
    )
    t0 = time.perf_counter()
    fd = bpf(BPF_LINK_CREATE, attr)
    if fd < 0:
        _raise_for(-fd, f"uprobe-multi link on {path} ({n} functions)")
    return Link([fd], "multi", n, time.perf_counter() - t0)


def uprobe_pmu() -> tuple[int, int]:
    base = "/sys/bus/event_source/devices/uprobe"
    try:
        with open(f"{base}/type") as f:
            ptype = int(f.read())
        with open(f"{base}/format/retprobe") as f:
            bit = int(f.read().split(":")[1])
    except (OSError, ValueError, IndexError) as exc:
        raise BpfUnavailable(f"no uprobe perf PMU ({exc})", "the kernel needs CONFIG_UPROBE_EVENTS") from None
    return ptype, bit


def attach_perf(
    prog_fd: int,
    path: str,
    offsets: Sequence[int],
    cookies: Sequence[int],
    *,
    retprobe: bool = False,
    pid: int = -1,
) -> Link:
    """The fallback: a perf_event uprobe per offset, each with a BPF link carrying its cookie."""
    ptype, bit = uprobe_pmu()
    c_path = ctypes.create_string_buffer(os.fsencode(path))
    fds: list[int] = []
    t0 = time.perf_counter()
    try:
        for off, cookie in zip(offsets, cookies):
            pattr = bytearray(_PERF_ATTR_SIZE)
            # type, size, config, sample_period, sample_type, read_format, flags(u64), wakeup, bp_type, config1, config2
            struct.pack_into("IIQQQQQIIQQ", pattr, 0, ptype, _PERF_ATTR_SIZE, (1 << bit) if retprobe else 0,
                             1, 0, 0, 0, 1, 0, ctypes.addressof(c_path), off)
            pbuf = ctypes.create_string_buffer(bytes(pattr), len(pattr))
            pfd = _libc.syscall(syscall_number("perf_event_open"), pbuf, pid if pid > 0 else -1, 0 if pid <= 0 else -1, -1, 8)
            if pfd < 0:
                _raise_for(ctypes.get_errno(), f"perf uprobe at {path}+{off:#x}")
            fds.append(pfd)
            attr = bytearray(_ATTR_SIZE)
            struct.pack_into("IIIIQ", attr, 0, prog_fd, pfd, BPF_PERF_EVENT, 0, cookie)
            lfd = bpf(BPF_LINK_CREATE, attr)
            if lfd < 0:
                _raise_for(-lfd, f"perf link at {path}+{off:#x}")
            fds.append(lfd)
    except BaseException:
        Link(fds, "perf", 0, 0).close()
        raise
    return Link(fds, "perf", len(offsets), time.perf_counter() - t0)


_closer = None  # threads that close links beside the caller's (close_together)


def close_together(links: Sequence[Link]) -> None:
    """Closes the links at once, each in its own thread, rather than one after the other. Closing a
    uprobe link removes its breakpoints, then waits for a grace period (tens of ms); one after the
    other, the links not yet closed keep trapping the job through every earlier one's wait (seen on
    the H200: a return link left trapping every timed call for 50-100 ms after each window)."""
    global _closer
    live = [ln for ln in links if ln.fds]
    if len(live) <= 1:
        for ln in live:
            ln.close()
        return
    if _closer is None:
        from concurrent.futures import ThreadPoolExecutor

        _closer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gputrace-unlink")
    futures = [_closer.submit(ln.close) for ln in live[1:]]
    live[0].close()
    for f in futures:
        f.result()


def multi_supported(prog_fd: int, path: str, offset: int) -> tuple[bool, str]:
    """Tries a real one-probe multi link on `path`+`offset` and closes it at once."""
    try:
        attach_multi(prog_fd, path, [offset], [0]).close()
        return True, "uprobe-multi link created and closed"
    except (BpfUnavailable, PermissionDenied) as exc:
        return False, exc.msg
