"""`gputrace attach`: trace one job's driver calls and print the overhead audit; `gputrace demo`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import sys
from typing import Sequence

from .. import report as rep
from ..base.errors import GputraceError, UsageError
from ..base.procs import require_process, require_root
from ..base.units import fmt_ns, fmt_pct, fmt_rate, fmt_rate_or
from ..registry import PID, Pids, add_json, command, nonempty, number, parse_budget, parse_pids
from ..tracer.classify import base_name, waits
from ..tracer.symbols import read_functions

EXAMPLES = """examples:
  gputrace attach -p 1234                      until Ctrl-C, slowing the job at most 1% (the default budget)
  gputrace attach -p 1234 -d 30 --json -o audit.json
  gputrace attach -p 1234 -d 60 --jsonl > a.jsonl  a JSON line per interval as it ends, the report last
  gputrace attach --exact -- python train.py   every call from the command's first driver call on
  gputrace attach -p 1234 --functions 'cuLaunch*,cuMemcpy*'
  gputrace attach -p 1234 --preset proxy --cost-ns 5000
  gputrace attach --tree 1200 -d 30            a job: a launcher's ranks (and any it starts), each rank's audit
                                               and the job's (it moves at its slowest rank's pace)
  gputrace attach -p 1201,1202 -d 30 --json    the same for a list of processes
  gputrace attach --job -- torchrun --nproc-per-node 2 train.py

