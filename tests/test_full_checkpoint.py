"""Whole-process checkpoint with real CRIU on simcuda in device mode (device memory held by the
simcuda-device daemon, outside the process, as on a GPU): checkpoint, kill, restore and the job goes
on to print what an uninterrupted run prints; --leave-running; a failed dump gives the job back; and
each failure on the way (pid taken, damaged image, no CRIU or one too old) is a clear error."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.shim import client as shim_client
from gputrace.checkpointer import criu as criu_mod
from gputrace.checkpointer import driver, uprobes
from gputrace.simcuda.device import Device

from shimtest import open_files, shim_dir  # noqa: F401  (fixture)

STEPS = 150


def _criu_reason() -> str | None:
    if os.geteuid() != 0:
        return "CRIU needs root"
    try:
        c = criu_mod.find()
    except criu_mod.CriuUnavailable as exc:
        return f"{exc.msg} ({exc.hint})"
    ok, line = criu_mod.check(c)
    return None if ok else f"`criu check` fails here: {line}"


pytestmark = pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))


def gputrace(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def ckpt(j: "Job", *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`gputrace checkpoint --full -p JOB ARGS`.  A tracer running elsewhere on this host (another
    session's `gputrace top` attaches to every CUDA process) can put the kernel's [uprobes] page into the
    job, which CRIU cannot dump: that is no failure of the code under test, and a serial CI run has no
    such tracer, so the test is skipped with that reason instead."""
    r = gputrace(args[0], *(["--full"] if args[0] == "checkpoint" else []), "-p", str(j.pid), *args[1:], env=env)
    if r.returncode and any(s in r.stderr for s in FOREIGN_TRACER):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {r.stderr.splitlines()[0]}")
    return r


# What checkpoint --full says of a tracer's traces in the job (checkpointer/uprobes.py).
FOREIGN_TRACER = ("[uprobes]", "uprobe breakpoints", "uprobe trampoline")


# --- awaiting events, not sleeping ----------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
IN_MODIFY = 0x2


def wait_for_text(path: Path, text: str, timeout_s: float = 60) -> str:
    """Waits (inotify) until `path` contains `text`; returns the contents."""
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0
    try:
        assert _libc.inotify_add_watch(fd, str(path).encode(), IN_MODIFY) >= 0
        while True:
            content = path.read_text()
            if text in content:
                return content
            ready, _, _ = select.select([fd], [], [], timeout_s)
            assert ready, f"{path} never showed {text!r}; it holds: {content[-400:]!r}"
            os.read(fd, 4096)
    finally:
        os.close(fd)


def wait_exit(pid: int, timeout_s: float = 120) -> None:
    """Waits for a process that is not our child (a restored one) to end."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"process {pid} did not end"
    finally:
        os.close(fd)


# --- fixtures ---------------------------------------------------------------------------------------------------

_DRIVER: list[Path] = []


def sim_env() -> dict:
    """simcuda's environment, with the driver loaded from a private copy: uprobes that a concurrent tracer
    puts on the shared build (by inode) must not hit these jobs, since CRIU cannot dump a process with
    the kernel's [uprobes] page."""
    if not _DRIVER:
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="gputrace-full-driver-"))
        atexit.register(shutil.rmtree, d, True)
        shutil.copy2(simcuda.library_path(), d / "libcuda.so.1")
        _DRIVER.append(d)
    env = simcuda.env()
    env["LD_LIBRARY_PATH"] = f"{_DRIVER[0]}:{env['LD_LIBRARY_PATH']}"
    return env


@pytest.fixture
def device(tmp_path):
    with Device(tmp_path / "dev") as d:
        yield d


