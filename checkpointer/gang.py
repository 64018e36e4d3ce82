"""Jobs of several processes: checkpoint, restore, suspend and resume every rank of a job at once.

A rank stopped alone while its peers wait for it in a collective holds them; two ranks stopped one
after the other can hold each other for good (the first one's peers wait inside a collective the
first never launches, and the second can then not drain).  So every rank is stopped together,
through the shim's stepped protocol (shim/control.c, "Collectives" in shim/shim.c), each step on
every rank at once, one thread per rank:

  close    every rank's gate closes at the API boundary, wherever the rank is; nothing waits for
           the calls in flight, which may wait on a peer.  Each rank says how many collectives it
           has launched.
  advance  each rank behind the furthest one runs on until it has launched as many, and stops
           there: now every collective launched anywhere is launched everywhere and can complete.
  drain    every rank's calls in flight leave and its work on the device finishes.
  copy     `dump`, `restore` or `suspend` on every rank, through the same connections (they find
           the gate held and keep it so).  Each was staged on its rank before `close` (`stage=1`:
           the image mapped and pinned, the digest kernel loaded, while the job ran), so the freeze
           holds the copies alone: on the H200, pinning two ranks' 0.45-GiB images under the closed
           gates had made a 0.42-s freeze of 10-ms copies.
  open     every gate reopens (a suspension keeps its own closed until `resume`).

The whole of it has one time bound (`timeout_s`).  If any rank fails, dies or runs past the bound,
every rank still held is given back running (gates open; a rank suspended already is unsuspended)
and nothing is written that claims to be valid: the job directory is renamed into place only once
every rank's checkpoint in it is complete.

A job directory holds `job.json` and one directory per rank, `rank-N`, each a checkpoint of the
per-process format (checkpointer/store.py) with its own manifest and checksums: `restore` reads
and verifies every rank's before it touches any process.

Which processes form a job: the pids given, or `tree(PID)`, PID and its descendants that run the
shim (a launcher and its ranks).  They must be of one job: the same $GPUTRACE_JOB (which `gputrace
run` sets and its children inherit), or, where none is set, the same session.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import orjson

from gputrace.base.errors import (CheckpointError, CheckpointMismatch, CorruptCheckpoint,
                                  GputraceError, NoSuchProcess, ShimUnavailable, UsageError)
from gputrace.base.procs import alive, comm, descendants, environ, require_process, stop_point
from gputrace.shim import client

from . import schema, store
from .ops import (DEFAULT_CHUNK, DEFAULT_LANES, ShimSession, compare, identity_differences, manifest_of, shim_failure,
                  verified_image)

JOB_FORMAT = "gputrace-job-checkpoint"
JOB_SCHEMA = 1
JOB_MANIFEST = "job.json"
DEFAULT_TIMEOUT_S = 30.0
REPLY_GRACE_S = 5.0  # beyond the bound, for a reply on its way
RELEASE_TIMEOUT_S = 5.0


# ---------------------------------------------------------------------------------------------------------------
# Which processes


def job_of(pid: int) -> str:
    """What names the job process `pid` belongs to: its $GPUTRACE_JOB, else its session."""
    env = environ(pid)
    if env.get("GPUTRACE_JOB"):
        return f"job {env['GPUTRACE_JOB']}"
    try:
        return f"session {os.getsid(pid)}"
    except OSError:
        return "an unknown job"


def tree(pid: int) -> list[int]:
    """PID and its descendants, those whose shim serves (in pid order)."""
    require_process(pid)
    seen = descendants(pid)
    serving = sorted(p for p in seen if client.socket_path(p) is not None)
    if not serving:
        mapped = [p for p in seen if client.has_shim(p)]
        raise ShimUnavailable(
            f"no process in the tree of {pid} ({comm(pid)}) is served by the gputrace shim"
            + (f" ({len(mapped)} map it but have made no CUDA call yet)" if mapped else ""),
            "start the job with: gputrace run --checkpointable -- LAUNCHER ...; its ranks serve once they call CUDA")
    return serving


def resolve(pids: list[int], tree_of: int | None = None) -> list[int]:
    """The job's processes, checked: each alive and served by the shim, all of one job."""
    out: list[int] = []
    for p in (tree(tree_of) if tree_of is not None else []) + list(pids):
        if p not in out:
            out.append(p)
    if not out:
        raise UsageError("no process given", "give -p PID[,PID...] or --tree PID")
    for p in out:
        try:
            require_process(p)
        except NoSuchProcess:
            raise NoSuchProcess(f"no process with pid {p} (one of the job's {len(out)})",
                                "check the pids with `gputrace ps`; that rank may have exited") from None
        if client.socket_path(p) is None:
            mapped = client.has_shim(p)
            raise ShimUnavailable(
                f"process {p} ({comm(p)}) " + ("does not have the gputrace shim loaded" if mapped is False else
                                                "is not served by the gputrace shim (yet)"),
                "every process of the job must run under the shim: gputrace run --checkpointable -- CMD; "
                "`gputrace ps` lists those that do")
    jobs: dict[str, list[int]] = {}
    for p in out:
        jobs.setdefault(job_of(p), []).append(p)
    if len(jobs) > 1:
        parts = "; ".join(f"{', '.join(map(str, ps))} in {j}" for j, ps in jobs.items())
        raise UsageError(f"the processes belong to different jobs: {parts}",
                         "give the processes of one job (all started by one `gputrace run`), or its launcher with "
                         "--tree PID; operate on each job by itself")
    return out