The audit: a layer adding C ns to each call of the classes it intercepts adds A = rate x C CPU
seconds per second; the predicted slowdown lies between max(0, A - wait) and 1.5 x A (a layer's code
also slows the caller's own code: up to 1.4x its own time, measured on an H200). See README.md.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.set_defaults(pid=None, pids=None)
    p.add_argument("-p", "--pid", dest="pids", type=parse_pids, action=Pids, metavar="PID[,PID...]",
                   help="process to trace (or give `-- command args` to start one); several are one job")
    p.add_argument("--tree", type=PID, metavar="PID",
                   help="a job: every process below PID (and PID) that maps a libcuda, found as they start")
    p.add_argument("--job", action="store_true",
                   help="with `-- command`: the command's whole process tree as one job (a launcher and its ranks)")
    p.add_argument("-d", "--duration", type=number(above=True), help="seconds to trace (default: until Ctrl-C or the process exits)")
    p.add_argument("-i", "--interval", type=number(lo=0.05), default=1.0, help="seconds per report interval (default 1)")
    p.add_argument("--budget", default="1%", help="the most the tracer may slow the job, a share of its time (default 1%%; 100%% traces every call)")
    p.add_argument("--exact", action="store_true", help="trace every call continuously (same as --budget 100%%)")
    p.add_argument("--functions", action="append", default=[], metavar="PATTERN", type=nonempty,
                   help="only these driver functions (shell globs, comma-separated or repeated)")
    p.add_argument("--preset", choices=["all", "shim", "proxy"], default="all",
                   help="interception layer to audit: shim (submission+state), proxy (every call), all (default)")
    p.add_argument("--cost-ns", type=number(hi=1e9), help="ns a layer adds per intercepted call (overrides the preset's)")
    p.add_argument("--attach-mode", choices=["auto", "multi", "perf"], default="auto",
                   help="uprobe-multi links, per-probe perf links, or the first that works (default)")
    p.add_argument("-o", "--output", help="write the final report here instead of stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-interval lines on stderr")
    add_json(p)
    add_jsonl(p)


def filter_warnings(every: Sequence, kept: Sequence) -> list[str]:
    """What a --functions filter changes in the audit's inputs, said before tracing starts."""
    names = {f.name for f in kept}
    left_waits = sorted({base_name(f.name) for f in every if waits(f.name) and f.name not in names})
    out = [f"--functions traces {len(names)} of libcuda's {len(every)} functions: the rates, the driver CPU "
           "time and the audit's bounds are those of the calls it keeps"]
    if not any(waits(n) for n in names):
        out.append("--functions leaves out every call that waits for the GPU (synchronization, synchronous "
                   "copies): the wait time is not measured, nor the audit's lower bound")
    elif left_waits:
        shown = ", ".join(left_waits[:4]) + (f" and {len(left_waits) - 4} more" if len(left_waits) > 4 else "")
        out.append(f"--functions leaves out calls that wait for the GPU ({shown}): the wait time, and so the "
                   "audit's lower bound, counts only those it keeps")
    return out


def add_jsonl(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jsonl", action="store_true",
                   help="one compact JSON object per line: each interval as it ends, then the report (without its intervals)")


def _presets(args: argparse.Namespace):
    from ..tracer.audit import PRESETS, make_preset

    names = list(PRESETS) if args.preset == "all" else [args.preset]
    return [make_preset(n, args.cost_ns) for n in names]


class _Child:
    """The command to trace, forked and held before exec until the probes are in place.

    Forked by hand: subprocess.Popen waits for the exec, which is exactly what must not happen yet.
    """

    def __init__(self, argv: list[str], stdout_to_stderr: bool = False) -> None:
        """`stdout_to_stderr`: the command's standard output goes to gputrace's standard error
        (stdout holds the one JSON document)."""
        path = shutil.which(argv[0]) if "/" not in argv[0] else argv[0]
        if not path or not os.path.isfile(path):
            raise UsageError(f"command not found: {argv[0]}", "give the command as you would run it, after `--`")
        if not os.access(path, os.X_OK):
            raise UsageError(f"cannot execute {argv[0]}", "check that it is an executable file")
        hold_r, hold_w = os.pipe()
        err_r, err_w = os.pipe()  # close-on-exec: EOF tells the parent the exec happened
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(hold_w)
                os.close(err_r)
                if os.read(hold_r, 1) != b"g":  # gputrace died before releasing us: do not run untraced
                    os._exit(127)
                if stdout_to_stderr:
                    os.dup2(2, 1)
                os.execv(path, argv)
            except BaseException as exc:
                try:
                    os.write(err_w, str(exc).encode()[:500])
                finally:
                    os._exit(127)
        os.close(hold_r)
        os.close(err_w)
        self.pid = pid
        self.path = path
        self._hold: int | None = hold_w
        self._err = err_r
        self.status: int | None = None

    def release(self) -> None:
        os.write(self._hold, b"g")
        os.close(self._hold)
        self._hold = None
        msg = os.read(self._err, 600)
        os.close(self._err)
        if msg:
            self.wait()
            raise UsageError(f"cannot run {self.path}: {msg.decode(errors='replace')}", "check the command after `--`")

    def abandon(self) -> None:
        if self._hold is not None:
            os.close(self._hold)  # the held child reads EOF and exits without running the command
            self._hold = None
            os.close(self._err)
            self.wait()

    def poll(self) -> int | None:
        if self.status is None:
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(st)
        return self.status

    def wait(self) -> int:
        if self.status is None:
            _, st = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(st)
        return self.status


def _is_job(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "job", False) or getattr(args, "tree", None) is not None
                or len(getattr(args, "pids", None) or []) > 1)


