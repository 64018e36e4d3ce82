#!/usr/bin/env python3
"""Restore that never breaks the job, on the GPU: checkpoint/restore cycles from `gputrace top`.

For each job (bench/restore_job.py: `train`, a Llama-style model from transformers' config classes under
bf16 autocast and AdamW; `decode`, a GPT-2 KV-cache decode loop), started as a user would start it
(`setsid gputrace run --checkpointable -- python3 bench/restore_job.py KIND >log`):
  1. the reference: the same job run uninterrupted, twice (the second says whether its output repeats at all);
  2. top (TopApp driven through Textual's pilot, the real checkpointer) on the job, and --cycles times, at
     seeded random steps: `c`, `y` (a whole-process checkpoint, left running), a few steps later `r`,
     Enter, `y` (the job brought back to it); after each restore, once the job has printed a step more,
     its log must be what the reference printed up to there (the log is cut back to the checkpoint's
     moment by the restore, the lines after it kept beside it, themselves the reference's);
  3. `C`, `y` and `R`, Enter, `y`: a device-only rollback of the same job, which must be refused;
  4. the job left to finish: its whole log must equal the reference.
Recorded a cycle: the step checkpointed, the freeze (and its parts: driver lock and checkpoint, CRIU dump),
the time the job was held in all (the freeze and its GPU state given back; null from gputrace before 4e5dfcb),
the images' bytes, and the time back (ending the running process, CRIU restore, driver restore, unlock).
A job stops cycling early when its --budget-s is spent or it nears its last step; the count says so.

On the GPU machine (bench/gpu-env.sh; CRIU from bench/make-criu-bundle in .gpu/criu):
    python3 bench/restore_whole_gpu.py --out $OUT --images /dev/shm/gtrestore
Here, to check the script (simcuda's train --churn in device mode instead of PyTorch):
    .venv/bin/python bench/restore_whole_gpu.py --simcuda --out /tmp/rw --cycles 3
Writes OUT/restore-whole.json (and prints a summary).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
_libc = ctypes.CDLL(None, use_errno=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for_text(path: Path, text: str, timeout_s: float) -> str:
    """Waits (inotify) until `path` holds `text`; RuntimeError past the timeout."""
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0 or _libc.inotify_add_watch(fd, str(path).encode(), 0x2) < 0:
        raise RuntimeError(f"inotify on {path} failed")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            content = path.read_text(errors="replace")
            if text in content:
                return content
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {text!r} in {path} after {timeout_s:.0f} s: {content[-300:]!r}")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                os.read(fd, 4096)
    finally:
        os.close(fd)


def wait_exit(pid: int, timeout_s: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def reap(pid: int) -> None:
    def wait() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=wait, daemon=True).start()


class Spec:
    """How to run a job: its argv (uninterrupted, paced) and its environment."""

    def __init__(self, a: argparse.Namespace, kind: str, device=None) -> None:
        self.kind = kind
        if a.simcuda:
            from gputrace import simcuda
            from test_full_checkpoint import sim_env  # the driver from a private copy, as the tests run it

            base = simcuda.workload("train") + ["--steps", str(a.steps), "--vmm", "0", "--churn", "3"]
            self.ref_argv = base + ["--kernel-ns", "0"]
            self.argv = base + ["--kernel-ns", str(int(a.sleep * 1e9 / 2))]
            self.env = device.env(sim_env())
        else:
            job = [sys.executable, str(REPO / "bench" / "restore_job.py"), kind, "--steps", str(a.steps)]
            self.ref_argv = job
            self.argv = job + ["--sleep", str(a.sleep)]
            self.env = dict(os.environ)
        # As a user starts it: `gputrace run` execs the job (same pid) with the shim preloaded. The installed
        # command where there is one (`python -m` from the repository's root would find its source tree).
        gt = [shutil.which("gputrace")] if shutil.which("gputrace") else [sys.executable, "-m", "gputrace"]
        self.run_argv = [*gt, "run", "--checkpointable", "--", *self.argv]


class Job:
    def __init__(self, spec: Spec, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.out, self.err = root / "job.out", root / "job.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.p = subprocess.Popen(spec.run_argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                      start_new_session=True)
        self.pid = self.p.pid
        reap(self.pid)

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def steps_done(self) -> int:
        lines = [ln for ln in self.text().splitlines() if ln.startswith("step ")]
        return int(lines[-1].split()[1]) if lines else 0

    def at_step(self, k: int, timeout_s: float = 120) -> None:
        wait_for_text(self.out, f"step {k} ", timeout_s)

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        wait_exit(self.pid, 30)


def reference(spec: Spec, timeout_s: float) -> str:
    r = subprocess.run(spec.ref_argv, env=spec.env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"the reference run failed ({r.returncode}): {r.stderr[-600:]}")
    return r.stdout


async def drive(job: Job, ref: str, a: argparse.Namespace, root: Path, rec: dict) -> None:
    """The cycles through top's keys (see the module's docstring)."""
    from gputrace.hostview.checkpoints import CheckpointerAdapter, checkpointer_operations
    from gputrace.tui.app import TopApp
    from gputrace.tui.screens.dialogs import ConfirmScreen, RestoreScreen

    reports: list[tuple[str, dict]] = []
    ops = checkpointer_operations()

    def ck_full(pid, out, **kw):
        r = ops.checkpoint_full(pid, out, **kw)
        reports.append(("checkpoint", r.to_dict()))
        return r

    def rs_full(pid, path, **kw):
        r = ops.restore_full(pid, path, **kw)
        reports.append(("restore", r.to_dict()))
        return r

    ckroot = Path(a.images) / f"{job.pid}-{rec['kind']}"
    adapter = CheckpointerAdapter(root=ckroot, ops=dataclasses.replace(ops, checkpoint_full=ck_full,
                                                                       restore_full=rs_full))
    rng = random.Random(a.seed + (0 if rec["kind"] == "train" else 1))
    t_end = time.monotonic() + a.budget_s
    from topdata import OneJob  # (tests/ is on the path: see main)

    app = TopApp(OneJob(job.pid), adapter)

    async def until(cond, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                seen = "; ".join(f"{getattr(r, 'action', '?')}: {getattr(r, 'message', None) or getattr(r, 'error', '')}"
                                 for r in app.last_results[-3:])
                raise RuntimeError(f"top: {what} did not come within {timeout_s:.0f} s (screen {type(app.screen).__name__}; "
                                   f"last results: {seen})")
            await pilot.pause(0.05)

    def last(n: int):
        return app.last_results[-1] if len(app.last_results) > n else None

    async with app.run_test(size=(160, 30)) as pilot:
        await until(lambda: app.frame is not None, 30, "the first frame")
        for i in range(a.cycles):
            if time.monotonic() > t_end or job.steps_done() > a.steps - 30:
                rec["stopped_early"] = "budget spent" if time.monotonic() > t_end else "the job neared its end"
                break
            cyc: dict = {}
            job.at_step(max(2, job.steps_done() + rng.randint(0, 2)))
            n = len(app.last_results)
            await pilot.press("c")
            if not isinstance(app.screen, ConfirmScreen):
                raise RuntimeError("top: c asked nothing")
            await pilot.press("y")
            await until(lambda: last(n) is not None, 300, "the checkpoint's result")
            res = last(n)
            if getattr(res, "action", None) != "checkpoint_full" or hasattr(res, "error"):
                raise RuntimeError(f"top: the checkpoint failed: {getattr(res, 'error', res)} / {getattr(res, 'hint', '')}")
            ck = next((r for kind, r in reversed(reports) if kind == "checkpoint" and r["path"] == res.checkpoint.id), None)
            if ck is None:
                raise RuntimeError(f"top: no report of the checkpoint {res.checkpoint.id}; reports: "
                                   f"{[(kind, r['path']) for kind, r in reports[-3:]]}")
            held = ck.get("held_ns")
            cyc.update(freeze_ms=ck["freeze_ns"] / 1e6, held_ms=held / 1e6 if held is not None else None,
                       lock_ms=ck["lock_ns"] / 1e6,
                       driver_checkpoint_ms=ck["checkpoint_ns"] / 1e6, criu_dump_ms=ck["dump_ns"] / 1e6,
                       write_ms=ck["write_ns"] / 1e6, image_bytes=ck["image_bytes"],
                       status_line=str(app.screen.query_one("#status").render()))
            job.at_step(job.steps_done() + rng.randint(1, 3), 120)
            cyc["steps_when_restored"] = job.steps_done()
            await pilot.press("r")
            await until(lambda: isinstance(app.screen, RestoreScreen), 30, "the checkpoint list")
            await pilot.press("enter")
            if not isinstance(app.screen, ConfirmScreen):
                raise RuntimeError("top: r asked nothing")
            await pilot.press("y")
            await until(lambda: last(n + 1) is not None, 300, "the restore's result")
            res = last(n + 1)
            if getattr(res, "action", None) != "restore_full" or hasattr(res, "error"):
                raise RuntimeError(f"top: the restore failed: {getattr(res, 'error', res)} / {getattr(res, 'hint', '')}")
            back = next((r for kind, r in reversed(reports) if kind == "restore" and r["path"] == ck["path"]), None)
            if back is None:
                raise RuntimeError(f"top: no report of the restore from {ck['path']}; reports: "
                                   f"{[(kind, r['path']) for kind, r in reports[-3:]]}; result: {res.message}")
            cut = next((c for c in back["cut"] if c["path"] == str(job.out)), None)
            kept = Path(cut["kept"]).read_text(errors="replace") if cut else ""
            at = job.text()
            cyc.update(back_ms=back["back_ns"] / 1e6, end_ms=back["end_ns"] / 1e6, criu_restore_ms=back["criu_ns"] / 1e6,
                       driver_restore_ms=back["driver_restore_ns"] / 1e6, unlock_ms=back["unlock_ns"] / 1e6,
                       verify_ms=back["verify_ns"] / 1e6,
                       step_checkpointed=sum(1 for ln in at.splitlines() if ln.startswith("step ")),
                       kept_is_reference=ref.startswith(kept))
            job.at_step(cyc["step_checkpointed"] + 1, 120)  # the restored job's first step
            cyc["alive_after_restore"] = job.alive()
            cyc["equal_after_restore"] = ref.startswith(job.text())
            rec["cycles"].append(cyc)
            log(f"{rec['kind']} cycle {i}: step {cyc['step_checkpointed']}, freeze {cyc['freeze_ms']:.0f} ms, back "
                f"{cyc['back_ms']:.0f} ms, equal {cyc['equal_after_restore']}")
            for p in ckroot.glob("full-*"):  # what it was brought back to is not needed again: room in memory
                shutil.rmtree(p, ignore_errors=True)
            if cut:
                with contextlib.suppress(OSError):
                    os.unlink(cut["kept"])
        # A device-only rollback of the same job: asked with its consequence, and refused.
        n = len(app.last_results)
        await pilot.press("C", "y")
        await until(lambda: last(n) is not None, 300, "the device checkpoint's result")
        if getattr(last(n), "action", None) != "checkpoint" or hasattr(last(n), "error"):
            rec["device_only"] = {"checkpoint_failed": getattr(last(n), "error", str(last(n)))}
        else:
            job.at_step(job.steps_done() + 1)
            await pilot.press("R")
            await until(lambda: isinstance(app.screen, RestoreScreen), 30, "the device checkpoint list")
            await pilot.press("enter")
            question = getattr(app.screen, "question", "")
            await pilot.press("y")
            await until(lambda: last(n + 1) is not None, 300, "the rollback's result")
            r = last(n + 1)
            rec["device_only"] = {"question": question, "refused": r.action == "rollback" and hasattr(r, "error"),
                                  "error": getattr(r, "error", None), "hint": getattr(r, "hint", None)}
            shutil.rmtree(ckroot, ignore_errors=True)
        await pilot.press("q")


def summary(rec: dict) -> dict:
    cyc = rec["cycles"]

    def med(k: str) -> float | None:
        v = [c[k] for c in cyc if c.get(k) is not None]
        return statistics.median(v) if v else None

    def span(k: str) -> list[float] | None:
        v = [c[k] for c in cyc if c.get(k) is not None]
        return [min(v), max(v)] if v else None

    return {"cycles": len(cyc), "alive_after_every_restore": all(c["alive_after_restore"] for c in cyc) if cyc else None,
            "equal_after_every_restore": all(c["equal_after_restore"] and c["kept_is_reference"] for c in cyc)
            if cyc else None,
            "freeze_ms_median": med("freeze_ms"), "freeze_ms_range": span("freeze_ms"),
            "held_ms_median": med("held_ms"), "held_ms_range": span("held_ms"),
            "back_ms_median": med("back_ms"), "back_ms_range": span("back_ms"),
            "criu_dump_ms_median": med("criu_dump_ms"), "driver_checkpoint_ms_median": med("driver_checkpoint_ms"),
            "criu_restore_ms_median": med("criu_restore_ms"), "driver_restore_ms_median": med("driver_restore_ms"),
            "image_bytes_median": med("image_bytes")}


def one(a: argparse.Namespace, kind: str, out: dict) -> None:
    rec: dict = {"kind": kind, "cycles": [], "errors": []}
    out["jobs"][kind] = rec
    work = Path(a.images) / f"work-{kind}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    device = None
    if a.simcuda:
        from gputrace.simcuda.device import Device

        device = Device(work / "dev").__enter__()
    job = None
    try:
        spec = Spec(a, kind, device)
        t = time.monotonic()
        ref = reference(spec, 300)
        rec["reference_s"] = time.monotonic() - t
        rec["reference_repeats"] = None if a.simcuda else reference(spec, 300) == ref
        rec["reference_steps"] = sum(1 for ln in ref.splitlines() if ln.startswith("step "))
        log(f"{kind}: reference of {rec['reference_steps']} steps in {rec['reference_s']:.1f} s, repeats: "
            f"{rec['reference_repeats']}")
        job = Job(spec, work / "job")
        job.at_step(1, 300)
        asyncio.run(drive(job, ref, a, work, rec))
        rec["finished"] = wait_exit(job.pid, a.steps * (a.sleep + 0.2) + 60)
        rec["final_equal"] = job.text() == ref
        if not rec["final_equal"]:
            rec["final_tail"] = job.text()[-400:]
    except Exception as exc:  # recorded; the other job still runs
        rec["errors"].append(f"{type(exc).__name__}: {exc}")
        log(f"{kind}: {type(exc).__name__}: {exc}")
    finally:
        if job is not None:
            with contextlib.suppress(OSError):
                rec["job_stderr_tail"] = job.err.read_text(errors="replace")[-600:]
            job.kill()
        if device is not None:
            device.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
    rec["summary"] = summary(rec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--images", default="/dev/shm/gtrestore", help="where checkpoints go (tmpfs: they are large)")
    p.add_argument("--jobs", default="train,decode")
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=150.0, help="cycling time a job, at most")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sleep", type=float, default=0.05, help="host time a step (pace)")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--simcuda", action="store_true", help="simcuda's train --churn instead of PyTorch (a check here)")
    a = p.parse_args()
    sys.path.insert(0, str(REPO / "tests"))  # topdata (a frame for the job's row), the simcuda test helpers
    crit = REPO / ".gpu" / "criu" / "criu"
    if crit.exists() and "GPUTRACE_CRIU" not in os.environ:
        os.environ["GPUTRACE_CRIU"] = str(crit)
    from provenance import commit, device_name

    out: dict = {"schema": 1, "kind": "restore-whole", "commit": commit(), "device": device_name(a.simcuda),
                 "args": vars(a), "jobs": {}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for kind in a.jobs.split(","):
        one(a, kind, out)
        Path(a.out, "restore-whole.json").write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    for kind, rec in out["jobs"].items():
        s = rec["summary"]
        print(f"{kind}: {s['cycles']} cycles, alive after every restore: {s['alive_after_every_restore']}, equal after "
              f"every restore: {s['equal_after_every_restore']}, final equal: {rec.get('final_equal')}; freeze median "
              f"{s['freeze_ms_median']} ms, back median {s['back_ms_median']} ms; device-only refused: "
              f"{(rec.get('device_only') or {}).get('refused')}; errors: {rec['errors']}")
    ok = all(r["summary"]["cycles"] and r["summary"]["equal_after_every_restore"] and r.get("final_equal")
             and (r.get("device_only") or {}).get("refused") for r in out["jobs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
