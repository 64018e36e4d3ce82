"""Where a benchmark's figures come from, written into each result file: the code and the device."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    """The checkout's HEAD, else $GPUTRACE_COMMIT (a copy without .git), else None."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("GPUTRACE_COMMIT") or None


def nvsmi(*query: str) -> list[str]:
    """nvidia-smi's CSV rows for a query ([] where it is missing or fails)."""
    try:
        r = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 else []


def device_name(sim: bool = False) -> str:
    if sim:
        return "simcuda"
    names = nvsmi("--query-gpu=name")
    return names[0] if names else "unknown"
