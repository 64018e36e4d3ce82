"""Hardening: what a hostile local user, a malformed checkpoint or a killed gputrace can do to a job.

Each test sets up the attack or the damage the way it was found (an unprivileged user's files and
processes, a manifest or image made by the test, gputrace stopped at a chosen point and killed) and
checks that root's gputrace refuses it with a clear error, and that the job runs on untouched.
docs/security.md lists the threats and which test covers each."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.checkpointer import checkpoint, image, restore, resume, suspend
from gputrace.base.errors import CheckpointError, CheckpointMismatch, CorruptCheckpoint, ShimUnavailable, Untrusted
from gputrace.shim import client

from ckpttest import Target, target  # noqa: F401  (fixture)
from shimtest import procs, shim_dir, start  # noqa: F401  (fixtures)

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root: the attacks are on root's gputrace")


def gputrace(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def refused(r: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and "\nhint: " in r.stderr, r.stderr
    assert text in r.stderr, r.stderr


@pytest.fixture
def attacker(tmp_path):
    """(uid, gid) of an unprivileged local user made for the test (useradd), removed afterwards; where
    useradd is missing, an unused uid (setpriv runs processes as any uid)."""
    if not ROOT or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    name = f"gpt{os.getpid() % 100000}"
    made = False
    if shutil.which("useradd"):
        r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           capture_output=True, text=True)
        made = r.returncode == 0
    if made:
        import pwd

        pw = pwd.getpwnam(name)
        uid, gid = pw.pw_uid, pw.pw_gid
    else:
        uid = gid = 61000 + os.getpid() % 1000
    yield uid, gid
    if made:
        subprocess.run(["userdel", name], capture_output=True)


def as_user(uid: int, gid: int, argv: list[str], **kw) -> subprocess.Popen:
    """ARGV run as the user; returns once it runs as them (it says so on stdout, then execs ARGV)."""
    p = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "sh", "-c",
                          'echo ready; exec "$@"', "sh", *argv], stdout=subprocess.PIPE, text=True, **kw)
    assert p.stdout.readline().strip() == "ready"
    return p


def user_dir(base: Path, uid: int, gid: int, name: str) -> Path:
    """A 0700 directory owned by the user, as the user would make it."""
    d = base / name
    d.mkdir(mode=0o700)
    os.chown(d, uid, gid)
    return d


# --- the client checks who answers ----------------------------------------------------------------------------


@needs_root
def test_a_users_symlink_to_roots_socket_does_not_reach_roots_job(target, tmp_path, attacker):
    """A user runs `sleep` (no CUDA, no shim) with GPUTRACE_SHIM_DIR pointing at a directory of theirs
    that holds a symbolic link to root's job's socket: root's status, checkpoint and restore of the
    user's pid must not act on root's job."""
    uid, gid = attacker
    job = target()
    data = job.sum()
    ck = tmp_path / "ck"
    checkpoint(job.pid, ck)  # a checkpoint of root's job, for the restore attempt
    base = tmp_path / "pub"
    base.mkdir(mode=0o711)
    evil = user_dir(base, uid, gid, "evil")
    sleeper = as_user(uid, gid, ["sleep", "600"], env={**os.environ, "GPUTRACE_SHIM_DIR": str(evil)})
    try:
        link = evil / f"shim-{sleeper.pid}.sock"
        os.symlink(client.socket_path(job.pid), link)
        os.lchown(link, uid, gid)
        with pytest.raises(Untrusted, match="not a socket"):
            client.status(sleeper.pid)
        refused(gputrace("shim", "status", "-p", str(sleeper.pid)), 5, "refusing the control socket")
        refused(gputrace("checkpoint", "-p", str(sleeper.pid), "-o", str(tmp_path / "stolen")), 5,
                "refusing the control socket")
        assert not (tmp_path / "stolen").exists()
        refused(gputrace("restore", "-p", str(sleeper.pid), str(ck), "--device-only"), 10, f"not a checkpoint of process {sleeper.pid}")
        refused(gputrace("restore", "-p", str(sleeper.pid), str(ck), "--device-only", "--into-other-process"), 5,
                "refusing the control socket")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert job.gate_open() and job.sum() == data


def _fake_shim(sock: Path, reply: bytes | None, stop: threading.Event) -> threading.Thread:
    """A server at `sock`, in this process: answers every connection with `reply` (None: an endless
    stream that never ends its line)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(4)
    srv.settimeout(0.2)

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except socket.timeout:
                continue
            try:
                c.recv(4096)
                if reply is not None:
                    c.sendall(reply)
                else:
                    while not stop.is_set():
                        c.sendall(b"x" * 65536)
            except OSError:
                pass
            finally:
                c.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@needs_root
