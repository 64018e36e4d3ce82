"""`gputrace checkpoint` and `gputrace restore`: a shimmed job's device memory to a directory and back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..base.errors import GputraceError, UsageError
from ..base.units import fmt_bytes
from ..progress import Progress
from ..registry import add_json, add_job, command, dump_json, gbps, ms, number

CHECKPOINT_EPILOG = """examples:
  gputrace checkpoint -p 1234                   into ~/.local/share/gputrace/checkpoints/1234-TIME (or $GPUTRACE_CKPT_DIR), where top finds it
  gputrace checkpoint -p 1234 -o /ckpt/step100  into a new directory /ckpt/step100
  gputrace checkpoint -p 1234 --json            the report as JSON
  gputrace checkpoint -p 1234 --incremental    only what changed since this process's newest checkpoint there
  gputrace checkpoint -p 1234 -o /ckpt/step200 --since /ckpt/step100   only what changed since that one
  gputrace checkpoint -p 1234 --backend driver  NVIDIA's cuCheckpointProcess* on the same job, to compare
  gputrace checkpoint -p 1234,1235 -o /ckpt/j1  a job of two processes (ranks), stopped together
  gputrace checkpoint --tree 1200 -o /ckpt/j1   a launcher's ranks: 1200 and its descendants that run the shim
  gputrace checkpoint -p 1234 -p 1235 --timeout 10 --json

A job of several processes (-p A,B or --tree) is stopped as one: every rank's gate closes, ranks
behind in their collectives (NCCL's) run on to the same one, all drain, all are copied, all reopen;
one --timeout bounds it all, and if it passes or a rank fails every rank is given back running and
nothing is kept.  The directory then holds job.json and one checkpoint per rank (rank-N).

The job must run with the shim (gputrace run --checkpointable -- CMD).  It is frozen only while its
device memory is copied to host memory; the data are then checksummed and written while it runs on.
The directory appears only once complete (written as .NAME.partial-PID, synced, then renamed).

Every checkpoint hashes the job's device memory on the GPU, chunk by chunk (--digest-chunk, default
1 MiB), inside the freeze.  An incremental one (--since DIR, --incremental) copies and stores only
the chunks whose hash differs from DIR's: its directory holds those and names DIR, and restoring it
reads the whole chain, checking every link; keep the earlier ones beside it (a chain moved together
still resolves).
"""

RESTORE_EPILOG = """examples:
  gputrace checkpoint --full --leave-running -p 1234 -o /ckpt/s100   (earlier: the whole process, left running)
  gputrace restore -p 1234 /ckpt/s100           the job as it was then: process 1234 is ended and the
                                                checkpoint's runs in its place (same pid), GPU and CPU state
  gputrace restore -p 1234 /ckpt/s100 --json
  gputrace restore -p 1234 /ckpt/dev100 --device-only   roll device memory alone back (see below)
  gputrace restore /ckpt/j1 --device-only --force       a job's GPU-memory checkpoint, every rank's

A whole-process checkpoint (`checkpoint --full`) brings the job back whole: everything is checked
while it still runs (the checkpoint's files and checksums, that it is this job, that no other
process holds its thread ids, that the files it had open are as CRIU needs them: a log it wrote
on since is cut back to its size then and kept whole as LOG.after-TIME); only then is the running
process ended and the checkpoint's restored at its pid.  The report gives the time back.

