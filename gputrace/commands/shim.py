"""`gputrace run --checkpointable`, `gputrace shim status`, `gputrace ps`: the checkpointing shim."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from ..base.errors import GputraceError, UsageError
from ..base.units import fmt_bytes
from ..registry import add_job, add_json, command, dump_json, nonempty, number

RUN_EPILOG = """examples:
  gputrace run --checkpointable -- python train.py --epochs 3
  GPUTRACE_SHIM_DIR=/run/ckpt gputrace run --checkpointable -- ./job
  gputrace run --checkpointable --suspendable -- python train.py   (then: gputrace suspend / resume)

The command runs in place of gputrace (same pid) with the shim preloaded (LD_PRELOAD), which its
child processes inherit.  The shim does nothing until the process's first CUDA driver call; from
then on it tracks the GPU state the process holds and serves a control socket in
$GPUTRACE_SHIM_DIR, else $XDG_RUNTIME_DIR/gputrace, else /tmp/gputrace-UID (a 0700 directory).
"""


def configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpointable", action="store_true",
                   help="preload the checkpointing shim (what `run` does; the flag may be left out)")
    p.add_argument("--shim-dir", help="directory for the control socket (sets GPUTRACE_SHIM_DIR)")
    p.add_argument("--suspendable", action="store_true",
                   help="serve cuMemAlloc through the VMM API so `gputrace suspend` can free it (sets "
                        "GPUTRACE_SHIM_VMM=1; each allocation is rounded up to the allocation granularity)")


@command("run", "start a command with the checkpointing shim preloaded", RUN_EPILOG)(configure_run)
def run(args: argparse.Namespace) -> int:
    argv = args.command_argv
    if not argv:
        raise UsageError("no command to run", "give it after `--`: gputrace run --checkpointable -- python train.py")
    path = shutil.which(argv[0]) if "/" not in argv[0] else argv[0]
    if not path or not os.path.isfile(path):
        raise UsageError(f"command not found: {argv[0]}", "give the command as you would run it, after `--`")
    if not os.access(path, os.X_OK):
        raise UsageError(f"cannot execute {argv[0]}", "check that it is an executable file")
    from ..shim import preload_env

    env = preload_env()  # builds the shim first (cached), so a build error surfaces here, not in the job
    if args.shim_dir:
        env["GPUTRACE_SHIM_DIR"] = os.path.abspath(args.shim_dir)
    if args.suspendable:
        env["GPUTRACE_SHIM_VMM"] = "1"
    # Names the job for `checkpoint -p A,B`: every process it starts inherits it, and processes of
    # different jobs are refused as one (checkpointer/gang.py). A job started inside one keeps its.
    env.setdefault("GPUTRACE_JOB", os.urandom(8).hex())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(path, argv, env)
    except OSError as exc:
        raise UsageError(f"cannot run {argv[0]}: {exc.strerror}", "check the command after `--`") from None
    return 127  # not reached


SHIM_EPILOG = """examples:
  gputrace shim status -p 1234          what the process holds: contexts, memory, modules, streams
  gputrace shim status -p 1234 --json   the shim's own JSON (schema 1), as its control socket sends it
  gputrace shim emulate -p 1234 --cost-ns 2000 --classes submission
                                        feel a heavier layer: 2 us of CPU added to every launch, copy, ...
  gputrace shim emulate -p 1234 --cost-ns 500 --classes submission,synchronization,state,query
  gputrace shim emulate -p 1234 --cost-ns 2000 --preset shim
                                        the functions the shim gates, which `attach --preset shim`
                                        counts: the same set, from the shim's own list
  gputrace shim emulate -p 1234         what the emulated layer does now, and how many calls it slowed
  gputrace shim emulate -p 1234 --off
  gputrace shim emulate --tree 1200 --cost-ns 2000 --classes submission
                                        the same on every rank of a job (a launcher and its ranks;
                                        or -p 1234,1235): all of them, or none
  gputrace shim release -p 1234         give back the host memory the shim keeps pinned in the job
                                        between commands (the checkpoints' pool, a suspension's image,
                                        made by a suspend or by `suspend --prepare`) and its digest kernel;
                                        the next checkpoint or suspend makes what it needs again

