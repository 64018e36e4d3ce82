"""The shim's emulated layer (`gputrace shim emulate`): a set cost added to every intercepted call of the
chosen classes, switched at run time; it slows exactly the calls it says, and classes mean what the
tracer's audit means by them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gputrace import shim as shim_pkg
from gputrace import simcuda
from gputrace.shim.client import Connection
from gputrace.tracer.classify import FunctionClass, classify

from shimtest import procs, shim_dir, start  # noqa: F401  (fixtures)

API = Path(shim_pkg.__file__).with_name("shim_api.h")


def groups() -> dict[str, list[str]]:
    """shim_api.h's X-macro lists: group name -> the functions in it."""
    text = API.read_text()
    out = {}
    for m in re.finditer(r"#define (SHIM_\w+)\(X\)(.*?)(?=\n#define |\nenum )", text, re.S):
        out[m.group(1)] = re.findall(r"X\((cu\w+),", m.group(2))
    return out


def test_the_shims_classes_are_the_tracers():
    """The emulated layer's --classes select by the class the tracer's audit gives each function, so
    the audit's prediction for a class is held against a layer slowing exactly that class."""
    g = groups()
    want = {"SHIM_LAUNCH": FunctionClass.SUBMISSION, "SHIM_SUBMIT_REST": FunctionClass.SUBMISSION, "SHIM_STATE": FunctionClass.STATE,
            "SHIM_PASS_STATE": FunctionClass.STATE, "SHIM_SYNC": FunctionClass.SYNC, "SHIM_QUERY": FunctionClass.QUERY}
    for group, cls in want.items():
        assert g[group], group
        for name in g[group]:
            assert classify(name) is cls, (group, name, classify(name))


def gputrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=60)