--device-only: a GPU-memory checkpoint (`checkpoint -p PID`) is written back into the running
process, whose host state goes on.  That is safe only for programs that do not allocate, free or
reuse device memory between the checkpoint and the restore and are idle when it comes: with a
caching allocator (PyTorch, CuPy, JAX) or in the middle of a training loop, the checkpoint's bytes
land under tensors made since, and the job may crash or compute with stale data.  So it is refused
where the shim shows allocations made or freed since the checkpoint, a framework's caching
allocator, the program's own VMM mappings or stream-ordered pools, or work submitted in the moments
before it would stop; --force skips these checks (unsafe: nothing then stands between the job and
the consequence).  The checkpoint's checksums and the job's allocations (addresses and sizes) are
checked in any case; under the freeze only the chunks that differ are copied back (--copy-all:
every byte).  A job's checkpoint (-p A,B at checkpoint time) is rolled back on every rank together;
its checks are not made, so it needs --force.
"""


def _job(args: argparse.Namespace, action: str) -> list[int] | None:
    """The job's processes for -p A,B / --tree (or a single -p with --timeout); None: one process, as ever."""
    pids = args.pids or []
    if args.tree is None and len(pids) <= 1 and args.timeout is None:
        if not pids:
            raise UsageError(f"{action} needs -p PID (or -p PID,PID... or --tree PID for a job)",
                             f"gputrace {action} -p PID; gputrace ps lists the processes that run the shim")
        return None
    if getattr(args, "backend", "shim") == "driver":
        raise UsageError("--backend driver takes one process", f"give one -p PID, or {action} the job with the shim")
    from ..checkpointer import gang

    return gang.resolve(pids, args.tree)


def _job_timeout(args: argparse.Namespace) -> float:
    from ..checkpointer import gang

    return args.timeout if args.timeout is not None else gang.DEFAULT_TIMEOUT_S


def _print_job(r, what: str) -> None:
    at = f" at collective {r.collectives}" if r.collectives else ""
    print(f"{what} of a job of {len(r.pids)} process(es){at}" + (f": {r.path}" if r.path else ""))
    for row in r.ranks:
        print(f"  rank {row['rank']}  pid {row['pid']}  {row.get('allocations', 0)} allocation(s), "
              f"{fmt_bytes(row.get('bytes', 0))}, copy {ms(row.get('copy_ns', 0))}")
    print(f"  freeze   {ms(r.freeze_ns)} (every rank stopped together)")
    print(f"  total    {ms(r.total_ns)}")


def _job_json(r) -> None:
    dump_json({"schema": 1, "job": True, **r.to_dict()})


def _tuning(p: argparse.ArgumentParser, direct: bool = False) -> None:
    p.add_argument("--lanes", type=number(int, lo=1, hi=16), default=4, help="copy threads, each with its own streams (default 4)")
    p.add_argument("--chunk", type=number(int, lo=4096, hi=1 << 30, multiple=4096), default=8 << 20,
                   help="bytes per staged copy, a multiple of 4096 (default 8 MiB)")
    p.add_argument("--timeout-ms", type=number(int, lo=0, hi=600000), default=5000,
                   help="how long to wait for driver calls in flight, and then for the work they submitted, before "
                        "giving up the freeze (default 5000)")
    if direct:
        _staging(p)


def _staging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--staging", dest="direct", action="store_false",
                   help="copy through pinned staging buffers and a CPU copy into the image, instead of pinning the "
                        "image before the freeze and copying straight into (or out of) it (the default, which "
                        "falls back to staging by itself where the driver cannot pin the image)")


def _backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["shim", "driver"], default="shim",
                   help="shim: this project's path (needs `gputrace run --checkpointable`); driver: NVIDIA's "
                        "cuCheckpointProcess* API, for any CUDA process (data stay in its host memory)")


def configure_checkpoint(p: argparse.ArgumentParser) -> None:
    add_job(p)
    p.add_argument("-o", "--output", help="new directory to write (default PID-TIME under $GPUTRACE_CKPT_DIR, else ~/.local/share/gputrace/checkpoints: where `gputrace top` looks)")
    inc = p.add_mutually_exclusive_group()
    inc.add_argument("--since", metavar="DIR", help="an earlier checkpoint of the same process: copy and store only "
                                                    "the chunks that changed since it")
    inc.add_argument("--incremental", action="store_true",
                     help="--since this process's newest checkpoint in the directory the new one goes to (a whole "
                          "checkpoint where there is none)")
    p.add_argument("--digest-chunk", type=number(int, lo=0, hi=1 << 30, multiple=4096), default=None,
                   metavar="BYTES", help="bytes each GPU-computed digest covers, a multiple of 4096 from 65536 "
                                         "(default 1 MiB; 0: none, so no checkpoint can later be taken --since this "
                                         "one); --since takes the earlier checkpoint's")
    _backend(p)
    _tuning(p, direct=True)
    add_json(p)