The emulated layer spins on the calling thread for --cost-ns before each intercepted call of those
classes (or --functions, or --preset), as a layer's bookkeeping would, until --off. Compare the job's speed with
what `gputrace attach` predicted for a layer of that cost: the audit's bounds should hold it.
"""

EMULATE_CLASSES = ("submission", "synchronization", "state", "query")


def configure_shim(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["status", "emulate", "release"],
                   help="status: the GPU state the shim has recorded; emulate: add a set cost to intercepted calls; "
                        "release: give back the pinned host memory the shim keeps between checkpoints and "
                        "suspensions")
    add_job(p, bound=False)
    p.add_argument("--cost-ns", type=number(hi=1e9), help="emulate: ns of busy CPU time added to each call")
    p.add_argument("--classes", type=nonempty, help=f"emulate: comma-separated classes ({', '.join(EMULATE_CLASSES)})")
    p.add_argument("--functions", type=nonempty, help="emulate: comma-separated driver functions the shim wraps, e.g. cuLaunchKernel")
    p.add_argument("--preset", choices=["shim"],
                   help="emulate: the functions the audit's preset of that name counts (shim: those the shim gates)")
    p.add_argument("--off", action="store_true", help="emulate: stop adding cost")
    add_json(p)


def emulate_command(args: argparse.Namespace) -> str:
    """The control command for `shim emulate`'s arguments (usage errors raised here, not by the shim)."""
    preset = getattr(args, "preset", None)
    if args.off:
        if args.cost_ns is not None or args.classes or args.functions or preset:
            raise UsageError("--off takes no cost, classes or functions", "gputrace shim emulate -p PID --off")
        return "emulate off"
    if args.cost_ns is None and not args.classes and not args.functions and not preset:
        return "emulate"
    if args.cost_ns is None or not (0 <= args.cost_ns <= 1e9):
        raise UsageError("give --cost-ns between 0 and 1e9 with --classes, --functions or --preset",
                         "gputrace shim emulate -p PID --cost-ns 2000 --classes submission")
    if not args.classes and not args.functions and not preset:
        raise UsageError("say which calls to slow: --classes, --functions or --preset",
                         "e.g. --classes submission,synchronization, or --preset shim")
    words = [f"cost={int(round(args.cost_ns))}"]
    if args.classes:
        cls = [c.strip() for c in args.classes.split(",") if c.strip()]
        bad = [c for c in cls if c not in EMULATE_CLASSES and c != "sync"]
        if bad:
            raise UsageError(f"unknown class {bad[0]!r}", f"choose from {', '.join(EMULATE_CLASSES)}")
        words.append("classes=" + ",".join(cls))
    if args.functions:
        words.append("functions=" + ",".join(f.strip() for f in args.functions.split(",") if f.strip()))
    if preset:
        words.append(f"layer={preset}")  # the shim's own list (emulate.c), which the audit's preset reads too
    return "emulate " + " ".join(words)


def _spent(e: dict) -> str:
    """The spins' real mean length: a clock read's granularity, preemption or a hypervisor make
    it longer than the set cost, and a check of the audit needs the real one."""
    n, spent = e["calls_slowed"], e.get("spent_ns")
    out = f", {spent / n:.0f} ns each on average" if n and spent is not None else ""
    m, driver = e.get("driver_calls"), e.get("driver_ns")
    if m and driver is not None:
        out += f"; the driver took {driver / m:.0f} ns a call after it"
    return out


def render_emulate(e: dict) -> str:
    if not e["on"]:
        return f"emulated layer off; {e['calls_slowed']} calls slowed while it was last on{_spent(e)}"
    fns = e["functions"]
    return (f"emulated layer on: {e['cost_ns']} ns added to each call of {len(fns)} function(s) "
            f"({', '.join(fns[:8])}{', ...' if len(fns) > 8 else ''}); {e['calls_slowed']} calls slowed so far"
            f"{_spent(e)}")


