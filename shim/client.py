"""Talking to the shim in another process: find its control socket, send a command, read the reply.

The shim serves `<dir>/shim-<pid>.sock`, where dir is the target's $GPUTRACE_SHIM_DIR, else
$XDG_RUNTIME_DIR/gputrace, else /tmp/gputrace-<euid> (see shim/control.c); this module computes the
same candidates from the target's /proc entries.  One command per line, one JSON line back.

`status` (schema 1) is an object with:
  schema, pid, paused (gate closed), suspended (device memory released by `suspend`), in_flight (threads inside a gated call), waiting (threads stopped
  at the closed gate), threads (threads that made an intercepted call), membarrier (whether the hot
  path runs fence-free), driver (the libcuda file), socket,
  calls: {wrapper name: calls so far},
  contexts: [{handle, device, primary, refs, flags}],
  allocations: [{kind, base, size, device, ctx, [handle], [offset, access], [flags]}] where kind is
    device | pitch | async | managed (device memory; a device allocation served through the VMM API,
    GPUTRACE_SHIM_VMM=1, also has handle, reserved and suspended), host | host_registered (pinned host memory),
    va_reserve (address space only), vmm_phys (cuMemCreate backing; base 0, handle), vmm_map (a mapped
    piece: base, handle, offset, access),
  modules: [{kind: module | library, handle, ctx, image_bytes, [path]}],
  streams: [{handle, ctx, flags, priority}], events: [{handle, ctx, flags}],
  totals: {device_bytes (device + pitch + async + managed + vmm_phys), host_bytes, va_reserved_bytes,
    vmm_mapped_bytes, module_image_bytes, contexts, allocations, modules, streams, events}.
Handles and addresses are integers.  Other replies: {"ok": true|false, ...; "error" when false}.

`dump` / `restore` (see shim/dump.c) take the image file as a descriptor sent with the command
(:meth:`Connection.request` with `fd=`); their replies: ok, allocations, bytes, image_bytes, skipped,
lanes, chunk, pieces, setup_ns, drain_ns, sync_ns, copy_ns, freeze_ns, and for dump driver_version and
devices [{ordinal, name, uuid}]; on failure error (and detail, or differences for a mismatch).
`suspend` adds reserved_bytes and release_ns, `unsuspend` remap_ns and suspended_ns.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from gputrace.errors import PermissionDenied, ShimUnavailable
from gputrace.procs import require_process

SONAME = "libgputrace_shim.so"
SCHEMA = 1


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def comm(pid: int) -> str:
    data = _read(f"/proc/{pid}/comm")
    return data.decode(errors="replace").strip() if data else "?"


def euid(pid: int) -> int | None:
    data = _read(f"/proc/{pid}/status")
    for line in (data or b"").splitlines():
        if line.startswith(b"Uid:"):
            return int(line.split()[2])
    return None


def has_shim(pid: int) -> bool | None:
    """Whether the process maps the shim (None: its maps are not readable by us)."""
    data = _read(f"/proc/{pid}/maps")
    if data is None:
        return None
    return SONAME.encode() in data


def socket_candidates(pid: int) -> list[Path]:
    env: dict[str, str] = {}
    raw = _read(f"/proc/{pid}/environ")
    for item in (raw or b"").split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k in (b"GPUTRACE_SHIM_DIR", b"XDG_RUNTIME_DIR"):
            env[k.decode()] = v.decode(errors="replace")
    uid = euid(pid)
    dirs = []
    if env.get("GPUTRACE_SHIM_DIR"):
        dirs.append(Path(env["GPUTRACE_SHIM_DIR"]))
    else:
        if env.get("XDG_RUNTIME_DIR", "").startswith("/"):
            dirs.append(Path(env["XDG_RUNTIME_DIR"]) / "gputrace")
        if uid is not None:
            dirs.append(Path(f"/tmp/gputrace-{uid}"))
    return [d / f"shim-{pid}.sock" for d in dirs]


def socket_path(pid: int) -> Path | None:
    for p in socket_candidates(pid):
        try:
            if p.is_socket():
                return p
        except OSError:  # a directory we may not enter: try connecting anyway, it says why
            return p
    return None


@dataclass(frozen=True)
class Shimmed:
    """A process that maps the shim; `socket` is None until it serves (its first CUDA call)."""

    pid: int
    comm: str
    uid: int | None
    socket: Path | None


def shimmed_processes() -> Iterator[Shimmed]:
    """Processes whose maps we can read and that map the shim."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == os.getpid() or not has_shim(pid):
            continue
        yield Shimmed(pid, comm(pid), euid(pid), socket_path(pid))


