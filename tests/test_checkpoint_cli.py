"""`gputrace checkpoint` and `gputrace restore` from the command line: reports, and `error:`/`hint:` for
what goes wrong (no such pid, no shim, a damaged checkpoint, an existing output directory)."""

from __future__ import annotations

import json
import subprocess
import sys

import orjson

from gputrace import simcuda

from shimtest import procs, shim_dir, start  # noqa: F401  (fixtures)


def gputrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=120)


def cmd(p, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_checkpoint_and_restore_from_the_cli(procs, shim_dir, tmp_path):
    p = start(procs, simcuda.workload("pattern") + ["--size", str(2 << 20)])
    ready = json.loads(p.stdout.readline())
    r = gputrace("checkpoint", "-p", str(p.pid), "-o", str(tmp_path / "ck"), "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["schema"] == 1 and rep["bytes"] == ready["bytes"] and rep["path"] == str(tmp_path / "ck")
    assert rep["freeze_ns"] > 0 and rep["copy_gbps"] > 0 and rep["write_ns"] > 0
    assert cmd(p, "fill 4")["sum"] != ready["sum"]
    r = gputrace("restore", "-p", str(p.pid), str(tmp_path / "ck"))  # device memory alone is asked for, or refused
    assert r.returncode == 2 and "--device-only" in r.stderr and "checkpoint --full --leave-running" in r.stderr
    # A program that allocates once and is idle between commands: the checks see nothing unsafe.
    r = gputrace("restore", "-p", str(p.pid), str(tmp_path / "ck"), "--device-only")
    assert r.returncode == 0, r.stderr
    assert f"restored pid {p.pid}'s device memory" in r.stdout and "freeze" in r.stdout and "verify" in r.stdout
    # Where the user acts: only device memory went back.
    assert "device memory only: the process's host state" in r.stderr and "skipped" not in r.stderr
    r = gputrace("restore", "-p", str(p.pid), str(tmp_path / "ck"), "--device-only", "--json")
    doc = orjson.loads(r.stdout)
    assert r.returncode == 0 and doc["host_state_restored"] is False and doc["checked"] is True, r.stderr
    assert cmd(p, "sum")["sum"] == ready["sum"]
    text = gputrace("checkpoint", "-p", str(p.pid), "-o", str(tmp_path / "ck2"))
    assert text.returncode == 0 and "freeze" in text.stdout and "GB/s" in text.stdout
    again = gputrace("checkpoint", "-p", str(p.pid), "-o", str(tmp_path / "ck2"))
    assert again.returncode == 10 and "already exists" in again.stderr and "hint:" in again.stderr


def test_cli_errors_say_what_and_what_to_do(procs, shim_dir, tmp_path):
    r = gputrace("checkpoint", "-p", "999999999")
    assert r.returncode == 3 and "error: no process with pid 999999999" in r.stderr and "hint:" in r.stderr
    plain = subprocess.Popen(["sleep", "120"])
    procs.append(plain)
    r = gputrace("checkpoint", "-p", str(plain.pid), "-o", str(tmp_path / "x"))
    assert r.returncode == 8 and "does not have the gputrace shim loaded" in r.stderr
    assert "gputrace run --checkpointable" in r.stderr and not (tmp_path / "x").exists()
    r = gputrace("restore", "-p", str(plain.pid), str(tmp_path / "nothing"))
    assert r.returncode == 10 and "is not a checkpoint directory" in r.stderr and "hint:" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_refuses_a_damaged_checkpoint(procs, shim_dir, tmp_path):
    p = start(procs, simcuda.workload("pattern"))
    json.loads(p.stdout.readline())
    assert gputrace("checkpoint", "-p", str(p.pid), "-o", str(tmp_path / "ck")).returncode == 0
    with open(tmp_path / "ck" / "data.img", "r+b") as f:
        f.seek(5000)
        f.write(b"\0\1\2\3")
    # Nothing differs from the checkpoint, so a restore reads (and checks) no chunk: --verify-all reads all.
    r = gputrace("restore", "-p", str(p.pid), str(tmp_path / "ck"), "--device-only", "--verify-all")
    assert r.returncode == 10 and "fails its xxh3_64 checksum" in r.stderr
    assert "hint: the checkpoint is damaged; the process was not touched" in r.stderr


def test_a_checkpoint_without_o_goes_where_top_finds_it(procs, shim_dir, tmp_path, monkeypatch):
    """The CLI's default directory is the TUI's: `top` lists (and restores) what `checkpoint -p`
    wrote without -o."""
    from gputrace.hostview.checkpoints import CheckpointerAdapter

    monkeypatch.setenv("GPUTRACE_CKPT_DIR", str(tmp_path / "ckpts"))  # created on the way
    p = start(procs, simcuda.workload("pattern") + ["--size", str(1 << 20)])
    json.loads(p.stdout.readline())
    r = gputrace("checkpoint", "-p", str(p.pid), "--json")
    assert r.returncode == 0, r.stderr
    path = orjson.loads(r.stdout)["path"]
    assert path.startswith(str(tmp_path / "ckpts") + "/") and path.rsplit("/", 1)[1].startswith(f"{p.pid}-")
    listed = CheckpointerAdapter().list_checkpoints(p.pid)
    assert [c.id for c in listed] == [path], listed


def test_every_place_that_offers_a_device_only_rollback_says_what_it_risks():
    """`restore -p PID DIR` brings the whole process back; device memory alone goes back only on
    request, and the README's usage line, the command's help and the TUI's palette entry say what
    that risks (the report and the TUI's confirmation are tested with them)."""
    from pathlib import Path

    from gputrace.tui.app import PALETTE_ACTIONS

    lines = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if "--device-only" in x and x.strip().startswith("gputrace restore"))
    entry = " ".join(lines[i:i + 3])  # the usage line and what it does, below it
    assert "host memory goes on" in entry and "unsafe" in entry
    readme = "\n".join(lines)
    line = next(x for x in readme.splitlines() if x.strip().startswith("gputrace restore -p 1234 /ckpt/full"))
    assert "whole" in line
    help_text = gputrace("restore", "--help").stdout
    assert "--device-only" in help_text and "UNSAFE" in help_text and "stale data" in help_text
    assert "UNSAFE" in dict(PALETTE_ACTIONS)["rollback"] and "whole-process" in dict(PALETTE_ACTIONS)["restore_full"]
