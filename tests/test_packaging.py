"""The wheel: built from the repository, installed into a fresh virtualenv, every layer importable under
`gputrace.*` with its C sources, and nothing generic left at the top of site-packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTS = ["gputrace.cli", "gputrace.base.errors", "gputrace.hostview.live", "gputrace.exporter.metrics", "gputrace.tracer.session", "gputrace.checkpointer", "gputrace.shim", "gputrace.tui",
         "gputrace.bpf", "gputrace.simcuda"]
DATA = [("gputrace.bpf", "counts.bpf.c"), ("gputrace.bpf", "gputrace.h"), ("gputrace.tracer", "calib.c"),
        ("gputrace.simcuda", "libcuda.c"), ("gputrace.shim", "shim.c")]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(REPO)], check=True, cwd=tmp_path)
    (wheel,) = dist.glob("gputrace-*.whl")
    import zipfile

    # The licence pyproject.toml names travels with the wheel, as its text.
    with zipfile.ZipFile(wheel) as z:
        lic = [n for n in z.namelist() if n.endswith("LICENSE") and ".dist-info/" in n]
        assert lic and "Apache License" in z.read(lic[0]).decode() and "Version 2.0" in z.read(lic[0]).decode()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, cwd=tmp_path)

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
