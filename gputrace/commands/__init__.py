"""CLI subcommands; each module registers its commands with gputrace.cli.command on import."""

from . import attach, checkpoint, doctor, full, shim, top  # noqa: F401
