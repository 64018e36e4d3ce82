"""What scripts read from the tracing commands: one JSON document on stdout with --json (the traced
command's own output goes to stderr), a line per interval with --jsonl, and flags echoed back as
they were read. Needs root and bcc (CI has both)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from gputrace import simcuda

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_host"), pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "gputrace"]


def gputrace(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout)


def test_demo_json_is_one_document_and_the_workloads_output_goes_to_stderr():
    r = gputrace("demo", "--json", "-d", "2")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)  # the whole of stdout: one document, nothing before or after it
    assert doc["kind"] == "gputrace.attach" and doc["exit_status"] == 0
    s = doc["summary"]
    # 2 s read at 1%: a figure, or not known (and then why, with each busy function's range).
    assert (s["calls_hz"] or 0) > 1000 or (s["calls_hz"] is None and s["calls_not_known"]
                                            and max(f["rate_range_hz"][1] for f in s["functions"] if f["not_known"]) > 1000)
    # The workload prints a JSON line of its own counts when it ends: on stderr now.
    assert any(line.startswith('{"workload": "launch_bound"') for line in r.stderr.splitlines()), r.stderr[-2000:]


def test_jsonl_streams_a_line_per_interval_then_the_report(tmp_path):
    out = tmp_path / "a.jsonl"
    argv = simcuda.workload("launch_bound") + ["--seconds", "3", "--scale", "0.25"]
    r = subprocess.run(CLI + ["attach", "--jsonl", "-o", str(out), "--"] + argv, capture_output=True, text=True,
                       timeout=180, env=simcuda.env())
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    docs = [orjson.loads(line) for line in lines]  # each line a document of its own
    kinds = [d["kind"] for d in docs]
    assert kinds[-1] == "gputrace.attach" and set(kinds[:-1]) == {"gputrace.attach.interval"}, kinds
    assert len(kinds) >= 3  # a 3-s command at 1-s intervals
    assert [d["index"] for d in docs[:-1]] == list(range(len(docs) - 1))
    assert all(len(d["processes"]) == 1 for d in docs[:-1])
    final = docs[-1]
    s = final["summary"]
    assert final["intervals"] == [] and final["exit_status"] == 0
    assert (s["calls_hz"] or 0) > 1000 or (s["calls_hz"] is None and s["calls_not_known"])  # a figure, or why not
    # On stdout: the workload's own line and nothing else (the report went to the file).
    assert r.stdout.startswith('{"workload": "launch_bound"') and len(r.stdout.splitlines()) == 1


def test_json_and_jsonl_together_are_refused():
    r = gputrace("demo", "--json", "--jsonl", "-d", "1", timeout=60)
    assert r.returncode == 2
    assert "--json and --jsonl" in r.stderr and "hint:" in r.stderr


def test_an_unwritable_jsonl_path_fails_before_tracing(tmp_path):
    argv = simcuda.workload("launch_bound") + ["--seconds", "30"]
    r = subprocess.run(CLI + ["attach", "--jsonl", "-o", str(tmp_path / "no" / "such" / "dir.jsonl"), "--"] + argv,
                       capture_output=True, text=True, timeout=60, env=simcuda.env())
    assert r.returncode != 0 and "cannot write" in r.stderr, r.stderr
    assert "loading the BPF program" not in r.stderr  # refused before anything started


def test_a_bare_budget_fraction_is_echoed_as_a_percentage():
    r = gputrace("demo", "--budget", "0.02", "-d", "1")
    assert r.returncode == 0, r.stderr
    assert "--budget 0.02 read as 2% of the job's time" in r.stderr
    r = gputrace("demo", "--budget", "2%", "-d", "1")
    assert r.returncode == 0 and "read as" not in r.stderr


LOOP = """
import ctypes, json, sys, threading, time
lib = ctypes.CDLL("libcuda.so.1")
lib.cuInit(0)
dev = ctypes.c_int()
print("ready", flush=True)
sys.stdin.readline()
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
n, t0 = 0, time.perf_counter()
while not done.is_set():
    for _ in range(5):
        lib.cuCtxGetDevice(ctypes.byref(dev))
    time.sleep(0.0002)
    n += 1
print(json.dumps({"steps": n, "steps_per_s": n / (time.perf_counter() - t0)}), flush=True)
"""


def test_the_gpu_demo_attaches_to_its_loop_once_warm_and_ends_it_after(tmp_path):
    """On a GPU the demo's PyTorch loop is attached to once it says it is warm (torch_step.py
    --wait-stdin --seconds 0), so that the report is of its loop, not of PyTorch's start-up, and the
    loop ends when its stdin closes after the attach. Here a stand-in loop of the same protocol on
    simcuda: the report is of that pid, attached (no command), and the loop's own line follows it."""
    loop = tmp_path / "loop.py"
    loop.write_text(LOOP)
    code = ("import argparse, sys; from gputrace.commands import attach as a; "
            "ns = argparse.Namespace(pid=None, pids=None, tree=None, job=False, duration=None, interval=1.0, "
            "budget='1%', exact=False, functions=[], preset='all', cost_ns=None, attach_mode='auto', output=None, "
            "quiet=False, json=True, jsonl=False, command_argv=[]); "
            f"sys.exit(a.trace_loop(ns, [sys.executable, {str(loop)!r}], 2.0))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=simcuda.env())
    assert r.returncode == 0, r.stderr[-2000:]
    doc = orjson.loads(r.stdout)
    warm = next(line for line in r.stderr.splitlines() if "is warm: attaching" in line)
    assert doc["pid"] == int(warm.split("(pid ")[1].split(")")[0]) and not doc["command"]
    assert doc["summary"]["functions"], doc["summary"]
    own = next(line for line in r.stderr.splitlines() if "the loop itself:" in line)
    assert orjson.loads(own.split("the loop itself: ", 1)[1])["steps"] > 0
    assert subprocess.run(["pgrep", "-f", str(loop)], capture_output=True).returncode == 1  # the loop ended