def trace(args: argparse.Namespace) -> int:
    from ..tracer.audit import audit
    from ..tracer.session import Options, Session
    from ..tracer.targets import libcuda_of, resolve_for_command
    from ..tracer.threads import busiest, sched_sample, thread_slack

    budget = 1.0 if args.exact else parse_budget(args.budget, echo=not args.quiet)
    if args.interval <= 0 or (args.duration is not None and args.duration <= 0):
        raise UsageError("--interval and --duration must be positive", "e.g. --interval 1 -d 30")
    argv = args.command_argv
    patterns = tuple(p.strip() for arg in args.functions for p in arg.split(",") if p.strip())
    if args.json and args.jsonl:
        raise UsageError("--json and --jsonl are two forms of the same output: give one",
                         "--json for one document at the end, --jsonl for a line per interval")
    if _is_job(args):
        return trace_job(args, budget, patterns)
    if argv and args.pid:
        raise UsageError("give either -p PID or `-- command`, not both", "gputrace attach -p 1234  or  gputrace attach -- ./job")
    if not argv and not args.pid:
        raise UsageError("nothing to trace", "give -p PID, or a command after `--`: gputrace attach -- python train.py")
    stream = bool(args.jsonl)
    renderer = rep.get("jsonl" if stream else "json" if args.json else "text")
    live = rep.get("text")
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"gputrace: {msg}", file=sys.stderr, flush=True))

    out = sys.stdout
    if stream and args.output:
        # Opened before tracing starts: a path that cannot be written fails now, not after the attach.
        try:
            out = open(args.output, "w")
        except OSError as exc:
            raise GputraceError(f"cannot write {args.output}: {exc.strerror}", "choose a writable path for -o") from None
    child = None
    if argv:
        require_root("tracing")
        library = resolve_for_command(argv, os.environ)
        # With JSON on stdout, stdout is the report's alone: the command's output goes to stderr.
        child = _Child(argv, stdout_to_stderr=bool((args.json or stream) and not args.output))
        pid = child.pid
    else:
        pid = args.pid
        require_process(pid)
        library = libcuda_of(pid).path
        require_root("tracing")

    intervals = []
    try:
        say("loading the BPF program and calibrating the probe cost ...")
        session = Session(pid, library, Options(args.interval, budget, patterns, args.attach_mode), warn=say)
        cal = session.calibration
        say(f"probing {len(session.functions)} functions of {library} in pid {pid} ({session.program.mode} links, "
            f"{'precompiled BPF program' if session.program.loader == 'object' else 'BPF program compiled by bcc'}; "
            f"a hit costs {fmt_ns(cal.emulated.entry_ns)}-{fmt_ns(cal.stepped.entry_ns)}, "
            f"a timed call {fmt_ns(cal.emulated.entry_return_ns)}-{fmt_ns(cal.stepped.entry_return_ns)})")
        if patterns:
            for line in filter_warnings(read_functions(library), session.functions):
                say(line)
        if child:
            session.prime()
            child.release()

        sched = [sched_sample(pid), None]  # the threads' scheduler times at the start, and the latest

        def on_interval(iv):
            sched[1] = sched_sample(pid) or sched[1]
            intervals.append(iv)
            if stream:
                renderer.interval(iv, out)
            if not args.quiet:
                live.interval(iv, sys.stderr)

        try:
            summary = session.run(args.duration, on_interval)
        except KeyboardInterrupt:
            session.close()
            summary = session.summary()
        finally:
            sched[1] = sched_sample(pid) or sched[1]
            session.close()
        threads = thread_slack(sched[0], sched[1], session.program.read_thread_stats(pid),
                               {i: f.name for i, f in session.probes.ids.items()})
        top = busiest(sched[0], sched[1])
        pacer = None if top is None else {"tid": top[0], "comm": top[1], "busy_s_per_s": top[2]}
    except BaseException:
        if child:
            child.abandon()
        raise

    exit_status = _command_end(child, args, say)
    report = rep.Report(
        pid=pid,
        comm=session.comm,
        library=library,
        command=tuple(argv),
        exit_status=exit_status,
        options={"interval_s": args.interval, "budget": budget, "exact": budget >= 1.0,
                 "functions": list(patterns), "attach_mode": session.program.mode},
        calibration=session.calibration,
        attach={
            "started_monotonic_s": session.started,  # CLOCK_MONOTONIC: lines the intervals up with a job's own clock
            "mode": session.program.mode,
            "program": session.program.loader,  # "object" (precompiled) or "bcc" (compiled here)
            "functions": len(session.functions),
            "windows": len(session.attach_s),
            "attach_s_median": statistics.median(session.attach_s) if session.attach_s else None,
            "detach_s_median": statistics.median(session.detach_s) if session.detach_s else None,
            "stepped_functions": sum(k == "stepped" for k in session.kinds.values()),
            # Every window planned as whole steps and what came of it (tracer/probes.py StepTry),
            # its time from the attach's start.
            "step_windows": [dataclasses.asdict(t) | {"t": t.t - session.started} for t in session.step_log],
        },
        summary=summary,
        audits=tuple(audit(summary, p, threads, pacer) for p in _presets(args)),
        intervals=tuple(intervals),
        errors=session.program.read_errors(),
    )
    session.program.close()
    if stream:
        renderer.final(report, out)
        if out is not sys.stdout:
            out.close()
            say(f"report written to {args.output}")
    elif args.output:
        try:
            with open(args.output, "w") as f:
                renderer.final(report, f)
        except OSError as exc:
            raise GputraceError(f"cannot write {args.output}: {exc.strerror}", "choose a writable path for -o") from None
        say(f"report written to {args.output}")
    else:
        renderer.final(report, sys.stdout)
    return 0


