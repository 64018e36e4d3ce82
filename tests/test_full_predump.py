"""Whole-process checkpoints after pre-dumps (checkpointer/predump.py, issue 42 part 4), with real CRIU on
simcuda in device mode: a pre-dump while the job runs (no driver lock), then a final `checkpoint --full`
whose dump writes only the pages written since; restore needs and checks every pre-dump; a host whose
kernel cannot track written pages, and a pre-dump CRIU cannot make (a live CUDA job's device mappings),
are refused with the job untouched and the final checkpoint whole."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import orjson
import pytest
import xxhash

from gputrace import simcuda
from gputrace.base.errors import CorruptCheckpoint
from gputrace.checkpointer import criu as criu_mod
from gputrace.checkpointer import full, predump
from gputrace.simcuda.device import Device

from test_full_checkpoint import FOREIGN_TRACER, Job, _criu_reason, sim_env, state, uninterrupted, wait_exit
from test_full_checkpoint import gputrace as _gputrace

pytestmark = pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))

STEPS = 120
HOST = 64 << 20  # the job's host memory, of which a step writes one word


def _dirty_reason() -> str | None:
    if _criu_reason() is not None:
        return _criu_reason()
    ok, said = criu_mod.check(criu_mod.find(), criu_mod.DIRTY_TRACK)
    return None if ok else (f"this kernel cannot track the pages a process writes (`criu check --feature "
                            f"{criu_mod.DIRTY_TRACK}`: {said}; CONFIG_MEM_SOFT_DIRTY)")


class BigJob(Job):
    """train with --host: much host memory, little of it written a step."""

    def __init__(self, root: Path, device: Device, steps: int = STEPS) -> None:
        self.out = root / "job.out"
        argv = simcuda.workload("train") + ["--steps", str(steps), "--kernel-ns", "20000000", "--size", "65536",
                                            "--host", str(HOST)]
        with open(self.out, "w") as f:
            self.p = subprocess.Popen(argv, env=device.env(sim_env()), stdin=subprocess.DEVNULL, stdout=f,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.p.pid
        self.restored = False


@pytest.fixture
def device(tmp_path):
    with Device(tmp_path / "dev") as d:
        yield d


@pytest.fixture
def big(tmp_path, device):
    jobs: list[BigJob] = []

    def make() -> BigJob:
        jobs.append(BigJob(tmp_path, device))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory):
    return uninterrupted(tmp_path_factory.mktemp("ref"), STEPS, "--size", "65536", "--host", str(HOST))


def gputrace(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """As test_full_checkpoint's `ckpt`: a uprobe tracer of another session on this host (it probes every
    CUDA process) is no failure of the code under test, and a serial CI run has none: skipped so."""
    r = _gputrace(*args, env=env)
    if r.returncode and any(s in r.stderr for s in FOREIGN_TRACER):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {r.stderr.splitlines()[0]}")
    return r


def fake_criu(tmp_path: Path, body: str) -> dict:
    """An environment whose CRIU is a script that runs `body` (sh) and else execs the real one."""
    real = criu_mod.find().path
    w = tmp_path / "criu-wrapper"
    w.write_text(f"#!/bin/sh\n{body}\nexec {real} \"$@\"\n")
    w.chmod(0o755)
    return dict(os.environ, GPUTRACE_CRIU=str(w))


def parasite(pid: int) -> bool:
    return "CRIUMFD" in Path(f"/proc/{pid}/maps").read_text()


# --- everywhere CRIU runs ------------------------------------------------------------------------------------------

def test_a_host_without_dirty_tracking_refuses_the_pre_dump_and_the_job_runs_on(big, tmp_path):
    """`criu check --feature mem_dirty_track` failing (injected: some kernels lack the soft-dirty bits, and
    CRIU 4.x then aborts half-way through a pre-dump, its code left in the job): refused before CRIU
    runs on the job, with the hint; nothing is kept, and the checkpoint taken next is whole."""
    j = big()
    j.at_step(2)
    env = fake_criu(tmp_path, 'if [ "$1 $2 $3" = "check --feature mem_dirty_track" ]; then '
                              'echo "Warn  (criu/cr-check.c:824): Dirty tracking is OFF." >&2; exit 1; fi')
    ck = tmp_path / "ck"
    r = gputrace("checkpoint", "--full", "--pre-dump", "-p", str(j.pid), "-o", str(ck), env=env)
    assert r.returncode == 10, r.stderr
    assert "mem_dirty_track" in r.stderr and "Dirty tracking is OFF" in r.stderr and "Traceback" not in r.stderr
    assert "hint:" in r.stderr and "CONFIG_MEM_SOFT_DIRTY" in r.stderr and "checkpoint --full` alone" in r.stderr
    assert state(j.pid) == "running" and j.p.poll() is None and not parasite(j.pid)
    assert not predump.pending_dir(j.pid, ck).exists() and not ck.exists()
    r = gputrace("checkpoint", "--full", "-p", str(j.pid), "-o", str(ck), "--leave-running", "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["pre_dumps"] == 0 and rep["pre_dump_unused"] is None
    assert rep["pages_written"] >= HOST // 4096 and rep["page_bytes"] >= HOST  # whole: all its host memory


def test_a_pre_dump_criu_cannot_make_is_a_clear_error_and_the_final_checkpoint_is_whole(big, tmp_path):
    """On a GPU the live job maps the driver's devices, which CRIU cannot copy while it runs (the final
    dump can: the driver's lock and checkpoint have dropped them). A pre-dump failing so (injected, with
    the error CRIU logs) says what and why, keeps nothing, leaves the job running and unlocked, and the
    checkpoint taken next dumps whole."""
    j = big()
    j.at_step(2)
    env = fake_criu(tmp_path, 'if [ "$1 $2 $3" = "check --feature mem_dirty_track" ]; then exit 0; fi\n'
                              'if [ "$1" = pre-dump ]; then while [ $# -gt 0 ]; do [ "$1" = -D ] && d=$2; shift; done; '
                              'echo "(00.0123) Error (criu/proc_parse.c:1002): Can\'t handle non-regular mapping on '
                              '42\'s map 7f0000000000 (/dev/nvidia0)" > "$d/pre-dump.log"; exit 1; fi')
    ck = tmp_path / "ck"
    r = gputrace("checkpoint", "--full", "--pre-dump", "-p", str(j.pid), "-o", str(ck), env=env)
    assert r.returncode == 10, r.stderr
    assert "criu pre-dump of process" in r.stderr and "non-regular mapping" in r.stderr, r.stderr
    assert "maps a device" in r.stderr and "Nothing was kept" in r.stderr and "whole host memory" in r.stderr
    assert "Traceback" not in r.stderr
    assert state(j.pid) == "running" and j.p.poll() is None
    assert not predump.pending_dir(j.pid, ck).exists()
    r = gputrace("checkpoint", "--full", "-p", str(j.pid), "-o", str(ck), "--leave-running", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["pre_dumps"] == 0


def _chain(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint directory laid out as one dumped after two pre-dumps (files of bytes, not CRIU's),
    and its manifest: what restore's verification reads."""
    ck = tmp_path / "ck"
    files = []
    for d, parent in (("pre-1", None), ("pre-2", "../pre-1"), ("criu", "../pre-2")):
        (ck / d).mkdir(parents=True)
        data = os.urandom(8192) + d.encode()
        (ck / d / "pages-1.img").write_bytes(data)
        files.append({"path": f"{d}/pages-1.img", "bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)})
        if parent:
            os.symlink(parent, ck / d / "parent")
    m = {"files": files, "criu": {"pre_dumps": [{"dir": "pre-1"}, {"dir": "pre-2"}]}}
    return ck, m


def test_restore_refuses_a_checkpoint_whose_pre_dumps_are_missing_damaged_or_unchained(tmp_path):
    ck, m = _chain(tmp_path)
    full.verify(ck, m)  # as written
    page = ck / "pre-1" / "pages-1.img"
    good = page.read_bytes()
    page.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(CorruptCheckpoint) as e:
        full.verify(ck, m)
    assert "fails its xxh3_64 checksum" in e.value.msg and "pre-dump's" in e.value.msg
    page.write_bytes(good)
    page.unlink()
    with pytest.raises(CorruptCheckpoint) as e:
        full.verify(ck, m)
    assert "is missing" in e.value.msg and "pre-dump's" in e.value.msg and "every pre-N" in e.value.hint
    page.write_bytes(good)
    shutil.move(ck / "pre-1", tmp_path / "away")
    with pytest.raises(CorruptCheckpoint) as e:
        full.verify(ck, m)
    assert "pre-1, a pre-dump of this checkpoint, is missing" in e.value.msg
    shutil.move(tmp_path / "away", ck / "pre-1")
    (ck / "criu" / "parent").unlink()
    os.symlink("../pre-1", ck / "criu" / "parent")  # skipping pre-2
    with pytest.raises(CorruptCheckpoint) as e:
        full.verify(ck, m)
    assert "do not chain" in e.value.msg and "../pre-2" in e.value.msg


# --- where the kernel tracks written pages -------------------------------------------------------------------------

@pytest.mark.skipif(_dirty_reason() is not None, reason=str(_dirty_reason()))
def test_pre_dumps_then_the_freeze_dumps_only_what_changed_and_the_job_comes_back_right(big, tmp_path,
                                                                                          big_reference):
    j = big()
    j.at_step(2)
    whole = gputrace("checkpoint", "--full", "-p", str(j.pid), "-o", str(tmp_path / "whole"), "--leave-running",
                     "--json")
    assert whole.returncode == 0, whole.stderr
    w = orjson.loads(whole.stdout)
    ck = tmp_path / "ck"
    reps = []
    for k in (1, 2):
        at = j.out.read_text().count("step ")
        r = gputrace("checkpoint", "--full", "--pre-dump", "-p", str(j.pid), "-o", str(ck), "--json")
        assert r.returncode == 0, r.stderr
        reps.append(orjson.loads(r.stdout))
        assert reps[-1]["index"] == k and reps[-1]["pre_dumps"] == k
        assert state(j.pid) == "running"  # never locked in the driver
        j.at_step(at + 2)  # and it runs on
    assert reps[0]["bytes"] >= HOST and reps[1]["bytes"] < HOST // 4  # the second: what the job wrote since
    pend = predump.pending_dir(j.pid, ck)
    assert (pend / "pre-2" / "parent").is_symlink() and not ck.exists()
    r = gputrace("checkpoint", "--full", "-p", str(j.pid), "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    f = orjson.loads(r.stdout)
    assert f["pre_dumps"] == 2 and f["pre_dump_unused"] is None and f["pages_in_pre_dumps"] > 0
    assert f["pages_written"] * 4 < w["pages_written"] and f["page_bytes"] * 4 < w["page_bytes"]
    assert not pend.exists()
    m = orjson.loads((ck / "manifest.json").read_bytes())
    assert [e["dir"] for e in m["criu"]["pre_dumps"]] == ["pre-1", "pre-2"]
    listed = {x["path"] for x in m["files"]}
    assert {str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file() and not p.is_symlink()} - {"manifest.json"} \
        == listed
    assert os.readlink(ck / "criu" / "parent") == "../pre-2"
    assert j.reap() == -signal.SIGKILL

    # Restore needs every pre-dump, checked: a damaged or missing one is refused, nothing restored
    page = max((ck / "pre-1").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    good = page.read_bytes()
    page.write_bytes(good[:4096] + bytes([good[4096] ^ 0xFF]) + good[4097:])
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 10 and "fails its xxh3_64 checksum" in r.stderr and "pre-dump" in r.stderr, r.stderr
    assert not Path(f"/proc/{j.pid}").exists()
    page.write_bytes(good)
    shutil.move(ck / "pre-1", tmp_path / "pre-1")
    r = gputrace("restore", "--full", str(ck))
    assert r.returncode == 10 and "a pre-dump of this checkpoint, is missing" in r.stderr, r.stderr
    assert not Path(f"/proc/{j.pid}").exists()
    shutil.move(tmp_path / "pre-1", ck / "pre-1")

    r = gputrace("restore", "--full", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    j.restored = True
    wait_exit(j.pid)
    assert j.out.read_text() == big_reference  # every step, and all of its host memory ("done"'s second sum)
