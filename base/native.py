"""Builds the project's small C components with the system compiler, cached by source hash.

Used for simcuda (the simulated driver), its workloads and the tracer's calibration target. A build
goes to a temporary name and is renamed into place, so concurrent builders never see half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from .errors import BuildError


def cache_root() -> Path:
    env = os.environ.get("GPUTRACE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gputrace"


def find_cc() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise BuildError(
        "no C compiler found (tried $CC, cc, gcc, clang)",
        "install one: apt-get install gcc (Debian/Ubuntu)",
    )


def build(
    name: str,
    sources: Sequence[Path],
    *,
    shared: bool = False,
    soname: str | None = None,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    headers: Sequence[Path] = (),
) -> Path:
    """Compile `sources` into `<cache>/<hash>/<name>` and return its path (cached)."""
    cc = find_cc()
    h = hashlib.sha256()
    args = ["-O2", "-g", "-Wall", "-fPIC", *cflags]
    if shared:
        args += ["-shared"]
        if soname:
            args += [f"-Wl,-soname,{soname}"]
    for part in (cc, name, *args, *ldflags):
        h.update(part.encode() + b"\0")
    for src in (*sources, *headers):
        h.update(Path(src).read_bytes())
    out_dir = cache_root() / "native" / h.hexdigest()[:16]
    out = out_dir / name
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
    os.close(fd)
    cmd = [cc, *args, "-o", tmp, *map(str, sources), *ldflags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise BuildError(
            f"building {name} failed:\n{proc.stderr.strip()[-2000:]}",
            f"command: {' '.join(cmd)}",
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out