def _job_progress(frame, t: float, found: int) -> str:
    parts = [f"pid {r.pid} {fmt_rate_or(r.snapshot.calls_hz, r.snapshot.calls_not_known)} calls/s" for r in frame.processes]
    parts += [f"pid {p} not measured yet" for p in frame.pending]
    over = frame.tracer_overhead
    idle = f"the {found} process(es) traced have exited" if found else "no process of the job maps a libcuda yet"
    return (f"[{t:7.1f}s] " + (", ".join(parts) if parts else idle)
            + (f"; tracer at most {fmt_pct(over)} of a process's time" if over is not None else ""))


def _command_end(child, args: argparse.Namespace, say) -> int | None:
    """The exit status of the command attach started, once tracing is over: it is waited for where it
    ends by itself (a Ctrl-C meanwhile goes on to it), and left running where -d ended the trace."""
    if not child:
        return None
    if child.poll() is None and args.duration is not None:
        say(f"the command goes on running as pid {child.pid}; it is no longer traced")
        return None
    try:
        return child.wait()
    except KeyboardInterrupt:
        os.kill(child.pid, signal.SIGINT)
        return child.wait()


def trace_job(args: argparse.Namespace, budget: float, patterns: tuple[str, ...]) -> int:
    """`attach --tree PID`, `attach -p A,B`, `attach --job -- CMD`: every process of the job, host-wide
    links (as top's), each at the budget; each rank's audit and the job's (hostview/jobaudit.py)."""
    import time

    from ..base.procs import alive
    from ..hostview.jobaudit import build
    from ..hostview.live import LiveSource
    from ..tracer.session import Options
    from ..tracer.targets import CudaScanner, TreeScanner

    argv = args.command_argv
    pids = list(args.pids or [])
    tree = args.tree
    if args.jsonl:
        raise UsageError("--jsonl follows one process; a job's report comes as one document",
                         "use --json (or attach to each rank with -p PID --jsonl)")
    if argv and (pids or tree is not None):
        raise UsageError("give either processes (-p, --tree) or `-- command`, not both",
                         "gputrace attach --tree 1200  or  gputrace attach --job -- torchrun ... train.py")
    if args.job and not argv:
        raise UsageError("--job traces a command it starts: give one after `--`",
                         "gputrace attach --job -- torchrun --nproc-per-node 2 train.py; a running job: --tree LAUNCHER_PID")
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"gputrace: {msg}", file=sys.stderr, flush=True))
    require_root("tracing")
    for p in pids + ([tree] if tree is not None else []):
        require_process(p)
    if pids and tree is None:
        from ..tracer.targets import libcuda_of

        mapped = []
        for p in pids:
            try:
                libcuda_of(p)
                mapped.append(p)
            except GputraceError:
                say(f"pid {p} maps no libcuda (yet): it is traced once it does")
        if not mapped:
            raise UsageError(f"none of pids {', '.join(map(str, pids))} maps a libcuda",
                             "give the ranks' pids (the processes that use the GPU), or their launcher with --tree PID")
    out = None
    if args.output:
        try:  # opened before tracing starts: a path that cannot be written fails now, not after the attach
            out = open(args.output, "w")
        except OSError as exc:
            raise GputraceError(f"cannot write {args.output}: {exc.strerror}", "choose a writable path for -o") from None
    options = Options(args.interval, budget, patterns, args.attach_mode)
    child = _Child(argv, stdout_to_stderr=bool(args.json and not args.output)) if argv else None
    root = child.pid if child else tree
    selection = (f"the tree of pid {root}" if root is not None else "") + \
        (" and " if root is not None and pids else "") + (f"pids {', '.join(map(str, pids))}" if pids else "")
    src = LiveSource(options, args.interval, cumulative=True, discover=TreeScanner(root, CudaScanner(), pids), warn=say)
    frames = None
    try:
        say("loading the BPF program and calibrating the probe cost ...")
        src.start()
        if child:
            child.release()
        say(f"tracing {selection} ({'every call' if options.exact else f'budget {fmt_pct(budget, 1)} of each process'}; "
            f"{'for %g s' % args.duration if args.duration else 'until Ctrl-C'})")
        t0 = time.monotonic()
        frames = src.frames()
        try:
            for frame in frames:
                t = time.monotonic() - t0
                traced = src.traced()
                if t > 0.5 * args.interval:
                    say(_job_progress(frame, t, len(traced)))
                live = [pid for pid, _, _, _, exited in traced if not exited and alive(pid)]
                if args.duration is not None and t >= args.duration:
                    # Past -d, a few seconds more for a process found late to have its first window.
                    if not frame.pending or t >= args.duration + 5 * args.interval + 2:
                        break
                if child is not None:
                    if child.poll() is not None and not live:
                        break
                elif not live and traced and (root is None or not alive(root)) and not any(alive(p) for p in pids):
                    break
                elif not traced and root is not None and not alive(root):
                    break
        except KeyboardInterrupt:
            pass
        finally:
            frames.close()
        traced_s = time.monotonic() - t0
    except BaseException:
        if frames is None:
            src.close()
        if child:
            child.abandon()
        if out is not None:
            out.close()
        raise
    exit_status = _command_end(child, args, say)
    rows = [(pid, lib.path, tag, snap, exited) for pid, lib, tag, snap, exited in src.traced()]
    if not rows:
        if out is not None:
            out.close()
        raise GputraceError(f"no process of {selection} mapped a libcuda while it was traced",
                            "a process maps libcuda when it first uses CUDA; give the ranks' launcher with --tree, "
                            "and a -d long enough for them to start")
    report = build(rows, _presets(args), selection=selection, command=tuple(argv or ()), exit_status=exit_status,
                   options={"interval_s": args.interval, "budget": budget, "exact": budget >= 1.0,
                            "functions": list(patterns), "attach_mode": args.attach_mode},
                   calibration=src.calibration, traced_s=traced_s,
                   notes=[f"pid {p}: {m}" for p, m in sorted(src.errors().items())],
                   threads={pid: src.threads_of(pid) for pid, *_ in rows})
    renderer = rep.get("json" if args.json else "text", kind="job")
    if out is not None:
        with out:
            renderer.final(report, out)
        say(f"report written to {args.output}")
    else:
        renderer.final(report, sys.stdout)
    return 0