def test_a_socket_served_by_another_process_is_refused_before_anything_is_sent(tmp_path):
    """The job's directory is right (the job's user's, 0700) but the socket in it is served by another
    process: its reply must not be taken for the job's state."""
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    sleeper = subprocess.Popen(["sleep", "600"], env={**os.environ, "GPUTRACE_SHIM_DIR": str(d)})
    stop = threading.Event()
    try:
        _fake_shim(d / f"shim-{sleeper.pid}.sock", b'{"schema": 1, "pid": 1, "paused": false}\n', stop)
        with pytest.raises(Untrusted, match=rf"served by process {os.getpid()} .*not by process {sleeper.pid}"):
            client.status(sleeper.pid)
    finally:
        stop.set()
        sleeper.kill()
        sleeper.wait()


@needs_root
def test_a_default_directory_another_user_made_first_is_refused(tmp_path, attacker):
    """Root's job would serve in $XDG_RUNTIME_DIR/gputrace; a user made that directory first and serves
    a socket there under the job's pid: root's client refuses the directory (the shim itself would
    not serve there either)."""
    uid, gid = attacker
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o755)
    evil = user_dir(xdg, uid, gid, "gputrace")
    sleeper = subprocess.Popen(["sleep", "600"], env={**{k: v for k, v in os.environ.items()
                                                        if k != "GPUTRACE_SHIM_DIR"}, "XDG_RUNTIME_DIR": str(xdg)})
    stop = threading.Event()
    try:
        _fake_shim(evil / f"shim-{sleeper.pid}.sock", b'{"schema": 1, "paused": false}\n', stop)
        with pytest.raises(Untrusted, match=rf"belongs to uid {uid}, not to the job's user \(uid 0\)"):
            client.status(sleeper.pid)
        refused(gputrace("shim", "status", "-p", str(sleeper.pid)), 5, f"belongs to uid {uid}")
    finally:
        stop.set()
        sleeper.kill()
        sleeper.wait()


@needs_root
def test_the_lock_file_is_never_created_through_a_symlink(target, shim_dir, tmp_path):
    """A symbolic link where the lock file goes (the directory is the job's user's to write) must not
    make root create a file where it points."""
    job = target()
    victim = tmp_path / "victim"
    os.symlink(victim, shim_dir / f"shim-{job.pid}.lock")
    with pytest.raises(Untrusted, match="is a symbolic link"):
        checkpoint(job.pid, tmp_path / "ck")
    refused(gputrace("checkpoint", "-p", str(job.pid), "-o", str(tmp_path / "ck2")), 5, "is a symbolic link")
    assert not victim.exists() and not os.path.lexists(tmp_path / "ck") and not (tmp_path / "ck2").exists()
    # A hard link to another file is refused too (a plain file of the job's user with one link only).
    other = tmp_path / "other"
    other.write_text("x")
    (shim_dir / f"shim-{job.pid}.lock").unlink()
    os.link(other, shim_dir / f"shim-{job.pid}.lock")
    with pytest.raises(Untrusted, match="not a lock file gputrace made"):
        checkpoint(job.pid, tmp_path / "ck")
    (shim_dir / f"shim-{job.pid}.lock").unlink()
    assert checkpoint(job.pid, tmp_path / "ck").allocations > 0 and job.gate_open()


# --- reads with a size limit and a deadline; one client cannot stall the others --------------------------------

SERVER = r"""
import os, socket, sys, time
d = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(f"{d}/shim-{os.getpid()}.sock")
s.listen(4)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.recv(4096)
    try:
        while True:
            c.sendall(b"x" * (65536 if sys.argv[2] == "flood" else 1))
            if sys.argv[2] == "drip":
                time.sleep(0.2)
    except OSError:
        c.close()
"""


@pytest.mark.parametrize("how", ["flood", "drip"])
def test_a_reply_that_never_ends_is_cut_off(tmp_path, procs, how):
    """A "shim" (the target process itself, so its credentials pass) that answers with an endless line,
    fast or a byte at a time: the client gives up at the size limit or the reply's deadline."""
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    p = subprocess.Popen([sys.executable, "-c", SERVER, str(d), how], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "GPUTRACE_SHIM_DIR": str(d)})
    procs.append(p)
    assert p.stdout.readline().strip() == "ready"
    with client.Connection(p.pid, timeout_s=3) as c:
        with pytest.raises(ShimUnavailable, match="more than 64 MiB|did not answer 'status' within 3 s"):
            c.status()
    # And the command a user runs: an error, not a hang.
    refused(gputrace("shim", "status", "-p", str(p.pid), timeout=120), 8, "the shim of process")


