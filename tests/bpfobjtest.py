"""BPF objects for the loader's tests (test_bpfobj.py, test_doctor.py): built by clang from counts.bpf.c's
maps and headers around a body of the test's own, and the skip where clang is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputrace import bpf as bpfsrc
from gputrace.base import native
from gputrace.base.errors import BuildError

BPF_DIR = Path(bpfsrc.__file__).resolve().parent


def clang_or_skip() -> str:
    try:
        return native.find_clang()
    except BuildError:
        pytest.skip("clang is not installed (scripts/setup-host installs it): the BPF object cannot be built")


def build_test_object(tmp_path: Path, name: str, body: str) -> Path:
    """A BPF object from `body`, with counts.bpf.c's maps and headers: a stand-in the loader must refuse."""
    clang_or_skip()
    src = tmp_path / f"{name}.bpf.c"
    src.write_text('#include "compat.h"\n#include "gputrace.h"\n'
                   "GT_MAP(hash, stats, struct gt_key, struct gt_stats, GT_MAX_STATS);\n"
                   "GT_MAP(lru_hash, threads, u32, struct gt_thread, GT_MAX_THREADS);\n"
                   "GT_MAP(array, errors, int, u64, GT_ERR_COUNT);\n"
                   "GT_MAP(array, config, int, struct gt_config, 1);\n"
                   "GT_MAP(array, seen, int, u64, 2);\n"
                   "GT_MAP(lru_hash, tstats, struct gt_tkey, struct gt_tstats, GT_MAX_TSTATS);\n"
                   "GT_LICENSE\n" + body)
    return native.build(f"{name}.bpf.o", [src], cflags=["-DGT_BPF_OBJECT", f"-I{BPF_DIR}"], target="bpf",
                        headers=[BPF_DIR / "compat.h", BPF_DIR / "gputrace.h"])


REFUSED = """
GT_UPROBE int gt_entry(struct pt_regs *ctx)
{
    struct gt_key k = {};
    struct gt_stats *s = bpf_map_lookup_elem(&stats, &k);
    s->calls += 1;  /* no NULL check: the verifier refuses it */
    return 0;
}
GT_UPROBE int gt_return(struct pt_regs *ctx) { return 0; }
"""

GLOBAL_DATA = """
static u64 hits;
GT_UPROBE int gt_entry(struct pt_regs *ctx) { hits++; return 0; }
GT_UPROBE int gt_return(struct pt_regs *ctx) { return 0; }
"""