command("attach", "trace a CUDA job's driver calls and audit what interception would cost it", EXAMPLES)(configure)(trace)


DEMO_EPILOG = """examples:
  gputrace demo                     the launch-bound demo workload, 10 s, on simcuda unless a GPU is present
  gputrace demo --workload gpu_bound --exact
  gputrace demo --driver simcuda    on the simulated driver even where a GPU is present

On simcuda the workload is traced from its start. On a GPU it is a PyTorch loop, attached to once it
is warm (as `attach -p PID -d DURATION`), so that the audit is of its loop and not of PyTorch's start-up;
its own steps a second are printed after the report.
"""


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["launch_bound", "gpu_bound", "alloc_free", "launch_bound_py"],
                   default="launch_bound", help="which bundled workload (default launch_bound)")
    p.add_argument("--driver", choices=["auto", "simcuda", "system"], default="auto",
                   help="simcuda (the simulated driver), the system's libcuda, or auto: system when one exists")
    p.add_argument("-d", "--duration", type=number(above=True), default=10.0, help="seconds traced (default 10): the workload's whole run on simcuda, its warm loop on a GPU")
    p.add_argument("--exact", action="store_true", help="trace every call")
    p.add_argument("--budget", default="1%", help="tracer cost cap (default 1%%)")
    add_json(p)
    add_jsonl(p)


