"""The `gputrace` command: the parser built from the registry (registry.py), expected errors as
`error:`/`hint:` lines."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .base.errors import GputraceError
from .registry import COMMANDS, MODES, TAKES_COMMAND, runner


def _load_commands() -> None:
    # Each module registers its commands on import; importing them here keeps startup to what runs.
    from . import commands  # noqa: F401


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(
        prog="gputrace",
        description="What would GPU checkpointing cost this CUDA job? Measured with eBPF uprobes on libcuda.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  gputrace doctor                      check that this host can trace\n"
        "  gputrace demo                        audit the bundled demo workload\n"
        "  gputrace attach -p 1234 -d 10        audit a running job for 10 s\n"
        "  gputrace attach --exact -- python train.py\n"
        "run `gputrace COMMAND --help` for each command's options and examples",
    )
    parser.add_argument("--version", action="version", version=f"gputrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subparsers_by_name = {}  # for errors that show the command's own usage
    for cmd in COMMANDS.values():
        modes = MODES.get(cmd.name, [])
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help,
                           epilog=cmd.epilog + "".join(m.epilog for m in modes),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.configure(p)
        for m in modes:
            p.add_argument(f"--{m.flag.replace('_', '-')}", action="store_true", help=m.help)
            m.configure(p)
        p.set_defaults(_run=cmd.run)
        if cmd.name in TAKES_COMMAND:
            # The command to run comes after `--` (main() splits it off before argparse sees it).
            p.usage = p.format_usage().removeprefix("usage: ").rstrip("\n") + " [-- COMMAND [ARG ...]]"
        parser.subparsers_by_name[cmd.name] = p
    return parser


def _without(argv: list[str], extra: list[str]) -> list[str]:
    """argv less the tokens argparse left over, matched by position from the end (where a stray
    command lands), not by value: `attach -d 1 sleep 1` keeps the option's 1."""
    drop: set[int] = set()
    j = len(extra) - 1
    for i in range(len(argv) - 1, -1, -1):
        if j >= 0 and argv[i] == extra[j]:
            drop.add(i)
            j -= 1
    return [a for i, a in enumerate(argv) if i not in drop]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    trailing: list[str] = []
    if "--" in argv:  # `gputrace attach [opts] -- command args`: the command is not ours to parse
        i = argv.index("--")
        argv, trailing = argv[:i], argv[i + 1 :]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        cmd = getattr(args, "command", None)
        if cmd in TAKES_COMMAND and not extra[0].startswith("-"):
            # `gputrace run --checkpointable python train.py`: the command belongs after `--`.
            shown = " ".join(_without(argv[1:], extra))
            print(f"error: `{' '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}` is not an option of "
                  f"`gputrace {cmd}`", file=sys.stderr)
            print(f"hint: give the command to {'run' if cmd == 'run' else 'trace'} after `--`: "
                  f"gputrace {cmd} {shown + ' ' if shown else ''}-- {' '.join(extra)}", file=sys.stderr)
            return 2
        sub = getattr(parser, "subparsers_by_name", {}).get(cmd)
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)} (see `gputrace {cmd or ''} --help`)".replace("  ", " "))
    args.command_argv = trailing
    try:
        run = runner(args)
        if run is None:
            parser.print_help()
            return 2
        return int(run(args) or 0)
    except GputraceError as exc:
        print(f"error: {exc.msg}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
