"""The `gputrace` command: subcommands from a registry, expected errors as `error:`/`hint:` lines."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable

from . import __version__
from .errors import GputraceError


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    epilog: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}
TAKES_COMMAND = ("attach", "run")  # commands that run a program given after `--`


def command(name: str, help: str, epilog: str = "") -> Callable:
    """Registers `configure` (adds arguments); returns a decorator for the function that runs it."""

    def register(configure: Callable[[argparse.ArgumentParser], None]) -> Callable:
        def bind(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
            COMMANDS[name] = Command(name, help, epilog, configure, run)
            return run

        return bind

    return register


def number(kind: type = float, *, lo: float = 0, hi: float | None = None, above: bool = False,
           multiple: int | None = None) -> Callable[[str], float]:
    """An argparse type: a number of `kind` at least `lo` (above `lo` with `above`), at most `hi`,
    a multiple of `multiple`; argparse turns the ValueError into `error: argument ...: ...`."""

    fmt = "d" if kind is int else "g"

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or (above and v <= lo) or v < lo or (hi is not None and v > hi):
            rng = f"above {lo:{fmt}}" if above else f"at least {lo:{fmt}}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value {rng}"
                                             + (f" and at most {hi:{fmt}}" if hi is not None else ""))
        if multiple and v % multiple:
            raise argparse.ArgumentTypeError(f"{text} is not a multiple of {multiple}")
        return v

    parse.__name__ = kind.__name__  # what argparse names in its messages
    return parse


def nonempty(text: str) -> str:
    if not text.strip(" ,"):
        raise argparse.ArgumentTypeError("an empty value selects nothing: give a name or a pattern")
    return text


PID = number(int, lo=0, above=True)


def add_pid(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("-p", "--pid", type=PID, required=required, help="target process id")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (orjson; schema in docs/json-schema.md)")


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
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, epilog=cmd.epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
        parser.subparsers_by_name[cmd.name] = p
    return parser


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
            shown = " ".join(a for a in argv[1:] if a not in extra)
            print(f"error: `{' '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}` is not an option of "
                  f"`gputrace {cmd}`", file=sys.stderr)
            print(f"hint: give the command to {'run' if cmd == 'run' else 'trace'} after `--`: "
                  f"gputrace {cmd} {shown + ' ' if shown else ''}-- {' '.join(extra)}", file=sys.stderr)
            return 2
        sub = getattr(parser, "subparsers_by_name", {}).get(cmd)
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)} (see `gputrace {cmd or ''} --help`)".replace("  ", " "))
    args.command_argv = trailing
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
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
