"""One error hierarchy: every expected failure carries a message and a hint for the user.

The CLI prints `error: <msg>` and `hint: <hint>` and exits with `exit_code`; nothing expected ever
reaches the user as a traceback.
"""

from __future__ import annotations


class GputraceError(Exception):
    exit_code = 1

    def __init__(self, msg: str, hint: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.hint = hint

    def __str__(self) -> str:
        return self.msg


class UsageError(GputraceError):
    exit_code = 2


class NoSuchProcess(GputraceError):
    exit_code = 3


class NoLibcuda(GputraceError):
    exit_code = 4


class PermissionDenied(GputraceError):
    exit_code = 5


class Untrusted(PermissionDenied):
    """A path or a peer that is not the target's own (another user's socket, a symbolic link): refused."""


class BpfUnavailable(GputraceError):
    """bcc missing, kernel without BPF/uprobes, or a program that does not load."""

    exit_code = 6


class BuildError(GputraceError):
    """A C component (simcuda, calibration target, shim) failed to compile."""

    exit_code = 7


class ShimUnavailable(GputraceError):
    """The process has no gputrace shim, or its shim does not serve or answer."""

    exit_code = 8


class NotYetAvailable(GputraceError):
    exit_code = 9


class CheckpointError(GputraceError):
    """A checkpoint or restore that could not be done; the job is left running as it was."""

    exit_code = 10


class CorruptCheckpoint(CheckpointError):
    """A checkpoint directory that is incomplete, truncated or fails its checksums."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint whose allocations are not the ones the process holds."""


class CheckpointBusy(CheckpointError):
    """Another checkpoint or restore of the process is in progress, or its gate cannot close now."""


class DiskFull(CheckpointError):
    """No space left where the checkpoint is written."""


class TargetLost(CheckpointError):
    """The target process exited (or its shim stopped answering) during the operation."""


class NotSuspendable(CheckpointError):
    """The shim cannot give this job's device memory back (memory it does not serve through the VMM
    API); the driver's checkpoint API still can."""
