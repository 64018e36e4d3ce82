"""gputrace.shim: the checkpointing interposer, preloaded into a CUDA job.

The shim is C (``shim/*.c``) and links nothing but libc, because it must load into any process: a C
program, any Python 3.10-3.13 build, with ``LD_BIND_NOW=1``, and into processes that never touch
CUDA.  A cffi API-mode extension would leave libpython symbols undefined (fatal under
``LD_BIND_NOW=1`` in a non-Python process) and an embedding-mode one would drag its own libpython
into a Python process of another version; so the object is compiled as a plain shared library by
:func:`gputrace.base.native.build` (the project's cached compiler driver, which also builds simcuda), and
Python binds to its control functions with cffi in ABI mode (:func:`ffi` declares them from
``gputrace_shim.h``, :func:`open_in_process` dlopens the object).  From outside the target,
Python talks to it over its control socket (:mod:`gputrace.shim.client`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from gputrace.base.native import build

__all__ = ["SONAME", "library_path", "ffi", "open_in_process", "preload_env"]

_HERE = Path(__file__).resolve().parent
SONAME = "libgputrace_shim.so"
_SOURCES = ("shim.c", "hooks.c", "registry.c", "control.c", "dump.c", "image.c", "copy.c", "kept.c", "suspend.c",
            "changed.c", "vmm.c", "emulate.c", "digest.c")
_HEADERS = ("shim_int.h", "dump_int.h", "shim_api.h", "gputrace_shim.h", "cuda_driver.h", "digest_ptx.h")  # cuda_driver.h: its own driver API header


# How the shim is built (gputrace.base.native.build's arguments): at first use in a checkout, ahead
# of time into a wheel (setup.py), where `prebuilt` then holds it.
BUILD = dict(
    name=SONAME,
    sources=[_HERE / s for s in _SOURCES],
    shared=True,
    soname=SONAME,
    cflags=["-fvisibility=hidden", "-pthread", "-Wno-unused-parameter"],
    ldflags=["-pthread", "-ldl"],
    headers=[_HERE / h for h in _HEADERS],
    prebuilt=_HERE / "prebuilt",
)


def library_path() -> Path:
    """The shim ready for LD_PRELOAD: the wheel's prebuilt copy, else built (cached by source hash)."""
    return build(**BUILD)


def preload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) with the shim first on LD_PRELOAD."""
    env = dict(os.environ if base is None else base)
    lib = str(library_path())
    rest = [p for p in re.split(r"[: ]", env.get("LD_PRELOAD", "")) if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib, *rest])
    return env


@functools.lru_cache(maxsize=1)
def ffi():
    """A cffi FFI declaring the shim's control functions (from gputrace_shim.h)."""
    import cffi

    text = (_HERE / "gputrace_shim.h").read_text()
    cdef = text.split("/* BEGIN CDEF */", 1)[1].split("/* END CDEF */", 1)[0]
    f = cffi.FFI()
    f.cdef(cdef)
    return f


def open_in_process():
    """dlopen the shim into this process (RTLD_LOCAL: it interposes nothing here) and return the
    cffi library object.  For tests of its internals; a job gets the shim through LD_PRELOAD."""
    f = ffi()
    return f.dlopen(str(library_path()), f.RTLD_NOW | f.RTLD_LOCAL)
