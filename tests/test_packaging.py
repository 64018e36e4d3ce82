"""The wheel: built from the repository, installed into a fresh virtualenv, every layer importable under
`gputrace.*` with its C sources, nothing generic left at the top of site-packages; and, with its
prebuilt shim, calibration target and BPF object, `run --checkpointable` and `attach` working with no C
compiler, no clang and no bcc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = ["gputrace.cli", "gputrace.base.errors", "gputrace.hostview.live", "gputrace.exporter.metrics", "gputrace.tracer.session", "gputrace.checkpointer", "gputrace.shim", "gputrace.tui",
         "gputrace.bpf", "gputrace.simcuda"]
DATA = [("gputrace.bpf", "counts.bpf.c"), ("gputrace.bpf", "gputrace.h"), ("gputrace.bpf", "compat.h"),
        ("gputrace.tracer", "calib.c"),
        ("gputrace.simcuda", "libcuda.c"), ("gputrace.shim", "shim.c")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, a fresh venv with it installed)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(REPO)], check=True, cwd=tmp)
    (wheel,) = dist.glob("gputrace-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], check=True, cwd=tmp)
    return wheel, venv


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(installed, tmp_path: Path) -> None:
    wheel, venv = installed
    import zipfile

    # The licence pyproject.toml names travels with the wheel, as its text; so do the prebuilt natives.
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        lic = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
        assert lic and "Apache License" in z.read(lic[0]).decode() and "Version 2.0" in z.read(lic[0]).decode()
        for lib in ("gputrace/shim/prebuilt/libgputrace_shim.so", "gputrace/tracer/prebuilt/libgputrace_calib.so",
                    "gputrace/bpf/prebuilt/counts.bpf.o"):
            assert lib in names and lib + ".key" in names
    assert wheel.name.endswith("-py3-none-linux_" + __import__("platform").machine() + ".whl"), wheel.name
    py = venv / "bin" / "python"

    probe = (
        "import importlib, sys\n"
        "from importlib.resources import files\n"
        f"for m in {PARTS!r}: importlib.import_module(m)\n"
        f"for pkg, name in {DATA!r}: assert (files(pkg) / name).is_file(), (pkg, name)\n"
        "import gputrace.tracer.session as s; assert 'site-packages' in s.__file__, s.__file__\n"
    )
    # Run from an empty directory so that nothing in the checkout can stand in for the installed copy.
    subprocess.run([str(py), "-c", probe], check=True, cwd=tmp_path)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    generic = {"tracer", "tui", "shim", "bpf", "simcuda", "checkpointer", "commands"}
    assert not generic & {p.name for p in site.iterdir()}, sorted(p.name for p in site.iterdir())
    out = subprocess.run([str(venv / "bin" / "gputrace"), "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and "attach" in out.stdout, out.stderr


def _no_compiler_env(tmp_path: Path) -> dict:
    """No C compiler or clang reachable (PATH names an empty directory, no $CC, $GPUTRACE_CLANG), no bcc
    (GPUTRACE_BCC_PATH names an empty directory; the fresh venv has none of its own) and an empty build cache."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH", "GPUTRACE_CLANG", "GPUTRACE_BPF",
                                                            "GPUTRACE_BPF_OBJECT")}
    (tmp_path / "bin").mkdir()
    (tmp_path / "no-bcc").mkdir()
    env.update(PATH=str(tmp_path / "bin"), GPUTRACE_CACHE=str(tmp_path / "cache"),
               GPUTRACE_BCC_PATH=str(tmp_path / "no-bcc"))
    return env


@pytest.mark.slow
@pytest.mark.bpf
def test_the_wheel_runs_the_shim_and_attaches_without_a_compiler(installed, tmp_path: Path) -> None:
    import os

    import orjson

    from gputrace import simcuda

    if os.geteuid() != 0:
        pytest.skip("attach needs root for eBPF")
    _, venv = installed
    # simcuda itself is built with this checkout's compiler first: only gputrace's own parts must not need one.
    job = simcuda.workload("launch_bound")
    env = {**_no_compiler_env(tmp_path), **{k: v for k, v in simcuda.env().items() if k.startswith("LD_")}}
    gt = str(venv / "bin" / "gputrace")
    r = subprocess.run([gt, "run", "--checkpointable", "--", *job, "--steps", "50", "--scale", "0.2"], env=env,
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "a.json"
    r = subprocess.run([gt, "attach", "--exact", "--json", "-o", str(out), "-q", "--", *job, "--steps", "200",
                        "--scale", "0.2"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(out.read_bytes())
    assert rep["summary"]["calls_hz"] > 0
    assert rep["attach"]["program"] == "object"  # the wheel's BPF object: there is no bcc here
    # Nothing was compiled: the shim and the calibration target came from the wheel, as doctor says.
    assert not (tmp_path / "cache" / "native").exists(), list((tmp_path / "cache").rglob("*"))
    doc = orjson.loads(subprocess.run([gt, "doctor", "--json"], env=env, capture_output=True, cwd=tmp_path).stdout)
    native = next(c for c in doc["checks"] if c["name"] == "native")
    assert native["status"] == "OK" and "came built with the wheel" in native["detail"], native
    prog = next(c for c in doc["checks"] if c["name"] == "bpf-program")
    assert prog["status"] == "OK" and "(came built with the wheel)" in prog["detail"], prog
    assert prog["detail"].startswith("precompiled object ") and "site-packages" in prog["detail"], prog
