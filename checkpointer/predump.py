"""Pre-dumps: a whole-process checkpoint's host memory copied while the job runs, so that the final
`checkpoint --full` writes, inside its freeze, only the pages the job wrote since (issue 42 part 4).

    gputrace checkpoint --full --pre-dump -p PID -o DIR     while the job runs (again: only what changed since)
    gputrace checkpoint --full -p PID -o DIR                the freeze: the pages written since the last pre-dump

A pre-dump (`full.pre_dump`; this module holds what it and the final checkpoint share) is CRIU's
(`criu pre-dump --track-mem`): the job's tasks are frozen while their page maps
are collected and run on while the pages are written; the kernel's soft-dirty bits then mark every
page the job writes, and the final `criu dump --track-mem --prev-images-dir ../pre-N` writes only
those, naming the others as in pre-N.  The GPU side is left alone: no driver lock, no driver
checkpoint, no shim gate (the final dump takes them, as a whole one does).  What the shim keeps
between commands (its pinned pool, a suspension's image) is given back first, as before a final
dump, so that CRIU copies the job's own memory and not that.

Where the pre-dumps wait: `.NAME.pre-dump` beside the final directory DIR (without -o,
`.full-PID.pre-dump` under the default root), one directory `pre-N` a pre-dump (pre-2's `parent` link
names ../pre-1), and `pre-dump.json` (format "gputrace-full-pre-dump", schema 1: target {pid, comm,
start_time, boot_id}, criu {path, version}, hash, pre_dumps [{dir, created_unix, ns, stats (CRIU's
stats-dump: pages scanned, written, frozen time), bytes (its pages), files [{path, bytes, xxh3}]}]),
rewritten whole (written beside and renamed) after each.  The final checkpoint links them into its own
directory, names and checksums each in its manifest (`criu.pre_dumps`, their files among `files`) and
removes the pending directory once it is complete: `restore --full` needs every pre-N.

The kernel's tracking is one per process: any CRIU run with --track-mem on the job clears it.  So the
last run's images are recorded per process (`$TMPDIR/gputrace-track-mem/PID-STARTTIME`, under a lock
held across each run): a pre-dump chain whose last link is not that run's is stale (another target's
pre-dump or final dump cleared the tracking since) and is started again, and a final checkpoint does
not use it (it dumps whole and says why).  A failed pre-dump discards its target's pre-dumps: CRIU may
have cleared the tracking before it failed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import xxhash

from gputrace.base.errors import CheckpointError, CorruptCheckpoint
from gputrace.base.procs import boot_id, comm as procs_comm, require_process, require_running, start_time

from . import criu as criu_mod
from . import store
from .store import HASH

FORMAT = "gputrace-full-pre-dump"
STATE = "pre-dump.json"
PREFIX = "pre-"


class PreDumpFailed(CheckpointError):
    """CRIU could not pre-dump the job (on a GPU: its device mappings, most likely); nothing was kept."""


@dataclass(frozen=True)
class PreDumpReport:
    pid: int
    path: str  # the pending directory the pre-dumps wait in
    target: str  # the final checkpoint's directory they are for
    index: int  # this pre-dump's N (pre-N)
    restarted: str | None  # why an earlier chain there was dropped first (stale), or None
    ns: int  # the whole CRIU pre-dump
    frozen_ns: int | None  # CRIU's own count of the time the job's tasks were frozen (None: it said nothing)
    pages_scanned: int | None  # ... and of the pages (None: not known)
    pages_written: int | None
    bytes: int  # the pages this pre-dump wrote
    pre_dumps: int  # pre-dumps waiting there now, this one included
    pre_dump_bytes: int  # the pages they hold together
    released_pinned_bytes: int
    write_ns: int  # checksums and state, after CRIU
    total_ns: int
    criu: str

    def to_dict(self) -> dict:
        return {"kind": "full-pre-dump", **asdict(self)}


def pending_dir(pid: int, out: Path | None) -> Path:
    """Where the pre-dumps for the final checkpoint `out` wait (`out` None: the default root's)."""
    if out is not None:
        return out.parent / f".{out.name}.pre-dump"
    return store.default_root() / f".full-{pid}.pre-dump"


# --- the per-process record of the last run that cleared the kernel's tracking ---------------------------------

def _record_dir() -> Path:
    return Path(tempfile.gettempdir()) / "gputrace-track-mem"


class Tracking:
    """The record of which images the job's page tracking counts from, locked while held."""

    def __init__(self, pid: int, start: int | None) -> None:
        d = _record_dir()
        d.mkdir(mode=0o700, exist_ok=True)
        self.path = d / f"{pid}-{start}"
        self._fd = os.open(d / f"{pid}-{start}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def __enter__(self) -> "Tracking":
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)

    def last(self) -> dict:
        try:
            return orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}

    def counts_from(self, images: Path) -> bool:
        """Whether the tracking now counts from `images` (written by a run that completed)."""
        r = self.last()
        return r.get("images") == str(images) and r.get("state") == "done"

    def set(self, images: Path, state: str) -> None:
        tmp = self.path.with_name(self.path.name + ".new")
        tmp.write_bytes(orjson.dumps({"images": str(images), "state": state, "unix": time.time()}))
        os.replace(tmp, self.path)


