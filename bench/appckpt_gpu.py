#!/usr/bin/env python3
"""Application-level against system-level checkpoints of one training job: torch.save, PyTorch Distributed
Checkpoint (synchronous and async_save), `gputrace checkpoint` and `gputrace checkpoint --full`.  For each:
how long the job is held, how long until it trains again from the checkpoint after a failure, the
checkpoint's size on storage, whether the state came back (losses compared bit for bit), and, under a
stated failure model (bench/failure_model.py), the checkpoint interval that keeps the overhead at 1% and
the work expected to be lost per failure.

The job (bench/appckpt_job.py): GPT-2 style (transformers' GPT2LMHeadModel from GPT2Config, random init),
AdamW, one fixed batch; --size small (about 23M parameters) or large (about 355M: model + optimizer state
about 4 GiB).  Application-level methods run on a job started plainly (commands on its stdin); gputrace's
on a job started under `gputrace run --checkpointable --suspendable`, with setsid and its stdio on a file
(what CRIU needs; commands come as files, see the job's docstring).  Every method, in turn:

  torch       `save-torch` in the job: {model, optimizer, step} state_dicts, torch.save, flush, fsync.
              held_s: the command's time (the training loop is blocked throughout); write_s the same.
  dcp         `save-dcp`: torch.distributed.checkpoint.save (get_state_dict; gloo process group of world
              size 1), synchronous: held_s as above.
  dcp-async   `save-dcp-async`: the job trains a phase (the rate before), calls dcp.async_save (held_s:
              until it returns, the state staged into host memory), then trains on until the write
              completes: write_s from the call, the steps that ran meanwhile and their rate.
  dcp-async-pinned (not in the default list) the same with a DefaultStager staging into pinned memory in
              the background (held until staging is done).
    For these three (four), resume_s is what a job restarted after a failure pays: a fresh process
    (`appckpt_job.py --resume-from torch|dcp PATH`) from its spawn through imports, model build and the
    load to the end of its first training step (its evaluation of the loaded state not counted).  The live
    job also loads the checkpoint in place (load_in_place: its time and the same loss check).
  gputrace    `gputrace checkpoint -p PID -o DIR` while the job runs a heartbeat (a one-element kernel and a
              synchronize about every millisecond, the model untouched): held_s is the heartbeat's longest
              gap less its usual one (the tool's own freeze is held_reported_s); write_s the tool's total
              (the directory is complete then: the data are written after the job is released).  Then
              (--during-training) a second checkpoint while the job trains: its rate during the checkpoint
              and its longest step.  resume_s: `gputrace restore -p PID DIR --device-only --force` (a rollback of the live
              process's device memory) to the end of the first training step after it.
  gputrace-full `checkpoint_full(PID, DIR, leave_running=True)` (the Python API behind `gputrace checkpoint
              --full --leave-running`) under the same heartbeat: held_s as above (the job is stopped until
              the checkpoint is complete on storage); the job trains on, is then killed (the failure),
              and resume_s runs from `restore_full(DIR)` (CRIU restore, driver Restore + Unlock, shim resume)
              to the end of the first training step of the restored process.  --full-idle: the job is
              checkpointed idle instead (should a thread held at the shim's gate trouble CRIU), and held_s is
              then the report's freeze + image check + write, a lower bound.
  Loss check (every method): the evaluation loss right after resuming equals the one at the checkpoint,
  and the next two training losses equal the ones the job had after the checkpoint, bitwise (every method
  restores the whole training state: weights, AdamW moments and step counts, on the device with
  capturable=True; the batch is fixed; dropout is off and the kernels deterministic).
  Paired phases: --phase-s of training right before and right after each checkpoint in the same process
  (steps_per_s_before / _after); the job's step time (step_s) comes from a phase right after warm-up.

Before each resume the checkpoint's files are evicted from the page cache (sync, posix_fadvise DONTNEED;
--page-cache drop: the whole page cache, libraries too; keep: nothing): the checkpoint is read from storage,
as a restart after a failure would read it, while the code a restarted job maps stays cached.
Each method has --timeout seconds (SIGALRM; a job in an unknown state is then killed and the next method
starts a fresh one) and the run --budget-s: methods that would start too late are skipped, with the reason.
The JSON (schema gputrace.bench.appckpt/1) is rewritten after every method (FILE.tmp, then renamed;
"complete" false until the end); anything not measured is null with `<field>_reason` beside it.

On the GPU machine (CRIU from bench/make-criu-bundle in .gpu/criu, as bench/gpu-env.sh says):
    source bench/gpu-env.sh
    python3 bench/appckpt_gpu.py --size large --storage /var/tmp/appckpt --out /tmp/appckpt-large.json
    python3 bench/appckpt_gpu.py --size small --storage /var/tmp/appckpt --out /tmp/appckpt-small.json \\
        --methods torch,dcp,dcp-async,dcp-async-pinned,gputrace,gputrace-full --mtbf-h 1,4,24
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOB = HERE / "appckpt_job.py"
sys.path.insert(0, str(HERE))
import checkpoint_gpu as cg  # noqa: E402  (cli: a gputrace command's --json)
import full_checkpoint_gpu as fg  # noqa: E402  (wait_for_text, wait_exit: driving a job whose stdio is a file)
from failure_model import CheckpointCosts, FailureModel, assumptions, expected  # noqa: E402
from provenance import commit  # noqa: E402

SCHEMA = "gputrace.bench.appckpt/1"
GIB = 1 << 30
DEFAULT_METHODS = ("torch", "dcp", "dcp-async", "gputrace", "gputrace-full")
APP = ("torch", "dcp", "dcp-async", "dcp-async-pinned")
SYSTEM = ("gputrace", "gputrace-full")
ALL = APP + SYSTEM
BACKGROUND = {"dcp-async", "dcp-async-pinned", "gputrace"}  # write_s floors the interval (failure_model)
DEFAULT_TIMEOUT = {"small": 100.0, "large": 170.0}
START_S = {"small": 40.0, "large": 70.0}  # a job's start, held against the budget


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] appckpt: {msg}", flush=True)


class MethodTimeout(BaseException):
    """--timeout passed (SIGALRM); a BaseException, so that no `except Exception` on the way swallows it."""


class Failed(Exception):
    """A step of a method failed; the job is still answering."""


class _Skip(Exception):
    """The method is not run (rec["skipped"] says why)."""


class JobGone(Exception):
    """The job ended or cannot be trusted any more: the next method needs a fresh one."""


def _alarm(_sig, _frame):
    raise MethodTimeout()


def put(rec: dict, key: str, value, reason: str | None = None) -> None:
    """rec[key] = value; a None gets `key_reason` beside it."""
    rec[key] = value
    if value is None:
        rec[f"{key}_reason"] = reason or "not measured"
    else:
        rec.pop(f"{key}_reason", None)


def clean(x):
    """JSON-safe: non-finite floats become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean(doc), indent=1) + "\n")
    os.replace(tmp, path)


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def tree_bytes(path: Path) -> tuple[int, int]:
    """(apparent, allocated) bytes of every regular file under path (or of path itself)."""
    if path.is_file():
        st = path.stat()
        return st.st_size, st.st_blocks * 512
    size = alloc = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            full = os.path.join(dirpath, f)
            if not os.path.islink(full):
                st = os.lstat(full)
                size += st.st_size
                alloc += st.st_blocks * 512
    return size, alloc


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def page_cache(mode: str, path: Path) -> str:
    """Before a resume: the checkpoint read from storage, not from memory.  evict (the default): sync, then
    every file of the checkpoint dropped from the page cache (posix_fadvise DONTNEED), the code and libraries
    a restarted job maps staying cached, as on the node it ran on; drop: the whole page cache (echo 3 >
    /proc/sys/vm/drop_caches: libraries too, as on a node that never ran it); keep: nothing."""
    if mode == "keep":
        return "kept (--page-cache keep)"
    os.sync()
    if mode == "drop":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "dropped: the whole page cache (drop_caches 3)"
        except OSError as exc:
            return f"kept: could not drop it ({exc})"
    files = [path] if path.is_file() else [Path(d) / f for d, _s, fs in os.walk(path) for f in fs]
    n = nbytes = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
            nbytes += os.fstat(fd).st_size
        except OSError:
            pass
        finally:
            os.close(fd)
    return (f"evicted: the checkpoint's {n} files ({nbytes} bytes) dropped from the page cache after a sync "
            "(posix_fadvise DONTNEED); code and libraries stay cached")


