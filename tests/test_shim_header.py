"""The shim's own driver API header (shim/cuda_driver.h) against a real cuda.h: every prototype
redeclared after the real header (the compiler rejects any that differs), every constant's value,
and every complete struct's size and its members' offsets and sizes, as the shim's header lays them out.

The real header comes from the toolkit where one is installed, else from NVIDIA's
nvidia-cuda-runtime wheel (the dev extra installs it, so CI runs this)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = REPO / "shim" / "cuda_driver.h"


def real_cuda_h() -> Path | None:
    for d in (os.environ.get("GPUTRACE_CUDA_INCLUDE"), "/usr/local/cuda/include"):
        if d and (Path(d) / "cuda.h").exists():
            return Path(d) / "cuda.h"
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "include" / "cuda.h").exists():
            return Path(loc) / "include" / "cuda.h"
    return None


REAL = real_cuda_h()
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = [pytest.mark.skipif(REAL is None, reason="no real cuda.h (install the dev extra: nvidia-cuda-runtime-cu12)"),
              pytest.mark.skipif(CC is None, reason="no C compiler")]


def _body(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def prototypes(text: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"^CUresult\s+\w+\s*\([^;]*\);", _body(text), re.M)]


def constants(text: str) -> dict[str, str]:
    body = _body(text)
    out = {}
    for enum in re.findall(r"enum\s+\w*\s*{(.*?)}", body, re.S):
        for name, value in re.findall(r"\b(\w+)\s*=\s*([-\w]+)", enum):
            out[name] = value
    for name, value in re.findall(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)\s*$", body, re.M):
        out[name] = value
    return out


def structs(text: str) -> dict[str, list[str]]:
    """Complete struct typedefs -> their members at the top level (padding left out)."""
    body = _body(text)
    out = {}
    for m in re.finditer(r"typedef\s+(?:struct|union)\s+\w*\s*{", body):
        depth, i, start = 1, m.end(), m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(body[i], 0)
            i += 1
        inner = body[start:i - 1]
        name = re.match(r"\s*(\w+)\s*;", body[i:]).group(1)
        flat = re.sub(r"{[^{}]*}", "{}", inner)  # nested struct bodies: only their member name counts
        members = []
        for decl in flat.split(";"):
            decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
            if not decl:
                continue
            for part in decl.split(","):
                member = re.findall(r"\w+", part)[-1]
                if member != "pad":
                    members.append(member)
        out[name] = members
    return out


def test_the_parsers_see_what_the_header_declares():
    text = OURS.read_text()
    assert len(prototypes(text)) > 80 and "cuMemAlloc_v2" in " ".join(prototypes(text))
    assert constants(text)["CUDA_ERROR_NOT_READY"] == "600"
    assert structs(text)["CUmemAllocationProp"] == ["type", "requestedHandleTypes", "location", "win32HandleMetaData",
                                                    "allocFlags"]


@pytest.mark.parametrize("header", [OURS, REPO / "simcuda" / "cuda.h"], ids=["shim", "simcuda"])
def test_the_header_agrees_with_the_real_cuda_h(tmp_path, header):
    """The shim's header, and simcuda's (a program written against the real one must build against it)."""
    text = header.read_text()
    layout = structs(text)
    # Sizes and offsets as the shim's own header lays the structs out.
    probe = tmp_path / "ours.c"
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{header.name}"', "int main(void) {"]
    for s, members in layout.items():
        lines.append(f'    printf("{s} %zu\\n", sizeof({s}));')
        lines += [f'    printf("{s}.{m} %zu:%zu\\n", offsetof({s}, {m}), sizeof((({s} *)0)->{m}));' for m in members]
    lines.append("    return 0;\n}")
    probe.write_text("\n".join(lines) + "\n")
    subprocess.run([CC, "-std=c11", f"-I{header.parent}", str(probe), "-o", str(tmp_path / "ours")], check=True)
    ours = dict(ln.split() for ln in subprocess.run([str(tmp_path / "ours")], capture_output=True, text=True,
                                                    check=True).stdout.splitlines())
    # The same facts asserted against the real header, with our prototypes redeclared after it.
    # __CUDA_API_VERSION_INTERNAL: the header as the driver's own sources see it, each entry point
    # under its ABI name (cuGetProcAddress is the 4-argument one), not mapped to its newest version.
    check = ["#include <stddef.h>", "#define __CUDA_API_VERSION_INTERNAL 1", "#include <cuda.h>"]
    check += prototypes(text)
    check += [f'_Static_assert((long long)({n}) == (long long)({v}), "{n} is {v} in {header.name}");'
              for n, v in constants(text).items() if not n.endswith("_MAX")]  # a sentinel: the count of its version
    for key, value in ours.items():
        s, _, m = key.partition(".")
        if m:
            off, size = value.split(":")
            check.append(f'_Static_assert(offsetof({s}, {m}) == {off} && sizeof((({s} *)0)->{m}) == {size}, '
                         f'"{key}: at {off}, {size} bytes in {header.name}");')
        else:
            check.append(f'_Static_assert(sizeof({s}) == {value}, "{key}: {value} bytes in {header.name}");')
    src = tmp_path / "check.c"
    src.write_text("\n".join(check) + "\n")
    r = subprocess.run([CC, "-std=c11", "-fsyntax-only", "-Werror", f"-I{REAL.parent}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"{header.relative_to(REPO)} differs from {REAL}:\n{r.stderr[-4000:]}"
