"""`gputrace doctor`: one line per check of what tracing needs; exit status 1 if any check FAILs."""

from __future__ import annotations

import argparse
import sys

from ..registry import add_json, command

EPILOG = """\
examples:
  sudo gputrace doctor                 check this host: privileges, BPF, bcc, uprobes, the BPF program, libcuda, driver
  sudo gputrace doctor --json | jq '.checks[] | select(.status != "OK")'

output:
  one line per check: STATUS NAME DETAIL, and a `hint:` line under each WARN or FAIL.
  --json prints {"schema": 1, "status": WORST, "checks": [{"name", "status", "detail", "hint"}, ...]}.
  exit status: 1 if any check FAILs, else 0 (WARNs do not fail).

environment:
  GPUTRACE_KERNEL_HEADERS=DIR  check DIR instead of /lib/modules/$(uname -r)/build
  GPUTRACE_TRACEFS=DIR         check DIR instead of /sys/kernel/tracing and /sys/kernel/debug/tracing
  GPUTRACE_BCC_PATH=DIRS       look for bcc only in DIRS (empty: only this interpreter's own path)
  GPUTRACE_BPF=auto|object|bcc how the BPF program loads: the precompiled object, falling back to bcc's
                               run-time compile (auto, the default), or only one of the two
  GPUTRACE_BPF_OBJECT=FILE     load FILE as the precompiled BPF object

bpf-program says which way the tracer's BPF program loads, and why bcc where it is bcc. Where the
precompiled object loads, the bcc, kernel-headers and bcc-compile checks WARN rather than FAIL:
only the fallback needs them.
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_json(p)


@command("doctor", "check that this host can trace CUDA jobs with eBPF", EPILOG)(configure)
def run(args: argparse.Namespace) -> int:
    from ..doctor import FAIL, SCHEMA, run_checks, worst

    checks = run_checks()
    if args.json:
        import orjson

        doc = {"schema": SCHEMA, "status": worst(checks),
               "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "hint": c.hint} for c in checks]}
        sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        sys.stdout.flush()
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<4} {c.name:<{width}}  {c.detail}")
            if c.status != "OK" and c.hint:
                print(f"{'':<{width + 7}}hint: {c.hint}")
    return 1 if any(c.status == FAIL for c in checks) else 0
