"""The precompiled BPF object (bpf/counts.bpf.c built by clang, loaded by tracer/bpfobj.py) against bcc's
run-time compile of the same source: the same maps, the same counts of real uprobe hits; `gputrace attach`
working with bcc made unimportable; a corrupt, missing or refused object falling back to bcc with the reason.

The object needs clang (scripts/setup-host installs it): tests that need it skip with that reason only.
Loading needs root, as every eBPF test here.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gputrace import bpf as bpfsrc
from gputrace import simcuda
from gputrace.base import native
from gputrace.base.errors import BpfUnavailable
from gputrace.tracer import bpfobj, bpfprog, links

from bpfobjtest import BPF_DIR, GLOBAL_DATA, REFUSED, build_test_object, clang_or_skip

CLI = [sys.executable, "-m", "gputrace"]
is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root for BPF programs and uprobes")


@pytest.fixture(scope="module")
def object_path() -> Path:
    clang_or_skip()
    return native.build(**bpfsrc.OBJECT)


def bcc_or_skip() -> None:
    from gputrace.base.bccload import import_bcc

    try:
        import_bcc()
    except BpfUnavailable as exc:
        pytest.skip(f"bcc cannot be imported: {exc.msg}")


# --- the object as parsed: no kernel needed ---------------------------------------------------------------------

def test_the_object_holds_the_programs_and_maps_of_the_source(object_path):
    obj = bpfobj.BpfObject(object_path)
    assert set(obj.programs) == {"gt_entry", "gt_return", "raw_tracepoint__sched_process_exit"}
    assert obj.programs["gt_entry"].prog_type == obj.programs["gt_return"].prog_type == bpfobj.BPF_PROG_TYPE_KPROBE
    assert obj.programs["raw_tracepoint__sched_process_exit"].attach_to == "sched_process_exit"
    assert obj.license == "GPL"
    types = {name: (m.type, ctypes.sizeof(m.key_type), ctypes.sizeof(m.value_type), m.max_entries)
             for name, m in obj.maps.items()}
    h = bpfprog.header_constants((BPF_DIR / "gputrace.h").read_text())
    assert types == {"stats": (1, 8, 8 * (9 + h["GT_HIST_SLOTS"]), h["GT_MAX_STATS"]),  # 9 u64s and the histogram
                     "threads": (9, 4, 16 + 24 * h["GT_MAX_DEPTH"], h["GT_MAX_THREADS"]),
                     "errors": (2, 4, 8, h["GT_ERR_COUNT"]),
                     # gen, open, hit_ns[4]; sync_func, sync_tgid, 6 sync_* u64s, step_last_t, 3 gap_* u64s
                     "config": (2, 4, 8 + 32 + 8 + 48 + 8 + 24, 1), "seen": (2, 4, 8, 2),
                     # (tgid, tid, func, pad) -> calls, kept, outer_ns
                     "tstats": (9, 16, 24, h["GT_MAX_TSTATS"])}
    # The stats row typed from the BTF: RawStats' fields, laid out as the C struct.
    leaf = bpfprog.Layout.of(obj.maps["stats"].value_type)
    assert leaf.struct.format == f"=1Q1Q1Q1Q1Q1Q1Q1Q1Q{h['GT_HIST_SLOTS']}Q"
    assert list(leaf.fields)[:3] == ["calls", "timed", "total_ns"]
    for prog in obj.programs.values():
        assert prog.maps_at and all(prog.insns[8 * i] == 0x18 for i, _ in prog.maps_at)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-bpf"])
def test_a_damaged_object_is_refused_with_the_reason(object_path, tmp_path, damage):
    bad = tmp_path / "bad.o"
    if damage == "garbage":
        bad.write_bytes(b"not an ELF file at all\n")
    elif damage == "truncated":
        bad.write_bytes(object_path.read_bytes()[:2000])
    else:
        bad.write_bytes(Path(sys.executable).resolve().read_bytes()[:1 << 20])  # an x86 ELF, not BPF
    with pytest.raises(bpfobj.ObjectInvalid) as e:
        bpfobj.BpfObject(bad)
    assert str(bad) in e.value.msg and "not a BPF object gputrace can load" in e.value.msg, e.value.msg
    assert e.value.hint


def test_an_object_with_global_data_is_refused_before_loading(tmp_path):
    with pytest.raises(bpfobj.ObjectInvalid) as e:
        bpfobj.BpfObject(build_test_object(tmp_path, "globals", GLOBAL_DATA))
    assert "only map references are supported" in e.value.msg, e.value.msg


# --- loaded into this kernel ---------------------------------------------------------------------------------

def shape(t: type) -> object:
    """A ctypes type as (field, offset, shape) all the way down: what the tracer's reads depend on."""
    if issubclass(t, ctypes.Structure):
        return tuple((name, getattr(t, name).offset, shape(ft)) for name, ft in t._fields_)
    if issubclass(t, ctypes.Array):
        return (shape(t._type_), t._length_)
    return (ctypes.sizeof(t), t(-1).value < 0)  # size and signedness