def fits(name: str, info: dict, pid: int, storage: Path, a) -> str | None:
    """Why the method's checkpoint cannot fit the storage's free space (None: it fits), from the job's sizes."""
    free = shutil.disk_usage(storage).free
    state, reserved = info.get("state_bytes") or 0, info.get("reserved") or 0
    rss = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    need = {"gputrace": reserved * (2 if a.during_training else 1), "gputrace-full": reserved + rss}.get(name, state)
    need = int(need * 1.2) + (1 << 30)
    if need > free:
        return (f"skipped: its checkpoint needs about {need / GIB:.1f} GiB on {storage}, which has {free / GIB:.1f} GiB "
                f"free (state {state / GIB:.2f} GiB, GPU memory reserved {reserved / GIB:.2f} GiB, host RSS "
                f"{rss / GIB:.2f} GiB; a 20% margin and 1 GiB)")
    return None


def device() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def job_env() -> dict:
    return dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1")


# --- the two ways of driving the job ----------------------------------------------------------------------------

class PipeJob:
    """The job on pipes: commands on its stdin, answers on its stdout, its stderr in a log file."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log = log_path
        self._logf = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, env=job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._logf, text=True, cwd=str(REPO))
        self.pid = self.proc.pid
        self.n = 0
        self.ready = self._until(lambda d: d.get("ready") is True)

    def _until(self, pred) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise JobGone(f"the job ended (status {self.proc.wait()}): {tail(self.log)}")
            try:
                d = json.loads(line)
            except ValueError:
                continue  # not one of its answers
            if isinstance(d, dict) and pred(d):
                return d

    def send(self, line: str) -> str:
        self.n += 1
        tok = f"{self.n}x{secrets.token_hex(3)}"
        try:
            self.proc.stdin.write(f"@{tok} {line}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise JobGone(f"the job does not read its commands ({exc}): {tail(self.log)}") from None
        return tok

    def reply(self, tok: str) -> dict:
        return self._until(lambda d: d.get("tok") == tok)

    def started(self, tok: str) -> dict:
        return self._until(lambda d: d.get("tok") == f"{tok}-started")

    def cmd(self, line: str) -> dict:
        r = self.reply(self.send(line))
        if not r.get("ok"):
            raise Failed(f"`{line}` in the job: {r.get('error')}")
        return r

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._logf.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (JobGone, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class DirJob:
    """The job as CRIU needs it: setsid, stdin /dev/null, stdout and stderr on a log file opened
    O_WRONLY|O_APPEND, commands as files DIR/cmd-NNNNNN (the job holds none open).  The log must be in
    append mode: CRIU checks a regular file's size at restore unless it is open so, and the job writes on
    after a leave-running checkpoint (full_checkpoint_gpu.start opens it "w", which works there only
    because its job is killed at the dump), so this class starts its job itself."""

    def __init__(self, argv: list[str], log_path: Path, control: Path, timeout_s: float) -> None:
        self.log, self.control, self.timeout_s = log_path, control, timeout_s
        remove(control)
        control.mkdir(parents=True)
        with open(log_path, "a") as f:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                argv, env=job_env(), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=str(REPO))
        self.pid = self.proc.pid
        self.n = 0
        self.ready = self._line('"ready": true')

    def _line(self, text: str) -> dict:
        try:
            content = fg.wait_for_text(self.log, text, self.proc, self.timeout_s)
        except RuntimeError as exc:
            if self.proc is not None and self.proc.poll() is not None:
                raise JobGone(str(exc)) from None
            raise Failed(str(exc)) from None
        for line in reversed(content.splitlines()):
            if text in line:
                try:
                    return json.loads(line)
                except ValueError:
                    break
        raise Failed(f"no answer in JSON with {text!r} in {self.log}")

    def send(self, line: str) -> str:
        self.n += 1
        tok = f"{self.n}x{secrets.token_hex(3)}"
        path = self.control / f"cmd-{self.n:06d}"
        tmp = self.control / f".cmd-{self.n:06d}.tmp"
        tmp.write_text(f"@{tok} {line}\n")
        os.rename(tmp, path)
        return tok

    def reply(self, tok: str) -> dict:
        return self._line(f'"tok": "{tok}"')

    def started(self, tok: str) -> dict:
        return self._line(f'"tok": "{tok}-started"')

    def cmd(self, line: str) -> dict:
        r = self.reply(self.send(line))
        if not r.get("ok"):
            raise Failed(f"`{line}` in the job: {r.get('error')}")
        return r

    def rebase(self, n: int) -> None:
        """After the job was killed and is to be restored from a checkpoint taken while it ran command n:
        the commands sent since go, and the next one is n + 1 again (what the restored job reads next)."""
        for p in self.control.glob("cmd-*"):
            if int(p.name[4:]) > n:
                p.unlink()
        self.n = n

    def adopt(self, pid: int) -> None:
        """The job is now the process CRIU restored (this process's child by then: restore_full makes
        this process a subreaper while CRIU runs)."""
        self.proc, self.pid = None, pid

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait()
        else:
            try:
                fg.wait_exit(self.pid, 60)
            except RuntimeError:
                pass

    def close(self) -> None:
        try:
            self.send("quit")
            if self.proc is not None:
                self.proc.wait(timeout=60)
            else:
                fg.wait_exit(self.pid, 60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            pass
        self.kill()


# --- what every method shares ------------------------------------------------------------------------------------

def phase(job, seconds: float) -> dict:
    r = job.cmd(f"train-for {seconds}")
    return {"steps": r["steps"], "seconds": r["seconds"], "steps_per_s": r["steps_per_s"],
            "step_s_median": r["step_s_median"]}


def loss_check(eval_ck: str, next_ref: list[str], eval_after: str | None, next_after: list[str] | None) -> dict:
    eq_eval = eval_after is not None and eval_after == eval_ck
    eq_next = next_after is not None and list(next_after) == list(next_ref)
    return {"eval_at_checkpoint": eval_ck, "eval_after_resume": eval_after, "eval_equal": eq_eval,
            "next_losses_reference": list(next_ref), "next_losses_after_resume": next_after,
            "next_equal": eq_next, "bitwise": eq_eval and eq_next, "expected": "bitwise",
            "why_expected": "the method restores the whole training state (weights, AdamW moments and step counts "
                            "on the device); the batch is fixed, dropout off, the kernels deterministic"}


def resume_fresh(a, kind: str, path: Path, api: str | None, pg: str, log_path: Path) -> dict:
    """A fresh process resumes from the checkpoint (appckpt_job.py --resume-from): its own timings, and the
    wall time from its spawn to its answer."""
    with open(log_path, "ab") as logf:
        t0 = time.monotonic()
        argv = [sys.executable, str(JOB), "--size", a.size, "--resume-from", kind, str(path), "--dcp-pg", pg,
                "--t0", repr(t0)] + (["--dcp-api", api] if api else [])
        p = subprocess.Popen(argv, env=job_env(), stdout=subprocess.PIPE, stderr=logf, text=True, cwd=str(REPO))
        try:
            out, _ = p.communicate()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.monotonic() - t0
    for line in out.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("resumed"):
            d["process_wall_s"] = wall
            d["exit_status"] = p.returncode
            return d
    raise Failed(f"the resuming process gave no answer (status {p.returncode}): {tail(log_path)}")


def record(name: str) -> dict:
    level = "application" if name in APP else "system"
    return {"level": level, "background_write": name in BACKGROUND, "error": None}


def finish(rec: dict) -> None:
    """Every headline field present: a value, or None with its reason (the method's error or skip)."""
    why = rec.get("error") or rec.get("skipped") or "not measured"
    for k in ("held_s", "write_s", "resume_s", "bytes", "loss_check"):
        if rec.get(k) is None:
            put(rec, k, None, rec.get(f"{k}_reason") or why)


def app_method(a, job: PipeJob, name: str, storage: Path, logs: Path, rec: dict) -> None:
    kind = "torch" if name == "torch" else "dcp"
    path = storage / ("ck-torch.pt" if kind == "torch" else f"ck-{name}")
    remove(path)
    rec["path"] = str(path)
    try:
        if name in ("torch", "dcp"):
            rec["held_how"] = ("the save command's time in the job: state_dicts, " +
                               ("torch.save, flush, fsync" if kind == "torch" else "dcp.save (files fsynced)") +
                               "; the training loop is blocked throughout")
            before = phase(job, a.phase_s)
            eval_ck = job.cmd("loss")["loss"]
            saves = []
            for i in range(a.repeats):
                log(f"{name}: save {i + 1}/{a.repeats}")
                saves.append(job.cmd(f"save-{kind} {path}"))
            last = saves[-1]
            rec["saves"] = [{k: s.get(k) for k in ("held_s", "bytes", "api", "pg", "api_error") if k in s}
                            for s in saves]
            put(rec, "held_s", last["held_s"])
            put(rec, "write_s", last["held_s"])
            rec["write_how"] = "blocking: the checkpoint is on storage (fsynced) when the job is released"
            api, pg = last.get("api"), last.get("pg")
            eval_ref = eval_ck
            next_ref = job.cmd("train 2")["losses"]
            after = phase(job, a.phase_s)
        else:
            pinned = name == "dcp-async-pinned"
            rec["held_how"] = ("dcp.async_save's call until it returned (the state staged into host memory)" if not
                               pinned else "dcp.async_save with a pinned DefaultStager, until staging completed")
            before = None
            log(f"{name}: async save, training on until it completes")
            r = job.cmd(f"save-dcp-async {path} {a.phase_s} {a.timeout * 0.6:.0f}" + (" pinned" if pinned else ""))
            rec["save"] = {k: v for k, v in r.items() if k not in ("tok", "ok", "cmd")}
            put(rec, "held_s", r["held_s"])
            put(rec, "write_s", r["write_s"])
            rec["write_how"] = "from the async_save call until its future completed; the job trained meanwhile"
            rec["steps_per_s_before"] = r["steps_per_s_before"]
            put(rec, "steps_per_s_during", r["steps_per_s_during"],
                "the write completed before a step did" if r["steps_during"] == 0 else None)
            rec["steps_during_write"] = r["steps_during"]
            api, pg = r.get("api"), r.get("pg")
            eval_ref, next_ref = r["eval_at_save"], r["next_losses"]
            after = phase(job, a.phase_s)
        if before is not None:
            rec["steps_per_s_before"] = before["steps_per_s"]
        rec["steps_per_s_after"] = after["steps_per_s"]
        size, alloc = tree_bytes(path)
        rec["bytes"], rec["bytes_allocated"] = size, alloc
        rec["dcp_api"] = api if kind == "dcp" else None
        rec["process_group"] = pg if kind == "dcp" else None
        if name in ("torch", "dcp"):
            log(f"{name}: load into the live job")
            try:  # beside the headline numbers: its failure leaves the fresh process's resume to run
                ld = job.cmd(f"load-{kind} {path}" + (f" {api}" if kind == "dcp" and api else ""))
                ev = job.cmd("loss")["loss"]
                nx = job.cmd("train 2")["losses"]
                rec["load_in_place"] = {"seconds": ld["seconds"], **loss_check(eval_ref, next_ref, ev, nx)}
            except Failed as exc:
                rec["load_in_place"] = {"seconds": None, "seconds_reason": f"the load failed: {exc}"[:2000]}
        rec["page_cache"] = page_cache(a.page_cache, path)
        log(f"{name}: a fresh process resumes from it")
        res = resume_fresh(a, kind, path, api, "gloo" if pg == "gloo" else "none", logs / f"resume-{name}.log")
        put(rec, "resume_s", res["resume_s"])
        rec["resume_how"] = ("a fresh process (appckpt_job.py --resume-from): spawn, imports, model build, load, "
                             "to the end of its first training step, less its evaluation of the loaded state")
        rec["resume"] = {k: res.get(k) for k in ("since_spawn_s", "import_s", "build_s", "load_s", "eval_s",
                                                 "first_step_s", "process_wall_s", "exit_status", "load")}
        rec["loss_check"] = loss_check(eval_ref, next_ref, res.get("eval_loss"), res.get("losses"))
    except (Failed, OSError, KeyError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    finally:
        if not a.keep:
            remove(path)


def gt_cli(*args: str) -> dict:
    doc = cg.cli(*args)
    if "error" in doc:
        raise Failed(f"`gputrace {' '.join(args)}` failed (status {doc.get('rc')}): {doc['error']}")
    return doc


def held_from_heartbeat(rec: dict, hb: dict) -> None:
    put(rec, "held_s", hb.get("held_s"), "the heartbeat saw no beat (it did not run during the checkpoint)")
    rec["heartbeat"] = {k: hb.get(k) for k in ("beats", "seconds", "max_gap_s", "median_gap_s", "gaps_over_10ms",
                                               "flag_seen")}
    rec["held_how"] = ("the job's heartbeat (a one-element kernel and a synchronize about every millisecond, the "
                       "model untouched) during the checkpoint: its longest gap less its median gap")


def under_heartbeat(job: DirJob, action, max_s: float):
    """action() while the job beats; returns (action's result, the heartbeat's answer, action's wall time)."""
    flag = job.control / f"flag-{job.n + 1}"
    tok = job.send(f"heartbeat-until {flag} {max_s:.0f}")
    job.started(tok)
    time.sleep(0.05)  # a few beats before, for the median
    t = time.monotonic()
    try:
        out = action()
        wall = time.monotonic() - t
    finally:
        time.sleep(0.05)
        flag.touch()
    return out, job.reply(tok), wall


def gputrace_method(a, job: DirJob, storage: Path, rec: dict) -> None:
    if not shutil.which("gputrace"):
        raise Failed("`gputrace` is not on PATH (source bench/gpu-env.sh first)")
    ck, ck2 = storage / "ck-gputrace", storage / "ck-gputrace-during"
    remove(ck)
    remove(ck2)
    rec["path"] = str(ck)
    try:
        before = phase(job, a.phase_s)
        eval_ck = job.cmd("loss")["loss"]
        log("gputrace: checkpoint under the heartbeat")
        c, hb, wall = under_heartbeat(job, lambda: gt_cli("checkpoint", "-p", str(job.pid), "-o", str(ck)),
                                      a.timeout)
        held_from_heartbeat(rec, hb)
        rec["held_reported_s"] = c.get("freeze_ns", 0) / 1e9 if "freeze_ns" in c else None
        put(rec, "write_s", c["total_ns"] / 1e9 if c.get("total_ns") else wall)
        rec["write_how"] = ("the tool's total: the job is released once its device memory is copied to host memory; "
                            "the directory is complete (hashed, written, fsynced, renamed) at the end")
        rec["checkpoint"] = {k: c.get(k) for k in ("freeze_ns", "copy_ns", "drain_ns", "sync_ns", "write_ns",
                                                   "total_ns", "bytes", "image_bytes", "stored_bytes", "direct",
                                                   "wall_ns")}
        size, alloc = tree_bytes(ck)
        rec["bytes"], rec["bytes_allocated"] = size, alloc
        next_ref = job.cmd("train 2")["losses"]
        after = phase(job, a.phase_s)
        rec["steps_per_s_before"], rec["steps_per_s_after"] = before["steps_per_s"], after["steps_per_s"]
        if a.during_training:
            log("gputrace: a second checkpoint while the job trains")
            flag = job.control / f"flag-{job.n + 1}"
            tok = job.send(f"train-until {flag} {a.timeout:.0f}")
            job.started(tok)
            c2, why = None, None
            try:
                c2 = gt_cli("checkpoint", "-p", str(job.pid), "-o", str(ck2))
            except Failed as exc:  # beside the headline numbers: the rollback below still runs
                why = str(exc)
            finally:
                flag.touch()
            tr = job.reply(tok)
            if not tr.get("ok"):
                raise Failed(f"training during the checkpoint: {tr.get('error')}")
            steps = tr["step_s"]
            rec["during_training"] = {
                "steps": tr["steps"], "seconds": tr["seconds"], "steps_per_s": tr["steps_per_s"],
                "longest_step_s": max(steps), "median_step_s": statistics.median(steps),
                "stall_s": max(steps) - statistics.median(steps),
                "checkpoint_freeze_ns": (c2 or {}).get("freeze_ns"), "checkpoint_total_ns": (c2 or {}).get("total_ns"),
                "error": why,
                "how": "the job trained from before the checkpoint command until it returned; stall: its longest step "
                       "less its median step"}
            remove(ck2)
        rec["page_cache"] = page_cache(a.page_cache, ck)
        log("gputrace: restore (rollback of the live job)")
        t = time.monotonic()
        r = gt_cli("restore", "-p", str(job.pid), str(ck), "--device-only", "--force")
        restored = time.monotonic() - t
        ev = job.cmd("loss")
        tr = job.cmd("train 2")
        put(rec, "resume_s", restored + tr["first_step_s"])
        rec["resume_how"] = ("`gputrace restore -p PID DIR --device-only --force` (the live process's device memory rolled back, its wall "
                             "time here) + the first training step after it (the job's own time for it)")
        rec["resume"] = {"restore_wall_s": restored, "first_step_s": tr["first_step_s"],
                         "restore": {k: r.get(k) for k in ("verify_ns", "freeze_ns", "copy_ns", "total_ns",
                                                           "bytes", "bytes_copied", "chunks", "chunks_copied")}}
        rec["loss_check"] = loss_check(eval_ck, next_ref, ev["loss"], tr["losses"])
        rec["loss_check"]["note"] = ("only device memory goes back: the job's host side (its step counter) goes on, "
                                     "which this job's losses do not depend on")
    except (Failed, OSError, KeyError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    finally:
        if not a.keep:
            remove(ck)
        remove(ck2)


def full_method(a, job: DirJob, storage: Path, rec: dict) -> bool:
    """Fills `rec`; returns whether `job` still answers."""
    ck = storage / "ck-gputrace-full"
    remove(ck)
    rec["path"] = str(ck)
    alive = True
    try:
        try:
            from gputrace.checkpointer import criu
            from gputrace.checkpointer.full import checkpoint_full, restore_full
        except ImportError as exc:
            raise Failed(f"gputrace's checkpointer is not importable ({exc}): source bench/gpu-env.sh") from None
        bundle = REPO / ".gpu" / "criu" / "criu"
        if "GPUTRACE_CRIU" not in os.environ and bundle.exists():
            os.environ["GPUTRACE_CRIU"] = str(bundle)
        try:
            found = criu.find()
            rec["criu"] = f"{found.version_str} ({found.path})"
        except criu.CriuUnavailable as exc:
            raise Failed(f"no CRIU: {exc.msg} (on the GPU machine: bench/make-criu-bundle, carry .gpu)") from None
        before = phase(job, a.phase_s)
        eval_ck = job.cmd("loss")["loss"]

        def take():
            return checkpoint_full(job.pid, ck, leave_running=True, use_shim=True,
                                   timeout_ms=int(min(a.timeout, 60) * 1000))

        if a.full_idle:
            log("gputrace-full: checkpoint --full --leave-running of the idle job")
            n_ck = job.n  # the job waits for command n + 1: the restored one will too
            t = time.monotonic()
            c = take()
            wall = time.monotonic() - t
            put(rec, "held_s", (c.freeze_ns + c.image_check_ns + c.write_ns) / 1e9)
            rec["held_how"] = ("--full-idle: the job idle; the report's freeze (from the shim's gate closing to the end "
                               "of the CRIU dump) + image check + write (checksums, fsync, manifest): a lower bound, "
                               "the give-back (driver Restore + Unlock, shim resume) not included")
        else:
            log("gputrace-full: checkpoint --full --leave-running under the heartbeat")
            n_ck = job.n + 1  # the heartbeat's command: the one the checkpointed job is in
            c, hb, wall = under_heartbeat(job, take, a.timeout)
            held_from_heartbeat(rec, hb)
            rec["held_how"] += "; the job stays stopped until the checkpoint is complete on storage"
        put(rec, "write_s", wall)
        rec["write_how"] = "checkpoint_full's call: complete (checksummed, fsynced, manifest renamed) before the job runs"
        rec["held_reported_s"] = {"freeze_s": c.freeze_ns / 1e9, "image_check_s": c.image_check_ns / 1e9,
                                  "write_s": c.write_ns / 1e9, "total_s": c.total_ns / 1e9}
        rec["checkpoint"] = {"shim_s": c.shim_ns / 1e9, "lock_s": c.lock_ns / 1e9,
                             "driver_checkpoint_s": c.checkpoint_ns / 1e9, "dump_s": c.dump_ns / 1e9,
                             "image_bytes": c.image_bytes, "criu_bytes": c.criu_bytes, "files": c.files,
                             "shim_bytes": (c.shim or {}).get("bytes"), "shim": c.shim}
        size, alloc = tree_bytes(ck)
        rec["bytes"], rec["bytes_allocated"] = size, alloc
        next_ref = job.cmd("train 2")["losses"]
        after = phase(job, a.phase_s)
        rec["steps_per_s_before"], rec["steps_per_s_after"] = before["steps_per_s"], after["steps_per_s"]
        log("gputrace-full: the job is killed (the failure), then restored whole")
        alive = False
        job.kill()
        job.rebase(n_ck)
        rec["page_cache"] = page_cache(a.page_cache, ck)
        t = time.monotonic()
        r = restore_full(ck)
        restored = time.monotonic() - t
        job.adopt(r.pid)
        alive = True
        ev = job.cmd("loss")
        tr = job.cmd("train 2")
        put(rec, "resume_s", restored + tr["first_step_s"])
        rec["resume_how"] = ("restore_full(DIR) of the killed job (verify, CRIU restore, driver Restore + Unlock, shim "
                             "resume; its wall time here) + the restored job's first training step (its own time for it; "
                             "its clock is not this process's after CRIU, so no times are compared across the two)")
        rec["resume"] = {"restore_wall_s": restored, "first_step_s": tr["first_step_s"],
                         "restore": {"verify_s": r.verify_ns / 1e9, "criu_s": r.criu_ns / 1e9,
                                     "driver_restore_s": r.driver_restore_ns / 1e9, "unlock_s": r.unlock_ns / 1e9,
                                     "shim_s": r.shim_ns / 1e9, "total_s": r.total_ns / 1e9}}
        rec["loss_check"] = loss_check(eval_ck, next_ref, ev["loss"], tr["losses"])
    except Exception as exc:  # the checkpointer's own errors too (CheckpointError, CriuFailed)
        rec["error"] = f"{type(exc).__name__}: {getattr(exc, 'msg', exc)}"[:3000]
    finally:
        if not a.keep:
            remove(ck)
    return alive


# --- the run -----------------------------------------------------------------------------------------------------

def start_plain(a, logs: Path) -> PipeJob:
    log(f"starting the job ({a.size}) plainly")
    return PipeJob([sys.executable, str(JOB), "--size", a.size, "--warmup", str(a.warmup)], logs / "job-plain.log")


def start_shimmed(a, logs: Path, storage: Path) -> DirJob:
    exe = shutil.which("gputrace")
    if not exe:
        raise Failed("`gputrace` is not on PATH (source bench/gpu-env.sh first)")
    log(f"starting the job ({a.size}) under gputrace run --checkpointable --suspendable")
    argv = [exe, "run", "--checkpointable", "--suspendable", "--", sys.executable, str(JOB), "--size", a.size,
            "--warmup", str(a.warmup), "--control", str(storage / "control"), "--dcp-pg", "none"]
    return DirJob(argv, logs / "job-shimmed.log", storage / "control", a.timeout)


def baseline(job, a) -> dict:
    r = job.cmd(f"train-for {a.phase_s}")
    return {"step_s": r["step_s_median"], "steps_per_s": r["steps_per_s"], "steps": r["steps"]}


def failure_models(doc: dict, a) -> None:
    step = doc.get("step_s")
    for name, rec in doc["methods"].items():
        if rec.get("skipped"):
            continue
        costs = CheckpointCosts(held_s=rec.get("held_s"), resume_s=rec.get("resume_s"),
                                write_s=rec.get("write_s") if rec.get("background_write") else None,
                                step_s=step)
        rec["failure_model"] = {f"{m:g}h": expected(costs, FailureModel(mtbf_h=m, target_overhead=a.overhead)).to_dict()
                                for m in a.mtbf_h}


def summary(doc: dict) -> str:
    first = f"{doc['failure_model']['mtbf_h'][0]:g}h"
    rows = [f"{'method':17} {'held s':>8} {'write s':>8} {'resume s':>9} {'GiB':>6} {'bitwise':>8} "
            f"{'interval s':>11} {'lost/failure s':>15}  (MTBF {first}, overhead {doc['failure_model']['target_overhead']:g})"]
    for name, rec in doc["methods"].items():
        if rec.get("skipped") or rec.get("error") and rec.get("held_s") is None:
            rows.append(f"{name:17} " + (rec.get("skipped") or "error: " + str(rec.get("error"))[:150]).replace("\n", " "))
            continue
        fm = (rec.get("failure_model") or {}).get(first, {})
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        lc = rec.get("loss_check") or {}
        rows.append(f"{name:17} {f(rec.get('held_s'), 3):>8} {f(rec.get('write_s')):>8} {f(rec.get('resume_s')):>9} "
                    f"{f((rec.get('bytes') or 0) / GIB if rec.get('bytes') else None):>6} "
                    f"{str(lc.get('bitwise', '-')):>8} {f(fm.get('interval_s'), 0):>11} "
                    f"{f(fm.get('lost_per_failure_s'), 0):>15}" +
                    (f"  error: {rec['error'][:100]}".replace("\n", " ") if rec.get("error") else ""))
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("small", "large"), default="small")
    ap.add_argument("--storage", required=True, help="directory for the checkpoints, the job's control files and logs "
                                                     "(a disk, as a job's checkpoints would go)")
    ap.add_argument("--out", required=True, type=Path, help="the JSON to write (FILE.tmp, then renamed)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(ALL)} (default {','.join(DEFAULT_METHODS)})")
    ap.add_argument("--timeout", type=float, help="seconds each method may take, its job's start included "
                                                  "(default 100 small, 170 large)")
    ap.add_argument("--budget-s", type=float, default=470, help="the whole run (default 470): methods that could not "
                                                                "finish in what is left are skipped")
    ap.add_argument("--phase-s", type=float, default=2.0, help="each paired training phase (default 2 s)")
    ap.add_argument("--repeats", type=int, default=1, help="torch/dcp saves in a row, the last one counted (default 1)")
    ap.add_argument("--warmup", type=int, default=3, help="the job's warm-up steps (default 3)")
    ap.add_argument("--mtbf-h", default="4,24", help="mean times between failures, hours, comma-separated (default 4,24)")
    ap.add_argument("--overhead", type=float, default=0.01, help="the overhead target (default 0.01)")
    ap.add_argument("--page-cache", choices=("evict", "drop", "keep"), default="evict",
                    help="before each resume: evict the checkpoint's files from the page cache (default), drop the "
                         "whole page cache, or keep it")
    ap.add_argument("--no-during-training", dest="during_training", action="store_false",
                    help="leave out gputrace's second checkpoint, taken while the job trains")
    ap.add_argument("--full-idle", action="store_true",
                    help="gputrace-full: checkpoint the idle job instead of one running the heartbeat (held_s is then "
                         "the report's freeze + image check + write: a lower bound)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (default: each is removed after its method)")
    a = ap.parse_args()
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in ALL]
    if bad:
        ap.error(f"unknown method(s) {', '.join(bad)}; known: {', '.join(ALL)}")
    a.timeout = a.timeout or DEFAULT_TIMEOUT[a.size]
    try:
        a.mtbf_h = [float(x) for x in a.mtbf_h.split(",") if x]
        if not a.mtbf_h:
            raise ValueError("--mtbf-h names no mean time between failures")
        for m in a.mtbf_h:
            FailureModel(mtbf_h=m, target_overhead=a.overhead)
    except ValueError as exc:
        ap.error(str(exc))
    t_run = time.monotonic()
    storage = Path(a.storage).absolute()
    storage.mkdir(parents=True, exist_ok=True)
    logs = storage / "logs"
    logs.mkdir(exist_ok=True)
    a.out = a.out.absolute()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _alarm)
    order = [m for m in ALL if m in methods]  # application-level first (one plain job), then gputrace's, --full last
    doc: dict = {
        "schema": SCHEMA, "complete": False, "device": None, "commit": commit(), "size": a.size,
        "params": None, "state_bytes": None, "step_s": None,
        "command": " ".join(["python3", "bench/appckpt_gpu.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "storage": {"path": str(storage), "free_bytes": shutil.disk_usage(storage).free},
        "page_cache": a.page_cache, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "failure_model": {"target_overhead": a.overhead, "mtbf_h": a.mtbf_h,
                          "assumptions": assumptions(FailureModel(mtbf_h=a.mtbf_h[0], target_overhead=a.overhead)),
                          "formulas": "bench/failure_model.py"},
        "jobs": {}, "methods": {},
    }
    put(doc, "device", device(), "nvidia-smi named no GPU here")
    if doc["commit"] is None:
        doc["commit_reason"] = "no git work tree here and GPUTRACE_COMMIT is not set"
    for k in ("params", "state_bytes", "step_s"):
        doc[f"{k}_reason"] = "no job started"
    log(f"{a.size}: methods {', '.join(order)}; storage {storage}; timeout {a.timeout:.0f} s a method, "
        f"budget {a.budget_s:.0f} s")
    write_json(a.out, doc)

    job = None
    job_kind = None
    start_failed: dict[str, str] = {}
    for name in order:
        kind = "plain" if name in APP else "shimmed"
        rec = record(name)
        doc["methods"][name] = rec
        left = a.budget_s - (time.monotonic() - t_run)
        need = a.timeout * 0.5 + (START_S[a.size] if job is None or job_kind != kind else 0)
        if kind in start_failed:
            rec["skipped"] = f"skipped: the {kind} job did not start: {start_failed[kind]}"
        elif left < need:
            rec["skipped"] = (f"skipped: {left:.0f} s of the run's --budget-s left, less than the {need:.0f} s it "
                              "would need")
        if rec.get("skipped"):
            log(f"{name}: {rec['skipped'][:300]}")
            finish(rec)
            write_json(a.out, doc)
            continue
        if job is not None and job_kind != kind:
            job.close()
            job = None
        signal.setitimer(signal.ITIMER_REAL, max(1.0, min(a.timeout, left)))
        starting = False
        try:
            if job is None:
                starting = True
                job = start_plain(a, logs) if kind == "plain" else start_shimmed(a, logs, storage)
                job_kind = kind
                info = {k: job.ready.get(k) for k in ("pid", "startup_s", "import_s", "build_s", "params",
                                                       "state_bytes", "model_bytes", "optim_bytes", "allocated",
                                                       "reserved", "device", "torch", "transformers", "spec")}
                info.update(baseline(job, a))
                doc["jobs"][kind] = info
                for k in ("params", "state_bytes"):
                    if doc[k] is None:
                        put(doc, k, info.get(k))
                if kind == "plain" or doc["step_s"] is None:
                    put(doc, "step_s", info["step_s"])
                    doc["step_s_how"] = (f"the median step of a {a.phase_s:g}-s phase right after warm-up, in the "
                                         f"{kind} job")
                log(f"job {info['pid']} ready: {info['params'] / 1e6:.0f}M parameters, state "
                    f"{info['state_bytes'] / GIB:.2f} GiB, step {info['step_s'] * 1e3:.1f} ms")
                starting = False
            why = fits(name, doc["jobs"][kind], job.pid, storage, a)
            if why:
                rec["skipped"] = why
                log(f"{name}: {why}")
                raise _Skip()
            log(f"{name}: start")
            if name in APP:
                app_method(a, job, name, storage, logs, rec)
            elif name == "gputrace":
                gputrace_method(a, job, storage, rec)
            elif not full_method(a, job, storage, rec):
                job = None  # killed and not restored
        except _Skip:
            pass
        except MethodTimeout:
            rec["error"] = (f"timed out after {min(a.timeout, left):.0f} s (--timeout / --budget-s)" +
                            (" while the job started" if starting else "") + "; the job was ended")
            if job is not None:
                job.kill()
                job = None
        except Exception as exc:  # JobGone, Failed, OSError, and anything unforeseen: the next method goes on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            if starting:
                start_failed[kind] = rec["error"][:1000]
            if job is not None:
                job.kill()
                job = None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finish(rec)
        log(f"{name}: " + (f"error: {rec['error'][:300]}" if rec.get("error") else
                           f"held {rec.get('held_s')} s, resume {rec.get('resume_s')} s, {rec.get('bytes')} bytes, "
                           f"bitwise {(rec.get('loss_check') or {}).get('bitwise')}"))
        failure_models(doc, a)
        write_json(a.out, doc)
    if job is not None:
        job.close()
    failure_models(doc, a)
    doc["mismatches"] = [f"{n}: {what} after resuming differ from the checkpoint's"
                         for n, r in doc["methods"].items()
                         for what, ok in (("the evaluation loss", (r.get("loss_check") or {}).get("eval_equal")),
                                          ("the next two training losses", (r.get("loss_check") or {}).get("next_equal")))
                         if r.get("loss_check") and ok is False]
    doc["complete"] = True
    doc["wall_s"] = time.monotonic() - t_run
    write_json(a.out, doc)
    print(summary(doc), flush=True)
    for m in doc["mismatches"]:
        log(f"MISMATCH: {m}")
    log(f"wrote {a.out} ({doc['wall_s']:.0f} s)")
    return 1 if any(r.get("error") for r in doc["methods"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
