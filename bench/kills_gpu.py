#!/usr/bin/env python3
"""gputrace killed at random moments during checkpoint, restore, suspend and the driver backend's
checkpoint of a real PyTorch job (bench/ckpt_job.py holding 1 GiB under `gputrace run
--checkpointable --suspendable`): after every kill the job must run (a training step works), be
ungated, unsuspended (unless the suspend had finished), unlocked in the driver, and its tensors'
checksum unchanged.  The same as tests/test_hardening_kills.py on simcuda, on the real driver.

Run (root, GPU, after `source bench/gpu-env.sh`):
  python3 bench/kills_gpu.py --rounds 10 --out bench/results/kills-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from gputrace.checkpointer import guardian

HERE = Path(__file__).resolve().parent


def gputrace(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["gputrace", *args], capture_output=True, text=True, timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/var/tmp/gputrace-kills")
    ap.add_argument("--ops", default="checkpoint,restore,suspend,driver")
    ap.add_argument("--round-timeout", type=float, default=90.0, help="report what hangs after this long")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    import threading

    progress = {"t": time.monotonic(), "what": "start"}

    def watchdog() -> None:
        while True:
            time.sleep(5)
            if time.monotonic() - progress["t"] > args.round_timeout:
                print(f"HANG in {progress['what']} for {time.monotonic() - progress['t']:.0f} s", flush=True)
                print(subprocess.run("ps -eo pid,ppid,stat,wchan:30,etime,args | grep -v ' ps ' | "
                                     "grep -E 'gputrace|python|ckpt' | cut -c1-220", shell=True,
                                     capture_output=True, text=True).stdout, flush=True)
                for line in subprocess.run("pgrep -f 'gputrace'", shell=True, capture_output=True,
                                           text=True).stdout.split():
                    try:
                        print(line, Path(f"/proc/{line}/stack").read_text()[:600], flush=True)
                    except OSError:
                        pass
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    job = subprocess.Popen(["gputrace", "run", "--checkpointable", "--suspendable", "--", sys.executable,
                            str(HERE / "ckpt_job.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(line: str) -> dict:
        job.stdin.write(line + "\n")
        job.stdin.flush()
        return json.loads(job.stdout.readline())

    pid = json.loads(job.stdout.readline())["pid"]  # ready
    print(f"job ready: pid {pid}", flush=True)
    want = ask(f"hold {int(args.gib * (1 << 30))}")["checksum"]
    ask("train 2")
    print("held and trained", flush=True)
    ck = work / "ck"
    r = gputrace("checkpoint", "-p", str(pid), "-o", str(ck), timeout=120)
    assert r.returncode == 0, r.stderr
    print("first checkpoint taken", flush=True)
    ops = {
        "checkpoint": lambda i: ["checkpoint", "-p", str(pid), "-o", str(work / f"c{i}")],
        "restore": lambda i: ["restore", "-p", str(pid), str(ck), "--device-only", "--force"],
        "suspend": lambda i: ["suspend", "-p", str(pid)],
        "driver": lambda i: ["checkpoint", "--backend", "driver", "-p", str(pid)],
    }
    ops = {k: v for k, v in ops.items() if k in args.ops.split(",")}
    spans = {}
    for name, fn in ops.items():
        t = time.monotonic()
        progress.update(t=t, what=f"span of {name}")
        r = gputrace(*fn(-1), timeout=120)
        spans[name] = time.monotonic() - t
        print(f"span of {name}: {spans[name]:.2f} s", flush=True)
        assert r.returncode == 0, (name, r.stderr)
        if name == "suspend":
            assert gputrace("resume", "-p", str(pid), timeout=120).returncode == 0
    rows, bad = [], 0
    for i in range(args.rounds):
        for name, fn in ops.items():
            delay = rng.uniform(0, spans[name] * 1.1)
            progress.update(t=time.monotonic(), what=f"{name} round {i}, kill at {delay:.3f} s")
            errf = work / "err.txt"
            with open(errf, "w") as ef:  # a file, not a pipe: a guardian may hold it after the kill
                p = subprocess.Popen(["gputrace", *fn(i)], stdout=subprocess.DEVNULL, stderr=ef, text=True)
                try:
                    p.wait(timeout=delay)
                    killed = False
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    killed = True
            err = errf.read_text()
            progress["what"] += ", settle"
            guardian.settle(pid, 300)
            from gputrace.checkpointer import driver as _drv

            try:
                dstate = _drv.Driver(pid).state()
            except Exception as exc:  # noqa: BLE001
                dstate = f"? {exc}"
            glog = [ln for ln in errf.read_text().splitlines() if "guardian" in ln]
            print(f"  after settle: driver state {dstate}; guardian said: {glog[-1][:300] if glog else None}", flush=True)
            progress["what"] += ", status"
            st = json.loads(gputrace("shim", "status", "-p", str(pid), "--json").stdout)
            kept = bool(st.get("suspended")) and name == "suspend"
            if kept:
                gputrace("resume", "-p", str(pid))
                st = json.loads(gputrace("shim", "status", "-p", str(pid), "--json").stdout)
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            progress["what"] += ", checksum"
            sums = ask("checksum")["checksum"]
            loss = ask("train 1").get("ok", False)
            ok = (state not in ("T", "t") and not st.get("paused") and not st.get("suspended")
                  and sums == want and loss)
            bad += not ok
            rows.append({"op": name, "delay_s": delay, "killed": killed, "returncode": p.returncode,
                         "error": err.strip().splitlines()[0] if err.strip() else None, "suspend_had_finished": kept,
                         "state": state, "paused": st.get("paused"), "suspended": st.get("suspended"),
                         "checksum_equal": sums == want, "trained": bool(loss), "ok": ok})
            print(f"{name:10s} delay {delay:6.3f}s killed {killed!s:5s} rc {p.returncode} ok {ok} "
                  f"{(err.strip().splitlines() or [''])[0][:120]}", flush=True)
    ask("quit")
    job.wait(timeout=60)
    doc = {"command": " ".join(sys.argv), "spans_s": spans, "rounds": rows,
           "kills": sum(r["killed"] for r in rows), "attempts": len(rows), "not_ok": bad}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"{doc['kills']} kills in {doc['attempts']} attempts; {bad} left the job not as it should be")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
