"""`gputrace checkpoint --full`, `gputrace restore --full` and `gputrace migrate`: the whole job, GPU
and CPU state, to a directory and back (checkpointer/full.py)."""

from __future__ import annotations

import argparse
import sys

from ..base.errors import UsageError
from ..base.units import fmt_bytes
from ..registry import add_json, add_pid, command, dump_json, mode, ms, number

FULL_EXAMPLES = """
whole job (--full): GPU state by the driver's checkpoint API (after the shim's fast copy, for jobs started
with `gputrace run --checkpointable --suspendable`), then CPU state by CRIU >= 4.0, one manifest:
  gputrace checkpoint --full -p 1234 -o /ckpt/job     the job ends once its state is safe on disk
  gputrace checkpoint --full -p 1234 -o /ckpt/job --leave-running
  gputrace restore --full /ckpt/job                   the job comes back (same pid) and continues
  gputrace restore --full /ckpt/job --gpu-map 0=1     on another GPU (indices or UUIDs)
The job must be started the way CRIU needs: `setsid CMD </dev/null >out.log 2>&1`.  If the CRIU dump
fails, the job is given back running and unlocked.
"""

MIGRATE_EPILOG = """examples:
  gputrace migrate -p 1234 --to /shared/ckpt/job      checkpoint the whole job there, then end it
  (on the other machine)  gputrace restore --full /shared/ckpt/job

The move between machines is your storage's: DIR must be reachable from both (same GPU model, same
files the job has open, same pid free).  With --restore-here the job is restored on this machine
right away (a round trip, to test that a job survives migration).
"""


def parse_gpu_map(items: list[str] | None) -> list[tuple[str, str]]:
    pairs = []
    for it in items or []:
        old, sep, new = it.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--gpu-map {it}: expected OLD=NEW", "GPU indices or UUIDs, e.g. --gpu-map 0=1")
        pairs.append((old.strip(), new.strip()))
    return pairs


def configure_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--leave-running", action="store_true", help="with --full: the job runs on after the dump")


@mode("checkpoint", "full", "the whole process: GPU state, then CPU state by CRIU", FULL_EXAMPLES,
      only_with={"leave_running": "a GPU-memory checkpoint always leaves the job running"})(configure_checkpoint)
def checkpoint(args: argparse.Namespace) -> int:
    from ..checkpointer.full import checkpoint_full
    from ..progress import Progress

    if args.backend != "shim":
        raise UsageError("--full chooses its own GPU path (the shim where it can, the driver always)",
                         "drop --backend")
    if len(getattr(args, "pids", None) or []) > 1 or getattr(args, "tree", None) is not None \
            or getattr(args, "timeout", None) is not None:
        raise UsageError("--full takes one process: a whole job's CPU state is not checkpointed together yet",
                         "checkpoint the job's GPU memory with checkpoint -p PID,PID... (or --tree PID), or one "
                         "process with --full -p PID")
    if args.pid is None:
        raise UsageError("checkpoint --full needs -p PID", "gputrace checkpoint --full -p PID -o DIR")
    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = checkpoint_full(args.pid, args.output, leave_running=args.leave_running, timeout_ms=args.timeout_ms,
                            progress=prog)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    print(f"whole-process checkpoint of pid {r.pid}: {r.path}")
    print(f"  {r.files} file(s), {fmt_bytes(r.image_bytes)} of CRIU images ({r.criu})")
    gpu = (f"shim copy {ms(r.shim_ns)}, " if r.shim else "") + f"driver lock {ms(r.lock_ns)}, " \
          f"checkpoint {ms(r.checkpoint_ns)}"
    print(f"  freeze   {ms(r.freeze_ns)} ({gpu}, criu dump {ms(r.dump_ns)})")
    print(f"  write    {ms(r.write_ns)} (checksums, manifest, sync)")
    if r.image_check != "clean":
        why = r.image_check.removeprefix("skipped: ")
        print(f"  warning: the images were not searched for a tracer's breakpoints ({why}); if a uprobe tracer "
              "ran during the dump, the restored job may trap", file=sys.stderr)
    print(f"  the job {'runs on' if r.leave_running else 'has ended'}; "
          f"bring it back with: gputrace restore --full {r.path}")
    return 0


def configure_restore(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-map", action="append", metavar="OLD=NEW",
                   help="with --full: put the job's GPU OLD on GPU NEW (indices or UUIDs; repeatable)")


@mode("restore", "full", "a whole-process checkpoint: CRIU restore, then GPU state", FULL_EXAMPLES,
      only_with={"gpu_map": "the GPU map places a whole-process restore: gputrace restore --full DIR --gpu-map OLD=NEW"})(
    configure_restore)
def restore(args: argparse.Namespace) -> int:
    from ..checkpointer.full import restore_full

    if args.pid is not None or getattr(args, "tree", None) is not None:
        raise UsageError("--full restores the process itself, at its old pid: -p does not apply",
                         "drop -p: gputrace restore --full DIR")
    from ..progress import Progress

    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = restore_full(args.dir, gpu_map=parse_gpu_map(args.gpu_map), progress=prog)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    print(f"restored pid {r.pid} from {r.path}; it is running")
    print(f"  verify {ms(r.verify_ns)}; back in {ms(r.total_ns)}: criu restore {ms(r.criu_ns)}, driver restore "
          f"{ms(r.driver_restore_ns)}, unlock {ms(r.unlock_ns)}" + (f", shim {ms(r.shim_ns)}" if r.shim_ns else ""))
    return 0


def configure_migrate(p: argparse.ArgumentParser) -> None:
    add_pid(p)
    p.add_argument("--to", required=True, metavar="DIR", help="new directory for the whole-process checkpoint")
    p.add_argument("--restore-here", action="store_true", help="restore it on this machine right after")
    p.add_argument("--timeout-ms", type=number(int, lo=0, hi=600000), default=5000, help="how long the driver's lock may wait (default 5000)")
    add_json(p)


@command("migrate", "checkpoint a whole job to a directory, to restore it on another machine", MIGRATE_EPILOG)(
    configure_migrate)
def migrate_cmd(args: argparse.Namespace) -> int:
    from ..checkpointer.full import checkpoint_full, restore_full

    c = checkpoint_full(args.pid, args.to, timeout_ms=args.timeout_ms)
    r = restore_full(c.path) if args.restore_here else None
    if args.json:
        dump_json({"schema": 1, "checkpoint": c.to_dict(), "restore": r.to_dict() if r else None})
        return 0
    print(f"pid {c.pid} checkpointed whole to {c.path} (frozen {ms(c.freeze_ns)}) and ended")
    if r:
        print(f"restored here: pid {r.pid} running again after {ms(r.total_ns)}")
    else:
        print(f"on the target machine: gputrace restore --full {c.path}")
    return 0
