"""A guardian: a helper process that gives the job back if the gputrace working on it dies.

A whole-process checkpoint stops the job in three places at once (the shim's suspension, the driver's
lock and checkpoint, CRIU's SIGSTOP), and none of them ends when the process that made it dies: a
`gputrace checkpoint --full` killed half-way would leave the job frozen for good.  So before it
touches the job, gputrace starts a guardian (a Python process running main() below with the job's
pid; its command line ends in `# gputrace-guardian PID WHAT`), in its own session (a signal to gputrace's process group does not reach it), reading one pipe.  gputrace
tells it, before each step, what the step may leave behind (JSON lines: {"shim": true},
{"driver": true}, {"stopped": true}, {"criu": CRIU_PID}, {"partial": DIR}); at the end {"done": true}.  If the pipe
closes without "done" (gputrace died, however), the guardian waits for a CRIU still working on the
job to finish, then undoes what it was told of, from the job's actual state: SIGCONT, the driver's
Restore and Unlock, the shim's unsuspend.  It says what it did on its stderr (gputrace's).

A GPU-memory checkpoint or restore through the shim needs none: the shim's thread finishes it and
reopens the gate by itself.  A suspend is the shim's to undo (shim/control.c: the suspension belongs
to the connection until `keep`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import orjson

from gputrace.base.procs import stat_fields, wait_exit

CRIU_GRACE_S = 300.0
#: How the guardian is started (not `-m`: this module is imported by its package already).
TAG = "# gputrace-guardian"
ENTRY = f"import sys; from gputrace.checkpointer.guardian import main; sys.exit(main(sys.argv[1:]))  {TAG}"  # how long a CRIU left working on the job may take before it is killed


class Guardian:
    """Started before the first step; note() before each; done() when the job is as it should stay."""

    def __init__(self, pid: int, what: str) -> None:
        self.pid = pid
        r, w = os.pipe2(os.O_CLOEXEC)
        # cwd "/": `python -c` puts the working directory first on sys.path, and a directory holding a
        # `gputrace` of someone else's would be imported instead (as root, in the worst case).
        self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, str(pid), what], stdin=r, stdout=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True, cwd="/")
        os.close(r)
        self._w: int | None = w

    def note(self, **state: object) -> None:
        if self._w is not None:
            os.write(self._w, orjson.dumps(state) + b"\n")

    def done(self) -> None:
        """The operation is over (or given back by us): the guardian exits without touching the job."""
        if self._w is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._w, b'{"done": true}\n')
        os.close(self._w)
        self._w = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def leave(self) -> None:
        """Hands the job over: the pipe closes without "done", so the guardian gives the job back from
        its actual state (as if this process had died), waiting for it as long as that takes; for a
        process that cannot answer now (stopped by someone else) but must not be left as it is."""
        if self._w is not None:
            os.close(self._w)
            self._w = None

    def __enter__(self) -> "Guardian":
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


def running(pid: int) -> list[int]:
    """The pids of guardians watching over process `pid` now."""
    want = f"{TAG}\0{pid}\0".encode()
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/cmdline", "rb") as f:
                    if want in f.read():
                        out.append(int(e))
            except OSError:
                pass
    return out


def settle(pid: int, timeout_s: float = 600.0) -> bool:
    """Waits for every guardian of process `pid` to finish; False if one is still at it after timeout_s."""
    return all(wait_exit(g, timeout_s) for g in running(pid))


def _state(pid: int) -> str | None:
    f = stat_fields(pid)
    return f[0].decode() if f else None


def _tracer(pid: int) -> int | None:
    """The pid of the process ptracing `pid` (CRIU seizes the tasks it dumps), None if none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"TracerPid:"):
                    t = int(line.split()[1])
                    return t or None
    except (OSError, ValueError, IndexError):
        pass
    return None


def give_back(pid: int, state: dict, say) -> list[str]:
    """Undoes what `state` says may be left, from the job's actual state; what it did, in words."""
    did: list[str] = []
    criu = state.get("criu")
    if not isinstance(criu, int) and state.get("stopped"):
        # gputrace died after saying CRIU would start and before saying its pid: if one is at work
        # on the job, it is the job's tracer.
        criu = _tracer(pid)
    if isinstance(criu, int) and not wait_exit(criu, 0):
        say(f"waiting for CRIU (pid {criu}) to finish with process {pid}")
        if not wait_exit(criu, CRIU_GRACE_S):
            with contextlib.suppress(ProcessLookupError):
                os.kill(criu, signal.SIGKILL)
            wait_exit(criu, 10)
            did.append(f"killed CRIU (pid {criu}) after {CRIU_GRACE_S:.0f} s")
    if _state(pid) is None:
        return did + [f"process {pid} is gone"]
    if isinstance(criu, int):
        # A CRIU (or a task of its) may still hold the job in ptrace as it exits: until it lets go
        # (the job then reads "t", and a SIGCONT does not wake it: seen under load on a 2-core VM).
        deadline = time.monotonic() + 10.0
        while _tracer(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    if (state.get("stopped") or criu) and _state(pid) in ("T", "t"):
        os.kill(pid, signal.SIGCONT)
        did.append("continued it (SIGCONT)")
    if state.get("driver"):
        from .driverapi import Driver

        try:
            d = Driver(pid)
            st = d.state()
            if st == "checkpointed":
                d.call("Restore")
                did.append("restored its GPU state (cuCheckpointProcessRestore)")
                st = d.state()
            if st == "locked":
                d.call("Unlock")
                did.append("unlocked it in the driver")
        except Exception as exc:  # noqa: BLE001 - the guardian reports and goes on to the shim
            did.append(f"could not restore or unlock it in the driver: {exc}")
    if state.get("shim"):
        from gputrace.shim import client

        try:
            with client.Connection(pid, timeout_s=120) as c:
                if c.status().get("suspended"):
                    r = c.request("unsuspend", timeout_s=600)
                    did.append("unsuspended it in the shim" if r.get("ok") else
                               f"could not unsuspend it in the shim: {r.get('error')}")
        except Exception as exc:  # noqa: BLE001
            did.append(f"could not reach its shim: {exc}")
    partial = state.get("partial")
    if isinstance(partial, str) and "/." in partial and ".partial-" in partial and os.path.isdir(partial):
        import shutil

        shutil.rmtree(partial, ignore_errors=True)  # the unfinished checkpoint: of no use, and the shim is done with it
        did.append(f"removed the unfinished {partial}")
    return did


def main(argv: list[str]) -> int:
    pid, what = int(argv[0]), argv[1] if len(argv) > 1 else "operation"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is gputrace's to handle; this outlives it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    state: dict = {}
    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for ln in lines:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):
                state.update(orjson.loads(ln))
        if state.get("done"):
            return 0

    def say(msg: str) -> None:
        with contextlib.suppress(OSError):
            print(f"gputrace guardian: {msg}", file=sys.stderr, flush=True)

    t = time.monotonic()
    did = give_back(pid, state, say)
    say(f"the {what} of process {pid} was interrupted (the gputrace process doing it died); "
        + (", ".join(did) if did else "nothing needed undoing") + f" ({time.monotonic() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

