"""Shared fixtures."""

from __future__ import annotations

import os
import subprocess

import pytest


# --- tracer tests (test_tracer.py): a host that can load BPF, and processes that never outlive a test -------------

def bpf_skip_reason() -> str | None:
    """Why BPF tests cannot run here, or None when they can (root, and the precompiled BPF object or an
    importable bcc to load the tracer's program with)."""
    if os.geteuid() != 0:
        return "needs root for BPF programs and uprobes"
    from gputrace.base.bccload import import_bcc
    from gputrace.base.errors import BpfUnavailable
    from gputrace.tracer.bpfprog import object_file

    try:
        object_file()
        return None
    except BpfUnavailable as no_object:
        try:
            import_bcc()
        except BpfUnavailable as exc:
            return f"neither way of loading the BPF program works: {no_object.msg}; bcc cannot be imported: {exc.msg}"
    return None


@pytest.fixture(scope="session")
def bpf_host() -> None:
    reason = bpf_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def spawned():
    """A list to put started subprocess.Popen objects in; any still running at teardown is killed (by its pid)."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            if f:
                f.close()