def _driver_report(r) -> None:
    print(f"{r.action} of pid {r.pid} with the driver's checkpoint API ({r.driver}):")
    steps = [("lock", r.lock_ns), ("checkpoint", r.checkpoint_ns), ("restore", r.restore_ns), ("unlock", r.unlock_ns)]
    print("  " + ", ".join(f"{name} {ms(ns)}" for name, ns in steps if ns))
    print(f"  freeze   {ms(r.freeze_ns)}" + (" (device state round-tripped through host memory; nothing written "
                                                 "to disk)" if r.action == "checkpoint" else ""))


def _by_driver(args: argparse.Namespace, action: str) -> int:
    """`--backend driver`: the same action by NVIDIA's cuCheckpointProcess* API, for any CUDA process."""
    from ..checkpointer import driver

    if getattr(args, "output", None):
        raise UsageError("--backend driver writes no directory: the driver keeps the data in the process",
                         f"drop -o, or {action} a shimmed job (the shim backend) to write a checkpoint directory")
    if action == "checkpoint":
        r = driver.checkpoint(args.pid, timeout_ms=args.timeout_ms)
    elif action == "suspend":
        r = driver.suspend(args.pid, timeout_ms=args.timeout_ms)
    else:
        r = driver.resume(args.pid)
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
    else:
        _driver_report(r)
    return 0


def configure_restore(p: argparse.ArgumentParser) -> None:
    add_job(p)
    p.add_argument("dir", help="checkpoint directory: a whole-process one (`checkpoint --full`) replaces the "
                               "running process; a GPU-memory one needs --device-only")
    p.add_argument("--device-only", action="store_true",
                   help="roll back device memory alone, host state going on: only for programs that do not "
                        "reallocate (refused where the shim shows they do; see below)")
    p.add_argument("--force", action="store_true",
                   help="with --device-only: skip the checks that refuse an unsafe rollback (UNSAFE: the job may "
                        "crash or compute with stale data)")
    p.add_argument("--into-other-process", action="store_true",
                   help="restore a checkpoint of another process (or of an earlier one with this pid) into this "
                        "one; its allocations must still match")
    p.add_argument("--copy-all", dest="diff", action="store_false",
                   help="copy every byte back, not only the chunks whose GPU-computed digest differs")
    p.add_argument("--verify-all", action="store_true",
                   help="read and check every byte of the checkpoint (and of each earlier link of its chain) "
                        "before the job is touched, not only the manifests, heads and chunks the restore copies")
    _tuning(p, direct=True)
    add_json(p)


@command("checkpoint", "checkpoint a shimmed process's GPU memory to a directory", CHECKPOINT_EPILOG)(
    configure_checkpoint)
