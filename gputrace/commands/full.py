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
  gputrace restore -p 1234 /ckpt/job                  the same over the running job (left running): it is
                                                      ended, once all is checked, and the checkpoint's runs
  gputrace restore --full /ckpt/job --gpu-map 0=1     on another GPU (indices or UUIDs)
The job must be started the way CRIU needs: `setsid CMD </dev/null >out.log 2>&1`.  If the CRIU dump
fails, the job is given back running and unlocked.

a freeze of only what changed on the host (CRIU's pre-dump; the kernel must track written pages:
`criu check --feature mem_dirty_track`):
  gputrace checkpoint --full --pre-dump -p 1234 -o /ckpt/job   while the job runs: its host memory copied
  gputrace checkpoint --full --pre-dump -p 1234 -o /ckpt/job   again: only the pages written since
  gputrace checkpoint --full -p 1234 -o /ckpt/job --leave-running   the freeze dumps the pages written since
The pre-dumps wait beside the checkpoint (.job.pre-dump) and go into it; `restore --full` needs every one.
A pre-dump takes no driver lock and no GPU checkpoint; CRIU freezes the job only to read its page maps.

a job of several processes (a launcher and its ranks, all under `gputrace run --checkpointable`):
  gputrace checkpoint --full --tree 1200 -o /ckpt/j1  the launcher 1200 and everything below it
  gputrace checkpoint --full -p 1200,1201,1202 -o /ckpt/j1 --leave-running   the same tree, named in full
  gputrace checkpoint --full --tree 1200 --timeout 300 --json
  gputrace restore --full /ckpt/j1 --gpu-map 0=1,1=0  every process back at its pid, each rank's GPUs swapped
Every rank is stopped together (gates closed, ranks behind run on to the same collective, all
drained), so none is frozen while a peer waits for it; each rank's shim copies its device memory
where the job allows it (--suspendable), the driver locks and checkpoints every rank, then ONE
`criu dump` takes the tree from its root.  -p must name the root (the process the others descend
from) and every rank of its tree.  One --timeout (default 120 s) bounds all of it; past it, or if a
rank fails or dies, or CRIU fails, every rank is given back running and nothing is kept.
"""

MIGRATE_EPILOG = """examples:
  gputrace migrate -p 1234 --to /shared/ckpt/job      checkpoint the whole job there, then end it
  (on the other machine)  gputrace restore --full /shared/ckpt/job

The move between machines is your storage's: DIR must be reachable from both (same GPU model, same
files the job has open, same pid free).  With --restore-here the job is restored on this machine
right away (a round trip, to test that a job survives migration).
"""


def parse_gpu_map(items: list[str] | None) -> list[tuple[str, str]]:
    """--gpu-map OLD=NEW, repeated or comma-separated (0=1,1=0)."""
    pairs = []
    for it in (part for item in items or [] for part in item.split(",")):
        old, sep, new = it.partition("=")
        if not sep or not old or not new:
            raise UsageError(f"--gpu-map {it}: expected OLD=NEW", "GPU indices or UUIDs, e.g. --gpu-map 0=1")
        pairs.append((old.strip(), new.strip()))
    return pairs


def configure_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--leave-running", action="store_true", help="with --full: the job runs on after the dump")
    p.add_argument("--pre-dump", action="store_true",
                   help="with --full: copy the job's host memory now, while it runs (CRIU's pre-dump; no GPU lock), "
                        "so that the checkpoint -o DIR taken next dumps in its freeze only the pages written since")


@mode("checkpoint", "full", "the whole process: GPU state, then CPU state by CRIU", FULL_EXAMPLES,
      only_with={"leave_running": "a GPU-memory checkpoint always leaves the job running",
                 "pre_dump": "a pre-dump is of a whole process: gputrace checkpoint --full --pre-dump -p PID -o DIR"})(
    configure_checkpoint)
def checkpoint(args: argparse.Namespace) -> int:
    from ..checkpointer.full import checkpoint_full
    from ..progress import Progress

    if args.backend != "shim":
        raise UsageError("--full chooses its own GPU path (the shim where it can, the driver always)",
                         "drop --backend")
    if args.pre_dump:
        return _pre_dump(args)
    if len(args.pids or []) > 1 or args.tree is not None or args.timeout is not None:
        return _checkpoint_job(args)
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
    if r.pre_dumps:
        print(f"  pages    the dump wrote {_count(r.pages_written)} of {_count(r.pages_scanned)} ({fmt_bytes(r.page_bytes)}); "
              f"{_count(r.pages_in_pre_dumps)} were as in its {r.pre_dumps} pre-dump(s) ({fmt_bytes(r.pre_dump_bytes)}, "
              "written while the job ran)")
    elif r.pages_scanned:
        print(f"  pages    the dump wrote {_count(r.pages_written)} of {r.pages_scanned:,} ({fmt_bytes(r.page_bytes)})")
    if r.pre_dump_unused:
        print(f"  note: the pre-dumps waiting for this checkpoint were not used ({r.pre_dump_unused}): the dump "
              "was whole", file=sys.stderr)
    if r.held_ns is not None:
        print(f"  held     {ms(r.held_ns)} in all: the freeze, then its GPU state given back; it ran on from there")
    print(f"  write    {ms(r.write_ns)} (checksums, manifest, sync)")
    if r.image_check != "clean":
        why = r.image_check.removeprefix("skipped: ")
        print(f"  warning: the images were not searched for a tracer's breakpoints ({why}); if a uprobe tracer "
              "ran during the dump, the restored job may trap", file=sys.stderr)
    print(f"  the job {'runs on' if r.leave_running else 'has ended'}; "
          f"bring it back with: gputrace restore --full {r.path}")
    return 0


def _count(n: int | None) -> str:
    """A count CRIU's stats gave, or that it is not known (never 0 for want of them)."""
    return "(not known)" if n is None else f"{n:,}"