# ---------------------------------------------------------------------------------------------------------------
# The gang


class GangError(CheckpointError):
    """A rank failed, died, or the bound passed; every rank is running again."""


@dataclass
class _Rank:
    index: int
    pid: int
    s: ShimSession
    held: bool = False  # this connection holds its gate closed
    suspended: bool = False  # suspended by this operation, not kept yet
    broken: bool = False  # its connection failed: only closing it is left (the shim then gives the rank back)


class Gang:
    """Connections to every rank (each with its per-process lock), the bound, and the steps."""

    def __init__(self, pids: list[int], what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.ranks: list[_Rank] = []
        self.collectives = 0
        self.aligned = False  # every rank stopped just after launching the same collective
        try:
            for i, p in enumerate(pids):
                self.ranks.append(_Rank(i, p, ShimSession(p, what)))
        except GputraceError as exc:
            self.close()
            raise type(exc)(f"rank {len(self.ranks)} (pid {pids[len(self.ranks)]}): {exc.msg}", exc.hint) from None
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Gang":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def left_ms(self, rank: _Rank | None = None) -> int:
        left = int((self.deadline - time.monotonic()) * 1000)
        if left <= 0:
            raise self.timed_out(rank, "")
        return min(left, 600000)

    def timed_out(self, r: _Rank | None, detail: str) -> GangError:
        who = f"rank {r.index} (pid {r.pid})" if r else "the job"
        return GangError(f"the {self.what} of the job's {len(self.ranks)} processes ran past its bound of "
                         f"{self.timeout_s:g} s at {who}" + (f": {detail}" if detail else ""),
                         "every rank is running again and nothing was kept; try again, or give a longer --timeout "
                         "(collectives the shim does not know by name also hold a job: GPUTRACE_SHIM_COLLECTIVES)")

    def request(self, r: _Rank, command: str, fd: int | None = None) -> dict:
        try:
            return r.s.request(command, fd=fd, timeout_s=self.left_ms(r) / 1000 + REPLY_GRACE_S)
        except GputraceError:
            r.broken = True  # no answer, or the connection lost: closing it is what gives the rank back
            raise

    def each(self, fn: Callable[[_Rank], object], ranks: list[_Rank] | None = None) -> list:
        """fn on every rank at once; once all have returned, the first failure (by rank) is raised."""
        ranks = self.ranks if ranks is None else ranks
        if not ranks:
            return []
        with ThreadPoolExecutor(max_workers=len(ranks)) as ex:
            futs = [ex.submit(fn, r) for r in ranks]
            results, errors = [], []
            for r, f in zip(ranks, futs):
                exc = f.exception()
                results.append(None if exc else f.result())
                if exc:
                    errors.append((r, exc))
        if errors:  # a rank lost says most; then a rank's own failure; a bound passed last
            errors.sort(key=lambda e: (alive(e[0].pid), isinstance(e[1], GangError), e[0].index))
            r, exc = errors[0]
            if isinstance(exc, GangError):
                raise exc
            if isinstance(exc, GputraceError):
                gone = not alive(r.pid)
                others = "the other ranks are" if len(self.ranks) > 1 else "it is"
                raise GangError(f"rank {r.index} (pid {r.pid}) " + (f"exited during the {self.what}" if gone else
                                                                    f"failed: {exc.msg}"),
                                f"{others} running again (gates open) and nothing was kept"
                                + ("" if gone else f"; {exc.hint}")) from None
            raise exc
        return results

    def expect(self, r: _Rank, reply: dict, what: str) -> dict:
        if reply.get("ok"):
            return reply
        if reply.get("error") == "timeout":
            raise self.timed_out(r, str(reply.get("detail", "")))
        raise GangError(f"rank {r.index} (pid {r.pid}): {shim_failure(reply, r.pid, what).msg}",
                        "every rank is running again and nothing was kept")

    def stage(self, command: str, fds: list[int]) -> None:
        """Every rank's copy prepared while the job runs (the shim keeps it for the same connection's
        next `command`, which then passes no descriptor)."""
        self.each(lambda r: self.expect(r, self.request(r, f"{command} stage=1", fd=fds[r.index]),
                                        f"prepare to {command.split()[0]}"))

    def quiesce(self) -> None:
        """close, advance, drain: on return every rank is stopped at the same collective, drained.

        Where the job launches collectives, every rank runs on to just after its launch of the
        collective after the furthest rank's last one: then each is stopped at the same point of its
        program, so a job whose device memory is later put back there goes on as it went on from
        here (`aligned`).  A rank that launches no further collective within half the bound is
        stopped where it is, and the others at its count: no rank waits on another (not aligned)."""

        def close(r: _Rank) -> dict:
            rep = self.expect(r, self.request(r, f"close {min(self.left_ms(r), 1000)}"), "stop")
            r.held = True
            return rep

        counts = [rep["collectives"] for rep in self.each(close)]
        stop_point("gang:closed")
        self.aligned = False
        if max(counts) > 0:
            target = max(counts) + 1
            budget = max(1, min(self.left_ms(), int(self.timeout_s * 500)))

            def advance(r: _Rank) -> int:
                rep = self.request(r, f"advance {target} {min(budget, self.left_ms(r))}")
                if not rep.get("ok") and rep.get("error") == "timeout":
                    return int(rep.get("collectives", 0))
                return int(self.expect(r, rep, "stop")["collectives"])

            counts = self.each(advance)
            self.aligned = min(counts) == target
        self.collectives = target = max(counts)
        behind = [r for r, c in zip(self.ranks, counts) if c < target]
        self.each(lambda r: self.expect(r, self.request(r, f"advance {target} {self.left_ms(r)}"), "stop"), behind)
        self.each(lambda r: self.expect(r, self.request(r, f"drain {self.left_ms(r)}"), "drain"))
        stop_point("gang:quiesced")

    def release(self) -> None:
        """Every gate this gang holds reopened, every suspension it made and did not keep undone."""

        def give_back(r: _Rank) -> None:
            try:
                if r.suspended:
                    r.s.request("unsuspend", timeout_s=RELEASE_TIMEOUT_S + 60)
                    r.suspended = False
                if r.held:
                    r.s.request("resume", timeout_s=RELEASE_TIMEOUT_S)
                    r.held = False
            except GputraceError:
                pass  # closing the connection gives it back as well (shim/control.c)

        with ThreadPoolExecutor(max_workers=max(1, len(self.ranks))) as ex:
            list(ex.map(give_back, [r for r in self.ranks if (r.held or r.suspended) and not r.broken]))

    def close(self) -> None:
        self.release()
        for r in self.ranks:
            r.s.close()


def _statuses(g: Gang, refuse_suspended: bool, what: str) -> list[dict]:
    st = g.each(lambda r: r.s.request("status"))
    if refuse_suspended:
        for r, s in zip(g.ranks, st):
            if s.get("suspended"):
                raise CheckpointError(f"rank {r.index} (pid {r.pid}) is suspended: its device memory is off the GPU, "
                                      f"so the job cannot {what}",
                                      f"bring the job back first: gputrace resume -p {','.join(str(x.pid) for x in g.ranks)}")
    return st


# ---------------------------------------------------------------------------------------------------------------
# Reports


@dataclass(frozen=True)
class JobReport:
    action: str  # checkpoint | restore | suspend | resume
    pids: list[int]
    collectives: int  # where every rank was stopped (collectives launched by each)
    aligned: bool  # each just after its launch of that collective: the same point of its program
    freeze_ns: int  # the first gate closed to the last reopened (suspend: to the last rank released)
    total_ns: int
    ranks: list[dict]  # each rank's reply from its shim, with rank and pid
    path: str | None = None

    @property
    def bytes(self) -> int:
        return sum(int(r.get("bytes", 0)) for r in self.ranks)

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes}