def test_a_client_that_does_not_read_does_not_stall_the_others(target, shim_dir):
    """A client sends status commands without reading a reply: the shim stops reading its commands
    until it reads, and drops it after a while; other clients are answered meanwhile."""
    job = target()
    greedy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    greedy.connect(str(client.socket_path(job.pid)))
    greedy.setblocking(False)
    sent = 0
    try:
        while sent < 4 << 20:
            sent += greedy.send(b"status\n" * 1024)
    except BlockingIOError:
        pass  # the shim stopped reading: its commands back up in the socket, not in the shim
    for _ in range(5):
        with client.Connection(job.pid, timeout_s=5) as c:  # within 5 s each, while the greedy one waits
            assert c.status()["pid"] == job.pid
    greedy.close()
    assert job.gate_open()


# --- malformed checkpoints ---------------------------------------------------------------------------------------


def _edit(ck: Path, fn) -> None:
    m = orjson.loads((ck / "manifest.json").read_bytes())
    fn(m)
    (ck / "manifest.json").write_bytes(orjson.dumps(m))


MANIFEST_DAMAGE = {
    "wrong-type": (lambda m: m["data"].__setitem__("bytes", "many"), "data.bytes is missing or not an integer"),
    "missing-key": (lambda m: m.pop("allocations"), "allocations is missing or not a list"),
    "huge-chunk": (lambda m: m["data"].__setitem__("chunk_bytes", 1 << 62), "data.chunk_bytes is 4611686018427387904"),
    "negative-size": (lambda m: m["allocations"][0].__setitem__("size", -1), "allocations[0].size is -1"),
    "target-not-object": (lambda m: m.__setitem__("target", [1]), "target is missing or not an object"),
    "outside-file": (lambda m: m["data"].__setitem__("file", "../other/data.img"), "outside the checkpoint"),
    "absolute-file": (lambda m: m["data"].__setitem__("file", "/etc/passwd"), "outside the checkpoint"),
    "offset-past-data": (lambda m: m["allocations"][0].__setitem__("offset", m["data"]["bytes"]),
                         "allocations[0].offset"),
}


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE, ids=list(MANIFEST_DAMAGE))
def test_a_malformed_manifest_is_a_clear_error_and_changes_nothing(target, tmp_path, damage):
    job = target()
    ck = tmp_path / "ck"
    checkpoint(job.pid, ck)
    now = job.cmd("fill 7")["sum"]
    fn, text = MANIFEST_DAMAGE[damage]
    _edit(ck, fn)
    with pytest.raises(CorruptCheckpoint, match=text.replace("[", r"\[").replace("]", r"\]")):
        restore(job.pid, ck)
    refused(gputrace("restore", "-p", str(job.pid), str(ck), "--device-only"), 10, text)
    assert job.sum() == now and job.gate_open()


FILE_DAMAGE = {
    "manifest-fifo": ("manifest.json", lambda p: os.mkfifo(p), "is a FIFO"),
    "manifest-dev-zero": ("manifest.json", lambda p: os.symlink("/dev/zero", p), "is a symbolic link"),
    "data-dev-urandom": ("data.img", lambda p: os.symlink("/dev/urandom", p), "is a symbolic link"),
    "data-directory": ("data.img", lambda p: p.mkdir(), "is a directory"),
    "data-fifo": ("data.img", lambda p: os.mkfifo(p), "is a FIFO"),
}


@pytest.mark.parametrize("damage", FILE_DAMAGE, ids=list(FILE_DAMAGE))
def test_a_checkpoint_file_that_is_not_a_plain_file_is_refused_before_it_is_read(target, tmp_path, damage):
    """A FIFO would hang the reader, /dev/zero would read without end: refused on what they are."""
    job = target()
    ck = tmp_path / "ck"
    checkpoint(job.pid, ck)
    name, make, text = FILE_DAMAGE[damage]
    (ck / name).unlink()
    make(ck / name)
    with pytest.raises(CorruptCheckpoint, match=text):
        restore(job.pid, ck)
    refused(gputrace("restore", "-p", str(job.pid), str(ck), "--device-only", timeout=60), 10, text)
    assert job.gate_open()