def checkpoint_cmd(args: argparse.Namespace) -> int:
    from ..checkpointer import checkpoint

    job = _job(args, "checkpoint")
    if job is not None and (args.since or args.incremental or args.digest_chunk is not None):
        raise UsageError("--since, --incremental and --digest-chunk take one process",
                         "checkpoint the job whole, or each process with its own -p PID")
    if job is not None:
        from ..checkpointer import gang

        r = gang.checkpoint(job, args.output, timeout_s=_job_timeout(args), lanes=args.lanes, chunk=args.chunk,
                            direct=args.direct)
        _job_json(r) if args.json else _print_job(r, "checkpoint")
        return 0
    if args.backend == "driver":
        return _by_driver(args, "checkpoint")

    if args.backend == "driver" and (args.since or args.incremental or args.digest_chunk is not None):
        raise UsageError("--since, --incremental and --digest-chunk are the shim's", "drop them, or use --backend shim")
    if args.digest_chunk and args.digest_chunk < 65536:
        raise UsageError(f"--digest-chunk {args.digest_chunk} is below 65536",
                         "give a multiple of 4096 from 65536 to 1 GiB, or 0 for no digests")
    since = args.since
    if args.incremental:
        from ..checkpointer import store
        from ..checkpointer.ops import latest

        where = Path(args.output).absolute().parent if args.output else store.default_root()
        since = latest(args.pid, where)
    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = checkpoint(args.pid, args.output, lanes=args.lanes, chunk=args.chunk, timeout_ms=args.timeout_ms,
                       direct=args.direct, progress=prog, since=since, digest_chunk=args.digest_chunk)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    print(f"checkpoint of pid {r.pid}: {r.path}")
    print(f"  {r.allocations} allocation(s), {fmt_bytes(r.bytes)} of device memory")
    if r.parent:
        print(f"  changed  {r.chunks_copied} of {r.chunks} chunks ({fmt_bytes(r.bytes_copied)}) since {r.parent}")
    elif since is not None or args.incremental:
        print(f"  whole    {r.digest_why or 'no earlier checkpoint of this process there'}: every byte copied")
    _print_freeze(r)
    if r.attempts > 1:
        print(f"  before   {r.attempts - 1} freeze(s) of {ms(r.aborted_freeze_ns)} in all that found more changed than "
              "the shim's pinned pool held and copied nothing; then prepared for it")
    if r.staging_copied_bytes:
        print(f"  staging  {fmt_bytes(r.staging_copied_bytes)} copied through the staging buffers inside the freeze")
    print(f"  write    {ms(r.write_ns)}, {fmt_bytes(r.stored_bytes)} at {gbps(r.stored_bytes, r.write_ns)} "
          f"(job running; {'hashed and written on two threads' if r.pipelined else 'hashed and written in turn'})")
    if r.streamed_bytes:
        print(f"  pool     {fmt_bytes(r.streamed_bytes)} written out of the shim's pinned pool in {r.writeback_batches} "
              f"batch(es), {ms(r.writeback_ns)}, while the ones before were hashed and written "
              f"({fmt_bytes(r.hashed_during_writeback_bytes)} hashed before its last)")
    print(f"  durable  {ms(r.durable_ns)} after it began: data, manifest and directory fsynced "
          f"({ms(r.fsync_ns)} of fsync)")
    print(f"  total    {ms(r.total_ns)}")
    return 0


def _print_freeze(r) -> None:
    """The freeze of a shim checkpoint or restore, by phase: the same fields in both reports."""
    hashed = f"digest {ms(r.digest_ns)}, " if r.chunks else ""
    copy = f"copy {ms(r.copy_ns)} at {gbps(r.bytes_copied, r.copy_ns)}" if r.bytes_copied else "nothing to copy"
    print(f"  freeze   {ms(r.freeze_ns)} (drain {ms(r.drain_ns)}, sync {ms(r.sync_ns)}, {hashed}"
          f"{copy}{', direct' if r.direct else ''})")


def _manifest_format(path: str) -> str | None:
    """The format a checkpoint directory's manifest names (a job's: gang's job.json), None where it
    has none this can read (the restore that follows says why)."""
    from ..checkpointer import gang, store

    if gang.is_job(path):
        return "job"
    try:
        m = store.load_manifest(Path(path), "")
    except GputraceError:
        return None
    return m.get("format") if isinstance(m, dict) else None


@command("restore", "bring a job back to a checkpoint: whole from `checkpoint --full`, or its device memory alone",
         RESTORE_EPILOG)(configure_restore)