def _rank_row(r: _Rank, reply: dict, **extra) -> dict:
    keep = ("allocations", "bytes", "image_bytes", "reserved_bytes", "direct", "drain_ns", "sync_ns", "copy_ns",
            "freeze_ns", "release_ns", "remap_ns", "suspended_ns", "staged", "digest_ns", "chunks", "chunks_copied",
            "bytes_copied")
    return {"rank": r.index, "pid": r.pid, **{k: reply[k] for k in keep if k in reply}, **extra}


# ---------------------------------------------------------------------------------------------------------------
# The four operations


def _opts(lanes: int, chunk: int, direct: bool) -> str:
    return f"lanes={lanes} chunk={chunk} direct={int(direct)}"


def checkpoint(pids: list[int], out: Path | str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, direct: bool = True) -> JobReport:
    """Every rank's device memory, taken at the same collective, into the new job directory `out`
    (default job-PID-TIME under store.default_root(), PID the first rank's)."""
    t0 = time.monotonic_ns()
    out = Path(out) if out is not None else store.default_out(pids[0], prefix="job-")
    out = out.absolute()
    store.check_target(out)
    with Gang(pids, "checkpoint", timeout_s) as g:
        statuses = _statuses(g, True, "be checkpointed")
        fds = [os.memfd_create(f"gputrace-ckpt-{r.pid}", os.MFD_CLOEXEC) for r in g.ranks]
        try:
            g.stage(f"dump {_opts(lanes, chunk, direct)}", fds)
            tf = time.monotonic_ns()
            g.quiesce()

            def dump(r: _Rank) -> dict:
                return g.expect(r, g.request(r, f"dump timeout={g.left_ms(r)}"), "dump its device memory")

            replies = g.each(dump)
            g.release()
            freeze_ns = time.monotonic_ns() - tf
            part = store.PartialDir(out)
            tmp = part.create()
            rows = []
            try:
                for r, st, rep, fd in zip(g.ranks, statuses, replies, fds):
                    nbytes = os.fstat(fd).st_size
                    if nbytes != rep["image_bytes"]:
                        raise CheckpointError(f"rank {r.index}'s image is {nbytes} bytes, its shim said "
                                              f"{rep['image_bytes']}", "this is a bug; nothing was kept")
                    _, manifest = manifest_of(r.pid, st, rep, fd, nbytes)
                    manifest["job"] = {"rank": r.index, "ranks": len(g.ranks), "collectives": g.collectives}
                    store.write(tmp / f"rank-{r.index}", fd, nbytes, manifest)
                    rows.append(_rank_row(r, rep, dir=f"rank-{r.index}"))
                job = {"schema": JOB_SCHEMA, "format": JOB_FORMAT, "complete": True, "created_unix": time.time(),
                       "host": os.uname().nodename, "collectives": g.collectives, "aligned": g.aligned,
                       "ranks": [{"rank": row["rank"], "pid": row["pid"], "dir": row["dir"], "bytes": row["bytes"]}
                                 for row in rows]}
                part.write_file(JOB_MANIFEST, orjson.dumps(job, option=orjson.OPT_INDENT_2))
                part.commit()
            except OSError as exc:
                raise store.disk_error(exc, out) from None
            finally:
                part.discard()
        finally:
            for fd in fds:
                os.close(fd)
    return JobReport("checkpoint", list(pids), g.collectives, g.aligned, freeze_ns, time.monotonic_ns() - t0, rows, str(out))


