"""Imports bcc, which is not on PyPI, from wherever the distribution installed it.

bcc's Python module is pure Python over libbcc (ctypes), so the distro's copy works from a virtualenv
or from another interpreter of the same major version: we look in this interpreter's path first,
then in the distribution's dist-packages directories, then in $GPUTRACE_BCC_PATH.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
from types import ModuleType

from .errors import BpfUnavailable

_HINT = (
    "install bcc from your distribution: apt-get install python3-bpfcc (Debian/Ubuntu; on Ubuntu also "
    "linux-headers-$(uname -r)), or run scripts/setup-host; point GPUTRACE_BCC_PATH at the directory that "
    "holds the bcc package if it lives elsewhere"
)


def candidate_dirs() -> list[str]:
    env = os.environ.get("GPUTRACE_BCC_PATH")
    if env is not None:  # set, even empty: search only there (also how tests hide the distro's copy)
        dirs = [d for d in env.split(os.pathsep) if d]
    else:
        dirs = ["/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages"]
        dirs += sorted(glob.glob("/usr/lib/python3.*/site-packages"))
        dirs += sorted(glob.glob("/usr/lib/python3.*/dist-packages"))
    return [d for d in dirs if os.path.isfile(os.path.join(d, "bcc", "__init__.py"))]


def _import_from(path: str) -> ModuleType:
    # Only bcc itself comes from that directory: adding the whole dist-packages to sys.path would let
    # the distro's other (older) packages shadow this environment's.
    sys.path.insert(0, path)
    try:
        for name in [m for m in sys.modules if m == "bcc" or m.startswith("bcc.")]:
            del sys.modules[name]
        return importlib.import_module("bcc")
    finally:
        sys.path.remove(path)


def import_bcc() -> ModuleType:
    """Returns the bcc module or raises BpfUnavailable with what to install."""
    if "bcc" in sys.modules and hasattr(sys.modules["bcc"], "BPF"):
        return sys.modules["bcc"]
    try:
        return importlib.import_module("bcc")
    except ImportError:
        pass
    errors = []
    for d in candidate_dirs():
        try:
            return _import_from(d)
        except Exception as exc:  # libbcc missing or broken: say which copy failed and why
            errors.append(f"{d}/bcc: {exc}")
    if errors:
        raise BpfUnavailable("bcc was found but does not import: " + "; ".join(errors), _HINT)
    raise BpfUnavailable("the bcc Python module (python3-bpfcc) is not installed", _HINT)


def where() -> str | None:
    """The directory bcc would be imported from, without importing it."""
    try:
        spec = importlib.util.find_spec("bcc")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.origin:
        return os.path.dirname(os.path.dirname(spec.origin))
    dirs = candidate_dirs()
    return dirs[0] if dirs else None
