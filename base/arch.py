"""What depends on the CPU architecture: the numbers of the system calls the tracer makes itself
(bcc covers the rest) and whether uprobes' first-instruction decoding is known. Anything else gets a
clear error instead of a wrong syscall."""

from __future__ import annotations

import platform

from .errors import BpfUnavailable

MACHINE = platform.machine()

# From each architecture's unistd tables (arm64 uses the generic ones).
_SYSCALLS = {
    "x86_64": {"bpf": 321, "perf_event_open": 298},
    "aarch64": {"bpf": 280, "perf_event_open": 241},
}


def syscall_number(name: str, machine: str = MACHINE) -> int:
    try:
        return _SYSCALLS[machine][name]
    except KeyError:
        raise BpfUnavailable(f"the tracer does not know the {name}(2) system call's number on {machine or 'this CPU'}",
                             f"supported architectures: {', '.join(_SYSCALLS)}; `gputrace doctor` shows what this "
                             "host has") from None


def decodes_first_instruction(machine: str = MACHINE) -> bool:
    """Whether the calibration knows which first instructions this architecture's uprobes emulate
    (x86-64); elsewhere every probe is charged as single-stepped, the dearer kind."""
    return machine == "x86_64"
