#!/usr/bin/env python3
"""The tmux trial of `w` (whole-job checkpoint) in `gputrace top`, scripted: two simcuda jobs (launch_bound
and a train started the way CRIU needs), top in a tmux session, the train row selected, `w`, `y`; then the job
is killed and restored from what `w` wrote. Keys go in with `tmux send-keys`, screens come back with
`tmux capture-pane`; times are from the key to the first capture that shows the result (captures every
50 ms: upper bounds). Run as root with bcc, CRIU >= 4.2 and simcuda built (the test suite builds it):
    .venv/bin/python bench/top_trial_whole_job.py
See bench/results/top-tmux-trial.md.
"""
import os
import re
import signal
import subprocess
import sys
import time
from gputrace import simcuda

GT = os.path.join(os.path.dirname(sys.executable), "gputrace")
WL = lambda name: simcuda.workload(name)[0]  # noqa: E731
env = simcuda.env()
os.makedirs("/tmp/trial2", exist_ok=True)
lb = subprocess.Popen([WL("launch_bound"),
     "--seconds", "600", "--scale", "0.05", "--launch-ns", "200000", "--kernel-ns", "3000000"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
train = subprocess.Popen([WL("train"), "--size", "16777216", "--steps", "100000", "--kernel-ns", "5000000"],
    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
print("train", train.pid, "launch_bound", lb.pid)
def cap():
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", "trial2"], capture_output=True, text=True).stdout
def wait_for(pred, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = cap()
        if pred(s): return s, time.monotonic() - t0
        time.sleep(0.05)
    raise SystemExit("timeout:\n" + cap())
subprocess.run(["tmux", "kill-session", "-t", "trial2"], stderr=subprocess.DEVNULL)
subprocess.run(["tmux", "new", "-d", "-s", "trial2", "-x", "150", "-y", "30", f"{GT} top --checkpoint-dir /tmp/trial2/ckpt"])
s, t = wait_for(lambda s: str(train.pid) in s and str(lb.pid) in s)
print(f"both on screen after {t:.1f} s"); 
s, t = wait_for(lambda s: re.search(rf"{train.pid}\s+train\s+[1-9]", s) is not None)
print(s)
print("[uprobes] in train:", "[uprobes]" in open(f"/proc/{train.pid}/maps").read())
# select the train row
lines = s.splitlines()
hdr = next(i for i, l in enumerate(lines) if "PID" in l and "COMMAND" in l)
rows = [l for l in lines[hdr+1:] if re.match(r"\s*\d+\s", l)]
idx = next(i for i, l in enumerate(rows) if f"{train.pid}" in l.split()[0])
for _ in range(idx): subprocess.run(["tmux", "send-keys", "-t", "trial2", "Down"])
subprocess.run(["tmux", "send-keys", "-t", "trial2", "w"])
s, t = wait_for(lambda s: "Yes" in s)
print(f"confirmation after {t:.2f} s:\n" + s)
t0 = time.monotonic()
subprocess.run(["tmux", "send-keys", "-t", "trial2", "y"])
s, t = wait_for(lambda s: "done, froze" in s or "failed" in s.lower() or "error:" in s.lower(), timeout=120)
print(f"result after {t:.2f} s:\n" + s)
print("train alive:", train.poll() is None)
time.sleep(1)
s = cap(); print(s)
subprocess.run(["tmux", "send-keys", "-t", "trial2", "q"])
t0 = time.monotonic()
while subprocess.run(["tmux", "has-session", "-t", "trial2"], stderr=subprocess.DEVNULL).returncode == 0 and time.monotonic() - t0 < 30:
    time.sleep(0.05)
print(f"quit took {time.monotonic() - t0:.2f} s")
ck = sorted(p for p in os.listdir("/tmp/trial2/ckpt") if p.startswith("full-"))
print("checkpoints:", ck)
train.kill(); train.wait(); lb.kill(); lb.wait()
r = subprocess.run([GT, "restore", "--full", "/tmp/trial2/ckpt/" + ck[-1]], capture_output=True, text=True)
print("restore:", r.returncode, r.stdout[-600:], r.stderr[-600:])
time.sleep(2)
print("restored alive:", os.path.exists(f"/proc/{train.pid}"), open(f"/proc/{train.pid}/comm").read().strip() if os.path.exists(f"/proc/{train.pid}") else "")
subprocess.run([GT, "checkpoint", "-p", str(train.pid), "-o", "/tmp/trial2/after-restore"], capture_output=True)
os.kill(train.pid, signal.SIGKILL)