def demo(args: argparse.Namespace) -> int:
    from .. import simcuda
    from ..tracer.targets import resolve_for_command

    require_root("tracing")
    driver = args.driver
    if driver == "auto":
        try:
            resolve_for_command(["true"], {})
            driver = "system"
        except GputraceError:
            driver = "simcuda"
    if driver == "simcuda":
        os.environ.update(simcuda.env())
        argv = simcuda.workload(args.workload) + ["--seconds", str(args.duration)]
        if args.workload.startswith("launch_bound"):
            # simcuda's calls cost tens of ns, a probe hit here microseconds: a quarter of the call mix
            # and 30 us launches keep the probes' share of the job's time near a real GPU host's.
            argv += ["--scale", "0.25", "--launch-ns", "30000"]
    else:
        # The simcuda workloads load a fake module image; on a real driver the demo is a PyTorch loop.
        argv = torch_workload(args.workload)
    print(f"gputrace: demo workload {args.workload} on the {'simulated' if driver == 'simcuda' else 'system'} driver",
          file=sys.stderr)
    ns = argparse.Namespace(
        pid=None, pids=None, tree=None, job=False, duration=None, interval=1.0, budget=args.budget, exact=args.exact, functions=[], preset="all",
        cost_ns=None, attach_mode="auto", output=None, quiet=False, json=args.json, jsonl=args.jsonl,
        command_argv=argv,
    )
    if driver == "simcuda":
        return trace(ns)
    return trace_loop(ns, argv, args.duration)


def trace_loop(ns: argparse.Namespace, argv: list[str], duration: float) -> int:
    """The PyTorch demo loop audited as a user audits a job: attached (`attach -p PID -d DURATION`)
    once it is warm, so that the report is of its loop, not of its start-up (PyTorch's import and
    CUDA's initialisation take longer than the loop's first seconds: traced from its start, the
    report averaged them in). The loop runs until the attach has ended; its own steps a second are
    printed after the report."""
    import subprocess

    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if child.stdout else ""
        if line.strip() != "ready":
            child.kill()
            child.wait()
            raise GputraceError(f"the demo's PyTorch loop did not start (exit status {child.returncode})",
                                "its own error is above; `gputrace demo --driver simcuda` runs the demo without a GPU")
        print(f"gputrace: the loop (pid {child.pid}) is warm: attaching for {duration:g} s", file=sys.stderr)
        child.stdin.write("\n")
        child.stdin.flush()
        ns.command_argv, ns.pid, ns.duration = [], child.pid, duration
        rc = trace(ns)
    finally:
        if child.poll() is None:
            try:
                out, _ = child.communicate(timeout=60)  # (its stdin closed: the loop's end)
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
            if out and out.strip():
                print(f"gputrace: the loop itself: {out.strip()}", file=sys.stderr)
    return rc


def torch_workload(kind: str) -> list[str]:
    from importlib import resources
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise GputraceError(
            "the demo on a real GPU runs a PyTorch loop, and PyTorch is not importable here",
            "install torch, or run the demo on the simulated driver: gputrace demo --driver simcuda",
        )
    script = str(resources.files("gputrace.simcuda") / "workloads" / "torch_step.py")
    mode = "gpu" if kind == "gpu_bound" else "launch"
    return [sys.executable, script, "--mode", mode, "--seconds", "0", "--wait-stdin"]


command("demo", "audit a bundled demo workload (simulated driver where no GPU is present)", DEMO_EPILOG)(configure_demo)(demo)
