"""`gputrace export`: every CUDA process of this node, traced at the budget, as Prometheus metrics."""

from __future__ import annotations

import argparse
import sys

from ..registry import command, number, parse_budget

EXPORT_EPILOG = """examples:
  gputrace export --listen :9400                    every CUDA process of this node, at /metrics
  gputrace export --listen 127.0.0.1:9400 --per-function 10
  curl -s localhost:9400/metrics | grep gputrace_process_predicted_slowdown_ratio

Metrics (prefix gputrace_, base units, counters end in _total; docs/exporter.md has the full list):
per process, labelled with pid, comm and its container and pod (from its cgroup path; the pod's
name, namespace and workload where the container shows them): driver calls by class, driver CPU
seconds, wait seconds, the tracer's own cost, the audit's predicted slowdown bounds per preset;
per node: the budget, the calibrated probe cost, how many processes are traced, pending or not
traceable. Series of a process go when it exits. Needs root (or CAP_BPF, CAP_PERFMON and
CAP_SYS_PTRACE): see deploy/README.md for a DaemonSet.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=":9400", metavar="ADDR:PORT", help="where to serve /metrics (default :9400)")
    p.add_argument("--interval", type=number(lo=0.2), default=1.0, help="seconds per measurement interval (default 1)")
    p.add_argument("--budget", default="1%", help="the most the tracer may slow each process (default 1%%)")
    p.add_argument("--per-function", type=number(int, lo=0, hi=100), default=0, metavar="N",
                   help="also each process's N busiest driver functions (default 0: classes only)")
    p.add_argument("-d", "--duration", type=number(above=True), help="seconds to serve (default: until stopped)")
    p.add_argument("--attach-mode", choices=["auto", "multi", "perf"], default="auto", help=argparse.SUPPRESS)


@command("export", "serve every CUDA process's driver-call cost as Prometheus metrics", EXPORT_EPILOG)(configure)
def export(args: argparse.Namespace) -> int:
    from ..base.procs import require_root
    from ..exporter.metrics import FleetMetrics
    from ..exporter.server import parse_listen, serve
    from ..hostview.live import LiveSource
    from ..tracer.session import Options

    addr, port = parse_listen(args.listen)
    require_root("tracing")
    say = lambda msg: print(f"gputrace: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    options = Options(interval_s=args.interval, budget=parse_budget(args.budget), attach_mode=args.attach_mode)
    source = LiveSource(options, args.interval, warn=say)

    def start() -> None:
        say("loading the BPF program and calibrating the probe cost ...")
        source.start()

    serve(source, FleetMetrics(per_function=args.per_function), addr, port, duration_s=args.duration,
          on_ready=lambda bound: say(f"serving http://{addr}:{bound}/metrics (Ctrl-C ends it)"), start=start)
    return 0