def _image_with(entries: list[tuple[int, int, int]], data_bytes: int) -> bytes:
    count = len(entries)
    data_offset = 4096
    hdr = struct.pack("<16s4Q", image.MAGIC, count, data_offset, data_bytes, 8 << 20)
    ents = b"".join(struct.pack("<3Q2i", b, s, o, 0, 1) for b, s, o in entries)
    return (hdr + ents).ljust(data_offset, b"\0") + b"\xab" * data_bytes


def test_the_shim_checks_every_offset_it_is_handed_again(target, tmp_path):
    """An image whose entry offset wraps around 2^64 (offset + size small again) killed the job with
    SIGSEGV; handed straight to the shim (no checks on this side), it is refused and the job runs on."""
    job = target()
    now = job.sum()
    live = image.saved_allocations(client.status(job.pid))
    base, size, _ = live[0]
    total = sum(s for _, s, _ in live)
    cases = {
        "offset wraps": [(base, size, (1 << 64) - 4096)] + [(b, s, 4096 + size) for b, s, _ in live[1:]],
        "past the end": [(b, s, 4096 + i * s + (1 << 40)) for i, (b, s, _) in enumerate(live)],
        "overlapping": [(b, s, 4096) for b, s, _ in live],
    }
    for what, ents in cases.items():
        fd = os.memfd_create("img")
        try:
            os.write(fd, _image_with(ents, total))
            with client.Connection(job.pid) as c:
                r = c.request("restore", fd=fd)
        finally:
            os.close(fd)
        assert r["ok"] is False and r["error"] == "bad image", (what, r)
        assert job.p.poll() is None, what
    assert job.sum() == now and job.gate_open()


# --- identity: a checkpoint records what it was taken of ------------------------------------------------------


def test_restore_into_another_process_needs_a_flag_and_says_what_differs(target, tmp_path):
    a, b = target(), target()
    ck = tmp_path / "ck"
    checkpoint(a.pid, ck)
    m = orjson.loads((ck / "manifest.json").read_bytes())
    assert m["target"]["pid"] == a.pid and m["target"]["start_time"] > 0 and m["target"]["boot_id"]
    now = b.sum()
    refused(gputrace("restore", "-p", str(b.pid), str(ck), "--device-only"), 10, f"it was taken of process {a.pid}")
    assert b.sum() == now
    # The same pid, but an earlier process (its start time differs): refused too.
    _edit(ck, lambda m: m["target"].__setitem__("start_time", m["target"]["start_time"] - 1))
    with pytest.raises(CheckpointMismatch, match=f"an earlier process {a.pid}"):
        restore(a.pid, ck)
    # Asked for explicitly, the data go where the layout matches (simcuda gives both the same layout),
    # and nothing else is checked away.
    r = gputrace("restore", "-p", str(b.pid), str(ck), "--device-only", "--into-other-process")
    if client.status(b.pid)["allocations"] and image.saved_allocations(client.status(b.pid)) == \
            [(x["base"], x["size"], x["device"]) for x in m["allocations"]]:
        assert r.returncode == 0, r.stderr
        assert b.sum() == a.sum()
    else:
        refused(r, 10, "does not match what process")


# --- a stopped or suspended job ---------------------------------------------------------------------------------


def test_operations_on_a_stopped_job_fail_at_once(target, tmp_path):
    job = target()
    os.kill(job.pid, signal.SIGSTOP)
    try:
        for args in (["checkpoint", "-p", str(job.pid), "-o", str(tmp_path / "ck")],
                     ["checkpoint", "--backend", "driver", "-p", str(job.pid)],
                     ["suspend", "-p", str(job.pid)]):
            refused(gputrace(*args, timeout=30), 10, f"process {job.pid}: it is stopped")
        refused(gputrace("checkpoint", "--full", "-p", str(job.pid), "-o", str(tmp_path / "full"), timeout=30), 10,
                f"process {job.pid}: it is stopped")
    finally:
        os.kill(job.pid, signal.SIGCONT)
    assert job.gate_open()


