"""A uprobe-multi link on simcuda's libcuda.so.1 counts exactly the calls a workload says it made.

Uses the project's own pieces (bcc import, attach_multi) the way the tracer does: one BPF program,
one link over several function offsets of the file, a cookie per function, filtered to one pid.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from gputrace import simcuda

pytestmark = pytest.mark.bpf

FUNCS = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuCtxGetDevice_v2", "cuGetProcAddress_v2"]

PROGRAM = r"""
BPF_ARRAY(hits, u64, %d);

int on_call(struct pt_regs *ctx)
{
    u32 k = bpf_get_attach_cookie(ctx);
    u64 *v = hits.lookup(&k);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
""" % len(FUNCS)


def file_offsets(path: str, names: list[str]) -> list[int]:
    """Symbol address to file offset, through the PT_LOAD segment that holds it."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        syms = {s.name: s["st_value"] for s in elf.get_section_by_name(".dynsym").iter_symbols()}
        loads = [seg for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]
        out = []
        for name in names:
            v = syms[name]
            seg = next(s for s in loads if s["p_vaddr"] <= v < s["p_vaddr"] + s["p_memsz"])
            out.append(v - seg["p_vaddr"] + seg["p_offset"])
        return out


@pytest.fixture(scope="module")
def bpf():
    if os.geteuid() != 0:
        pytest.skip("needs root for BPF and uprobes")
    from gputrace.base.bccload import import_bcc
    from gputrace.base.errors import BpfUnavailable

    try:
        bcc = import_bcc()
    except BpfUnavailable as exc:
        pytest.skip(f"bcc cannot be imported: {exc.msg}")
    b = bcc.BPF(text=PROGRAM.encode())
    fn = b.load_func(b"on_call", bcc.BPF.KPROBE, attach_type=48)  # BPF_TRACE_UPROBE_MULTI
    yield b, fn
    b.cleanup()


def traced_run(bpf, argv: list[str]) -> tuple[dict, list[int]]:
    """Starts a workload gated on stdin, attaches to its pid once it is ready, lets it run."""
    from gputrace.tracer.links import attach_multi

    b, fn = bpf
    hits = b[b"hits"]
    for k in range(len(FUNCS)):
        hits[ctypes.c_int(k)] = ctypes.c_ulonglong(0)
    lib = str(simcuda.library_path())
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(argv + ["--wait-stdin", "--ready-fd", str(wfd)], env=simcuda.env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=(wfd,))
    os.close(wfd)
    try:
        with os.fdopen(rfd) as ready:
            assert ready.readline() == "ready\n"
        link = attach_multi(fn.fd, lib, file_offsets(lib, FUNCS), list(range(len(FUNCS))), pid=proc.pid)
        try:
            stdout, stderr = proc.communicate("go\n", timeout=120)
        finally:
            link.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    return json.loads(stdout), [hits[ctypes.c_int(k)].value for k in range(len(FUNCS))]


def test_uprobe_counts_exactly_the_launches_of_a_linked_workload(bpf) -> None:
    out, hits = traced_run(bpf, simcuda.workload("launch_bound") + ["--steps", "4", "--scale", "0.2",
                                                                    "--kernel-ns", "1000", "--launch-ns", "0"])
    counts = dict(zip(FUNCS, hits))
    assert out["calls"]["cuLaunchKernel"] == 4 * 4  # round(21 * 0.2) per step
    for name in FUNCS:
        assert counts[name] == out["calls"].get(name, 0), (name, counts, out["calls"])


def test_uprobe_sees_calls_through_cuGetProcAddress(bpf) -> None:
    out, hits = traced_run(bpf, simcuda.workload("launch_bound_py") + ["--steps", "3", "--ptsz", "--scale", "0.3",
                                                                       "--kernel-ns", "1000", "--launch-ns", "0"])
    counts = dict(zip(FUNCS, hits))
    assert out["calls"]["cuLaunchKernel_ptsz"] == 3 * 6 and counts["cuLaunchKernel"] == 0
    for name in FUNCS:
        assert counts[name] == out["calls"].get(name, 0), (name, counts, out["calls"])