def test_emulate_slows_exactly_the_calls_of_the_chosen_classes(procs, shim_dir):
    # Held after set-up and after teardown: every call between the two is the loop's (and one copy back).
    p = start(procs, simcuda.workload("launch_bound") + ["--steps", "40", "--scale", "0.25", "--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1
    r = gputrace("shim", "emulate", "-p", str(p.pid), "--cost-ns", "1500", "--classes", "submission,query", "--json")
    assert r.returncode == 0, r.stderr
    on = orjson.loads(r.stdout)["emulate"]
    assert on["on"] and on["cost_ns"] == 1500 and on["calls_slowed"] == 0
    assert {"cuLaunchKernel", "cuCtxGetDevice_v2", "cuDevicePrimaryCtxGetState"} <= set(on["functions"])
    assert "cuStreamSynchronize" not in on["functions"] and "cuMemAlloc_v2" not in on["functions"]
    p.stdin.write("\n")
    p.stdin.flush()
    assert json.loads(p.stdout.readline())["hold"] == 2
    with Connection(p.pid) as c:
        slowed = c.request("emulate")["emulate"]["calls_slowed"]
        st = c.status()
        off = c.request("emulate off")["emulate"]
    assert st["emulate"]["on"] and not off["on"] and off["calls_slowed"] == slowed
    # Each spin lasts at least its set cost, and the shim says how long they took in all.
    assert off["spent_ns"] >= 1500 * slowed
    # Every slowed call came back (the job is held between its calls) with the driver's own time.
    assert off["driver_calls"] == slowed and off["driver_ns"] > 0
    p.stdin.write("\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=60)
    report = json.loads(out.strip().splitlines()[-1])
    per_step = report["per_step"]
    wanted = [n for n in per_step if classify(n) in (FunctionClass.SUBMISSION, FunctionClass.QUERY)]
    assert {"cuLaunchKernel", "cuCtxGetDevice_v2"} <= set(wanted)
    # The loop's calls of those classes, and the teardown's one copy back to the host.
    assert slowed == report["steps"] * sum(per_step[n] for n in wanted) + 1


def test_a_zero_cost_layer_times_the_driver_calls_of_every_class(procs, shim_dir):
    """cost=0 over every class: no spin, but every wrapper kind (launch, submission, state, query,
    synchronization) hands each call it selected back for the driver's own time, so the figure with
    a spin has a baseline to be compared with."""
    p = start(procs, simcuda.workload("launch_bound") + ["--steps", "20", "--scale", "0.25", "--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1
    with Connection(p.pid) as c:
        on = c.request("emulate cost=0 classes=submission,synchronization,state,query")
        assert on["ok"] and on["emulate"]["driver_calls"] == 0
        p.stdin.write("\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["hold"] == 2
        off = c.request("emulate off")["emulate"]
    assert off["calls_slowed"] > 0 and off["driver_calls"] == off["calls_slowed"]
    assert off["driver_ns"] > 0
    p.stdin.write("\n")
    p.stdin.flush()
    out, _ = p.communicate(timeout=60)
    per_step = json.loads(out.strip().splitlines()[-1])["per_step"]
    # The loop calls every class (a synchronization a step among them): each was slowed and timed.
    assert {classify(n) for n in per_step} >= {FunctionClass.SUBMISSION, FunctionClass.SYNC, FunctionClass.QUERY}


def test_emulate_usage_errors_say_what_to_give(procs, shim_dir):
    p = start(procs, simcuda.workload("launch_bound") + ["--steps", "1", "--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1
    pid = str(p.pid)
    r = gputrace("shim", "emulate", "-p", pid, "--cost-ns", "100")
    assert r.returncode == 2 and "--classes, --functions or --preset" in r.stderr
    r = gputrace("shim", "emulate", "-p", pid, "--cost-ns", "100", "--classes", "launches")
    assert r.returncode == 2 and "unknown class 'launches'" in r.stderr and "submission" in r.stderr
    r = gputrace("shim", "emulate", "-p", pid, "--cost-ns", "100", "--functions", "cuNotAThing")
    assert r.returncode != 0 and "does not wrap this function: cuNotAThing" in r.stderr
    r = gputrace("shim", "emulate", "-p", pid, "--off", "--cost-ns", "5")
    assert r.returncode == 2 and "--off takes no cost" in r.stderr
    r = gputrace("shim", "status", "-p", pid, "--cost-ns", "5")
    assert r.returncode == 2 and "go with `shim emulate`" in r.stderr
    r = gputrace("shim", "emulate", "-p", pid)
    assert r.returncode == 0 and "emulated layer off" in r.stdout
    p.stdin.write("\n\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


@pytest.mark.parametrize("line", ["emulate cost=-1 classes=query", "emulate cost=10", "emulate classes=query",
                                  "emulate cost=10 classes=query,nope", "emulate bogus", "emulate cost=1x classes=query"])
def test_the_control_command_refuses_malformed_requests(procs, shim_dir, line):
    p = start(procs, simcuda.workload("launch_bound") + ["--steps", "1", "--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1
    with Connection(p.pid) as c:
        reply = c.request(line)
        assert reply["ok"] is False and reply["error"]
        assert c.request("emulate")["emulate"]["on"] is False  # nothing was switched on
    p.stdin.write("\n\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


def test_a_jobs_ranks_get_the_emulated_layer_together(procs, shim_dir):
    """`shim emulate --tree LAUNCHER` (or -p A,B): the layer on every rank of simcuda's collective job,
    each rank counting the calls it slowed; --off on all of them; status stays a one-process command."""
    from test_gang import Job

    j = Job(procs, 2)
    j.wait_all_past(2, "both ranks running")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gputrace", "shim", *args], capture_output=True, text=True,
                              timeout=60)

    r = cli("emulate", "--tree", str(j.launcher), "--cost-ns", "1000", "--classes", "submission", "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["job"] and [x["pid"] for x in doc["ranks"]] == j.ranks
    assert all(x["emulate"]["on"] and x["emulate"]["cost_ns"] == 1000 for x in doc["ranks"])
    n = len(j.lines)
    j.wait(lambda ls: len(ls) >= n + 4, "the job runs on under the layer")
    r = cli("emulate", "-p", j.pids())
    assert r.returncode == 0, r.stderr
    per_rank = [int(m) for m in re.findall(r"(\d+) calls slowed so far", r.stdout)]
    assert len(per_rank) == 2 and all(c > 0 for c in per_rank)
    assert "job of 2 processes: " in r.stdout
    r = cli("emulate", "--tree", str(j.launcher), "--off", "--json")
    assert r.returncode == 0 and not any(x["emulate"]["on"] for x in orjson.loads(r.stdout)["ranks"])
    r = cli("status", "-p", j.pids())
    assert r.returncode == 2 and "shim status takes one process" in r.stderr
    j.stop()
