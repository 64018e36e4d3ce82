"""The tracer end to end on this host's kernel: `gputrace attach` as a subprocess on simcuda workloads, and a
Session in-process on a small fake libcuda. Every count is compared with what the traced program says it did.

Needs root, and the precompiled BPF object (built by clang) or bcc to load the program with (CI has all
three); skipped with the reason where they are missing. No test sleeps for a
condition that can be awaited: workloads are held with --wait-stdin / --ready-fd, tracers are awaited on their
live lines ("[", printed once the probes are attached) and on their exit.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import pytest

from gputrace import simcuda
from gputrace.base import native
from gputrace.tracer import bpfprog, links

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_host"), pytest.mark.timeout(180)]

CLI = [sys.executable, "-m", "gputrace"]
SIMCUDA_DIR = Path(simcuda.__file__).resolve().parent
BPF_LINK_GET_NEXT_ID = 31
LIVE = re.compile(r"^\[\s*[\d.]+s\] pid (\d+) .*?: (\S+) calls/s")


# --- helpers ---------------------------------------------------------------------------------------------------

def attach(*args: str) -> list[str]:
    return CLI + ["attach", *args]


def run_attach(args: list[str], out: Path, *, timeout: float = 120) -> tuple[dict, dict]:
    """Runs `gputrace attach ... --json -o out -- workload`: (the report, the workload's JSON line)."""
    p = subprocess.run(attach(*args), env=simcuda.env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return load_report(out), workload_json(p.stdout)


def load_report(path: Path) -> dict:
    doc = orjson.loads(path.read_bytes())
    assert doc["schema"] == 2 and doc["kind"] == "gputrace.attach"
    return doc


def workload_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout
    doc = json.loads(lines[0])
    assert doc.get("check", "ok") == "ok", doc
    return doc


def summary_calls(report: dict) -> dict[str, int]:
    return {f["name"]: f["calls_observed"] for f in report["summary"]["functions"]}


def by_name(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["summary"]["functions"]}


def start_held(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a workload that stops before its first driver call (libcuda already mapped) until a line on stdin."""
    r, w = os.pipe()
    proc = subprocess.Popen(argv + ["--wait-stdin", "--ready-fd", str(w)], env=env or simcuda.env(), pass_fds=(w,),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r) as ready:
        assert ready.readline() == "ready\n", proc.communicate()
    return proc


def release(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def start_tracer(args: list[str], spawned: list) -> subprocess.Popen:
    p = subprocess.Popen(attach(*args), env=simcuda.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    return p


def wait_live_line(tracer: subprocess.Popen, pred=lambda m: True) -> re.Match:
    """Reads the tracer's stderr up to a live interval line for which pred(match) holds."""
    seen = []
    for line in tracer.stderr:
        seen.append(line)
        m = LIVE.match(line)
        if m and pred(m):
            return m
    raise AssertionError(f"tracer exited with {tracer.wait()} before the expected live line:\n{''.join(seen)}")


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    return out or "", err or ""


def link_ids() -> set[int]:
    """Ids of every BPF link on the host (BPF_LINK_GET_NEXT_ID until ENOENT)."""
    ids, start = set(), 0
    while True:
        attr = bytearray(8)
        struct.pack_into("II", attr, 0, start, 0)
        ret = links.bpf(BPF_LINK_GET_NEXT_ID, attr)
        if ret == -errno.ENOENT:
            return ids
        assert ret >= 0, os.strerror(-ret)
        start = struct.unpack_from("II", attr)[1]
        ids.add(start)


def own_link_ids(pid: int) -> set[int]:
    """Ids of the BPF links process `pid` holds fds of (its /proc fdinfo names them): other BPF users on the
    host (a concurrent test run) may create and keep links of their own meanwhile."""
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except FileNotFoundError:
            continue  # closed meanwhile
        m = re.search(r"^link_id:\s*(\d+)$", text, re.M)
        if m:
            ids.add(int(m.group(1)))
    return ids


def uprobe_events() -> str | None:
    for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            return Path(d, "uprobe_events").read_text()
        except OSError:
            continue
    return None


def launch_bound(*args: str) -> list[str]:
    return simcuda.workload("launch_bound") + list(args)


# --- 1. exact counts ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload, steps", [("launch_bound", 400), ("launch_bound_py", 40)])
def test_exact_counts_every_function(workload, steps, tmp_path):
    """--exact: every function's count, setup and teardown included, is what the workload says it called; the
    Python workload reaches the driver only through dlopen + cuGetProcAddress_v2."""
    out = tmp_path / "report.json"
    # Short intervals: the run crosses several interval boundaries, where no call may be lost either.
    report, wl = run_attach(["--exact", "--interval", "0.05", "-q", "--json", "-o", str(out), "--",
                             *simcuda.workload(workload), "--steps", str(steps), "--launch-ns", "0"], out)
    assert len(report["intervals"]) >= 2
    assert summary_calls(report) == wl["calls"]
    if workload == "launch_bound_py":
        assert wl["calls"]["cuGetProcAddress_v2"] > 0
    for f in report["summary"]["functions"]:
        assert f["timed_calls"] == f["calls_observed"], f  # exact: every call timed as well
    assert report["options"]["exact"] is True
    assert report["exit_status"] == 0
    assert report["errors"]["depth"] == 0 and report["errors"]["stats_full"] == 0


def test_exact_counts_with_per_probe_links(tmp_path):
    """The per-probe (perf link) fallback counts as exactly as multi links, for the functions asked for."""
    out = tmp_path / "report.json"
    report, wl = run_attach(["--exact", "-q", "--json", "-o", str(out), "--attach-mode", "perf",
                             "--functions", "cuLaunch*,cuStreamSynchronize", "--",
                             *launch_bound("--steps", "5", "--launch-ns", "0")], out)
    assert report["attach"]["mode"] == "perf" and report["options"]["attach_mode"] == "perf"
    want = {n: c for n, c in wl["calls"].items() if n.startswith("cuLaunch") or n == "cuStreamSynchronize"}
    assert set(want) == {"cuLaunchKernel", "cuLaunchKernelEx", "cuStreamSynchronize"}
    assert summary_calls(report) == want


# --- 2. per-call time after calibration ------------------------------------------------------------------------

LAUNCH_TIMER = r"""
/* n rounds of two launches of the same kernel through the same code (launch_impl): cuLaunchKernel_ptsz, timed
 * here and left untraced (the tracer is given --functions cuLaunchKernel), then cuLaunchKernel, traced.
 * Interleaving them call by call gives the untraced reference under the same conditions as the traced calls. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "cuda.h"

#define OK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, (int)r_); exit(1); } } while (0)

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv)
{
    long n = atol(argv[1]);
    CUdevice dev; CUcontext ctx; CUmodule mod; CUfunction fn; CUdeviceptr buf;
    OK(cuInit(0)); OK(cuDeviceGet(&dev, 0)); OK(cuDevicePrimaryCtxRetain(&ctx, dev)); OK(cuCtxSetCurrent(ctx));
    OK(cuModuleLoadData(&mod, "SIMCUDA-MODULE\nkernel inc inc_u32 0\n"));
    OK(cuModuleGetFunction(&fn, mod, "inc"));
    OK(cuMemAlloc_v2(&buf, 1024));
    unsigned long long elems = 256;
    void *params[] = {&buf, &elems};
    double untraced = 0;
    for (long i = 0; i < n; i++) {
        double t0 = now_ns();
        OK(cuLaunchKernel_ptsz(fn, 1, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
        untraced += now_ns() - t0;
        OK(cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    }
    OK(cuStreamSynchronize(NULL));
    printf("{\"launches\": %ld, \"untraced_mean_ns\": %.1f}\n", n, untraced / n);
    return 0;
}
"""


def test_per_call_time_of_a_busy_wait_launch(tmp_path):
    """SIMCUDA_LAUNCH_NS=50000 makes each launch spin 50 µs: with the probe bias subtracted, the mean_ns of
    cuLaunchKernel is within 10% of what the same launch takes untraced (the 50 µs plus the launch's own cost,
    measured in the same process, interleaved call by call with the traced launches)."""
    src = tmp_path / "launch_timer.c"
    src.write_text(LAUNCH_TIMER)
    exe = native.build("launch_timer", [src], cflags=[f"-I{SIMCUDA_DIR}"],
                       ldflags=[f"-L{simcuda.driver_dir()}", "-lcuda"], headers=[SIMCUDA_DIR / "cuda.h"])
    n = 1500
    out = tmp_path / "report.json"
    p = subprocess.run(attach("--exact", "-q", "--json", "-o", str(out), "--functions", "cuLaunchKernel", "--",
                              str(exe), str(n)),
                       env={**simcuda.env(), "SIMCUDA_LAUNCH_NS": "50000"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    untraced = workload_json(p.stdout)["untraced_mean_ns"]
    assert untraced >= 50000  # the knob works: every launch spins at least that long
    report = load_report(out)
    assert set(by_name(report)) == {"cuLaunchKernel"}  # the reference launches went untraced
    launch = by_name(report)["cuLaunchKernel"]
    assert launch["calls_observed"] == n and launch["timed_calls"] == n
    assert abs(launch["mean_ns"] - untraced) <= 0.10 * untraced, (launch["mean_ns"], untraced)


# --- 3. the default budget ---------------------------------------------------------------------------------------

def test_sampled_rates_within_budget(tmp_path):
    """At the default 1% budget: rates of the functions above 1k calls/s are within 10% of the exact ones, the
    tracer's own cost stays near the budget, and probes were attached for only part of the run."""
    out = tmp_path / "report.json"
    report, wl = run_attach(["--interval", "0.5", "-q", "--json", "-o", str(out), "--",
                             *launch_bound("--seconds", "8", "--scale", "0.05", "--launch-ns", "1000000")], out)
    s = report["summary"]
    assert report["options"]["budget"] == pytest.approx(0.01) and report["options"]["exact"] is False
    got = by_name(report)
    hot = {n: c / wl["elapsed_s"] for n, c in wl["calls"].items() if c / wl["elapsed_s"] > 1000}
    assert hot, wl  # the workload's mix must give the test something to compare
    for name, rate in hot.items():
        assert name in got, (name, sorted(got))
        assert abs(got[name]["rate_hz"] - rate) <= 0.10 * rate, (name, got[name]["rate_hz"], rate)
    # The budget is a target for the expected cost, not a hard cap: allow twice it.
    assert s["tracer_overhead"] is not None and s["tracer_overhead"] < 2 * 0.01, s["tracer_overhead"]
    assert 0 < s["window_s"] < s["interval_s"], (s["window_s"], s["interval_s"])
    assert report["attach"]["windows"] >= 2  # attached and detached more than once


def test_a_single_threads_time_in_calls_never_exceeds_its_wall_time():
    """One thread launching and synchronizing (one synchronize a step, a few a window): driver CPU
    plus wait, rate x mean per call, read 1.2-1.6 s per second in some intervals. No interval may
    say one thread spent more than a second a second in driver calls."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.json"
        report, wl = run_attach(["-q", "--json", "-o", str(out), "--",
                                 *launch_bound("--seconds", "6", "--kernel-ns", "200000")], out)
    measured = [(p["driver_cpu_s_per_s"], p["wait_s_per_s"]) for iv in report["intervals"] for p in iv["processes"]
                if p["driver_cpu_s_per_s"] is not None and p["wait_s_per_s"] is not None]
    assert len(measured) >= 3, report["intervals"]
    assert all(cpu + wait <= 1.0 + 1e-9 for cpu, wait in measured), measured
    assert max(cpu + wait for cpu, wait in measured) > 0.3  # it does spend most of its time in them


# --- 4. a traced process that exits ------------------------------------------------------------------------------

def test_tracer_ends_when_the_process_exits(spawned):
    """attach -p on a running job: when the job exits the tracer stops by itself, exit 0, with its report."""
    proc = start_held(launch_bound("--steps", "200", "--scale", "0.2"))
    spawned.append(proc)
    tracer = start_tracer(["--interval", "0.2", "-p", str(proc.pid)], spawned)
    m = wait_live_line(tracer)
    assert int(m.group(1)) == proc.pid
    release(proc)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    report, err = finish(tracer)
    assert tracer.returncode == 0, err
    assert "Traceback" not in err
    assert report.startswith(f"gputrace audit of pid {proc.pid} (launch_bound)\n"), report
    assert "predicted slowdown between" in report
    assert "command exited" not in report  # not our child: no exit status to report
    assert workload_json(out)["steps"] == 200


# --- 5. the tracer SIGKILLed ---------------------------------------------------------------------------------------

def test_sigkilled_tracer_leaves_no_probes_and_the_job_runs_on(spawned):
    events_before = uprobe_events()
    before = link_ids()
    proc = start_held(launch_bound("--seconds", "2", "--scale", "0.2"))
    spawned.append(proc)
    tracer = start_tracer(["--exact", "--interval", "0.1", "-p", str(proc.pid)], spawned)
    wait_live_line(tracer)  # links are attached before the first interval line
    ours = own_link_ids(tracer.pid)
    assert len(ours) >= 2, ours  # an entry and a return link, at least
    assert ours <= link_ids() - before  # new since the start, and the enumeration sees them
    release(proc)
    wait_live_line(tracer, lambda m: not m.group(2).startswith("0.0"))  # the job is making calls, traced
    assert proc.poll() is None  # killed mid-run, not after
    tracer.send_signal(signal.SIGKILL)
    tracer.wait()
    assert tracer.returncode == -signal.SIGKILL

    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert workload_json(out)["steps"] > 0
    # The kernel frees a link when its last fd closes, which a killed process does before it can be reaped.
    assert not (link_ids() & ours)
    assert uprobe_events() == events_before


# --- 6. errors ---------------------------------------------------------------------------------------------------

def assert_clean_error(p: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), p.stderr
    assert p.returncode == code, p.stderr
    for frag in fragments:
        assert frag in lines[0], p.stderr


def test_error_process_without_libcuda(spawned):
    holder = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    spawned.append(holder)
    p = subprocess.run(attach("-p", str(holder.pid)), capture_output=True, text=True, timeout=60)
    assert_clean_error(p, 4, f"process {holder.pid} has no libcuda")


def test_error_no_such_process():
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read())  # pids stay below pid_max: this one cannot exist
    p = subprocess.run(attach("-p", str(pid)), capture_output=True, text=True, timeout=60)
    assert_clean_error(p, 3, f"no process with pid {pid}")


def test_error_nothing_to_trace():
    p = subprocess.run(attach("--exact"), capture_output=True, text=True, timeout=60)
    assert_clean_error(p, 2, "nothing to trace")


@pytest.fixture
def public_dir():
    """A directory uid 65534 can read (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="gputrace-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("owner", ["its own", "root's"])
def test_error_without_privileges(owner, spawned, public_dir):
    """Without root or capabilities: on its own process the tracer says it needs privileges; on root's it
    cannot even read the maps. Either way one error line and a hint, exit 5."""
    setpriv = shutil.which("setpriv")
    if not setpriv:
        pytest.skip("setpriv (util-linux) is not installed")
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    if owner == "its own":
        shutil.copy2(simcuda.library_path(), public_dir / "libcuda.so.1")
        exe = shutil.copy2(simcuda.workload("launch_bound")[0], public_dir / "launch_bound")
        proc = start_held(drop + [str(exe), "--steps", "1"], env={**os.environ, "LD_LIBRARY_PATH": str(public_dir)})
        want = "tracing needs root or the CAP_BPF and CAP_PERFMON capabilities"
    else:
        proc = start_held(launch_bound("--steps", "1"))
        want = f"cannot read the memory maps or libcuda of process {proc.pid}"
    spawned.append(proc)
    p = subprocess.run(drop + attach("-p", str(proc.pid)), capture_output=True, text=True, timeout=60,
                       env={**simcuda.env(), "HOME": "/tmp"})
    assert_clean_error(p, 5, want)
    release(proc)
    out, err = finish(proc)
    assert proc.returncode == 0, err  # untouched
    assert workload_json(out)["steps"] == 1


# --- 7. two tracers at once ----------------------------------------------------------------------------------------

def test_two_concurrent_tracers_both_count_exactly(tmp_path, spawned):
    """Two exact tracers on one process, each with its own program and links: both see every call."""
    proc = start_held(launch_bound("--steps", "6", "--launch-ns", "0"))
    spawned.append(proc)
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    tracers = [start_tracer(["--exact", "--interval", "0.2", "--json", "-o", str(o), "-p", str(proc.pid)], spawned)
               for o in outs]
    for t in tracers:
        wait_live_line(t)
    release(proc)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    wl = workload_json(out)
    for t, o in zip(tracers, outs):
        _, err = finish(t)
        assert t.returncode == 0, err
        assert summary_calls(load_report(o)) == wl["calls"]


# --- 8. nesting, recursion, threads that die mid-call (in-process Session) ------------------------------------------

FAKE_LIBCUDA = r"""
/* A fake libcuda.so.1. Calls between these functions go through the PLT (default visibility, -fPIC), so
 * each is a call of the exported symbol and its uprobe fires. */
#include <pthread.h>
#include <stdint.h>

static volatile uint64_t sink;

static void work(long n)
{
    for (long i = 0; i < n; i++)
        sink += (uint64_t)i;
}

__attribute__((noinline)) int cuInner(long n)
{
    work(n);
    return 0;
}

__attribute__((noinline)) int cuOuter(long n)
{
    for (int i = 0; i < 3; i++)
        cuInner(n);
    return 0;
}

__attribute__((noinline)) int cuRecurse(int depth, long n)
{
    if (depth > 1)
        cuRecurse(depth - 1, n);
    work(n);
    return 0;
}

__attribute__((noinline)) int cuDie(void)
{
    pthread_exit(0);
}
"""

FAKE_DRIVER = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int cuInner(long n);
int cuOuter(long n);
int cuRecurse(int depth, long n);
int cuDie(void);

#define WORK 2000
static pid_t tids[64];

static void *die(void *arg)
{
    tids[(long)arg] = gettid();
    cuInner(WORK);
    cuDie();
    return NULL;
}

static void wait_line(void)
{
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        exit(3);
}

int main(int argc, char **argv)
{
    long outer = atol(argv[1]), inner = atol(argv[2]), rec = atol(argv[3]), threads = atol(argv[5]);
    int depth = atoi(argv[4]);
    wait_line();
    for (long i = 0; i < outer; i++)
        cuOuter(WORK);
    for (long i = 0; i < inner; i++)
        cuInner(WORK);
    for (long i = 0; i < rec; i++)
        cuRecurse(depth, WORK);
    for (long i = 0; i < threads && i < 64; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, die, (void *)i) || pthread_join(t, NULL))
            return 4;
    }
    printf("{\"main_tid\": %d, \"dead_tids\": [", gettid());
    for (long i = 0; i < threads; i++)
        printf("%s%d", i ? ", " : "", tids[i]);
    printf("]}\n");
    fflush(stdout);
    wait_line();
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_libcuda")
    (d / "fake_libcuda.c").write_text(FAKE_LIBCUDA)
    (d / "fake_driver.c").write_text(FAKE_DRIVER)
    lib = native.build("libcuda.so.1", [d / "fake_libcuda.c"], shared=True, soname="libcuda.so.1",
                       cflags=["-O1", "-fno-ipa-icf", "-fno-optimize-sibling-calls", "-pthread"], ldflags=["-pthread"])
    exe = native.build("fake_driver", [d / "fake_driver.c"],
                       ldflags=[f"-L{lib.parent}", "-l:libcuda.so.1", "-pthread"])
    return lib, exe


def wait_until(cond, what: str, limit_s: float = 10.0) -> None:
    """A bounded retry on a condition the kernel makes true shortly (no event to wait on)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("loader", ["object", "bcc"])
def test_nesting_recursion_and_dying_threads(fake_driver, spawned, loader, monkeypatch):
    """Once per way of loading the program (the precompiled object, bcc's run-time compile): the same
    exact counts from both."""
    from gputrace.base.errors import BuildError
    from gputrace.tracer.session import Options, Session

    if loader == "object":
        try:
            native.find_clang()
        except BuildError:
            pytest.skip("clang is not installed (scripts/setup-host installs it): no BPF object to load")
    else:
        from gputrace.base.bccload import import_bcc
        from gputrace.base.errors import BpfUnavailable

        try:
            import_bcc()
        except BpfUnavailable as exc:
            pytest.skip(f"bcc cannot be imported: {exc.msg}")
    monkeypatch.setenv(bpfprog.BPF_ENV, loader)
    lib, exe = fake_driver
    outer, inner, rec, depth, nthreads = 40, 25, 10, 12, 5
    assert depth > bpfprog.MAX_DEPTH
    proc = subprocess.Popen([str(exe), str(outer), str(inner), str(rec), str(depth), str(nthreads)],
                            env={**os.environ, "LD_LIBRARY_PATH": str(lib.parent)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spawned.append(proc)
    session = Session(proc.pid, str(lib), Options(interval_s=0.5, budget=1.0))
    try:
        assert session.program.loader == loader
        ids = {f.name: i for i, f in session.ids.items()}
        assert set(ids) == {"cuInner", "cuOuter", "cuRecurse", "cuDie"}
        errors0 = session.program.read_errors()
        t0 = time.monotonic()
        session.prime()
        release(proc)
        told = json.loads(proc.stdout.readline())  # every call made, every dying thread joined
        assert len(told["dead_tids"]) == nthreads

        # A thread that died inside cuDie leaves no frame stack behind; the live main thread keeps its own.
        for tid in told["dead_tids"]:
            wait_until(lambda: not os.path.exists(f"/proc/{proc.pid}/task/{tid}"), f"thread {tid} is reaped")
        threads = session.program.thread_ids()
        assert told["main_tid"] in threads
        assert not threads & set(told["dead_tids"]), threads

        release(proc)
        summary = session.run(None)
        run_ns = (time.monotonic() - t0) * 1e9
        assert proc.wait() == 0
        raw = {f: st for (tgid, f), st in session.program.read_stats().items() if tgid == proc.pid}
        errors = {k: v - errors0[k] for k, v in session.program.read_errors().items()}
        # The batched read (parsed with struct) gives what the row-by-row ctypes read gives.
        assert session.program._batch is not None
        session.program._batch, session.program._rows = None, {}
        assert {f: st for (tgid, f), st in session.program.read_stats().items() if tgid == proc.pid} == raw
    finally:
        session.close()
        session.program.close()

    st = {name: raw[i] for name, i in ids.items()}
    fs = {f.name: f for f in summary.functions}
    # Every call counted; every call that returned timed.
    assert st["cuOuter"].calls == st["cuOuter"].timed == outer
    assert fs["cuOuter"].calls_observed == fs["cuOuter"].timed_calls == outer
    assert st["cuOuter"].nested == 0
    inner_calls = 3 * outer + inner + nthreads
    assert st["cuInner"].calls == st["cuInner"].timed == inner_calls
    assert st["cuInner"].nested == 3 * outer
    assert st["cuDie"].calls == nthreads and st["cuDie"].timed == 0
    # Recursion: every level counted; the 8 innermost-tracked levels timed, the deeper ones counted as depth
    # errors, and no return paired with the wrong entry.
    md = bpfprog.MAX_DEPTH
    assert st["cuRecurse"].calls == rec * depth
    assert st["cuRecurse"].timed == rec * md
    assert st["cuRecurse"].nested == rec * (md - 1)
    assert errors["depth"] == rec * (depth - md)
    assert errors["unpaired"] == 0, errors
    assert errors["threads_full"] == 0 and errors["stats_full"] == 0
    # No paired duration longer than the whole run; the plain calls are short.
    for name, s in st.items():
        assert sum(s.hist) == s.timed
        top = max((k for k, n in enumerate(s.hist) if n), default=0)
        assert 2 ** (top - 1) <= run_ns, (name, top)
    for name in ("cuInner", "cuOuter"):
        assert fs[name].p99_ns is not None and fs[name].p99_ns < 100e6, fs[name]
    # The outer call of a recursion contains all its levels: longer than any nested one's mean.
    assert fs["cuRecurse"].outer_mean_ns > fs["cuRecurse"].mean_ns


# --- 7. targets that are not what they seem (issue: hardening) --------------------------------------------------

def test_attach_finds_a_libcuda_installed_under_another_file_name(spawned, tmp_path):
    """A driver installed as libnvcuda-sim.so.580 and reached through a libcuda.so.1 symbolic link: the
    process's maps name the file, not the link; its ELF soname says what it is."""
    d = tmp_path / "drv"
    d.mkdir()
    shutil.copy2(simcuda.library_path(), d / "libnvcuda-sim.so.580")
    os.symlink("libnvcuda-sim.so.580", d / "libcuda.so.1")
    env = simcuda.env()
    env["LD_LIBRARY_PATH"] = f"{d}:{env['LD_LIBRARY_PATH']}"
    proc = start_held(launch_bound("--steps", "100", "--scale", "0.2"), env=env)
    spawned.append(proc)
    assert "libnvcuda-sim.so.580" in Path(f"/proc/{proc.pid}/maps").read_text()
    out = tmp_path / "r.json"
    tracer = start_tracer(["--exact", "--interval", "0.2", "-p", str(proc.pid), "--json", "-o", str(out)], spawned)
    wait_live_line(tracer)
    release(proc)
    wl_out, err = finish(proc)
    assert proc.returncode == 0, err
    _, err = finish(tracer)
    assert tracer.returncode == 0, err
    report = load_report(out)
    assert report["library"].endswith("libnvcuda-sim.so.580")
    assert summary_calls(report).get("cuLaunchKernel") == workload_json(wl_out)["calls"]["cuLaunchKernel"]


def test_a_process_that_exits_while_the_tracer_sets_up_is_a_clear_error(spawned):
    proc = start_held(launch_bound("--steps", "10"))
    spawned.append(proc)
    tracer = subprocess.Popen(attach("-q", "-p", str(proc.pid), "-d", "5"),
                              env={**simcuda.env(), "GPUTRACE_STOP_AT": "tracer:setup"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(tracer)
    info = os.waitid(os.P_PID, tracer.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)  # stopped itself there
    assert info.si_code == os.CLD_STOPPED, tracer.communicate()
    proc.kill()
    proc.wait()
    os.kill(tracer.pid, signal.SIGCONT)
    out, err = finish(tracer)
    # Caught while the session is made, or when its first window attaches: either way a clean error.
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 2 and lines[1].startswith("hint: "), err
    assert tracer.returncode in (3, 6) and "exited" in lines[0], err
