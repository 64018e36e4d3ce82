"""`gputrace top` (the live dashboard, or one snapshot with --once) and `gputrace record`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..base.errors import GputraceError, UsageError
from ..registry import PID, add_json, command, number, parse_budget

TOP_EPILOG = """examples:
  sudo gputrace top                         every CUDA process on the host, live (q quits, ? for keys)
  sudo gputrace top --once --json           one snapshot of the same data, over 3-15 s (until every calls/s is known)
  sudo gputrace top --once --tree 1200      a job's processes only (its launcher's tree), and the job's line
  sudo gputrace record -o run.jsonl -d 60   save a session
  gputrace top --replay run.jsonl           show a saved session (no root needed)
  gputrace top --replay run.jsonl --once    the session summed up: each process as last recorded (--json too)

Each process is slowed at most --budget (a share of its time), as `gputrace attach` does. The predicted
overhead is what an interception layer of the chosen preset would add (lower: hidden in the time
the job waits for the GPU; upper: fully exposed); `p` in the dashboard switches the preset.
"""

RECORD_EPILOG = """examples:
  sudo gputrace record -o run.jsonl           until Ctrl-C
  sudo gputrace record -o run.jsonl -d 60     one minute
  gputrace top --replay run.jsonl

The file is JSON lines: a gputrace.record header, then one gputrace.top.frame per refresh (schema 2,
the same objects `top --once --json` prints).
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--interval", type=number(lo=0.05), default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--budget", default="1%", help="the most the tracer may slow each process, a share of its time (default 1%%)")
    p.add_argument("--attach-mode", choices=["auto", "multi", "perf"], default="auto", help=argparse.SUPPRESS)


# `top --once` without -d: at least ONCE_MIN_S of measuring, then on until every process listed has a
# calls/s that is known (tracer/model.py, unknown_reason), ONCE_MAX_S at most (past it, what is not
# known says so). A fixed 3 s read three jobs -21..+20% on an H100.
ONCE_MIN_S = 3.0
ONCE_MAX_S = 15.0


