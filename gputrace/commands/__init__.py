"""CLI subcommands; each module registers its commands with gputrace.registry on import."""

from . import attach, checkpoint, doctor, export, fleet, full, shim, top  # noqa: F401
