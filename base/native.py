"""Builds the project's small C components with the system compiler, cached by source hash.

Used for the shim, the tracer's calibration target, simcuda (the simulated driver) and its
workloads, and (with `target="bpf"`, by clang) for the tracer's BPF object. A build goes to a
temporary name and is renamed into place, so concurrent builders never see half a file. A wheel
carries the shim, the calibration target and the BPF object built ahead of time (`prebuild`,
run by setup.py): `build` takes a prebuilt copy whose key matches its sources and options, and only
compiles (needing a compiler) where there is none, as in a checkout.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

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


def find_clang() -> str:
    """clang for BPF objects: $GPUTRACE_CLANG, else clang, else the newest versioned clang-N on PATH."""
    env = os.environ.get("GPUTRACE_CLANG")
    if env:
        if shutil.which(env):
            return env
        raise BuildError(f"GPUTRACE_CLANG={env} is not an executable", "point it at clang, or unset it")
    if shutil.which("clang"):
        return "clang"
    found = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        for path in glob.glob(os.path.join(d, "clang-[0-9]*")):
            m = re.fullmatch(r"clang-(\d+)", os.path.basename(path))
            if m and os.access(path, os.X_OK):
                found.append((int(m.group(1)), path))
    if found:
        return max(found)[1]
    raise BuildError("no clang found (tried $GPUTRACE_CLANG, clang, clang-N): the BPF object needs it",
                     "install it: apt-get install clang (Debian/Ubuntu)")


def _args(shared: bool, soname: str | None, cflags: Sequence[str], target: str | None = None) -> list[str]:
    if target == "bpf":  # a relocatable BPF object, with BTF (-g): what tracer/bpfobj.py loads
        return ["-target", "bpf", "-O2", "-g", "-Wall", *cflags, "-c"]
    if target is not None:
        raise ValueError(f"unknown build target {target!r}")
    args = ["-O2", "-g", "-Wall", "-fPIC", *cflags]
    if shared:
        args += ["-shared"]
        if soname:
            args += [f"-Wl,-soname,{soname}"]
    return args


def source_key(name: str, sources: Sequence[Path], *, shared: bool = False, soname: str | None = None,
               cflags: Sequence[str] = (), ldflags: Sequence[str] = (), headers: Sequence[Path] = (),
               target: str | None = None) -> str:
    """What a build is made of (sources, headers, options), whichever compiler makes it."""
    h = hashlib.sha256()
    for part in (name, *_args(shared, soname, cflags, target), *ldflags):
        h.update(part.encode() + b"\0")
    for src in (*sources, *headers):
        h.update(Path(src).read_bytes())
    return h.hexdigest()


def is_prebuilt(spec: Mapping) -> bool:
    """Whether `spec` (build()'s arguments) has a prebuilt copy whose key matches its sources."""
    spec = dict(spec)
    prebuilt = spec.pop("prebuilt", None)
    if prebuilt is None:
        return False
    try:
        return (Path(prebuilt) / spec["name"]).is_file() and \
            (Path(prebuilt) / f"{spec['name']}.key").read_text().strip() == source_key(**spec)
    except OSError:
        return False  # no key: compiled at first use, as in a checkout


def build(
    name: str,
    sources: Sequence[Path],
    *,
    shared: bool = False,
    soname: str | None = None,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    headers: Sequence[Path] = (),
    prebuilt: Path | None = None,
    target: str | None = None,
) -> Path:
    """`prebuilt/<name>` if its key matches, else compile `sources` into `<cache>/<hash>/<name>`
    and return its path (cached). `target="bpf"`: a BPF object, compiled by clang."""
    spec = dict(name=name, sources=sources, shared=shared, soname=soname, cflags=cflags, ldflags=ldflags,
                headers=headers, prebuilt=prebuilt)
    if target is not None:
        spec["target"] = target
    if is_prebuilt(spec):
        return Path(prebuilt) / name
    cc = find_clang() if target == "bpf" else find_cc()
    h = hashlib.sha256()
    args = _args(shared, soname, cflags, target)
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
        Path(tmp).unlink(missing_ok=True)  # (clang removes its output when it fails)
        raise BuildError(
            f"building {name} failed:\n{proc.stderr.strip()[-2000:]}",
            f"command: {' '.join(cmd)}",
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def prebuild(spec: Mapping) -> Path:
    """Builds `spec` (build()'s arguments, `prebuilt` among them) into its prebuilt directory, with
    the key that lets build() take it: the wheel's build step (setup.py)."""
    spec = dict(spec)
    out_dir = Path(spec.pop("prebuilt"))
    lib = build(**spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lib, out_dir / spec["name"])
    (out_dir / f"{spec['name']}.key").write_text(source_key(**spec) + "\n")
    return out_dir / spec["name"]
