"""Subcommands whose machinery later work brings; they validate their target, then say so."""

from __future__ import annotations

from ..cli import add_pid, command, not_yet


for _name, _help, _issue in [
    ("top", "live dashboard of every CUDA process (not yet available)", "the `top` dashboard (issue 6)"),
    ("record", "record a tracing session to a file for replay (not yet available)", "the `top` dashboard (issue 6)"),
    ("suspend", "take a job's device memory off the GPU (not yet available)", "the checkpointer (issue 5)"),
    ("resume", "bring a suspended job's device memory back (not yet available)", "the checkpointer (issue 5)"),
]:
    command(_name, _help)(lambda p: add_pid(p, required=False))(not_yet(_name, _issue))
