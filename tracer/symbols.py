"""The functions a libcuda exports, read from its `.dynsym`, with the file offsets uprobes need.

libcuda's dynamic symbol table is large, so results are cached by file identity (device, inode,
mtime, size) rather than by path: the same file seen through several `/proc/PID/root/...` or
`/proc/PID/map_files/...` paths is read once, and a file replaced in place is read again.
"""

from __future__ import annotations

import functools
import os
import sys
from array import array
from dataclasses import dataclass, field

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from gputrace.base.errors import NoLibcuda, PermissionDenied

from .classify import FunctionClass, classify

_FUNC_TYPES = ("STT_FUNC", "STT_GNU_IFUNC")
_VERSYM_HIDDEN = 0x8000  # a non-default version (name@VER rather than name@@VER)
_PERMISSION_HINT = "run as root to read another user's or a container's libcuda"


@dataclass(frozen=True)
class Function:
    name: str  # version suffix such as "@@libcuda.so.1" stripped; "_v2", "_ptsz", "_ptds" kept as distinct names
    offset: int  # file offset for a uprobe
    address: int  # st_value
    size: int
    cls: FunctionClass
    aliases: tuple[str, ...] = ()  # other exported names at the same address


@dataclass(frozen=True)
class _FileKey:
    dev: int
    inode: int
    mtime_ns: int
    size: int
    path: str = field(compare=False)  # how to open it; not part of its identity


def read_functions(path: str | os.PathLike[str], prefix: str = "cu") -> tuple[Function, ...]:
    """Defined FUNC (and GNU IFUNC) symbols named `prefix*`, one per address, sorted by name.

    The canonical name at an address is the shortest, then the alphabetically first (so `cuFoo` wins
    over `cuFoo_v2` when both point at one body); the others become `aliases`. For an IFUNC the
    address is its resolver's. Symbols that no PT_LOAD segment holds are left out: no uprobe can
    go there.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NoLibcuda(f"{path}: no such file", "check the path; pass the libcuda.so.1 the job loads") from None
    except PermissionError:
        raise PermissionDenied(f"{path}: permission denied", _PERMISSION_HINT) from None
    return _read_cached(_FileKey(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, path), prefix)


@functools.lru_cache(maxsize=8)
def _read_cached(key: _FileKey, prefix: str) -> tuple[Function, ...]:
    try:
        with open(key.path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise NoLibcuda(f"{key.path} is not an ELF file", "pass the path of the shared library itself, e.g. libcuda.so.1")
            f.seek(0)
            return _functions(ELFFile(f), key.path, prefix)
    except ELFError as e:
        raise NoLibcuda(f"{key.path}: unreadable ELF file ({e})", "the file may be truncated or not a shared library") from None
    except IsADirectoryError:
        raise NoLibcuda(f"{key.path} is a directory", "pass the path of libcuda.so.1 itself") from None
    except FileNotFoundError:
        raise NoLibcuda(f"{key.path}: no such file", "the file vanished while being read; try again") from None
    except PermissionError:
        raise PermissionDenied(f"{key.path}: permission denied", _PERMISSION_HINT) from None


def _functions(elf: ELFFile, path: str, prefix: str) -> tuple[Function, ...]:
    dynsym = elf.get_section_by_name(".dynsym")
    if dynsym is None:
        raise NoLibcuda(f"{path} has no dynamic symbol table", "pass a shared library (libcuda.so.1), not an object file")
    hidden = _hidden_versions(elf)
    loads = [seg.header for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]

    # name -> (address, size); a default version (@@) beats a hidden one (@) of the same name.
    by_name: dict[str, tuple[int, int, bool]] = {}
    for i, sym in enumerate(dynsym.iter_symbols()):
        name = sym.name.split("@", 1)[0]
        if (
            not name.startswith(prefix)
            or sym["st_info"]["type"] not in _FUNC_TYPES
            or sym["st_shndx"] in ("SHN_UNDEF", "SHN_ABS")
        ):
            continue
        is_hidden = i < len(hidden) and bool(hidden[i] & _VERSYM_HIDDEN)
        if name not in by_name or (by_name[name][2] and not is_hidden):
            by_name[name] = (sym["st_value"], sym["st_size"], is_hidden)

    by_address: dict[int, list[str]] = {}
    for name, (address, _, _) in by_name.items():
        by_address.setdefault(address, []).append(name)

    funcs = []
    for address, names in by_address.items():
        offset = _file_offset(loads, address)
        if offset is None:
            continue
        names.sort(key=lambda n: (len(n), n))
        name = names[0]
        size = max(by_name[n][1] for n in names)
        funcs.append(Function(name, offset, address, size, classify(name), tuple(sorted(names[1:]))))
    funcs.sort(key=lambda fn: fn.name)
    return tuple(funcs)


def _hidden_versions(elf: ELFFile) -> array:
    """The raw `.gnu.version` entries, one per dynsym index (empty when the file has no versions)."""
    versym = elf.get_section_by_name(".gnu.version")
    if versym is None:
        return array("H")
    entries = array("H", versym.data())
    if elf.little_endian != (sys.byteorder == "little"):
        entries.byteswap()
    return entries


def _file_offset(loads: list, address: int) -> int | None:
    for ph in loads:
        if ph["p_vaddr"] <= address < ph["p_vaddr"] + ph["p_filesz"]:
            return address - ph["p_vaddr"] + ph["p_offset"]
    return None