@needs_root
@pytest.mark.bpf
@pytest.mark.parametrize("mode", ["multi", "perf"])
def test_both_loaders_make_the_same_maps(object_path, monkeypatch, mode):
    """The same maps (kind, key and value sizes, max_entries set at load, flags) and the same row layouts."""
    bcc_or_skip()
    got = {}
    for loader in ("object", "bcc"):
        monkeypatch.setenv(bpfprog.BPF_ENV, loader)
        prog = bpfprog.Program(mode, max_stats=1234, max_threads=567)
        try:
            assert prog.loader == loader and prog.origin.fallback == ""
            infos = {name: (i.type, i.key_size, i.value_size, i.max_entries, i.flags, i.name)
                     for name, i in prog.map_infos().items()}
            layouts = {name: (shape(m.key_type), shape(m.value_type)) for name, m in prog.maps.items()}
            got[loader] = (infos, layouts)
        finally:
            prog.close()
    assert got["object"] == got["bcc"]
    assert got["object"][0]["stats"][3] == 1234 and got["object"][0]["threads"][3] == 567


@needs_root
@pytest.mark.bpf
def test_the_object_loader_counts_real_uprobe_hits(object_path, monkeypatch, spawned):
    """In process: the object's programs on a multi link over simcuda's libcuda count exactly the calls the
    workload reports, through the tracer's own reads (batched and row by row)."""
    from gputrace.tracer.symbols import read_functions

    monkeypatch.setenv(bpfprog.BPF_ENV, "object")
    lib = str(simcuda.library_path())
    funcs = {f.name: f for f in read_functions(lib)}
    names = ["cuLaunchKernel", "cuLaunchKernelEx", "cuStreamSynchronize", "cuMemcpyDtoDAsync_v2"]
    prog = bpfprog.Program("multi")
    r, w = os.pipe()
    proc = subprocess.Popen(simcuda.workload("launch_bound") + ["--steps", "30", "--launch-ns", "0", "--wait-stdin",
                                                                "--ready-fd", str(w)],
                            env=simcuda.env(), pass_fds=(w,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spawned.append(proc)
    os.close(w)
    try:
        with os.fdopen(r) as ready:
            assert ready.readline() == "ready\n"
        prog.next_generation()
        prog.open()
        link = prog.attach(lib, [funcs[n].offset for n in names], [i | bpfprog.COOKIE_TIMED for i in range(len(names))],
                           retprobe=False, pid=proc.pid)
        ret = prog.attach(lib, [funcs[n].offset for n in names], [i | bpfprog.COOKIE_TIMED for i in range(len(names))],
                          retprobe=True, pid=proc.pid)
        with link, ret:
            out, _ = proc.communicate("go\n", timeout=120)
        assert proc.returncode == 0
        wl = orjson.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
        rows = {f: st for (tgid, f), st in prog.read_stats().items() if tgid == proc.pid}
        assert {names[f]: st.calls for f, st in rows.items()} == {n: wl["calls"][n] for n in names if wl["calls"].get(n)}
        for st in rows.values():
            assert st.timed == st.calls and sum(st.hist) == st.timed and st.total_ns > 0
        assert prog.read_errors() == dict.fromkeys(bpfprog.ERROR_NAMES, 0)
        prog._batch, prog._rows = None, {}  # row by row, through the map's key iteration
        assert {f: st for (tgid, f), st in prog.read_stats().items() if tgid == proc.pid} == rows
        prog.forget([(proc.pid, f) for f in rows])
        assert not [k for k in prog.read_stats() if k[0] == proc.pid]
    finally:
        prog.close()


def run_attach(tmp_path: Path, env: dict, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None, dict | None]:
    out = tmp_path / "report.json"
    if out.exists():
        out.unlink()
    p = subprocess.run(CLI + ["attach", "--exact", "--interval", "0.1", "--json", "-o", str(out), *extra, "--",
                              *simcuda.workload("launch_bound"), "--steps", "60", "--launch-ns", "0"],
                       env={**os.environ, **simcuda.env(), **env}, capture_output=True, text=True, timeout=180)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return p, (orjson.loads(out.read_bytes()) if out.exists() else None), (orjson.loads(lines[0]) if lines else None)


def calls(report: dict) -> dict[str, int]:
    return {f["name"]: f["calls_observed"] for f in report["summary"]["functions"]}


@needs_root
@pytest.mark.bpf
@pytest.mark.timeout(400)
def test_both_loaders_count_the_same_workload_identically(object_path, tmp_path):
    """`gputrace attach --exact` on the same workload, once per loader: every count what the workload says,
    so the same from both; every call timed from both."""
    bcc_or_skip()
    got = {}
    for loader in ("object", "bcc"):
        p, report, wl = run_attach(tmp_path, {bpfprog.BPF_ENV: loader}, "-q")
        assert p.returncode == 0, p.stderr
        assert report["attach"]["program"] == loader
        assert calls(report) == wl["calls"]
        for f in report["summary"]["functions"]:
            assert f["timed_calls"] == f["calls_observed"], (loader, f)
        assert report["errors"]["unpaired"] == 0 and report["errors"]["depth"] == 0
        got[loader] = calls(report)
    assert got["object"] == got["bcc"]


@pytest.fixture
def bcc_unimportable(tmp_path) -> dict:
    """An environment whose Python cannot import bcc: a `bcc` package first on PYTHONPATH that raises
    ImportError, and GPUTRACE_BCC_PATH naming an empty directory (no distribution copy either)."""
    shim = tmp_path / "no-bcc"
    (shim / "bcc").mkdir(parents=True)
    (shim / "bcc" / "__init__.py").write_text('raise ImportError("bcc is made unimportable for this test")\n')
    (tmp_path / "empty").mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "GPUTRACE_BCC_PATH": str(tmp_path / "empty")}
    probe = subprocess.run([sys.executable, "-c", "from gputrace.base.bccload import import_bcc; import_bcc()"],
                           env={**os.environ, **env}, capture_output=True, text=True)
    assert probe.returncode != 0 and "BpfUnavailable" in probe.stderr, probe.stderr
    return env


@needs_root
@pytest.mark.bpf
@pytest.mark.timeout(300)
def test_attach_works_without_bcc_through_the_object(object_path, tmp_path, bcc_unimportable):
    p, report, wl = run_attach(tmp_path, bcc_unimportable)
    assert p.returncode == 0, p.stderr
    assert report["attach"]["program"] == "object"
    assert "precompiled BPF program" in p.stderr
    assert calls(report) == wl["calls"]
    # Forced to bcc, the same host has no way to load the program: a clear error, no traceback.
    p, report, _ = run_attach(tmp_path, {**bcc_unimportable, bpfprog.BPF_ENV: "bcc"}, "-q")
    assert p.returncode == BpfUnavailable.exit_code, p.stderr
    assert "bcc" in p.stderr and "hint:" in p.stderr and report is None


@needs_root
@pytest.mark.bpf
@pytest.mark.timeout(300)
def test_a_corrupt_object_falls_back_to_bcc_and_says_why(object_path, tmp_path):
    bcc_or_skip()
    bad = tmp_path / "corrupt.bpf.o"
    bad.write_bytes(object_path.read_bytes()[:3000])
    p, report, wl = run_attach(tmp_path, {bpfprog.OBJECT_ENV: str(bad)})
    assert p.returncode == 0, p.stderr
    assert report["attach"]["program"] == "bcc"
    assert "precompiled BPF program did not load" in p.stderr and str(bad) in p.stderr, p.stderr
    assert calls(report) == wl["calls"]
    # GPUTRACE_BPF=object: no fallback, the reason as the error.
    p, report, _ = run_attach(tmp_path, {bpfprog.OBJECT_ENV: str(bad), bpfprog.BPF_ENV: "object"}, "-q")
    assert p.returncode == BpfUnavailable.exit_code and report is None
    assert "not a BPF object gputrace can load" in p.stderr and "hint:" in p.stderr, p.stderr


@needs_root
@pytest.mark.bpf
def test_a_refused_program_carries_the_verifiers_reason(tmp_path, monkeypatch):
    path = build_test_object(tmp_path, "refused", REFUSED)
    with pytest.raises(bpfobj.ProgramRefused) as e:
        bpfobj.BpfObject(path).load()
    assert "the kernel's verifier refused gt_entry of refused.bpf.o" in e.value.msg
    assert "map_value_or_null" in e.value.msg and "map_value_or_null" in e.value.log, e.value.msg
    assert "\n" not in e.value.msg and "GPUTRACE_BPF=bcc" in e.value.hint
    # Through Program: bcc takes over, and its origin says why.
    bcc_or_skip()
    monkeypatch.setenv(bpfprog.OBJECT_ENV, str(path))
    prog = bpfprog.Program("multi")
    try:
        assert prog.loader == "bcc" and "map_value_or_null" in prog.origin.fallback, prog.origin
    finally:
        prog.close()


@needs_root
@pytest.mark.bpf
def test_a_kernel_without_multi_programs_is_not_sent_to_bcc(object_path, monkeypatch):
    """Where the kernel refuses only the uprobe-multi attach type, bcc would be refused the same: the object
    path says so (and attach goes on with perf links), rather than compiling with bcc for nothing."""
    real = bpfobj.prog_load

    def refuses_multi(insns, prog_type, expected_attach_type=0, **kw):  # as a kernel before 6.6 does
        if expected_attach_type == links.BPF_TRACE_UPROBE_MULTI:
            raise bpfobj.ProgramRefused(f"the kernel refused {kw.get('what')}: Invalid argument", "", errno_=22)
        return real(insns, prog_type, expected_attach_type, **kw)

    monkeypatch.setattr(bpfobj, "prog_load", refuses_multi)
    monkeypatch.setenv(bpfprog.BPF_ENV, "auto")
    with pytest.raises(bpfprog.MultiUnsupported) as e:
        bpfprog.Program("multi")
    assert "uprobe-multi" in e.value.msg and "6.6" in e.value.hint
    from gputrace.tracer.session import open_program

    said = []
    prog, _cal = open_program("auto", said.append)
    try:
        assert prog.mode == "perf" and prog.loader == "object"
        assert any("uprobe-multi links unavailable" in s for s in said), said
    finally:
        prog.close()


def test_an_unknown_loader_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(bpfprog.BPF_ENV, "llvm")
    with pytest.raises(BpfUnavailable) as e:
        bpfprog.Program("multi")
    assert "GPUTRACE_BPF='llvm'" in e.value.msg and "object or bcc" in e.value.hint
