"""CLI subcommands; each module registers its commands with gputrace.cli.command on import."""

from . import attach, doctor, pending, shim  # noqa: F401
