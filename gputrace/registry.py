"""What every command shares: the registry the command modules add themselves to, argument types
defined once, and the output helpers of their reports. Command modules import this, never each
other; cli.py builds the parser from it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import orjson

from .base.errors import UsageError


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


@dataclass(frozen=True)
class Mode:
    """A second path through a command, chosen by a flag (`checkpoint --full`): its own options,
    examples and function, registered by its own module; the command's module does not know it."""

    command: str
    flag: str                                           # the flag's dest: `--full` is "full"
    help: str
    epilog: str
    configure: Callable[[argparse.ArgumentParser], None]  # the mode's options besides the flag
    run: Callable[[argparse.Namespace], int]
    only_with: dict[str, str]                           # dest -> hint, for options that need the flag


MODES: dict[str, list[Mode]] = {}


def mode(command: str, flag: str, help: str, epilog: str = "", only_with: dict[str, str] | None = None) -> Callable:
    """Like `command`: registers `configure`, then the function that runs the mode."""

    def register(configure: Callable[[argparse.ArgumentParser], None]) -> Callable:
        def bind(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
            MODES.setdefault(command, []).append(Mode(command, flag, help, epilog, configure, run, dict(only_with or {})))
            return run

        return bind

    return register


def runner(args: argparse.Namespace) -> Callable[[argparse.Namespace], int] | None:
    """The function that runs what was asked: a mode whose flag is set, else the command; an option
    of a mode given without its flag is a usage error, not ignored."""
    for m in MODES.get(getattr(args, "command", None) or "", ()):
        if getattr(args, m.flag, False):
            return m.run
        for dest, hint in m.only_with.items():
            if getattr(args, dest, None):
                raise UsageError(f"--{dest.replace('_', '-')} goes with --{m.flag}", hint)
    return getattr(args, "_run", None)


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


def parse_pids(text: str) -> list[int]:
    """`-p 1,2,3`: one pid or several, comma-separated."""
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give pids separated by commas, e.g. 1234,1235")
    return [PID(t) for t in parts]


class Pids(argparse.Action):
    """-p may be repeated and take lists: all of them in `pids`, the first in `pid` (what a command
    of one process reads)."""

    def __call__(self, parser, namespace, values, option_string=None):
        pids = list(getattr(namespace, "pids", None) or [])
        pids.extend(p for p in values if p not in pids)
        namespace.pids = pids
        namespace.pid = pids[0]


def add_job(p: argparse.ArgumentParser, *, bound: bool = True) -> None:
    """The target of checkpoint, restore, suspend, resume (and of `shim emulate`, without the bound):
    one process, or a job of several."""
    p.set_defaults(pid=None, pids=None, timeout=None)
    p.add_argument("-p", "--pid", dest="pids", type=parse_pids, action=Pids, metavar="PID[,PID...]",
                   help="target process id; several (comma-separated or -p repeated) are one job" +
                        (", stopped together" if bound else ""))
    p.add_argument("--tree", type=PID, metavar="PID",
                   help="a job: PID and its descendants that run the shim (e.g. a launcher and its ranks)")
    if not bound:
        return
    p.add_argument("--timeout", type=number(float, lo=0, above=True), metavar="S",
                   help="a job's one bound, in seconds, on stopping, copying and reopening all of it; past it, or "
                        "if a process fails, every one is given back running (default 30)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (orjson; schema in docs/json-schema.md)")


def parse_share(text: str, what: str = "budget") -> float:
    """A share of the job's time, as `1%` or `0.01`, above 0 and at most 1 (`--budget`, `--threshold`)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UsageError(f"invalid {what} {text!r}", "give a share of the job's time: e.g. 1% or 0.005") from None
    if not 0 < value <= 1:
        raise UsageError(f"{what} {text} is out of range", "use a value above 0% and at most 100%"
                         + (" (100% traces every call)" if what == "budget" else ""))
    return value


def parse_budget(text: str, echo: bool = True) -> float:
    """`--budget`: the most the tracer may slow the job, a share of its time. A bare fraction (0.5
    is 50%, not half a percent) is echoed back as the percentage it was read as, on stderr."""
    value = parse_share(text, "budget")
    if echo and not text.strip().endswith("%"):
        print(f"gputrace: --budget {text.strip()} read as {100 * value:g}% of the job's time", file=sys.stderr)
    return value


# --- output ---------------------------------------------------------------------------------------
def dump_json(doc: object) -> None:
    """A command's JSON document on stdout, indented (its own output only: children's go to stderr)."""
    sys.stdout.buffer.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.flush()


def ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def gbps(nbytes: int, ns: int) -> str:
    return f"{nbytes / ns:.2f} GB/s" if ns else "-"
