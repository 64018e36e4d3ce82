"""The functions the shim wraps, read from the one list its C build generates its wrappers from.

`shim_api.h` holds the shim's wrappers as X-macro lists (SHIM_SUBMIT, SHIM_STATE, ...); the C build
expands them into the wrappers, the exported symbols and the emulated layer's class table
(emulate.c). This module reads the same lists, so that the tracer's audit counts, for the shim,
exactly the functions the shim's library wraps (tests/test_shim_layer.py holds the lists to the
built library's exported symbols, and the audit's set to the one `shim emulate` slows).

Pure text: importing it builds nothing, and it needs no compiler (the header is package data).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

API = Path(__file__).resolve().with_name("shim_api.h")

# The emulated layer's class of each list (emulate.c's fn_class; the tracer's classes by name). The
# lists not here (SHIM_LOOKUP, SHIM_HANDLE, SHIM_PROC) are wrapped for the shim's own bookkeeping
# and no class of the emulated layer selects them.
CLASS_OF_GROUP = {
    "SHIM_LAUNCH": "submission", "SHIM_SUBMIT_REST": "submission", "SHIM_STATE": "state",
    "SHIM_PASS_STATE": "state", "SHIM_SYNC": "synchronization", "SHIM_QUERY": "query",
}
# The lists whose calls the shim gates and counts: where its own work (the measured 15 ns a launch)
# is done. The others pass through at a load and a jump. emulate.c's `layer=shim` selects these.
GATED_GROUPS = ("SHIM_LAUNCH", "SHIM_SUBMIT_REST", "SHIM_STATE")


@functools.lru_cache(maxsize=1)
def groups() -> dict[str, tuple[str, ...]]:
    """shim_api.h's leaf X-macro lists: list name -> the functions in it, in the header's order
    (lists made only of other lists, such as SHIM_SUBMIT or SHIM_ALL, are left out)."""
    text = API.read_text()
    out = {}
    for m in re.finditer(r"#define (SHIM_\w+)\(X\)(.*?)(?=\n#define |\nenum |\n#endif)", text, re.S):
        names = tuple(re.findall(r"\bX\((cu\w+),", m.group(2)))
        if names:
            out[m.group(1)] = names
    return out


@functools.lru_cache(maxsize=1)
def wrapped() -> frozenset[str]:
    """Every driver function the shim's library exports a wrapper of."""
    return frozenset(n for names in groups().values() for n in names)


@functools.lru_cache(maxsize=1)
def gated() -> frozenset[str]:
    """The functions the shim gates and counts: those a layer like the shim adds its cost to (the
    audit's `shim` preset, and `shim emulate --preset shim`)."""
    g = groups()
    return frozenset(n for grp in GATED_GROUPS for n in g[grp])


def emulated_class(name: str) -> str | None:
    """The emulated layer's class of a wrapped function (None: no class selects it, or not wrapped)."""
    for grp, names in groups().items():
        if name in names:
            return CLASS_OF_GROUP.get(grp)
    return None