def configure_top(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--tree", type=PID, metavar="PID",
                   help="only PID and its descendants (a job's launcher and its ranks, and any it starts later)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit (with --json: as JSON)")
    p.add_argument("-d", "--duration", type=number(above=True), default=None,
                   help=f"with --once: seconds to measure before printing (default: at least {ONCE_MIN_S:g}, and on "
                        f"until every process's calls/s is known, its 95%% interval within half of it, at most "
                        f"{ONCE_MAX_S:g}: at the 1%% budget a launch-bound job needs a few seconds of windows)")
    p.add_argument("--replay", metavar="FILE", help="show a session saved by `gputrace record`")
    p.add_argument("--speed", type=number(), default=1.0, help="replay speed factor (default 1; 0: no pauses)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="where the c key writes checkpoints (default $GPUTRACE_CKPT_DIR, else ~/.local/share/gputrace/checkpoints)")
    p.add_argument("--preset", default="shim", help="interception layer for the predicted overhead (shim, proxy)")
    add_json(p)


def _options(args: argparse.Namespace):
    from ..tracer.session import Options

    if args.interval <= 0:
        raise UsageError("--interval must be positive", "e.g. -i 1")
    return Options(interval_s=args.interval, budget=parse_budget(args.budget), attach_mode=args.attach_mode)


def _live(args: argparse.Namespace, cumulative: bool = False):
    from ..base.procs import require_root
    from ..hostview.checkpoints import CheckpointerAdapter
    from ..hostview.live import LiveSource

    require_root("tracing")
    say = lambda msg: print(f"gputrace: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    root = getattr(args, "checkpoint_dir", None)
    adapter = CheckpointerAdapter(root=Path(root).absolute() if root else None)
    discover = None
    if getattr(args, "tree", None) is not None:
        from ..base.procs import require_process
        from ..tracer.targets import CudaScanner, TreeScanner

        require_process(args.tree)
        discover = TreeScanner(args.tree, CudaScanner())
    source = LiveSource(_options(args), args.interval, cumulative=cumulative, checkpointer=adapter, warn=say,
                        discover=discover)
    adapter.hold_tracing = source.hold_tracing  # `c` takes top's own probes off the job while CRIU copies it
    return source


def once(args: argparse.Namespace) -> int:
    """Waits -d seconds (and until every process found has been measured), then prints one frame;
    without -d, from ONCE_MIN_S on until every process's calls/s is known, ONCE_MAX_S at most."""
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive", "e.g. --once -d 3")
    auto = args.duration is None
    least = ONCE_MIN_S if auto else args.duration
    src = _live(args, cumulative=True)
    print("gputrace: loading the BPF program and calibrating the probe cost ...", file=sys.stderr, flush=True)
    src.start()
    t0, last, initial = time.monotonic(), None, None
    try:
        for frame in src.frames():
            last = frame
            if initial is None:
                initial = set(frame.pending) | {r.pid for r in frame.processes}
            rows = {r.pid: r for r in frame.processes}
            # Every process there at the start (still there) traced for -d seconds and measured:
            # not the ones that keep coming (a test suite's), and never without bound.
            there = [pid for pid in initial if pid in rows or pid in frame.pending]
            ready = all(pid in rows and rows[pid].snapshot.interval_s >= least - 0.05 for pid in there)
            if auto:  # and each one's calls/s known (measured, and not too uncertain to show)
                ready = ready and all(rows[pid].snapshot.not_measured is None
                                      and rows[pid].snapshot.calls_not_known is None for pid in there)
            if ready or time.monotonic() - t0 >= (ONCE_MAX_S if auto else args.duration + 30):
                break
    finally:
        src.close()
    return _print_frame(last, args)


def _print_frame(frame, args: argparse.Namespace) -> int:
    """One frame on stdout, as JSON with --json, else as text."""
    from .. import report

    report.get("json" if args.json else "text", kind="frame", preset=args.preset).final(frame, sys.stdout)
    return 0


def replay_once(args: argparse.Namespace) -> int:
    """A recording summed up offline: each process as last recorded (its row from the last frame it
    is in), in one frame printed as `--once` prints the live host."""
    import dataclasses

    from ..hostview.recording import read_record

    _, frames = read_record(args.replay)
    if not frames:
        raise UsageError(f"{args.replay} holds no frame", "record one with `gputrace record -o FILE -d 30`")
    last: dict = {}
    for f in frames:
        for r in f.processes:
            last[r.pid] = r
    shown = set(last)
    pending = tuple(sorted({p for f in frames for p in f.pending} - shown))
    end = frames[-1]
    note = f"replayed from {args.replay}: {len(frames)} frames over {end.t - frames[0].t:.0f} s; each process as last recorded"
    summary = dataclasses.replace(end, processes=tuple(last[p] for p in sorted(last)), pending=pending,
                                  notes=(note, *end.notes))
    return _print_frame(summary, args)


@command("top", "live dashboard of every CUDA process: cost of interception, checkpoint at a key", TOP_EPILOG)(configure_top)
def top(args: argparse.Namespace) -> int:
    from ..tracer.audit import PRESETS

    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}", f"choose one of {', '.join(PRESETS)}")
    if args.replay and args.tree is not None:
        raise UsageError("--tree picks live processes; a replay shows what was recorded",
                         "gputrace top --tree PID on the live host, or --replay FILE without it")
    if args.replay and args.once:
        return replay_once(args)
    if args.json and not args.once:
        raise UsageError("--json goes with --once", "gputrace top --once --json")
    if args.once:
        return once(args)
    if args.replay:
        from ..hostview.checkpoints import NoCheckpointer
        from ..hostview.recording import ReplaySource

        source, actions = ReplaySource(args.replay, args.speed), NoCheckpointer()
    else:
        source = _live(args)
        actions = source.checkpointer
    if not sys.stdout.isatty():
        raise UsageError("`gputrace top` needs a terminal", "use `gputrace top --once --json` in scripts and pipes")
    from ..tui.app import TopApp

    app = TopApp(source, actions, preset=args.preset)
    if source.live:  # the terminal is the app's now: warnings become notifications, not stray stderr lines
        source.warn = lambda msg: app.call_from_thread(app.notify, msg, severity="warning", timeout=15)
    app.run()
    return 0


def configure_record(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("-o", "--output", required=True, help="file to write (JSON lines)")
    p.add_argument("-d", "--duration", type=number(above=True), help="seconds to record (default: until Ctrl-C)")


@command("record", "record what `top` shows to a file, for `top --replay`", RECORD_EPILOG)(configure_record)
def record(args: argparse.Namespace) -> int:
    from ..hostview.recording import Recorder

    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive", "e.g. -d 60")
    src = _live(args)
    try:
        out = open(args.output, "wb")
    except OSError as exc:
        raise GputraceError(f"cannot write {args.output}: {exc.strerror}", "choose a writable path for -o") from None
    print("gputrace: loading the BPF program and calibrating the probe cost ...", file=sys.stderr, flush=True)
    src.start()  # -d counts from here: seconds of recording, not of setting up
    print(f"gputrace: recording to {args.output} (Ctrl-C ends it) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with out:
        rec = Recorder(out, {"interval_s": args.interval, "budget": src.options.budget})
        try:
            for frame in src.frames():
                if frame.processes or frame.pending:
                    rec.frame(frame)
                if args.duration is not None and time.monotonic() - t0 >= args.duration:
                    break
        except KeyboardInterrupt:
            pass
        finally:
            src.close()
    print(f"gputrace: {rec.frames} frames written to {args.output}", file=sys.stderr)
    return 0