class Connection:
    """A connection to one process's shim.  A pause taken through it ends when it closes."""

    def __init__(self, pid: int, timeout_s: float = 30.0) -> None:
        require_process(pid)
        self.pid = pid
        path = socket_path(pid)
        if path is None:
            mapped = has_shim(pid)
            if mapped is False:
                raise ShimUnavailable(
                    f"process {pid} ({comm(pid)}) does not have the gputrace shim loaded",
                    "start the job with the shim: gputrace run --checkpointable -- COMMAND",
                )
            if mapped is None:
                raise PermissionDenied(
                    f"cannot inspect process {pid}: it belongs to another user",
                    "run this as the job's owner or as root",
                )
            raise ShimUnavailable(
                f"the shim in process {pid} ({comm(pid)}) is not serving yet",
                "it starts its control socket at the process's first CUDA driver call; if the job has made one, "
                "its stderr says why the shim could not serve",
            )
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(path))
        except PermissionError:
            self._sock.close()
            raise PermissionDenied(
                f"permission denied connecting to the shim of process {pid} ({path})",
                "only the job's owner and root may control it: run this as that user or with sudo",
            ) from None
        except (ConnectionRefusedError, FileNotFoundError):
            self._sock.close()
            raise ShimUnavailable(
                f"the shim of process {pid} refused the connection ({path})",
                "the process may be exiting, or the socket is left over from an earlier one",
            ) from None
        self._buf = b""

    def request(self, command: str, fd: int | None = None, timeout_s: float | None = None) -> dict:
        """Sends one command (with the descriptor `fd`, if given) and returns the reply; `timeout_s`
        overrides the connection's timeout for this reply (a dump takes as long as its bytes)."""
        if timeout_s is not None:
            self._sock.settimeout(timeout_s)
        try:
            if fd is not None:
                socket.send_fds(self._sock, [command.encode() + b"\n"], [fd])
            else:
                self._sock.sendall(command.encode() + b"\n")
            while b"\n" not in self._buf:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    break
                self._buf += chunk
        except socket.timeout:
            raise ShimUnavailable(f"the shim of process {self.pid} did not answer {command!r}",
                                  "the process may be stopped (SIGSTOP) or overloaded; try again") from None
        except OSError as exc:
            raise ShimUnavailable(f"lost the connection to the shim of process {self.pid}: {exc.strerror}",
                                  "the process may have exited") from None
        line, sep, self._buf = self._buf.partition(b"\n")
        if not sep:
            raise ShimUnavailable(f"the shim of process {self.pid} closed the connection",
                                  "the process may have exited")
        reply = orjson.loads(line)
        if reply.get("ok") is False:
            err = str(reply.get("error", "unknown error"))
            if err.startswith("permission denied"):
                raise PermissionDenied(f"the shim of process {self.pid} refused: {err}",
                                       "run this as the job's owner or as root")
        return reply

    def status(self) -> dict:
        return self.request("status")

    def pause(self, timeout_ms: int = 5000) -> dict:
        return self.request(f"pause {int(timeout_ms)}")

    def resume(self) -> dict:
        return self.request("resume")

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status(pid: int) -> dict:
    with Connection(pid) as c:
        return c.status()
