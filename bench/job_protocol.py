"""The bench jobs' line protocols, written once and free of any framework.

The job's side of the whole-process checkpoint jobs (bench/full_job.py, bench/full_job_jax.py): one
JSON line per event on stdout; after N steps the job says it is paused with its checksums and waits for
SIGUSR1 (blocked by the job before its framework starts threads), then M more steps and the final
checksums.

The harness's side of the jobs driven line by line (bench/ckpt_job.py, bench/gang_job.py): `Client`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Callable


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def pause_then_finish(train: Callable[[int, int], None], checksum: Callable[[], list],
                      steps_before: int, steps_after: int) -> None:
    train(0, steps_before)
    emit(paused=steps_before, checksum=checksum())
    signal.sigwait({signal.SIGUSR1})
    emit(resumed=True, checksum=checksum())
    train(steps_before, steps_before + steps_after)
    emit(done=True, checksum=checksum())


class Client:
    """A job driven line by line: each command a line on its stdin, each answer one JSON line on its
    stdout, the first (its hello, `self.hello`) once it is up; an answer without "ok" raises. The job
    runs deterministic cuBLAS (CUBLAS_WORKSPACE_CONFIG) and unbuffered, with `env_add` on top."""

    def __init__(self, argv: list[str], env_add: dict | None = None) -> None:
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1", **(env_add or {}))
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the job exited (rc {self.proc.wait()})")
        return json.loads(line)

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        r = self._read()
        if not r.get("ok"):
            raise RuntimeError(f"job: {line}: {r}")
        return r

    def close(self) -> None:
        """`quit`, then a minute to exit before it is killed."""
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