def restore_cmd(args: argparse.Namespace) -> int:
    from ..checkpointer import gang, restore, store

    fmt = _manifest_format(args.dir)
    if args.force and not args.device_only:
        raise UsageError("--force goes with --device-only", "gputrace restore -p PID DIR --device-only --force")
    if fmt == store.FULL_JOB.format:
        raise UsageError(f"{args.dir} is a whole-job checkpoint: it comes back with `gputrace restore --full DIR`",
                         "end the running job first (CRIU brings its processes back at their pids)")
    if fmt == store.FULL.format:
        if args.device_only:
            raise UsageError(f"{args.dir} is a whole-process checkpoint: --device-only takes a GPU-memory one",
                             f"gputrace restore -p PID {args.dir} brings the whole process back")
        if args.pid is None or len(args.pids or []) > 1 or args.tree is not None or args.timeout is not None:
            raise UsageError("restoring a whole-process checkpoint over a running job takes one -p PID",
                             f"gputrace restore -p PID {args.dir}; for a job that has ended: gputrace restore --full "
                             f"{args.dir}")
        return _replace(args)
    if not args.device_only and fmt is not None:
        raise UsageError(f"{args.dir} is a GPU-memory checkpoint: restoring it rolls back device memory alone while "
                         "the process's host state goes on, which breaks any job that allocated, freed or reused "
                         "device memory since (a training loop does, every step)",
                         "bring the job back whole: `gputrace checkpoint --full --leave-running -p PID`, then "
                         "`gputrace restore -p PID DIR`; for a program that does not reallocate, add --device-only")
    if gang.is_job(args.dir) or len(args.pids or []) > 1 or args.tree is not None or args.timeout is not None:
        if not gang.is_job(args.dir):
            raise UsageError(f"{args.dir} is a checkpoint of one process, not of a job",
                             "restore it with one -p PID; a job's checkpoint is written by checkpoint -p PID,PID...")
        if not args.force:
            raise UsageError("a device-only rollback of a job of several processes is not checked for safety here",
                             "checkpoint the job whole (`gputrace checkpoint --full --tree LAUNCHER`) and restore "
                             "that; or add --force to roll every rank's device memory back anyway (unsafe: the job "
                             "may crash or compute with stale data)")
        pids = gang.resolve(args.pids or [], args.tree) if (args.pids or args.tree is not None) else None
        r = gang.restore(args.dir, pids, timeout_s=_job_timeout(args), lanes=args.lanes, chunk=args.chunk,
                         direct=args.direct, other_process=args.into_other_process)
        if args.json:
            dump_json({"schema": 1, "job": True, **r.to_dict(), "host_state_restored": False})
        else:
            _print_job(r, "restore")
        return 0
    if args.pid is None:
        raise UsageError("restore needs -p PID (or --full for a whole-process checkpoint of a job that has ended)",
                         "gputrace restore -p PID DIR, or gputrace restore --full DIR")
    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = restore(args.pid, args.dir, lanes=args.lanes, chunk=args.chunk, timeout_ms=args.timeout_ms,
                    direct=args.direct, progress=prog, other_process=args.into_other_process, diff=args.diff,
                    checked=not args.force, verify_all=args.verify_all)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict(), "host_state_restored": False, "checked": not args.force})
        return 0
    print(f"restored pid {r.pid}'s device memory from {r.path}")
    print(f"  {r.allocations} allocation(s), {fmt_bytes(r.bytes)} of device memory")
    chain = f" ({r.links} links of an incremental chain)" if r.links > 1 else ""
    what = "every byte" if r.verified == "all" else "the chunks copied, the heads and manifests"
    why = f"; {r.verify_why}" if r.verify_why else ""
    print(f"  verify   {ms(r.verify_ns)}, {fmt_bytes(r.bytes_read)} read: {what}{chain}{why} (job running)")
    if r.chunks:
        print(f"  copied   {r.chunks_copied} of {r.chunks} chunks differed: {fmt_bytes(r.bytes_copied)} copied back")
    elif r.digest_why:
        print(f"  copied   every byte ({r.digest_why})")
    _print_freeze(r)
    print(f"  total    {ms(r.total_ns)}")
    print("  note     device memory only: the process's host state (step counters, host tensors) was not "
          "rolled back" + ("; the safety checks were skipped (--force)" if args.force else ""), file=sys.stderr)
    return 0


def _replace(args: argparse.Namespace) -> int:
    """restore -p PID FULL_DIR: the running process replaced by its whole-process checkpoint."""
    from ..checkpointer.replace import replace_full

    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = replace_full(args.pid, args.dir, progress=prog)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict(), "host_state_restored": True})
        return 0
    print(f"restored pid {r.pid} whole from {r.path}; it is running")
    print(f"  verify   {ms(r.verify_ns)} (job running)")
    print(f"  back in  {ms(r.back_ns)}: end the running process {ms(r.end_ns)}, criu restore {ms(r.criu_ns)}, driver "
          f"restore {ms(r.driver_restore_ns)}, unlock {ms(r.unlock_ns)}" + (f", shim {ms(r.shim_ns)}" if r.shim_ns else ""))
    for c in r.cut:
        print(f"  {c['path']} cut back to {c['bytes_then']} bytes, as it was then (kept whole as {c['kept']})")
    return 0


