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

`dump` / `restore` (shim/dump.c; the image: shim/image.c) take the image file as a descriptor sent with the command
(:meth:`Connection.request` with `fd=`); their replies: ok, allocations, bytes, image_bytes, skipped,
lanes, chunk, pieces, setup_ns, drain_ns, sync_ns, copy_ns, freeze_ns, plan (pool | image | staging |
pool and staging: where the copies went under the gate), staging_copied_bytes (through the lanes' staging
under the gate), attempts and aborted_freeze_ns (a dump whose changes outgrew its plan reopens the gate
without a copy, prepares again and freezes once more), and for dump driver_version and
devices [{ordinal, name, uuid}]; on failure error (and detail, or differences for a mismatch).
status's kept (shim/kept.c) also says expect_bytes (what the next incremental dump is planned for),
staging_copied_bytes and outgrown (such reopened freezes, counted).
`suspend` adds reserved_bytes and release_ns, `unsuspend` remap_ns and suspended_ns.
`prepare_suspend` (the image a suspension copies into, made ahead while the job runs): made, allocations,
bytes, image_bytes, setup_ns, pin_cap, kept_pinned_bytes, suspend_image_allocs, suspend_image_prepared; refused
with error `over the pin cap` (and needs_bytes, pin_cap, kept_pinned_bytes), `host memory`, `unsupported`,
`busy` (the gate closed, or a command staged) or `suspended`, nothing pinned.  `release`: released_pinned_bytes,
released_digester.
A job of several processes is stopped in steps (checkpointer/gang.py): `close [MS]` (gate closed, no
drain; replies collectives), `advance N [MS]`, `drain [MS]`, then dump/restore/suspend on the same
connection and `resume`; status also says collectives (launched so far), collective_kernels (kernels
known to be collectives) and advancing.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from gputrace.base.errors import PermissionDenied, ShimUnavailable, Untrusted
from gputrace.base.procs import comm, require_process

SONAME = "libgputrace_shim.so"
SCHEMA = 1


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


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


def sock_name(pid: int) -> str:
    return f"shim-{pid}.sock"


def _dirs(pid: int) -> list[Path]:
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
    return dirs


class _Refused(Exception):
    """A socket directory that exists but that the job's shim could not have made: not to be used."""


def _open_dir(d: Path, uid: int | None) -> int | None:
    """An O_PATH descriptor of socket directory `d`, checked the way the shim checks it before it
    serves there (a directory, not a symbolic link, owned by the job's user, no group or other
    access); None when it does not exist; _Refused when it exists and fails a check."""
    try:
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise _Refused(f"{d} is not a directory (a symbolic link or a file)") from None
        if exc.errno == errno.EACCES:
            raise PermissionError(exc.errno, exc.strerror, str(d)) from None
        return None
    st = os.fstat(fd)
    why = None
    if uid is not None and st.st_uid != uid:
        why = f"{d} belongs to uid {st.st_uid}, not to the job's user (uid {uid}); another user may have made it"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        why = f"{d} is open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        os.close(fd)
        raise _Refused(why)
    return fd


def _find(pid: int) -> tuple[int, Path] | None:
    """(directory descriptor, socket path) of the first candidate directory that holds the target's
    socket; None when none does; _Refused for a directory that is not the job user's own."""
    uid = euid(pid)
    for d in _dirs(pid):
        try:
            fd = _open_dir(d, uid)
        except PermissionError:
            raise PermissionDenied(f"cannot enter {d}, the socket directory of process {pid}",
                                   "only the job's owner and root may control it: run this as that user or with sudo"
                                   ) from None
        if fd is None:
            continue
        try:
            st = os.stat(sock_name(pid), dir_fd=fd, follow_symlinks=False)
        except OSError:
            os.close(fd)
            continue
        if not stat.S_ISSOCK(st.st_mode):
            os.close(fd)
            raise _Refused(f"{d / sock_name(pid)} is not a socket (a symbolic link or a file)")
        return fd, d / sock_name(pid)
    return None


def socket_path(pid: int) -> Path | None:
    """Where the target's shim serves, if it does, in a directory that passes the shim's own checks."""
    try:
        found = _find(pid)
    except (_Refused, PermissionDenied):
        return None
    if found is None:
        return None
    os.close(found[0])
    return found[1]


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