def is_job(path: Path | str) -> bool:
    return (Path(path) / JOB_MANIFEST).exists()


def read_job(path: Path) -> tuple[dict, list[dict]]:
    """The job manifest and every rank's manifest, each checked (checksums are checked on copy)."""
    raw = schema.read_small(path / JOB_MANIFEST, "job manifest")
    try:
        job = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise CorruptCheckpoint(f"{path / JOB_MANIFEST} is not valid JSON", "the checkpoint is damaged") from None
    if not isinstance(job, dict) or job.get("format") != JOB_FORMAT or job.get("schema") != JOB_SCHEMA:
        raise CorruptCheckpoint(f"{path} is not a job checkpoint this gputrace reads",
                                "give the directory `gputrace checkpoint -p PID,PID...` wrote")
    ranks = job.get("ranks")
    if job.get("complete") is not True or not isinstance(ranks, list) or not ranks:
        raise CorruptCheckpoint(f"{path / JOB_MANIFEST} does not describe a complete job checkpoint",
                                "take a new checkpoint")
    manifests = []
    for i, r in enumerate(ranks):
        d = r.get("dir") if isinstance(r, dict) else None
        if not isinstance(d, str) or d != f"rank-{i}":
            raise CorruptCheckpoint(f"{path / JOB_MANIFEST}: rank {i} names no directory rank-{i}",
                                    "the checkpoint is damaged; take a new one")
        manifests.append(store.read_manifest(path / d))
    return job, manifests