SUSPEND_EPILOG = """examples:
  gputrace suspend -p 1234          free the job's GPU memory (its data wait in host memory)
  gputrace suspend -p 1234 -o /ckpt/s1   the same, the data written to a checkpoint directory, host memory freed
  gputrace resume -p 1234           bring it back at the same addresses; the job continues
  gputrace suspend --backend driver -p 1234   the same with NVIDIA's API, for a job without the shim
  gputrace suspend -p 1234,1235     a job of two processes, stopped at the same collective and suspended together
  gputrace resume -p 1234,1235      (or --tree LAUNCHER_PID) every rank back at once
  gputrace suspend --prepare -p 1234   a job that will be preempted: pin its suspension's image now,
                                    while it runs, so that the suspend frees the GPU after its copies alone

Needs a job started with `gputrace run --checkpointable --suspendable -- CMD`, whose cuMemAlloc
memory the shim serves through the VMM API (rounded up to the allocation granularity).  While
suspended, the job waits at its next GPU submission.

A suspension copies into host memory mapped and pinned in the job, which the shim keeps for the
next one (within GPUTRACE_SHIM_PIN_CAP, the job's environment, bytes; default 2 GiB).  Pinning it
takes about 0.35 s a GiB (5.7 s at 16 GiB on an H100, against 0.3 s for the copy), which a job's
first suspend pays before the GPU is free, unless --prepare paid it earlier, while the job ran.
Its cost: host memory the size of the job's device memory (and a sixteenth more), pinned until
`gputrace shim release -p PID` or the job ends.
"""


def configure_suspend(p: argparse.ArgumentParser) -> None:
    add_job(p)
    p.add_argument("-o", "--output", help="also write the data to this new checkpoint directory and give the host "
                                          "memory back: resume reads them from disk (a valid checkpoint for restore)")
    p.add_argument("--prepare", action="store_true",
                   help="do not suspend: make the image the next suspend copies into now, while the job runs (host "
                        "memory the size of its device memory, mapped and pinned in the job until `gputrace shim "
                        "release -p PID` or its end, within GPUTRACE_SHIM_PIN_CAP), so that the suspend frees the GPU "
                        "after its copies alone")
    _backend(p)
    _tuning(p, direct=True)
    add_json(p)


@command("suspend", "take a job's device memory off the GPU, keeping it in host memory", SUSPEND_EPILOG)(
    configure_suspend)