#: The most a reply may hold: a status of a job with a million allocations fits many times over.
MAX_REPLY = 64 << 20


class Connection:
    """A connection to one process's shim.  A pause taken through it ends when it closes.

    The socket is reached through a descriptor of its directory, opened without following a
    symbolic link and checked as the shim checks it; once connected, the server's peer credentials
    must be the target's own (its pid, its user), or nothing is sent: a socket path names nothing
    for sure, since the target's environment, which chooses the directory, is its user's to set."""

    def __init__(self, pid: int, timeout_s: float = 30.0) -> None:
        require_process(pid)
        self.pid = pid
        self.timeout_s = timeout_s
        uid = euid(pid)
        try:
            found = _find(pid)
        except _Refused as exc:
            raise Untrusted(f"refusing the control socket of process {pid}: {exc}",
                            "the job's shim would not serve there either; if the job is yours, remove that path "
                            "and restart the job (or point GPUTRACE_SHIM_DIR at a private directory)") from None
        if found is None:
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
        self.dir_fd, self.path = found
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(f"/proc/self/fd/{self.dir_fd}/{sock_name(pid)}")
        except PermissionError:
            self.close()
            raise PermissionDenied(
                f"permission denied connecting to the shim of process {pid} ({self.path})",
                "only the job's owner and root may control it: run this as that user or with sudo",
            ) from None
        except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
            self.close()
            raise ShimUnavailable(
                f"the shim of process {pid} refused the connection ({self.path})",
                "the process may be exiting, or the socket is left over from an earlier one",
            ) from None
        peer_pid, peer_uid, _ = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if peer_pid != pid or (uid is not None and peer_uid != uid):
            self.close()
            raise Untrusted(
                f"the socket {self.path} is served by process {peer_pid} (uid {peer_uid}), not by process {pid}"
                f"{f' (uid {uid})' if uid is not None else ''}: refusing it",
                f"a socket there that another process serves is not this job's shim; nothing was sent. If process "
                f"{peer_pid} is the job you meant, give that pid",
            )
        self._buf = b""

    def request(self, command: str, fd: int | None = None, timeout_s: float | None = None) -> dict:
        """Sends one command (with the descriptor `fd`, if given) and returns the reply; `timeout_s`
        overrides the connection's timeout for this reply (a dump takes as long as its bytes).  The
        whole reply must come within the timeout and hold at most MAX_REPLY bytes."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        try:
            self._sock.settimeout(limit)
            if fd is not None:
                socket.send_fds(self._sock, [command.encode() + b"\n"], [fd])
            else:
                self._sock.sendall(command.encode() + b"\n")
            parts, size, done = [self._buf], len(self._buf), b"\n" in self._buf
            while not done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout
                self._sock.settimeout(left)
                chunk = self._sock.recv(1 << 20)
                if not chunk:
                    break
                parts.append(chunk)
                size += len(chunk)
                done = b"\n" in chunk
                if size > MAX_REPLY and not done:
                    raise ShimUnavailable(f"the shim of process {self.pid} sent more than {MAX_REPLY >> 20} MiB "
                                          f"in reply to {command.split()[0]!r} without ending it",
                                          "that is not the shim's reply; nothing more was read")
            self._buf = b"".join(parts)
        except socket.timeout:
            raise ShimUnavailable(f"the shim of process {self.pid} did not answer {command.split()[0]!r} "
                                  f"within {limit:.0f} s",
                                  "the process may be stopped (SIGSTOP) or overloaded; try again") from None
        except OSError as exc:
            raise ShimUnavailable(f"lost the connection to the shim of process {self.pid}: {exc.strerror}",
                                  "the process may have exited") from None
        line, sep, self._buf = self._buf.partition(b"\n")
        if not sep:
            raise ShimUnavailable(f"the shim of process {self.pid} closed the connection",
                                  "the process may have exited")
        try:
            reply = orjson.loads(line)
        except orjson.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            raise ShimUnavailable(f"the shim of process {self.pid} sent a reply that is not a JSON object",
                                  "a shim of another gputrace version, or a damaged process")
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
        if getattr(self, "_sock", None) is not None:
            self._sock.close()
        if getattr(self, "dir_fd", None) is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status(pid: int) -> dict:
    with Connection(pid) as c:
        return c.status()