# --- the pending directory ----------------------------------------------------------------------------------------

def read_state(pend: Path) -> dict | None:
    """The pending directory's state, or None where there is none."""
    p = pend / STATE
    if not p.exists():
        return None
    try:
        st = orjson.loads(p.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{p} cannot be read ({exc})",
                                f"remove {pend} (pre-dumps only: the next checkpoint dumps whole)") from None
    if st.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{p} is not a gputrace pre-dump's state", f"remove {pend}, or use another -o")
    return st


def same_process(st: dict, pid: int) -> bool:
    t = st.get("target", {})
    return t.get("pid") == pid and t.get("start_time") == start_time(pid) and t.get("boot_id") == boot_id()


def last_images(pend: Path, st: dict) -> Path | None:
    return pend / st["pre_dumps"][-1]["dir"] if st.get("pre_dumps") else None


def write_state(pend: Path, st: dict) -> None:
    tmp = pend / f".{STATE}.new"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(st, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pend / STATE)
    store.fsync_dir(pend)


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def hash_files(images: Path, rel: str) -> list[dict]:
    out = []
    for p in sorted(q for q in images.iterdir() if q.is_file() and not q.is_symlink()):
        out.append({"path": f"{rel}/{p.name}", "bytes": p.stat().st_size, HASH: _hash_file(p)})
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    store.fsync_dir(images)
    return out


def page_bytes(images: Path) -> int:
    """What CRIU wrote of pages into `images` (its pages-*.img)."""
    return sum(p.stat().st_size for p in images.glob("pages-*.img"))


def parasite_left(pid: int) -> bool:
    """Whether CRIU's own code is still mapped in the job (what an aborted CRIU leaves)."""
    try:
        return "CRIUMFD" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


# --- used by the final checkpoint ---------------------------------------------------------------------------------

@dataclass
class Chain:
    """The pre-dumps a final checkpoint takes, linked into its directory."""

    pend: Path
    state: dict

    @property
    def last(self) -> str:
        return self.state["pre_dumps"][-1]["dir"]

    def files(self) -> list[dict]:
        return [f for e in self.state["pre_dumps"] for f in e["files"]]

    def manifest(self) -> list[dict]:
        """The manifest's `criu.pre_dumps`: each pre-dump named, with what it held."""
        return [{"dir": e["dir"], "created_unix": e["created_unix"], "ns": e["ns"], "bytes": e["bytes"],
                 "files": len(e["files"]), "stats": e["stats"]} for e in self.state["pre_dumps"]]

    def bytes(self) -> int:
        return sum(e["bytes"] for e in self.state["pre_dumps"])

    def link_into(self, tmp: Path) -> None:
        """Every pre-N into the checkpoint's directory `tmp` (hard links, copies across filesystems),
        each pre-N's `parent` link as it was."""
        for e in self.state["pre_dumps"]:
            src, dst = self.pend / e["dir"], tmp / e["dir"]
            dst.mkdir(mode=0o700)
            for f in e["files"]:
                name = f["path"].split("/", 1)[1]
                try:
                    os.link(src / name, dst / name)
                except OSError:
                    shutil.copy2(src / name, dst / name)
            if (src / "parent").is_symlink():
                os.symlink(os.readlink(src / "parent"), dst / "parent")

    def sizes_ok(self) -> str | None:
        """Why the pre-dumps cannot be used as they are on disk (a file gone or of another size), or None."""
        for e in self.state["pre_dumps"]:
            for f in e["files"]:
                p = self.pend / f["path"]
                try:
                    if p.stat().st_size != f["bytes"]:
                        return f"{p} changed size since its pre-dump"
                except OSError:
                    return f"{p} is missing"
        return None


def usable(pid: int, out: Path, c: criu_mod.Criu, track: Tracking) -> tuple[Chain | None, str | None]:
    """The pre-dumps waiting for the final checkpoint `out` of `pid` that it can dump after: (chain,
    None); or (None, why not) where some wait that it cannot use; (None, None) where none wait.
    Refuses pre-dumps of another process (CheckpointError): the wrong -o, most likely."""
    pend = pending_dir(pid, out)
    st = read_state(pend)
    if st is None or not st.get("pre_dumps"):
        return None, None
    if not same_process(st, pid):
        t = st.get("target", {})
        raise CheckpointError(f"{pend} holds pre-dumps of another process (pid {t.get('pid')}, {t.get('comm')}), "
                              f"not of {pid}", f"remove {pend}, or give another -o")
    if not track.counts_from(last_images(pend, st)):
        return None, ("another pre-dump or dump of the job cleared the kernel's page tracking after the last "
                      "pre-dump there")
    ok, said = criu_mod.check(c, criu_mod.DIRTY_TRACK)
    if not ok:
        return None, f"`criu check --feature {criu_mod.DIRTY_TRACK}` fails now ({said})"
    chain = Chain(pend, st)
    bad = chain.sizes_ok()
    if bad:
        return None, bad
    return chain, None


def discard(pid: int, out: Path) -> None:
    """The pending pre-dumps for `out` removed (used by the final checkpoint, or of no use any more)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(pending_dir(pid, out))