def suspend_cmd(args: argparse.Namespace) -> int:
    from ..checkpointer import suspend

    if args.prepare:
        return _prepare(args)
    job = _job(args, "suspend")
    if job is not None:
        from ..checkpointer import gang

        if args.output:
            raise UsageError("suspend -o takes one process", "suspend the job without -o, or checkpoint it with "
                                                            "checkpoint -p PID,PID... -o DIR")
        r = gang.suspend(job, timeout_s=_job_timeout(args), lanes=args.lanes, chunk=args.chunk, direct=args.direct)
        if args.json:
            _job_json(r)
        else:
            _print_job(r, "suspend")
            print(f"  resume with: gputrace resume -p {','.join(map(str, r.pids))}")
        return 0
    if args.backend == "driver":
        return _by_driver(args, "suspend")

    prog = Progress(not args.json and sys.stderr.isatty())
    try:
        r = suspend(args.pid, lanes=args.lanes, chunk=args.chunk, timeout_ms=args.timeout_ms, direct=args.direct,
                    out=args.output, progress=prog)
    finally:
        prog.end()
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    where = f"written to {r.path} ({ms(r.write_ns)}, host memory given back)" if r.path else "kept in host memory"
    print(f"suspended pid {r.pid}: {r.allocations} allocation(s), {fmt_bytes(r.bytes)} {where}, "
          f"{fmt_bytes(r.reserved_bytes)} of GPU memory freed")
    print(f"  set-up {ms(r.setup_ns)} (job running), copy {ms(r.copy_ns)} at {gbps(r.bytes, r.copy_ns)}, "
          f"release {ms(r.release_ns)}; "
          f"resume with: gputrace resume -p {r.pid}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    """suspend --prepare: the suspension's image made ahead (checkpointer/suspend.py `prepare`)."""
    from ..checkpointer import prepare

    if len(args.pids or []) > 1 or args.tree is not None:
        raise UsageError("suspend --prepare takes one process",
                         "a job of several processes suspends each rank into an image of its own, which nothing "
                         "can make ahead; prepare a job of one process with -p PID")
    if args.pid is None:
        raise UsageError("suspend --prepare needs -p PID", "gputrace ps lists the processes that run the shim")
    if args.backend == "driver":
        raise UsageError("--prepare is the shim's", "the driver's suspend keeps its data in the process its own way; "
                                                    "drop --backend driver")
    if args.output:
        raise UsageError("--prepare makes the image a suspension into host memory copies into; -o writes a "
                         "directory instead", f"gputrace suspend --prepare -p {args.pid}, then gputrace suspend -p "
                                              f"{args.pid}")
    if not args.direct:
        raise UsageError("--prepare is for the direct copy (the default); --staging copies through buffers of its own",
                         "drop --staging")
    r = prepare(args.pid)
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    release = f"gputrace shim release -p {r.pid}"
    if not r.bytes:
        print(f"pid {r.pid} holds no device memory yet: nothing to prepare (prepare it once the job has allocated)")
    elif not r.made:
        print(f"pid {r.pid}'s suspension image is ready already: {fmt_bytes(r.image_bytes)} pinned, holding its "
              f"{fmt_bytes(r.bytes)} of device memory; nothing was done")
        print(f"  pinned until `{release}` or the job ends")
    else:
        print(f"prepared pid {r.pid}'s suspension image: {fmt_bytes(r.image_bytes)} of host memory mapped and pinned "
              f"in {ms(r.setup_ns)} (the job ran on), for its {fmt_bytes(r.bytes)} of device memory in "
              f"{r.allocations} allocation(s) and a sixteenth more room")
        print(f"  the next `gputrace suspend -p {r.pid}` copies straight into it; pinned until `{release}` or the "
              "job ends")
    return 0


def configure_resume(p: argparse.ArgumentParser) -> None:
    add_job(p)
    _backend(p)
    p.add_argument("--lanes", type=number(int, lo=1, hi=16), default=4, help="copy threads (default 4)")
    p.add_argument("--chunk", type=number(int, lo=4096, hi=1 << 30, multiple=4096), default=8 << 20,
                   help="bytes per staged copy (default 8 MiB)")
    _staging(p)
    add_json(p)


@command("resume", "bring a suspended job's device memory back to the same addresses", SUSPEND_EPILOG)(
    configure_resume)
def resume_cmd(args: argparse.Namespace) -> int:
    from ..checkpointer import resume

    job = _job(args, "resume")
    if job is not None:
        from ..checkpointer import gang

        r = gang.resume(job, timeout_s=_job_timeout(args), lanes=args.lanes, chunk=args.chunk, direct=args.direct)
        _job_json(r) if args.json else _print_job(r, "resume")
        return 0
    if args.backend == "driver":
        return _by_driver(args, "resume")

    r = resume(args.pid, lanes=args.lanes, chunk=args.chunk, direct=args.direct)
    if args.json:
        dump_json({"schema": 1, **r.to_dict()})
        return 0
    print(f"resumed pid {r.pid}: {r.allocations} allocation(s), {fmt_bytes(r.bytes)} back on the GPU "
          f"after {r.suspended_ns / 1e9:.1f} s suspended")
    print(f"  remap {ms(r.remap_ns)}, copy {ms(r.copy_ns)} at {gbps(r.bytes, r.copy_ns)}")
    return 0
