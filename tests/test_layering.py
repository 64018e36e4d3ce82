"""The layering, as the README's "How it works" draws it, held by the imports themselves: every
import of every module (at the top or inside a function) read with `ast`, resolved to the module it
names, and checked against the layer rules; and the import graph has no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gputrace.base import arch
from gputrace.base.errors import BpfUnavailable

REPO = Path(__file__).resolve().parents[1]
# package -> directory, as pyproject.toml maps them
DIRS = {"gputrace": "gputrace", "gputrace.base": "base", "gputrace.hostview": "hostview", "gputrace.exporter": "exporter",
        "gputrace.tracer": "tracer",
        "gputrace.checkpointer": "checkpointer", "gputrace.shim": "shim", "gputrace.tui": "tui", "gputrace.bpf": "bpf",
        "gputrace.simcuda": "simcuda"}
CLI = ("gputrace.cli", "gputrace.commands", "gputrace.registry", "gputrace.report", "gputrace.progress",
       "gputrace.doctor", "gputrace.__main__")
UI = ("gputrace.tui",)
# layer -> what it may not import
FORBIDDEN = {
    "gputrace.base": CLI + UI + ("gputrace.hostview", "gputrace.tracer", "gputrace.checkpointer", "gputrace.shim"),
    "gputrace.tracer": CLI + UI + ("gputrace.hostview", "gputrace.checkpointer"),
    "gputrace.checkpointer": CLI + UI + ("gputrace.hostview",),
    "gputrace.shim": CLI + UI + ("gputrace.hostview", "gputrace.checkpointer"),
    "gputrace.hostview": CLI + UI + ("gputrace.exporter",),
    "gputrace.exporter": CLI + UI,
    "gputrace.tui": CLI,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, d in DIRS.items():
        root = REPO / d
        for f in root.rglob("*.py"):
            if pkg == "gputrace" and f.relative_to(root).parts[0] not in ("commands",) and f.parent != root:
                continue
            rel = f.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The gputrace modules `name` imports, each resolved to the module (not the package's names)."""
    tree = ast.parse(path.read_text(), str(path))
    base = name if _is_package(path) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("gputrace")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            if not mod.startswith("gputrace"):
                continue
            for a in node.names:  # `from pkg import module` names a module; `from mod import name` the module
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return {m for m in out if m in known} | {m.rpartition(".")[0] for m in out if m not in known
                                              and m.rpartition(".")[0] in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) - {name} for name, path in mods.items()}


def _layer(mod: str) -> str | None:
    return next((l for l in sorted(FORBIDDEN, key=len, reverse=True) if mod == l or mod.startswith(l + ".")), None)


def test_no_library_imports_the_cli_or_the_ui(graph):
    bad = []
    for mod, deps in graph.items():
        layer = _layer(mod)
        for dep in deps:
            if layer and any(dep == f or dep.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{mod} -> {dep}")
    assert not bad, "layering broken:\n" + "\n".join(sorted(bad))


def test_command_modules_do_not_import_each_other(graph):
    cmds = {m for m in graph if m.startswith("gputrace.commands.")}
    bad = [f"{m} -> {d}" for m in cmds for d in graph[m] if d in cmds]
    assert not bad, bad


def test_no_import_cycles(graph):
    # Packages importing their own submodules (re-exports) are not cycles of code: a package's
    # __init__ is left out as a target of its own children.
    def deps(m):
        return {d for d in graph[m] if not m.startswith(d + ".")}

    seen, stack, cycles = set(), [], []

    def visit(m, on_path):
        if m in on_path:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.add(m)
        stack.append(m)
        for d in sorted(deps(m)):
            visit(d, on_path)
        stack.pop()
        on_path.discard(m)

    for m in sorted(graph):
        visit(m, set())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_rules_see_the_imports_they_judge(graph):
    """The checks above must not pass by reading nothing: known imports are found."""
    assert "gputrace.hostview.model" in graph["gputrace.tui.app"]
    assert "gputrace.registry" in graph["gputrace.commands.checkpoint"]
    assert "gputrace.base.errors" in graph["gputrace.tracer.links"]
    assert "gputrace.checkpointer.uprobes" in graph["gputrace.hostview.checkpoints"]  # a lazy one, inside a function
    assert "gputrace.hostview.model" in graph["gputrace.exporter.metrics"]


def test_syscall_numbers_are_this_architectures():
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if arch.MACHINE == "x86_64" and header.exists():
        text = header.read_text()
        for name in ("bpf", "perf_event_open"):
            assert int(re.search(rf"#define __NR_{name}\s+(\d+)", text).group(1)) == arch.syscall_number(name)
    generic = Path("/usr/include/asm-generic/unistd.h")
    if generic.exists():  # arm64's numbers are the generic table's
        text = generic.read_text()
        for name in ("bpf", "perf_event_open"):
            assert int(re.search(rf"#define __NR_{name}\s+(\d+)", text).group(1)) == arch.syscall_number(name, "aarch64")
    with pytest.raises(BpfUnavailable, match="riscv64") as e:
        arch.syscall_number("bpf", "riscv64")
    assert "x86_64" in e.value.hint
    assert not arch.decodes_first_instruction("aarch64") and arch.decodes_first_instruction("x86_64")
