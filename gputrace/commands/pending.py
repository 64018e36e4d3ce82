"""Subcommands whose machinery later work brings; they validate their target, then say so."""

from __future__ import annotations

from ..cli import add_pid, command, not_yet


for _name, _help, _issue in [
]:
    command(_name, _help)(lambda p: add_pid(p, required=False))(not_yet(_name, _issue))