def restore(path: Path | str, pids: list[int] | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
            lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, direct: bool = True,
            other_process: bool = False) -> JobReport:
    """Rolls every rank back to the job checkpoint in `path`: all ranks' checkpoints are verified
    (checksums, identities, allocations) before any process is touched, then all are stopped at the
    same collective and restored together.  `pids`: the job's processes, by default those the
    checkpoint was taken of; with `other_process`, given in rank order and restored whatever they are."""
    t0 = time.monotonic_ns()
    path = Path(path).absolute()
    job, manifests = read_job(path)
    taken = [m["target"]["pid"] for m in manifests]
    if pids is None:
        pids = taken
    if len(pids) != len(manifests):
        raise CheckpointMismatch(f"{path} holds {len(manifests)} ranks, {len(pids)} processes were given",
                                 "give every process of the job (or --tree LAUNCHER); nothing was changed")
    if not other_process:
        if sorted(pids) != sorted(taken):
            raise CheckpointMismatch(f"{path} was taken of processes {', '.join(map(str, taken))}, not "
                                     f"{', '.join(map(str, pids))}",
                                     "restore it into the job it was taken of, or pass --into-other-process to "
                                     "restore rank by rank in the order given; nothing was changed")
        pids = taken
        for i, (m, p) in enumerate(zip(manifests, pids)):
            who = identity_differences(m, p)
            if who:
                raise CheckpointMismatch(f"rank {i} of {path} is not a checkpoint of process {p}: {'; '.join(who)}",
                                         "restore it into the job it was taken of; nothing was changed")
    with Gang(pids, "restore", timeout_s) as g:
        statuses = _statuses(g, True, "be restored")
        for r, m, st in zip(g.ranks, manifests, statuses):
            diffs = compare(m, st)
            if diffs:
                raise CheckpointMismatch(f"rank {r.index} (pid {r.pid}) does not hold what {path / f'rank-{r.index}'} "
                                         f"describes: {'; '.join(diffs[:3])}",
                                         "restore into the job the checkpoint was taken of; nothing was changed")
        fds = [os.memfd_create(f"gputrace-restore-{r.pid}", os.MFD_CLOEXEC) for r in g.ranks]
        try:
            for r, m, fd in zip(g.ranks, manifests, fds):
                rdir = path / f"rank-{r.index}"
                verified_image(rdir, m, fd)
            g.stage(f"restore {_opts(lanes, chunk, direct)}", fds)
            tf = time.monotonic_ns()
            g.quiesce()

            def put_back(r: _Rank) -> dict:
                rep = g.request(r, f"restore timeout={g.left_ms(r)}")
                if not rep.get("ok") and rep.get("error") == "mismatch":
                    raise GangError(f"rank {r.index} (pid {r.pid}) changed its allocations meanwhile",
                                    "every rank is running again; their device memory may be partly restored: "
                                    "restore again before relying on it")
                return g.expect(r, rep, "restore its device memory")

            try:
                replies = g.each(put_back)
            except GangError as exc:
                raise GangError(exc.msg, "every rank is running again; ranks restored before the failure hold the "
                                         "checkpoint's data, the others their own: restore again before relying on "
                                         "the job") from None
            g.release()
            freeze_ns = time.monotonic_ns() - tf
        finally:
            for fd in fds:
                os.close(fd)
    rows = [_rank_row(r, rep) for r, rep in zip(g.ranks, replies)]
    return JobReport("restore", list(pids), g.collectives, g.aligned, freeze_ns, time.monotonic_ns() - t0, rows, str(path))