def _pre_dump(args: argparse.Namespace) -> int:
    """checkpoint --full --pre-dump: the job's host memory copied while it runs (checkpointer/predump.py)."""
    from ..checkpointer.full import pre_dump

    if args.leave_running:
        raise UsageError("a pre-dump always leaves the job running", "drop --leave-running")
    if len(args.pids or []) > 1 or args.tree is not None or args.timeout is not None:
        raise UsageError("--pre-dump takes one process: a job of several (--tree, -p A,B) is dumped whole",
                         "gputrace checkpoint --full --pre-dump -p PID -o DIR")
    if args.since or args.incremental or args.digest_chunk is not None:
        raise UsageError("--since, --incremental and --digest-chunk do not go with --full", "drop them")
    if args.pid is None:
        raise UsageError("--pre-dump needs -p PID", "gputrace checkpoint --full --pre-dump -p PID -o DIR")
    r = pre_dump(args.pid, args.output)
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    print(f"pre-dump {r.index} of pid {r.pid} (for {r.target or 'its next checkpoint --full without -o'}): {r.path}")
    if r.restarted:
        print(f"  note: {r.restarted}", file=sys.stderr)
    frozen = "for a time CRIU did not say" if r.frozen_ns is None else f"{ms(r.frozen_ns)} of it (CRIU's count)"
    print(f"  wrote    {_count(r.pages_written)} of {_count(r.pages_scanned)} pages ({fmt_bytes(r.bytes)}) in {ms(r.ns)}, "
          f"the job frozen {frozen}; no GPU lock")
    print(f"  waiting  {r.pre_dumps} pre-dump(s), {fmt_bytes(r.pre_dump_bytes)}; the job runs on")
    out = f" -o {r.target}" if r.target else ""
    print(f"  next: gputrace checkpoint --full -p {r.pid}{out} dumps only the pages written since")
    return 0


