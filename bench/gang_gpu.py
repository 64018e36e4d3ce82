#!/usr/bin/env python3
"""A job of several processes checkpointed, restored, suspended and resumed together, on one real GPU.

    python3 bench/gang_gpu.py --out OUT.json [--ranks 2] [--work /dev/shm/gtgang]

The job (bench/gang_job.py): a torch.distributed launcher and --ranks ranks training one model with
DistributedDataParallel over gloo (NCCL refuses two ranks on one GPU), each rank holding 256 MiB of
seeded tensors, all on the one GPU. Without the shim, 60 steps uninterrupted: the reference. Under
`gputrace run --checkpointable --suspendable`: 20 steps; `gputrace checkpoint --tree LAUNCHER`;
20 steps; the weights and tensors overwritten; `gputrace restore --tree LAUNCHER`, every rank's step
counter set back to 20 (host state is not rolled back), 20 steps; `gputrace suspend --tree
LAUNCHER` (each rank's GPU memory per NVML before, while suspended), `gputrace resume --tree`,
20 steps. Every rank's losses are compared with the reference's, bit for bit.
Writes OUT.json and OUT.md.  Run after `source bench/gpu-env.sh`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_gpu import Job, cli, gputrace, log, nvml_used, results_main  # noqa: E402
from job_protocol import Client  # noqa: E402

JOB = HERE / "gang_job.py"


class Gang(Job):
    """The launcher, spoken to as bench/checkpoint_gpu.py's Job is; each reply is every rank's."""

    def __init__(self, shim: bool, ranks: int, port: int) -> None:
        argv = [sys.executable, str(JOB), "--ranks", str(ranks), "--port", str(port)]
        if shim:
            argv = [gputrace(), "run", "--checkpointable", "--suspendable", "--"] + argv
        Client.__init__(self, argv)
        self.launcher, self.ranks = self.hello["launcher"], [r["pid"] for r in self.hello["ranks"]]

    def cmd(self, line: str) -> list[dict]:
        return super().cmd(line)["ranks"]

    def losses(self, k: int) -> list[list[str]]:
        return [r["losses"] for r in self.cmd(f"train {k}")]


def run(ranks: int, work: Path) -> dict:
    res: dict = {"ranks": ranks}
    log("reference: 60 steps without the shim")
    ref = Gang(False, ranks, 29517)
    try:
        r = [ref.losses(20), ref.losses(20), ref.losses(20)]
    finally:
        ref.close()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log("the job under the shim")
    job = Gang(True, ranks, 29518)
    tree = str(job.launcher)
    try:
        res["pids"] = {"launcher": job.launcher, "ranks": job.ranks}
        a = job.losses(20)
        res["first_20_equal"] = a == r[0]
        log("checkpoint --tree")
        res["checkpoint"] = cli("checkpoint", "--tree", tree, "-o", str(work / "ck"))
        b = job.losses(20)
        res["steps_21_40_equal"] = b == r[1]
        before = job.cmd("checksum")
        job.cmd("scribble")
        res["scribble_changed"] = job.cmd("checksum") != before
        log("restore --tree")
        res["restore"] = cli("restore", "--tree", tree, str(work / "ck"), "--device-only", "--force")
        job.cmd("seek 20")
        c = job.losses(20)
        res["steps_21_40_again_equal"] = c == r[1]
        log("suspend --tree / resume --tree")
        used = [nvml_used(p) for p in job.ranks]
        res["suspend"] = cli("suspend", "--tree", tree)
        res["nvml_suspended"] = [nvml_used(p) for p in job.ranks]
        res["nvml_before"] = used
        res["resume"] = cli("resume", "--tree", tree)
        d = job.losses(20)
        res["steps_41_60_equal"] = d == r[2]
    finally:
        job.close()
        shutil.rmtree(work, ignore_errors=True)
    return res


def summary(r: dict) -> str:
    def ms(d, k="freeze_ns"):
        return f"{d[k] / 1e6:.1f}" if isinstance(d, dict) and k in d else f"error: {str(d.get('error', ''))[:300]}"

    lines = [f"# A job of {r['ranks']} processes on one GPU: checkpoint, restore, suspend, resume together", "",
             f"Command: `{r['command']}` on {r.get('device', '?')}.", "",
             "| step | freeze ms (every rank stopped together) | total ms |", "|---|---:|---:|"]
    for k in ("checkpoint", "restore", "suspend", "resume"):
        lines.append(f"| {k} --tree | {ms(r.get(k, {}))} | {ms(r.get(k, {}), 'total_ns')} |")
    lines += ["", f"- first 20 steps equal to the uninterrupted run without the shim: **{r.get('first_20_equal')}**",
              f"- steps 21-40 equal: **{r.get('steps_21_40_equal')}**",
              f"- steps 21-40 again after the restore (step counters set back): **{r.get('steps_21_40_again_equal')}**",
              f"- steps 41-60 after suspend and resume equal: **{r.get('steps_41_60_equal')}**",
              f"- the overwrite changed the data: {r.get('scribble_changed')}",
              f"- each rank's GPU memory (NVML, MiB) before suspend {[round((x or 0) / 2**20) for x in r.get('nvml_before', [])]}, "
              f"suspended {[round((x or 0) / 2**20) for x in r.get('nvml_suspended', [])]}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/gtgang"))
    rc, r = results_main(ap, lambda a: run(a.ranks, a.work), summary)
    keys = ("first_20_equal", "steps_21_40_equal", "steps_21_40_again_equal", "steps_41_60_equal")
    return rc if r is None or all(r.get(k) for k in keys) else 1


if __name__ == "__main__":
    sys.exit(main())
