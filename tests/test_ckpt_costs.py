"""bench/ckpt_costs_gpu.py on simcuda (device mode, sizes in MiB): each path's freeze, time back, bytes and
write figures, its data checked after the restore, and the skipping of a size that cannot fit, with the
numbers.  The whole-process path needs root and CRIU >= 4.0; where they are missing the script records it
as skipped with the reason, and this test holds it to that instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "ckpt_costs_gpu.py"
MIB = 1 << 20


def _criu_reason() -> str | None:
    if os.geteuid() != 0:
        return "CRIU needs root"
    from gputrace.checkpointer import criu

    try:
        c = criu.find()
    except criu.CriuUnavailable as exc:
        return exc.msg
    ok, line = criu.check(c)
    return None if ok else f"`criu check` fails here: {line}"


def _storage(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ckpt_costs_gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return "tmpfs" if ckpt_costs_gpu.fstype(path) in ckpt_costs_gpu.MEMORY_FS else "disk"


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    work = tmp_path / "images"
    work.mkdir(exist_ok=True)
    shim_dir = tmp_path / "rt"
    shim_dir.mkdir(mode=0o700, exist_ok=True)
    out = tmp_path / "out" / "ckpt.json"
    env = dict(os.environ, GPUTRACE_SHIM_DIR=str(shim_dir))
    r = subprocess.run([sys.executable, str(SCRIPT), "--simcuda", "--storage", _storage(work), "--workdir", str(work),
                        "--out", str(out), *args], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    return r, out


def test_every_path_is_measured_and_its_data_checked(tmp_path):
    size = 2
    r, out = _run(tmp_path, "--size", str(size))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["schema"] == "gputrace.bench.ckpt_costs/1" and d["device"] == "simcuda" and d["skipped"] is None
    assert d["size"] == size and d["size_unit"] == "MiB" and d["size_bytes"] == size * MIB
    assert d["wall_s"] > 0 and "commit" in d
    assert d["limits"]["d2h_gb_s"] is None and "simcuda" in d["limits"]["d2h_gb_s_reason"]
    assert d["limits"]["storage_write"]["write_gb_s"] > 0
    criu_missing = _criu_reason()
    measured = ["gputrace", "driver"] + ([] if criu_missing else ["full"])
    for name in measured:
        p = d["paths"][name]
        assert "error" not in p and "skipped" not in p, p
        assert p["freeze_s"] > 0 and p["back_s"] > 0, p
        assert p["bytes"] >= size * MIB, p
        assert p["data_ok"] is True and p["data_check"], p
        assert p["raw"] and all("wall_ns" in doc for doc in p["raw"].values())
        assert p["copy_limit"] is None and p["copy_limit_reason"]
    g = d["paths"]["gputrace"]
    assert g["scribble_changed_data"] is True
    assert g["write_s"] > 0 and g["write_gb_s"] > 0 and g["freeze_s"] == g["raw"]["checkpoint"]["freeze_ns"] / 1e9
    drv = d["paths"]["driver"]
    assert drv["write_gb_s"] is None and "not applicable" in drv["write_gb_s_reason"]
    assert drv["write_s"] is None and drv["write_s_reason"]
    assert drv["device_bytes"]["process_suspended"] == 0  # the driver's checkpoint let go of every allocation
    if criu_missing:
        assert criu_missing.split(":")[0] in d["paths"]["full"]["skipped"]
    else:
        f = d["paths"]["full"]
        assert f["write_s"] > 0 and f["write_gb_s"] > 0 and f["exit_status_after_restore"] == 0
        assert f["bytes"] >= f["criu_bytes"] + size * MIB
    # written atomically, and nothing left behind on the storage
    assert not out.with_name(out.name + ".tmp").exists() and not out.with_name(out.name + ".partial").exists()
    assert list((tmp_path / "images").iterdir()) == []


def test_a_size_that_cannot_fit_is_skipped_with_the_numbers(tmp_path):
    r, out = _run(tmp_path, "--size", "64", "--paths", "gputrace,full", "--assume-free-space", "1M")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["skipped"] and d["filesystem"]["assumed_free_bytes"] == MIB
    for name in ("gputrace", "full"):
        why = d["paths"][name]["skipped"]
        assert "1.0 MiB are free" in why and "needs about" in why, why
        assert d["paths"][name]["needs"]["storage_bytes"] > 64 * MIB
    assert "freeze_s" not in d["paths"]["gputrace"]
    # the driver path writes nothing to storage: it is held to host memory instead
    r, out = _run(tmp_path, "--size", "64", "--paths", "driver", "--assume-free-space", "1M",
                  "--assume-mem-available", "2M")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    why = d["paths"]["driver"]["skipped"]
    assert "MemAvailable is 2.0 MiB" in why and "are free" not in why, why
    assert d["skipped"] == why