def _vmm_target(procs) -> Target:
    env = {**shim.preload_env(simcuda.env()), "GPUTRACE_SHIM_VMM": "1"}
    t = Target.__new__(Target)
    t.p = subprocess.Popen(simcuda.workload("pattern") + ["--plain", "--size", str(1 << 20)], env=env,
                           stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(t.p)
    t.ready = json.loads(t.p.stdout.readline())
    t.pid = t.p.pid
    return t


def test_checkpoint_or_restore_of_a_suspended_job_says_it_is_suspended(procs, shim_dir, tmp_path):
    job = _vmm_target(procs)
    ck = tmp_path / "ck"
    checkpoint(job.pid, ck)
    suspend(job.pid)
    for fn in (lambda: checkpoint(job.pid, tmp_path / "ck2"), lambda: restore(job.pid, ck)):
        with pytest.raises(CheckpointError, match="is suspended") as e:
            fn()
        assert "gputrace resume" in e.value.hint and "gate is open" not in e.value.hint
    resume(job.pid)
    assert job.sum() == job.ready["sum"]


# --- smaller items -------------------------------------------------------------------------------------------------


def test_a_partial_directory_that_is_not_ours_is_neither_used_nor_deleted(target, tmp_path):
    job = target()
    theirs = tmp_path / f".ck.partial-{os.getpid()}"
    theirs.mkdir()
    (theirs / "keep").write_text("someone's")
    with pytest.raises(CheckpointError, match="exists already, and it is not this checkpoint's"):
        checkpoint(job.pid, tmp_path / "ck")
    assert (theirs / "keep").read_text() == "someone's" and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("args,text", [
    (["attach", "-p", "1", "--cost-ns", "-1"], "--cost-ns: -1 is out of range"),
    (["attach", "-p", "1", "--functions", ""], "--functions: an empty value selects nothing"),
    (["demo", "-d", "-5"], "--duration: -5 is out of range"),
    (["checkpoint", "-p", "1", "--chunk", "1000"], "--chunk: 1000 is out of range"),
    (["checkpoint", "-p", "1", "--lanes", "0"], "--lanes: 0 is out of range"),
    (["top", "--once", "-d", "0"], "--duration: 0 is out of range"),
])
def test_bad_numbers_and_empty_patterns_are_refused_by_the_parser(args, text):
    r = gputrace(*args, timeout=30)
    assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,hint", [
    (["run", "--checkpointable", "sleep", "1"], "hint: give the command to run after `--`: "
                                                "gputrace run --checkpointable -- sleep 1"),
    (["attach", "--exact", "python3", "train.py"], "hint: give the command to trace after `--`: "
                                                   "gputrace attach --exact -- python3 train.py"),
    # An option's value equal to a word of the command stays with the option.
    (["attach", "-d", "1", "sleep", "1"], "hint: give the command to trace after `--`: "
                                          "gputrace attach -d 1 -- sleep 1"),
])
def test_a_command_given_without_its_double_dash_gets_the_line_to_type(args, hint):
    r = gputrace(*args, timeout=30)
    assert r.returncode == 2 and hint in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_unknown_option_shows_the_commands_own_usage():
    r = gputrace("attach", "--bogus", timeout=30)
    assert r.returncode == 2 and "gputrace attach: error: unrecognized arguments: --bogus" in r.stderr
    assert "[--jsonl]" in r.stderr  # attach's usage, not the top level's


@pytest.mark.parametrize("cmd, example", [
    ("attach", "gputrace attach -p 1234"), ("run", "gputrace run"), ("checkpoint", "gputrace checkpoint -p 1234"),
    ("restore", "gputrace restore -p 1234"), ("suspend", "gputrace suspend -p 1234"),
    ("resume", "gputrace resume -p 1234"), ("top", "gputrace top"), ("ps", "gputrace ps"),
    ("doctor", "gputrace doctor"), ("demo", "gputrace demo")])
def test_every_commands_help_has_examples(cmd, example):
    r = gputrace(cmd, "--help", timeout=30)
    assert r.returncode == 0 and "examples:" in r.stdout and example in r.stdout.split("examples:", 1)[1], r.stdout


@pytest.mark.parametrize("cmd", ["run", "attach"])
def test_the_usage_line_shows_where_the_command_goes(cmd):
    r = gputrace(cmd, "--help", timeout=30)
    usage = r.stdout.split("\n\n")[0]
    assert r.returncode == 0 and usage.startswith(f"usage: gputrace {cmd}") and "[-- COMMAND [ARG ...]]" in usage


def test_run_needs_no_flag_to_preload_the_shim(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gputrace", "run", "--", "sh", "-c", "echo $LD_PRELOAD"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "gputrace" in r.stdout and r.stdout.strip().endswith(".so"), (r.stdout, r.stderr)