def suspend(pids: list[int], *, timeout_s: float = DEFAULT_TIMEOUT_S, lanes: int = DEFAULT_LANES,
            chunk: int = DEFAULT_CHUNK, direct: bool = True) -> JobReport:
    """Every rank suspended at the same collective (their data in host memory); all or none."""
    t0 = time.monotonic_ns()
    with Gang(pids, "suspend", timeout_s) as g:
        statuses = g.each(lambda r: r.s.request("status"))
        for r, st in zip(g.ranks, statuses):
            if st.get("suspended"):
                raise CheckpointError(f"rank {r.index} (pid {r.pid}) is already suspended",
                                      f"bring the job back first: gputrace resume -p {','.join(map(str, pids))}")
        fds = [os.memfd_create(f"gputrace-suspend-{r.pid}", os.MFD_CLOEXEC) for r in g.ranks]
        try:
            g.stage(f"suspend {_opts(lanes, chunk, direct)}", fds)
            tf = time.monotonic_ns()
            g.quiesce()

            def off(r: _Rank) -> dict:
                rep = g.request(r, f"suspend timeout={g.left_ms(r)}")
                if rep.get("ok"):
                    r.suspended, r.held = True, False  # the gate is the suspension's now
                elif rep.get("error") == "unsupported":
                    raise GangError(f"rank {r.index} (pid {r.pid}) cannot be suspended: {rep.get('detail', '')}",
                                    "start the job with: gputrace run --checkpointable --suspendable -- CMD; every "
                                    "rank is running again")
                return g.expect(r, rep, "suspend")

            replies = g.each(off)
            kept = g.each(lambda r: r.s.request("keep"))
            for r, k in zip(g.ranks, kept):
                if not k.get("ok"):
                    raise GangError(f"rank {r.index} (pid {r.pid}) would not keep its suspension: {k.get('error')}",
                                    "every rank is given back running")
                r.suspended = False
            freeze_ns = time.monotonic_ns() - tf
        finally:
            for fd in fds:
                os.close(fd)  # the shims hold their own descriptors of the images
    rows = [_rank_row(r, rep) for r, rep in zip(g.ranks, replies)]
    return JobReport("suspend", list(pids), g.collectives, g.aligned, freeze_ns, time.monotonic_ns() - t0, rows)


def resume(pids: list[int], *, timeout_s: float = DEFAULT_TIMEOUT_S, lanes: int = DEFAULT_LANES,
           chunk: int = DEFAULT_CHUNK, direct: bool = True) -> JobReport:
    """Every rank of a suspended job back on the GPU, all at once (they were stopped at the same
    collective, so none waits on another for long)."""
    t0 = time.monotonic_ns()
    with Gang(pids, "resume", timeout_s) as g:
        statuses = g.each(lambda r: r.s.request("status"))
        not_susp = [r for r, st in zip(g.ranks, statuses) if not st.get("suspended")]
        if not_susp:
            raise CheckpointError(f"{', '.join(f'rank {r.index} (pid {r.pid})' for r in not_susp)} "
                                  f"{'is' if len(not_susp) == 1 else 'are'} not suspended; nothing was resumed",
                                  f"suspend the whole job first: gputrace suspend -p {','.join(map(str, pids))}")
        results: dict[int, dict] = {}

        def back(r: _Rank) -> dict:
            rep = g.request(r, f"unsuspend {_opts(lanes, chunk, direct)}")
            results[r.index] = rep
            return rep

        g.each(back)
        failed = [r for r in g.ranks if not results[r.index].get("ok")]
        if failed:
            raise CheckpointError(
                f"{', '.join(f'rank {r.index} (pid {r.pid})' for r in failed)} could not resume: "
                + "; ".join(str(results[r.index].get("detail") or results[r.index].get("error")) for r in failed),
                "those stay suspended with their data kept (the others run, and wait for them in their next "
                f"collective); free GPU memory and run: gputrace resume -p {','.join(str(r.pid) for r in failed)}")
    rows = [_rank_row(r, results[r.index]) for r in g.ranks]
    return JobReport("resume", list(pids), 0, False, max(int(x.get("remap_ns", 0)) + int(x.get("copy_ns", 0)) for x in rows),
                     time.monotonic_ns() - t0, rows)


__all__ = ["DEFAULT_TIMEOUT_S", "GangError", "JobReport", "checkpoint", "is_job", "job_of", "read_job", "resolve",
           "restore", "resume", "suspend", "tree"]
