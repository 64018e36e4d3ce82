"""Every command that takes --json prints exactly one JSON document on stdout, whatever else it does:
each is run here with --json on a real scenario (a shimmed simcuda job, real eBPF, a recording, a
checkpoint), and the list of commands comes from the CLI's own registry, so a command that gains
--json without a scenario here fails this test. Needs root and bcc (CI has both)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.cli import build_parser
from gputrace.hostview.recording import write_record
from shimtest import procs, shim_dir  # noqa: F401  (fixtures)
from topdata import frame

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_host"), pytest.mark.timeout(600)]

CLI = [sys.executable, "-m", "gputrace"]
# Commands whose --json is checked elsewhere, and where (a test that must exist).
ELSEWHERE = {"migrate": ("test_full_checkpoint.py", "test_migrate_json_is_one_document")}


def commands_with_json() -> set[str]:
    parser = build_parser()
    return {name for name, sub in parser.subparsers_by_name.items()
            if any("--json" in a.option_strings for a in sub._actions)}


def one_document(r: subprocess.CompletedProcess, what: str) -> object:
    assert r.returncode == 0, f"{what}: {r.stderr[-2000:]}"
    try:
        return orjson.loads(r.stdout)  # all of stdout: one document, nothing before or after
    except orjson.JSONDecodeError as exc:
        raise AssertionError(f"{what}: stdout is not one JSON document ({exc}):\n{r.stdout[:2000]}") from None


def test_every_json_command_has_a_scenario_here_or_elsewhere():
    here = set(re.findall(r'^\s+\("(\w+)",', Path(__file__).read_text(), re.M))
    assert commands_with_json() == here | set(ELSEWHERE), (commands_with_json(), here)
    for name, (module, test) in ELSEWHERE.items():
        assert f"def {test}(" in (Path(__file__).parent / module).read_text(), (name, module, test)


def test_each_command_prints_one_document(procs, shim_dir, tmp_path):  # noqa: F811
    env = shim.preload_env(simcuda.env())
    env["GPUTRACE_SHIM_VMM"] = "1"  # suspendable, for suspend and resume
    job = subprocess.Popen(simcuda.workload("pattern") + ["--plain", "--size", str(2 << 20)], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(job)
    assert json.loads(job.stdout.readline())["ready"]
    pid = str(job.pid)
    rec = tmp_path / "rec.jsonl"
    write_record(str(rec), [dataclasses.replace(frame(0), host="node-a")])
    ck = tmp_path / "ck"
    busy = simcuda.workload("launch_bound") + ["--seconds", "30", "--scale", "0.3"]
    tracee = subprocess.Popen(busy, env=simcuda.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(tracee)
    scenarios = [  # in this order: checkpoint before restore, suspend before resume
        ("doctor", ["doctor"], lambda d: d["schema"] == 1 and d["checks"]),
        ("demo", ["demo", "-d", "1"], lambda d: d["kind"] == "gputrace.attach"),
        ("attach", ["attach", "-p", str(tracee.pid), "-d", "1.5"], lambda d: d["kind"] == "gputrace.attach"),
        ("top", ["top", "--once", "--replay", str(rec)], lambda d: d["kind"] == "gputrace.top.frame"),
        ("report", ["report", str(rec)], lambda d: d["kind"] == "gputrace.fleet"),
        ("shim", ["shim", "status", "-p", pid], lambda d: d["pid"] == job.pid),
        ("shim", ["shim", "release", "-p", pid], lambda d: d["ok"] and d["pid"] == job.pid),
        ("ps", ["ps"], lambda d: job.pid in {p["pid"] for p in d["processes"]}),
        ("checkpoint", ["checkpoint", "-p", pid, "-o", str(ck)], lambda d: d["path"] == str(ck)),
        ("restore", ["restore", "-p", pid, str(ck), "--device-only"], lambda d: d["host_state_restored"] is False),
        ("suspend", ["suspend", "--prepare", "-p", pid], lambda d: d["made"] and d["image_bytes"] > 0),
        ("suspend", ["suspend", "-p", pid], lambda d: d["reserved_bytes"] > 0),
        ("resume", ["resume", "-p", pid], lambda d: d["allocations"] > 0),
    ]
    for name, argv, check in scenarios:
        r = subprocess.run(CLI + argv + ["--json"], capture_output=True, text=True, timeout=300, env=simcuda.env())
        doc = one_document(r, name)
        assert check(doc), (name, doc)