def uninterrupted(root: Path, steps: int, *args: str) -> str:
    """What simcuda's train prints run uninterrupted for `steps` (kernel time does not change it), with
    `args`, on a device of its own under root."""
    with Device(root / "dev") as d:
        r = subprocess.run(simcuda.workload("train") + ["--steps", str(steps), "--kernel-ns", "0", *args],
                           env=d.env(sim_env()), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What an uninterrupted run prints."""
    return uninterrupted(tmp_path_factory.mktemp("ref"), STEPS)


class Job:
    """train, started the way CRIU needs: its own session, stdio on files."""

    def __init__(self, root: Path, device: Device, kernel_ns: int = 20_000_000, pass_fds=(), shimmed: bool = False,
                 vmm: int = 1, steps: int = STEPS) -> None:
        self.out = root / "job.out"
        env = device.env(sim_env())
        if shimmed:  # as `gputrace run --checkpointable --suspendable` starts it
            env = {**shim.preload_env(env), "GPUTRACE_SHIM_VMM": "1"}
        argv = simcuda.workload("train") + ["--steps", str(steps), "--kernel-ns", str(kernel_ns), "--vmm", str(int(vmm))]
        with open(self.out, "w") as f:
            self.p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                      stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
        self.pid = self.p.pid
        self.restored = False

    def maps(self) -> str:
        try:
            return Path(f"/proc/{self.pid}/maps").read_text()
        except OSError:
            return ""

    def at_step(self, k: int) -> None:
        wait_for_text(self.out, f"step {k} ")

    def reap(self) -> int:
        """The original process's exit status (a killed job must be reaped before its pid is free)."""
        return self.p.wait(timeout=60)

    def kill(self) -> None:
        for pid in {self.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.p.poll() is None:
            self.p.wait(timeout=60)
        wait_exit(self.pid)


@pytest.fixture
def job(tmp_path, device):
    jobs = []

    def make(**kw) -> Job:
        j = Job(tmp_path, device, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.kill()


def state(pid: int) -> str:
    return driver.Driver(pid).state()


# --- the tests --------------------------------------------------------------------------------------------------

def test_device_memory_is_outside_the_process_and_criu_refuses_it(job, device, tmp_path):
    j = job()
    j.at_step(2)
    assert len(device.files()) == 2  # the buffer and the VMM handle, in the daemon's files
    assert any(f.startswith("socket:") for f in open_files(j.pid))
    c = criu_mod.find()
    (tmp_path / "img").mkdir()
    with pytest.raises(criu_mod.CriuFailed) as e:
        criu_mod.dump(c, j.pid, tmp_path / "img", leave_stopped=False)
    if "[uprobes]" in j.maps():
        pytest.skip("a uprobe tracer outside this test probed the job; CRIU cannot dump its [uprobes] page")
    assert "External socket" in e.value.msg
    assert j.p.poll() is None


def test_checkpoint_kill_restore_continues_like_an_uninterrupted_run(job, device, tmp_path, reference):
    j = job()
    j.at_step(5)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["kind"] == "full" and rep["pid"] == j.pid and rep["leave_running"] is False
    assert rep["freeze_ns"] >= rep["dump_ns"] > 0 and rep["checkpoint_ns"] > 0
    assert j.reap() == -signal.SIGKILL  # the job ended once its state was safe
    assert device.files() == []  # its device memory went with it, as on a GPU
    m = orjson.loads((ck / "manifest.json").read_bytes())
    assert m["complete"] is True and m["target"]["pid"] == j.pid
    assert {f["path"] for f in m["files"]} == {str(p.relative_to(ck)) for p in (ck / "criu").rglob("*") if p.is_file()}
    assert not list(tmp_path.glob(".ck.partial-*"))
    stopped_at = j.out.read_text()
    assert "done" not in stopped_at

    r = gputrace("restore", "--full", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    back = orjson.loads(r.stdout)
    assert back["pid"] == j.pid and back["criu_ns"] > 0
    j.restored = True
    assert state(j.pid) == "running"
    assert len(device.files()) == 2  # new device memory, at the same addresses
    wait_exit(j.pid)
    assert j.out.read_text() == reference  # every step, device memory and host state intact


def test_a_restored_job_is_held_still_but_the_drivers_thread_until_its_gpu_state_is_back(job, device, tmp_path,
                                                                                         reference, monkeypatch):
    """On the H200 every JAX job restored whole died of SIGSEGV as soon as CRIU let it run, before
    the driver's Restore had put its device mappings back (XLA's threads run on where PyTorch's sit
    idle). CRIU now leaves the job stopped, and while the driver restores it every thread but the one
    that serves the driver's calls is held in a tracing stop; all run once it is unlocked."""
    from gputrace.checkpointer import driverapi, full, hold

    j = job()
    j.at_step(4)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck))
    assert r.returncode == 0, r.stderr
    assert j.reap() == -signal.SIGKILL
    seen: dict[str, dict[int, str]] = {}
    call = driverapi.Driver.call

    def spy(self, name: str, timeout_ms: int = 0) -> int:
        seen[name] = {t: hold.thread_state(self.pid, t) for t in hold.threads(self.pid)}
        seen[name + " tid"] = self.restore_tid()
        return call(self, name, timeout_ms)

    monkeypatch.setattr(driverapi.Driver, "call", spy)
    back = full.restore_full(ck)
    j.restored = True
    assert back.pid == j.pid
    served = seen["Restore tid"]
    assert served and served != j.pid  # simcuda's serving thread, not the main one
    for name in ("Restore", "Unlock"):
        states = seen[name]
        assert len(states) >= 2 and states[served] not in ("t", "T", ""), states
        assert all(st == "t" for t, st in states.items() if t != served), (name, states)  # the rest held
    assert all(hold.thread_state(j.pid, t) != "t" for t in hold.threads(j.pid))  # and let go after
    wait_exit(j.pid)
    assert j.out.read_text() == reference


def test_a_restore_the_driver_fails_ends_the_process_says_so_and_loses_nothing(job, device, tmp_path, reference,
                                                                               monkeypatch):
    """The driver's Restore failing after CRIU made the process: the error names the driver's call,
    says the process was ended, and the hint fits `restore --full` (another GPU, the same command
    again), not the driver's own hint for a live job; the checkpoint then restores as ever."""
    from gputrace.base.errors import CheckpointError
    from gputrace.checkpointer import driverapi, full

    j = job()
    j.at_step(3)
    ck = tmp_path / "ck"
    assert ckpt(j, "checkpoint", "-o", str(ck)).returncode == 0
    assert j.reap() == -signal.SIGKILL
    call = driverapi.Driver.call

    def failing(self, name: str, timeout_ms: int = 0) -> int:
        if name == "Restore":
            raise CheckpointError(f"cuCheckpointProcessRestore on process {self.pid} failed: CUresult 999",
                                  "see `gputrace shim status` / the driver's state of the process")
        return call(self, name, timeout_ms)

    monkeypatch.setattr(driverapi.Driver, "call", failing)
    with pytest.raises(CheckpointError) as e:
        full.restore_full(ck)
    assert "cuCheckpointProcessRestore" in e.value.msg and "the restored process was ended" in e.value.msg
    assert "--gpu-map" in e.value.hint and f"gputrace restore --full {ck}" in e.value.hint
    assert "shim status" not in e.value.hint
    assert not Path(f"/proc/{j.pid}").exists()  # ended and reaped: the pid is free for the next try
    monkeypatch.setattr(driverapi.Driver, "call", call)
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 0, r.stderr
    j.restored = True
    wait_exit(j.pid)
    assert j.out.read_text() == reference


def test_leave_running_keeps_the_job_going(job, device, tmp_path, reference):
    j = job()
    j.at_step(3)
    r = ckpt(j, "checkpoint", "-o", str(tmp_path / "ck"), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "runs on" in r.stdout
    assert state(j.pid) == "running"
    assert j.p.poll() is None
    assert j.reap() == 0
    assert j.out.read_text() == reference
    assert (tmp_path / "ck" / "manifest.json").is_file()
    # The job wrote on to its log after the checkpoint: CRIU will not restore it with a longer file. The
    # error says which file, its sizes and how to cut it back; done as it says, the restore works.
    r = gputrace("restore", "--full", str(tmp_path / "ck"))
    assert r.returncode == 10 and "Traceback" not in r.stderr, r.stderr
    assert f"{j.out} grew from" in r.stderr and "truncate -s" in r.stderr, r.stderr
    cmd = r.stderr.split("`")[1]  # cp LOG LOG.after && truncate -s N LOG
    assert subprocess.run(cmd, shell=True).returncode == 0
    r = gputrace("restore", "--full", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    j.restored = True
    wait_exit(j.pid)
    assert j.out.read_text() == reference and Path(f"{j.out}.after").read_text() == reference


def test_restore_onto_a_taken_pid_is_a_clear_error(job, device, tmp_path):
    j = job()
    j.at_step(2)
    ck = tmp_path / "ck"
    assert ckpt(j, "checkpoint", "-o", str(ck), "--leave-running").returncode == 0
    r = gputrace("restore", "--full", str(ck))  # the job still runs at that pid
    assert r.returncode == 10
    assert f"pid {j.pid} is in use" in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr
    assert j.p.poll() is None and state(j.pid) == "running"


def test_a_failed_dump_leaves_the_job_running_and_unlocked(job, device, tmp_path, reference):
    # The job also holds one end of a socket pair whose other end stays here, outside its process tree:
    # CRIU refuses to dump it, as it would a GPU descriptor the driver did not release.
    mine, theirs = socket.socketpair()
    j = job(pass_fds=(theirs.fileno(),))
    theirs.close()
    j.at_step(2)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck))
    assert r.returncode == 10, r.stderr
    assert "criu dump" in r.stderr and "External socket" in r.stderr and "hint:" in r.stderr
    assert "Traceback" not in r.stderr
    log = Path(r.stderr.split("(log: ", 1)[1].split(")", 1)[0])  # the hint's log outlives the directory
    assert log.name == "dump.log" and "External socket" in log.read_text()
    shutil.rmtree(log.parent)
    assert not ck.exists() and not list(tmp_path.glob(".ck.partial-*"))
    assert state(j.pid) == "running"  # GPU state restored and unlocked: not frozen
    assert len(device.files()) == 2
    assert j.reap() == 0
    assert j.out.read_text() == reference
    mine.close()


def test_a_failed_dump_gives_a_shimmed_job_its_device_memory_back(job, device, tmp_path, reference, shim_dir):
    mine, theirs = socket.socketpair()
    j = job(pass_fds=(theirs.fileno(),), shimmed=True, vmm=False)
    theirs.close()
    j.at_step(2)
    r = ckpt(j, "checkpoint", "-o", str(tmp_path / "ck"))
    assert r.returncode == 10 and "External socket" in r.stderr, r.stderr
    assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck.partial-*"))
    st = shim_client.status(j.pid)
    assert st["paused"] is False and not st.get("suspended")  # the shim resumed it: the gate is open
    assert j.reap() == 0
    assert j.out.read_text() == reference
    mine.close()


def test_damaged_or_missing_images_are_refused_before_anything_runs(job, device, tmp_path):
    j = job()
    j.at_step(2)
    ck = tmp_path / "ck"
    assert ckpt(j, "checkpoint", "-o", str(ck)).returncode == 0
    j.reap()
    pages = max((ck / "criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 10 and "fails its xxh3_64 checksum" in r.stderr and "Traceback" not in r.stderr
    assert not Path(f"/proc/{j.pid}").exists()
    pages.unlink()
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 10 and "is missing" in r.stderr
    (ck / "manifest.json").unlink()
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 10 and "no manifest.json" in r.stderr and "hint:" in r.stderr
    r = gputrace("restore", "--full", str(tmp_path / "nowhere"))
    assert r.returncode == 10 and "not a checkpoint directory" in r.stderr


def test_no_criu_or_one_too_old_is_a_clear_error_and_the_job_is_untouched(job, device, tmp_path):
    j = job()
    j.at_step(2)
    old = tmp_path / "old-criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    for criu, says in ((old, "3.17.1"), (tmp_path / "absent", "does not run")):
        r = ckpt(j, "checkpoint", "-o", str(tmp_path / "ck"),
                     env=dict(os.environ, GPUTRACE_CRIU=str(criu)))
        assert r.returncode == 10, r.stderr
        assert "no CRIU >= 4.0" in r.stderr and says in r.stderr and "hint:" in r.stderr
        assert "Traceback" not in r.stderr
        assert state(j.pid) == "running" and not (tmp_path / "ck").exists()


def test_a_shimmed_job_moves_its_device_memory_by_the_shim_first(job, device, tmp_path, reference, shim_dir):
    j = job(shimmed=True, vmm=False)
    j.at_step(4)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["shim"]["allocations"] == 2 and rep["shim"]["bytes"] == (4 << 20) + (2 << 20)
    assert j.reap() == -signal.SIGKILL
    # The device data went into the directory's gpu.img, which CRIU only names: its images hold the
    # job's 4 MiB host buffer and little else, not the 6 MiB of device data again.
    assert (ck / "gpu.img").stat().st_size >= 6 << 20
    criu_bytes = sum(p.stat().st_size for p in (ck / "criu").rglob("*") if p.is_file())
    assert 4 << 20 < criu_bytes < 6 << 20
    r = gputrace("restore", "--full", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["shim_ns"] > 0  # the shim brought its allocations back
    wait_exit(j.pid)
    assert j.out.read_text() == reference


def test_the_shims_kept_pool_is_given_back_first_and_criu_does_not_dump_it(job, device, tmp_path, reference,
                                                                           shim_dir):
    """A job checkpointed before keeps the shim's pinned pool (lanes' staging and chunk area, 96 MiB
    here) between its checkpoints: `checkpoint --full` sends `release` first, so CRIU's images hold the
    job's own memory and not that pool, and the job restored goes on as an uninterrupted run."""
    from gputrace.checkpointer import checkpoint

    j = job(shimmed=True, vmm=False)
    j.at_step(3)
    checkpoint(j.pid, tmp_path / "device-only")
    pool = shim_client.status(j.pid)["kept"]["pinned_bytes"]
    assert pool >= 64 << 20
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["released_pinned_bytes"] == pool
    assert orjson.loads((ck / "manifest.json").read_bytes())["gpu"]["released_pinned_bytes"] == pool
    assert rep["criu_bytes"] < 6 << 20 < pool  # the job's 4 MiB host buffer and little else
    assert j.reap() == -signal.SIGKILL
    r = gputrace("restore", "--full", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    wait_exit(j.pid)
    assert j.out.read_text() == reference


@pytest.mark.parametrize("vmm", [1, 3], ids=["own-vmm", "stream-ordered"])
def test_a_job_whose_memory_the_driver_serves_is_moved_all_by_the_shim(job, device, tmp_path, reference, shim_dir, vmm):
    """train's own VMM mapping beside its cuMemAlloc buffer (1); or that granule from cuMemAllocAsync
    (JAX's and CuPy's async allocators) and a scratch granule allocated and freed stream-ordered every
    step (3), served through the VMM API under --suspendable: the shim's fast path moves all of it (the
    stream-ordered memory went through the driver, at three times the freeze, before)."""
    j = job(shimmed=True, vmm=vmm)
    j.at_step(2)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)["shim"]
    assert "skipped" not in rep and rep["allocations"] == 2 and rep["bytes"] == (4 << 20) + (2 << 20)
    j.reap()
    r = gputrace("restore", "--full", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["shim_ns"] > 0  # the shim made the program's allocations again
    wait_exit(j.pid)
    assert j.out.read_text() == reference


def test_a_shimmed_job_the_shim_cannot_suspend_goes_through_the_driver(job, device, tmp_path, reference, shim_dir):
    j = job(shimmed=True, vmm=2)  # its mapping's handle released at once: the shim cannot make it again
    j.at_step(2)
    r = ckpt(j, "checkpoint", "-o", str(tmp_path / "ck"), "--json")
    assert r.returncode == 0, r.stderr
    assert "cannot be suspended" in orjson.loads(r.stdout)["shim"]["skipped"]
    j.reap()
    assert gputrace("restore", "--full", str(tmp_path / "ck")).returncode == 0
    wait_exit(j.pid)
    assert j.out.read_text() == reference


def test_migrate_json_is_one_document(job, device, tmp_path):
    j = job()
    j.at_step(2)
    r = ckpt(j, "migrate", "--to", str(tmp_path / "ck"), "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)  # all of stdout: one document
    assert doc["checkpoint"]["path"] == str(tmp_path / "ck") and doc["checkpoint"]["pid"] == j.pid
    assert doc["restore"] is None  # not --restore-here: the job ended, its state on disk
    j.reap()


def test_migrate_and_gpu_map(job, device, tmp_path, reference):
    j = job()
    j.at_step(2)
    r = ckpt(j, "migrate", "--to", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    assert f"gputrace restore --full {tmp_path / 'ck'}" in r.stdout
    j.reap()
    r = gputrace("restore", "--full", str(tmp_path / "ck"), "--gpu-map", "0=7")
    assert r.returncode == 10 and "there is no GPU 7" in r.stderr and "Traceback" not in r.stderr
    assert not Path(f"/proc/{j.pid}").exists()  # refused before CRIU ran
    # A GPU the driver refuses once the process is back: it is ended, and the checkpoint can be tried again.
    r = gputrace("restore", "--full", str(tmp_path / "ck"), "--gpu-map", "0=GPU-00000000-0000-0000-0000-000000000000")
    assert r.returncode == 10 and "the restored process was ended" in r.stderr and "Traceback" not in r.stderr
    assert not Path(f"/proc/{j.pid}").exists()
    r = gputrace("restore", "--full", str(tmp_path / "ck"), "--gpu-map", "0")
    assert r.returncode == 2 and "expected OLD=NEW" in r.stderr
    r = gputrace("restore", "--full", str(tmp_path / "ck"), "--gpu-map", "0=0")
    assert r.returncode == 0, r.stderr
    wait_exit(j.pid)
    assert j.out.read_text() == reference


# --- jobs a uprobe tracer has probed ----------------------------------------------------------------------------

def _attach(pid: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "gputrace", "attach", "-p", str(pid), "--exact", "--interval", "0.3", *args]


@contextlib.contextmanager
def _live_tracer(j: "Job"):
    """`gputrace attach --exact` on the job, from its first interval (the probes in place) until the end
    of the block."""
    tracer = subprocess.Popen(_attach(j.pid, "-d", "120"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    try:
        for line in tracer.stderr:  # its first interval's line: the probes are in place
            if line.startswith("[") and f"pid {j.pid}" in line:
                break
        yield tracer
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.communicate(timeout=60)


def _needs_criu_for_uprobes():
    c = criu_mod.find()
    if not c.allows_uprobes:
        pytest.skip(f"CRIU {c.version_str} here cannot dump a process with the [uprobes] page (4.2 can): "
                    "scripts/install-criu installs one")


def test_a_job_a_tracer_has_let_go_is_checkpointed_and_restored(job, device, tmp_path, reference):
    _needs_criu_for_uprobes()
    j = job()
    j.at_step(2)
    r = subprocess.run(_attach(j.pid, "-d", "1", "-q"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[uprobes]" in j.maps()  # the kernel's page stays for the process's life
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck))  # skipped if another tracer on this host is attached now
    assert r.returncode == 0, r.stderr
    assert orjson.loads((ck / "manifest.json").read_bytes())["criu"]["allow_uprobes"] is True
    j.reap()
    # A CRIU that cannot restore the page is refused before it runs, and the checkpoint stays usable.
    old = tmp_path / "criu-4.1"
    old.write_text("#!/bin/sh\necho 'Version: 4.1.1'\nexit 1\n")
    old.chmod(0o755)
    r = gputrace("restore", "--full", str(ck), env=dict(os.environ, GPUTRACE_CRIU=str(old)))
    assert r.returncode == 10 and "[uprobes]" in r.stderr and "4.2" in r.stderr and "Traceback" not in r.stderr
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 0, r.stderr
    j.restored = True
    wait_exit(j.pid)
    assert j.out.read_text() == reference  # no breakpoint trapped, no return jumped into a missing page


def test_a_job_under_a_live_tracer_is_refused_and_runs_on(job, device, tmp_path, reference):
    j = job(kernel_ns=100_000_000)  # 15 s: it runs on after the tracer's setup
    j.at_step(2)
    with _live_tracer(j):
        assert "done" not in j.out.read_text()
        r = gputrace("checkpoint", "--full", "-p", str(j.pid), "-o", str(tmp_path / "ck"))
        assert r.returncode == 10, r.stderr
        assert "live uprobe breakpoints" in r.stderr and "libcuda.so.1" in r.stderr and "hint:" in r.stderr
        assert "Traceback" not in r.stderr
        assert state(j.pid) == "running" and not (tmp_path / "ck").exists()
        assert not list(tmp_path.glob(".ck.partial-*"))
    assert j.reap() == 0
    assert j.out.read_text() == reference


# The checks on the live job made blind, as if the tracer attached only once CRIU had started copying.
_BLIND = ("import sys; from gputrace.checkpointer import full, uprobes; "
          "full._check_traces = lambda pid, c, after: uprobes.Traces(uprobes_page=1); "
          "from gputrace.cli import main; sys.exit(main(sys.argv[1:]))")


def test_a_tracer_that_attaches_while_criu_copies_the_job_is_caught_in_the_images(job, device, tmp_path, reference):
    """The live checks run before the freeze and right before CRIU; a tracer that attaches after the
    second leaves its breakpoints in CRIU's images. Here the live checks see nothing (as if the tracer
    came later) while a tracer is attached: the images are read, the breakpoints found, the checkpoint
    refused and the job given back, running."""
    _needs_criu_for_uprobes()
    j = job(kernel_ns=100_000_000)  # 15 s: it runs on after the tracer's setup
    j.at_step(2)
    with _live_tracer(j):
        assert uprobes.traces(j.pid).breakpoints  # what the blinded checks do not look at
        r = subprocess.run([sys.executable, "-c", _BLIND, "checkpoint", "--full", "-p", str(j.pid),
                            "-o", str(tmp_path / "ck")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 10, r.stderr
        assert "images CRIU wrote" in r.stderr and "live uprobe breakpoints" in r.stderr, r.stderr
        assert "libcuda.so.1" in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr
        assert state(j.pid) == "running" and state_of(j.pid) not in ("T", "t")
        assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck.partial-*"))
    assert j.reap() == 0
    assert j.out.read_text() == reference
    # Without a tracer, the same blinded run checks the images, finds them clean and says so.
    k = job()
    k.at_step(2)
    r = subprocess.run([sys.executable, "-c", _BLIND, "checkpoint", "--full", "-p", str(k.pid), "--leave-running",
                        "-o", str(tmp_path / "ck2")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert orjson.loads((tmp_path / "ck2" / "manifest.json").read_bytes())["criu"]["image_check"] == "clean"


def state_of(pid: int) -> str:
    """The process's scheduler state letter (/proc/PID/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
def test_top_checkpoints_a_job_it_traces_whole_and_it_restores(job, device, tmp_path, reference):
    """`c` in top: top's own probes leave the libcuda file for the checkpoint (LiveSource.hold_tracing),
    so a job top has traced since it started is copied without them, runs on, and restores."""
    _needs_criu_for_uprobes()
    from gputrace.checkpointer import uprobes
    from gputrace.base.errors import GputraceError
    from gputrace.tracer.session import Options
    from gputrace.hostview.checkpoints import CheckpointerAdapter
    from gputrace.hostview.live import LiveSource

    j = job(kernel_ns=100_000_000)  # 15 s: long enough for top to start and trace it
    j.at_step(1)
    src = LiveSource(Options(interval_s=0.5), refresh_s=0.5)
    adapter = CheckpointerAdapter(root=tmp_path / "cks")
    adapter.hold_tracing = src.hold_tracing
    res = None

    def progress(done: float, what: str) -> None:
        pass

    try:
        for frame in src.frames():
            row = next((r for r in frame.processes if r.pid == j.pid), None)
            if row is not None and row.snapshot.calls_hz > 0:
                assert "[uprobes]" in j.maps()  # top has traced it
                try:
                    res = adapter.checkpoint_full(j.pid, progress)
                except GputraceError as exc:
                    with src.hold_tracing(j.pid):  # breakpoints left while ours are off are another tracer's
                        if uprobes.settle(j.pid).breakpoints:
                            pytest.skip(f"another uprobe tracer on this host is attached to the job: {exc.msg}")
                    raise
                break
            assert "done" not in j.out.read_text(), "the job ended before top had traced it"
    finally:
        src.close()
    assert res is not None and res.action == "checkpoint_full" and res.freeze_s > 0
    ck = Path(res.message.split(" to ", 1)[1].split(" in ", 1)[0])
    assert (ck / "manifest.json").is_file()
    assert j.reap() == 0  # it ran on to the end
    assert j.out.read_text() == reference
    # Its log grew after the checkpoint (CRIU checks the size): `restore -p` cuts it back to then.
    r = gputrace("restore", "-p", str(j.pid), str(ck), "--json")
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["cut"][0]["path"] == str(j.out)
    j.restored = True
    wait_exit(j.pid)
    assert j.out.read_text() == reference  # the restored job ran its last steps again, the same way


def _take_pid(want: int) -> subprocess.Popen | None:
    """A process at pid `want` (through ns_last_pid), or None when another fork took it first."""
    for _ in range(5):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(want - 1))
        p = subprocess.Popen(["sleep", "600"])
        if p.pid == want:
            return p
        p.kill()
        p.wait()
    return None


def test_restore_whose_thread_ids_are_taken_names_them(job, device, tmp_path):
    j = job(shimmed=True)
    j.at_step(2)
    ck = tmp_path / "ck"
    r = ckpt(j, "checkpoint", "-o", str(ck))
    assert r.returncode == 0, r.stderr
    j.reap()
    tids = sorted(int(p.name[5:-4]) for p in (ck / "criu").glob("core-*.img"))
    others = [t for t in tids if t != j.pid]
    assert others, tids  # the shim's control thread at least
    holder = _take_pid(others[0])
    if holder is None:
        pytest.skip(f"could not start a process at pid {others[0]}: the host forks too much")
    # New tasks past the job's ids at once: the next ones after the holder's would be the job's
    # other threads' (a thread the simcuda device started then held one, and the second restore
    # below failed on it).
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(max(tids) + 50))
    try:
        r = gputrace("restore", "--full", str(ck))
        assert r.returncode == 10 and "Traceback" not in r.stderr, r.stderr
        assert f"thread ids of the checkpointed job are in use on this host: {others[0]} (held by sleep " \
               f"(pid {others[0]}))" in r.stderr, r.stderr
        assert "hint:" in r.stderr
    finally:
        holder.kill()
        holder.wait()
    r = gputrace("restore", "--full", str(ck))  # the thread ids free again: it comes back
    assert r.returncode == 0, r.stderr
    j.restored = True
    os.kill(j.pid, signal.SIGKILL)
    wait_exit(j.pid)


def test_a_restored_process_that_is_not_there_to_drive_says_what_happened(tmp_path):
    """After CRIU made the process: one that ended at once (reaped here, as its subreaper, for its
    status) or that maps no libcuda is a CheckpointError naming that, with the way to try again,
    not the tracer's "no libcuda in that process" (seen with a JAX job on the H200)."""
    from gputrace.base.errors import CheckpointError
    from gputrace.checkpointer.full import _restored_driver

    def ended(code: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code])
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: as CRIU's would be
        return p

    for code, said in (("import sys; sys.exit(3)", "exited with status 3"),
                       ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL")):
        p = ended(code)
        with pytest.raises(CheckpointError, match=f"{said} right after CRIU restored it") as e:
            _restored_driver(p.pid, tmp_path / "ck")
        assert f"gputrace restore --full {tmp_path / 'ck'}" in e.value.hint and "output" in e.value.hint
        p.returncode = 0  # reaped by the call above
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(CheckpointError, match="maps no libcuda") as e:
            _restored_driver(alive.pid, tmp_path / "ck")
        assert "files it had open" in e.value.hint
        assert "mappings, driver-like files: none" in e.value.msg  # what it maps instead, in a line
    finally:
        alive.kill()
        alive.wait()


def test_restore_full_verifies_with_progress_in_bytes(tmp_path):
    """`restore --full` checks every image file before CRIU runs: its progress counts the bytes read."""
    import xxhash

    from gputrace.checkpointer.full import verify
    from gputrace.checkpointer.store import HASH

    files = []
    for name, size in (("a.img", 3 << 20), ("b.img", 5000)):
        data = os.urandom(size)
        (tmp_path / name).write_bytes(data)
        files.append({"path": name, "bytes": size, HASH: xxhash.xxh3_64(data).hexdigest()})
    seen = []
    verify(tmp_path, {"files": files}, lambda phase, done, total: seen.append((phase, done, total)))
    total = (3 << 20) + 5000
    assert seen[-1] == ("verify", total, total) and all(p == "verify" and t == total for p, _, t in seen)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen) and len(seen) > 1
