"""The whole-process checkpoint jobs' protocol (bench/full_job.py, bench/full_job_jax.py), written
once and free of any framework: one JSON line per event on stdout; after N steps the job says it is
paused with its checksums and waits for SIGUSR1 (blocked by the job before its framework starts
threads), then M more steps and the final checksums."""

import json
import signal
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