def render_status(st: dict, comm: str) -> str:
    t = st["totals"]
    lines = [
        f"pid {st['pid']} ({comm}): gate {'CLOSED (paused)' if st['paused'] else 'open'}, "
        f"{st['in_flight']} call(s) in flight, {st['waiting']} waiting, {st['threads']} thread(s) seen",
        f"driver  {st['driver'] or '(not resolved yet)'}",
        f"socket  {st['socket']}",
        f"device memory {fmt_bytes(t['device_bytes'])}, pinned host {fmt_bytes(t['host_bytes'])}, "
        f"VA reserved {fmt_bytes(t['va_reserved_bytes'])}; {t['contexts']} context(s), {t['allocations']} allocation(s), "
        f"{t['modules']} module(s) ({fmt_bytes(t['module_image_bytes'])} of images), {t['streams']} stream(s), "
        f"{t['events']} event(s)",
    ]
    if st["contexts"]:
        lines.append("contexts:")
        for c in sorted(st["contexts"], key=lambda c: c["handle"]):
            lines.append(f"  {c['handle']:#x}  device {c['device']}  {'primary' if c['primary'] else 'created'}"
                         f"  refs {c['refs']}")
    if st["allocations"]:
        lines.append("allocations:")
        lines.append(f"  {'KIND':<10} {'BASE':>18} {'SIZE':>12}  DEVICE")
        for a in sorted(st["allocations"], key=lambda a: (a["kind"], a["base"], a.get("handle", 0))):
            extra = f"  handle {a['handle']:#x}" if "handle" in a else ""
            lines.append(f"  {a['kind']:<10} {a['base']:>#18x} {fmt_bytes(a['size']):>12}  {a['device']}{extra}")
    if st["modules"]:
        lines.append("modules:")
        for m in sorted(st["modules"], key=lambda m: m["handle"]):
            lines.append(f"  {m['kind']:<8} {m['handle']:#x}  image {fmt_bytes(m['image_bytes'])}"
                         + (f"  {m['path']}" if m.get("path") else ""))
    for key in ("streams", "events"):
        if st[key]:
            lines.append(f"{key}: " + ", ".join(f"{s['handle']:#x}" for s in sorted(st[key], key=lambda s: s["handle"])))
    calls = sorted(st["calls"].items(), key=lambda kv: -kv[1])
    if calls:
        lines.append("intercepted calls: " + ", ".join(f"{k} {v}" for k, v in calls))
    if st.get("emulate", {}).get("on"):
        lines.append(render_emulate(st["emulate"]))
    return "\n".join(lines)


def _emulate_job(args: argparse.Namespace, line: str) -> int:
    """`shim emulate` on every rank of a job: the emulated layer of a job is on all its ranks (a
    data-parallel step waits for the slowest), so a rank that refuses turns it off on those done."""
    from ..checkpointer import gang
    from ..shim.client import Connection

    pids = gang.resolve(args.pids or [], args.tree)
    replies: list[tuple[int, dict]] = []
    for pid in pids:
        with Connection(pid) as c:
            reply = c.request(line)
        if not reply.get("ok"):
            if line.startswith("emulate cost="):  # it was switching the layer on: off where it is on
                for done, _ in replies:
                    with Connection(done) as c:
                        c.request("emulate off")
            raise GputraceError(f"the shim of process {pid} (one of the job's {len(pids)}) refused: "
                                f"{reply.get('error')}",
                                "the emulated layer is off on every rank it had been switched on in; see "
                                "`gputrace shim --help` for the classes and the form of --functions")
        replies.append((pid, reply))
    if args.json:
        dump_json({"schema": 1, "job": True, "ranks": [{"pid": pid, **r} for pid, r in replies],
                   "calls_slowed": sum(r["emulate"]["calls_slowed"] for _, r in replies)})
        return 0
    for pid, r in replies:
        print(f"pid {pid}: {render_emulate(r['emulate'])}")
    print(f"job of {len(replies)} processes: {sum(r['emulate']['calls_slowed'] for _, r in replies)} calls slowed in all")
    return 0


@command("shim", "inspect the checkpointing shim in a process", SHIM_EPILOG)(configure_shim)
def shim_cmd(args: argparse.Namespace) -> int:
    from ..base.procs import comm
    from ..shim.client import Connection, status

    if not args.pids and args.tree is None:
        raise UsageError(f"shim {args.action} needs -p PID", "gputrace ps lists the processes that run the shim")
    if args.action == "emulate":
        line = emulate_command(args)
        if len(args.pids or []) > 1 or args.tree is not None:
            return _emulate_job(args, line)
        with Connection(args.pid) as c:
            reply = c.request(line)
        if not reply.get("ok"):
            raise GputraceError(f"the shim of process {args.pid} refused: {reply.get('error')}",
                                "see `gputrace shim --help` for the classes and the form of --functions")
        if args.json:
            dump_json(reply)
        else:
            print(render_emulate(reply["emulate"]))
        return 0
    if len(args.pids or []) > 1 or args.tree is not None:
        raise UsageError(f"shim {args.action} takes one process",
                         f"gputrace shim {args.action} -p PID, for each of the job's")
    if args.cost_ns is not None or args.classes or args.functions or args.off or args.preset:
        raise UsageError("--cost-ns, --classes, --functions, --preset and --off go with `shim emulate`",
                         "gputrace shim emulate -p PID --cost-ns 2000 --classes submission")
    if args.action == "release":
        return _release(args)
    st = status(args.pid)
    if args.json:
        dump_json(st)
    else:
        print(render_status(st, comm(args.pid)))
    return 0


