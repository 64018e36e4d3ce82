"""gputrace.checkpointer: a shimmed process's GPU device memory to a checkpoint directory and back.

No user interface here (the CLI is gputrace/commands/checkpoint.py).  `checkpoint(pid, dir)` and
`restore(pid, dir)` (checkpointer/ops.py), `suspend(pid)`, `resume(pid)` and `prepare(pid)` (a
suspension's image made ahead; checkpointer/suspend.py) talk to the shim's control socket;
checkpointer/gang.py does the four for a job of several processes at once; the directory format is
in checkpointer/store.py, the shim's image format in checkpointer/image.py.
"""

from .ops import CheckpointReport, RestoreReport, checkpoint, compare, restore
from .store import SCHEMA, read_manifest
from .suspend import PrepareReport, ResumeReport, SuspendReport, prepare, resume, suspend

__all__ = ["CheckpointReport", "PrepareReport", "RestoreReport", "ResumeReport", "SCHEMA", "SuspendReport",
           "checkpoint", "compare", "prepare", "read_manifest", "restore", "resume", "suspend"]
