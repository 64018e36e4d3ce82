"""Subcommands whose machinery later work brings; they validate their target, then say so."""

from __future__ import annotations

from ..cli import add_pid, command, not_yet


for _name, _help, _issue in [
    ("suspend", "take a job's device memory off the GPU (not yet available)", "the checkpointer (issue 5)"),
    ("resume", "bring a suspended job's device memory back (not yet available)", "the checkpointer (issue 5)"),
]:
    command(_name, _help)(lambda p: add_pid(p, required=False))(not_yet(_name, _issue))