def _release(args: argparse.Namespace) -> int:
    """`shim release`: what the shim keeps pinned between commands given back (its `release`), under the
    per-process lock, so that no checkpoint or suspension of the job is under way meanwhile."""
    from ..checkpointer.ops import ShimSession

    with ShimSession(args.pid, "release") as s:
        suspended = bool(s.request("status").get("suspended"))
        r = s.request("release")
    if not r.get("ok"):
        raise GputraceError(f"the shim of process {args.pid} did not release: {r.get('error')}",
                            "the job runs on as before")
    if args.json:
        dump_json({"schema": 1, "pid": args.pid, "suspended": suspended, **r})
        return 0
    print(f"pid {args.pid}: {fmt_bytes(r['released_pinned_bytes'])} of pinned host memory given back now"
          + (", and the digest kernel" if r.get("released_digester") else ""))
    if suspended:
        print(f"  suspended: the image its data wait in is given back at `gputrace resume -p {args.pid}`, not kept")
    return 0


PS_TIMEOUT_S = 2.0  # how long `ps` waits for a shim's answer

PS_EPILOG = """examples:
  gputrace ps            processes running with the shim (those whose memory maps this user can read)
  gputrace ps --json

STATE: serving (its control socket answers; "serving, suspended" when its device memory is off the
GPU), not serving yet (no CUDA call so far), or the reason it does not answer.  Every process is
asked at once, for at most 2 s: one whose shim does not answer does not hold up the others.
In --json, `state` is one of serving, not_serving_yet, unreachable; `detail` says why it is unreachable.
"""


def configure_ps(p: argparse.ArgumentParser) -> None:
    add_json(p)


@command("ps", "list processes running with the checkpointing shim", PS_EPILOG)(configure_ps)
def ps(args: argparse.Namespace) -> int:
    from ..shim.client import Connection, shimmed_processes

    from concurrent.futures import ThreadPoolExecutor

    def row_of(proc) -> dict:
        row = {"pid": proc.pid, "comm": proc.comm, "uid": proc.uid,
               "socket": str(proc.socket) if proc.socket else None, "state": "not_serving_yet", "detail": None,
               "paused": None, "suspended": None, "device_bytes": None, "allocations": None}
        if proc.socket:
            try:
                with Connection(proc.pid, timeout_s=PS_TIMEOUT_S) as c:
                    st = c.status()
                row.update(state="serving", paused=st["paused"], suspended=bool(st.get("suspended")),
                           device_bytes=st["totals"]["device_bytes"], allocations=st["totals"]["allocations"])
            except GputraceError as exc:
                row.update(state="unreachable", detail=exc.msg)
        return row

    procs = list(shimmed_processes())
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(procs)))) as pool:
        rows = list(pool.map(row_of, procs))
    if args.json:
        dump_json({"schema": 2, "processes": rows})
        return 0
    if not rows:
        print("no process with the gputrace shim found (start one with: gputrace run --checkpointable -- CMD)")
        return 0
    print(f"{'PID':>7}  {'COMMAND':<16} {'GATE':<6} {'DEVICE MEM':>11} {'ALLOCS':>6}  STATE")
    for r in rows:
        gate = "" if r["paused"] is None else ("closed" if r["paused"] else "open")
        mem = "" if r["device_bytes"] is None else fmt_bytes(r["device_bytes"])
        allocs = "" if r["allocations"] is None else str(r["allocations"])
        state = {"serving": "serving, suspended" if r["suspended"] else "serving",
                 "not_serving_yet": "not serving yet"}.get(r["state"], r["detail"] or r["state"])
        print(f"{r['pid']:>7}  {r['comm']:<16} {gate:<6} {mem:>11} {allocs:>6}  {state}")
    return 0