def _checkpoint_job(args: argparse.Namespace) -> int:
    """checkpoint --full of a job: --tree ROOT, or -p ROOT,RANK,... (checkpointer/fulljob.py)."""
    from ..checkpointer import fulljob
    from ..progress import Progress

    if args.since or args.incremental or args.digest_chunk is not None:
        raise UsageError("--since, --incremental and --digest-chunk do not go with --full", "drop them")
    root, ranks = fulljob.job_tree(args.pids, args.tree)
    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = fulljob.checkpoint_job(root, ranks, args.output, leave_running=args.leave_running,
                                   timeout_s=args.timeout if args.timeout is not None else fulljob.DEFAULT_TIMEOUT_S,
                                   progress=prog, lanes=args.lanes, chunk=args.chunk, direct=args.direct)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, "job": True, **r.to_dict()})
        return 0
    at = f" at collective {r.collectives}" if r.collectives else ""
    print(f"whole-job checkpoint of the tree of pid {r.root}: {len(r.processes)} process(es), {len(r.ranks)} "
          f"rank(s) stopped together{at}: {r.path}")
    for row in r.ranks:
        shim = row["shim"] or {}
        how = (f"shim copy {ms(shim.get('freeze_ns', 0))} ({fmt_bytes(shim.get('bytes', 0))}), " if "allocations" in shim
               else "")
        print(f"  rank {row['rank']}  pid {row['pid']}  {row['comm']}: {how}driver lock {ms(row['lock_ns'])}, "
              f"checkpoint {ms(row['checkpoint_ns'])}")
    skipped = next((row["shim"]["skipped"] for row in r.ranks if (row["shim"] or {}).get("skipped")), None)
    if skipped:
        print(f"  the shim's fast path was not taken ({skipped}): the driver moved every rank's device memory")
    print(f"  {r.files} file(s), {fmt_bytes(r.image_bytes)} ({fmt_bytes(r.criu_bytes)} of CRIU images, {r.criu})")
    print(f"  freeze   {ms(r.freeze_ns)} (stop every rank {ms(r.quiesce_ns)}, driver lock {ms(r.lock_ns)}, "
          f"checkpoint {ms(r.checkpoint_ns)}, criu dump {ms(r.dump_ns)})")
    print(f"  write    {ms(r.write_ns)} (checksums, manifest, sync)")
    if r.image_check != "clean":
        why = r.image_check.replace("skipped: ", "")
        print(f"  warning: the images were not all searched for a tracer's breakpoints ({why}); if a uprobe tracer "
              "ran during the dump, the restored job may trap", file=sys.stderr)
    print(f"  the job {'runs on' if r.leave_running else 'has ended'}; "
          f"bring it back with: gputrace restore --full {r.path}")
    return 0


def configure_restore(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-map", action="append", metavar="OLD=NEW",
                   help="with --full: put the job's GPU OLD on GPU NEW (indices or UUIDs; repeatable or "
                        "comma-separated, e.g. 0=1,1=0; a job's map is given to every rank)")


@mode("restore", "full", "a whole-process checkpoint: CRIU restore, then GPU state", FULL_EXAMPLES,
      only_with={"gpu_map": "the GPU map places a whole-process restore: gputrace restore --full DIR --gpu-map OLD=NEW"})(
    configure_restore)
def restore(args: argparse.Namespace) -> int:
    from ..checkpointer import fulljob
    from ..checkpointer.full import restore_full
    from ..progress import Progress

    if args.pid is not None or getattr(args, "tree", None) is not None:
        raise UsageError("--full restores the processes themselves, at their old pids: -p and --tree do not apply",
                         "drop them: gputrace restore --full DIR")
    gpu_map = parse_gpu_map(args.gpu_map)
    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        if fulljob.is_full_job(args.dir):
            j = fulljob.restore_job(args.dir, gpu_map=gpu_map, progress=prog)
        else:
            j, r = None, restore_full(args.dir, gpu_map=gpu_map, progress=prog)
    finally:
        prog.end()
    if j is not None:
        if args.json:
            dump_json({"schema": 1, "job": True, **j.to_dict()})
            return 0
        print(f"restored the job of {len(j.processes)} process(es) from {j.path} (root pid {j.root}); it is running")
        for row in j.ranks:
            print(f"  rank {row['rank']}  pid {row['pid']}: driver restore {ms(row['driver_restore_ns'])}, unlock "
                  f"{ms(row['unlock_ns'])}" + (f", shim {ms(row['shim_ns'])}" if row["shim_ns"] else ""))
        print(f"  verify {ms(j.verify_ns)}; back in {ms(j.total_ns)}: criu restore {ms(j.criu_ns)}, every rank's GPU "
              f"state {ms(j.gpu_ns)}" + (f", shims {ms(j.shim_ns)}" if j.shim_ns else ""))
        return 0
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
