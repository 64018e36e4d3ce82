"""Loads a precompiled BPF ELF object (bpf/counts.bpf.c built by clang -target bpf, see bpf/__init__.py)
with raw bpf(2) calls: no bcc, no compiler, no kernel headers on the node.

What it reads from the object (pyelftools for the ELF, its own small parser for the BTF):
  - maps: the BTF-defined maps of the `.maps` section (type, max_entries, key and value types, as
    libbpf declares them); the key and value become ctypes types built from the BTF, so the tracer
    reads the maps as it reads bcc's. max_entries can be set at load time (the object's is a default).
  - programs: each global function in an executable section; the section names its type
    (`uprobe`, `kprobe`, `raw_tracepoint/<event>`); uprobe programs get their expected attach type
    at load time (BPF_TRACE_UPROBE_MULTI for multi links, none for perf links).
  - relocations: ld_imm64 instructions against map symbols (R_BPF_64_64), patched to the maps' fds
    (BPF_PSEUDO_MAP_FD). Nothing else is supported: the program reads no kernel struct (no CO-RE),
    makes no BPF-to-BPF calls and has no global data, and an object that needs more is refused at
    parse time with the reason, not half loaded.

The kernel needs no BTF from us: maps are created without it and programs loaded without line info.
A program the verifier refuses raises ProgramRefused with the verifier's log (its last lines in the
message); raw tracepoint programs are attached on load, as bcc does with RAW_TRACEPOINT_PROBE.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from gputrace.base.errors import BpfUnavailable, PermissionDenied

from .bpfmaps import (ATTR_SIZE, BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_RAW_TRACEPOINT_OPEN, Map, sys_bpf)

BPF_PROG_TYPE_KPROBE = 2
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
BPF_PSEUDO_MAP_FD = 1
R_BPF_64_64 = 1
EM_BPF = 247
_LD_IMM64 = 0x18
_LOG_SIZE = 1 << 22  # the verifier's log on a refused load; newer kernels keep its end when it overflows

_PERMISSION_HINT = ("run as root, or grant CAP_BPF and CAP_PERFMON (e.g. sudo setcap cap_bpf,cap_perfmon+ep on "
                    "the interpreter)")


class ObjectInvalid(BpfUnavailable):
    """The file is not a BPF object this loader can load (corrupt, truncated, or needs what it lacks)."""


class ProgramRefused(BpfUnavailable):
    """The kernel refused a program or a map of the object; `log` holds the verifier's whole log."""

    def __init__(self, msg: str, hint: str = "", log: str = "", errno_: int = 0) -> None:
        super().__init__(msg, hint)
        self.log, self.errno = log, errno_


# --- BTF: the types of the maps' keys and values, and the maps' definitions -------------------------------------

_KIND = {1: "int", 2: "ptr", 3: "array", 4: "struct", 5: "union", 6: "enum", 7: "fwd", 8: "typedef",
         9: "volatile", 10: "const", 11: "restrict", 12: "func", 13: "func_proto", 14: "var", 15: "datasec",
         16: "float", 17: "decl_tag", 18: "type_tag", 19: "enum64"}


@dataclass
class BtfType:
    kind: str
    name: str
    size_or_type: int  # size for int/struct/union/enum/datasec, the referred type for the others
    vlen: int
    kflag: bool
    extra: object = None  # int: encoding word; array: (type, index_type, nelems); struct: [(name, type, bit_offset)]


class Btf:
    """The types of a .BTF section: enough of them to lay out structs and read map definitions."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise ValueError("the .BTF section is truncated")
        magic, version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != 0xEB9F:
            raise ValueError(f"bad BTF magic {magic:#x} (not little-endian BTF)")
        if version != 1:
            raise ValueError(f"BTF version {version}")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        types = data[hdr_len + type_off: hdr_len + type_off + type_len]
        self._strings = data[hdr_len + str_off: hdr_len + str_off + str_len]
        if len(types) != type_len or len(self._strings) != str_len:
            raise ValueError("the .BTF section is truncated")
        self.types: list[BtfType | None] = [None]  # type id 0 is void
        at = 0
        while at < len(types):
            name_off, info, st = struct.unpack_from("<III", types, at)
            at += 12
            vlen, kind_no, kflag = info & 0xFFFF, (info >> 24) & 0x1F, bool(info >> 31)
            kind = _KIND.get(kind_no)
            if kind is None:
                raise ValueError(f"unknown BTF kind {kind_no}")
            t = BtfType(kind, self.string(name_off), st, vlen, kflag)
            if kind == "int":
                (t.extra,) = struct.unpack_from("<I", types, at)
                at += 4
            elif kind == "array":
                t.extra = struct.unpack_from("<III", types, at)
                at += 12
            elif kind in ("struct", "union"):
                t.extra = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", types, at + 12 * i)
                    t.extra.append((self.string(m_name), m_type, m_off))
                at += 12 * vlen
            elif kind == "enum":
                at += 8 * vlen
            elif kind == "enum64":
                at += 12 * vlen
            elif kind == "func_proto":
                at += 8 * vlen
            elif kind == "var":
                at += 4
            elif kind == "datasec":
                t.extra = [struct.unpack_from("<III", types, at + 12 * i) for i in range(vlen)]
                at += 12 * vlen
            elif kind == "decl_tag":
                at += 4
            self.types.append(t)
        if at != len(types):
            raise ValueError("the BTF type section is truncated")
        self._ctypes: dict[int, type] = {}

    def string(self, off: int) -> str:
        end = self._strings.find(b"\0", off)
        if off >= len(self._strings) or end < 0:
            raise ValueError(f"BTF string offset {off} out of range")
        return self._strings[off:end].decode()

    def get(self, tid: int) -> BtfType:
        if not 0 < tid < len(self.types):
            raise ValueError(f"BTF type id {tid} out of range")
        return self.types[tid]

    def resolve(self, tid: int) -> int:
        """Through typedefs and qualifiers to the type itself."""
        for _ in range(64):
            t = self.get(tid)
            if t.kind not in ("typedef", "volatile", "const", "restrict", "type_tag"):
                return tid
            tid = t.size_or_type
        raise ValueError("BTF typedef loop")

    def find(self, kind: str, name: str) -> int:
        for tid, t in enumerate(self.types):
            if t is not None and t.kind == kind and t.name == name:
                return tid
        raise KeyError(f"no BTF {kind} named {name!r}")

    def ctype(self, tid: int) -> type:
        """A ctypes type laid out as BTF type `tid` (ints, arrays, structs and enums): the one the
        tracer reads the map's rows through, as it reads bcc's."""
        tid = self.resolve(tid)
        if tid in self._ctypes:
            return self._ctypes[tid]
        t = self.get(tid)
        if t.kind == "int":
            signed, bits = bool((t.extra >> 24) & 1), t.extra & 0xFF
            if (t.extra >> 16) & 0xFF or bits != 8 * t.size_or_type:
                raise ValueError(f"BTF int {t.name} is a bit field")
            out = {(1, False): ctypes.c_uint8, (1, True): ctypes.c_int8, (2, False): ctypes.c_uint16,
                   (2, True): ctypes.c_int16, (4, False): ctypes.c_uint32, (4, True): ctypes.c_int32,
                   (8, False): ctypes.c_uint64, (8, True): ctypes.c_int64}.get((t.size_or_type, signed))
            if out is None:
                raise ValueError(f"BTF int {t.name} of {t.size_or_type} bytes")
        elif t.kind == "enum":
            out = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}[t.size_or_type]
        elif t.kind == "array":
            elem, _index, n = t.extra
            out = self.ctype(elem) * n
        elif t.kind == "struct":
            fields, offsets = [], []
            for name, mtype, off in t.extra:
                if t.kflag and off >> 24:
                    raise ValueError(f"struct {t.name}.{name} is a bit field")
                fields.append((name, self.ctype(mtype)))
                offsets.append((off & 0xFFFFFF) if t.kflag else off)
            out = type(t.name or f"btf_struct_{tid}", (ctypes.Structure,), {"_fields_": fields})
            for (name, _), bit in zip(fields, offsets):
                if getattr(out, name).offset * 8 != bit:
                    raise ValueError(f"struct {t.name}.{name} is at bit {bit}, not where C's layout puts it")
            if ctypes.sizeof(out) != t.size_or_type:
                raise ValueError(f"struct {t.name} is {t.size_or_type} bytes, not {ctypes.sizeof(out)}")
        else:
            raise ValueError(f"BTF {t.kind} {t.name!r} cannot be a map key or value here")
        self._ctypes[tid] = out
        return out


# --- the object ------------------------------------------------------------------------------------------------

@dataclass
class MapSpec:
    name: str
    type: int
    key_type: type
    value_type: type
    max_entries: int
    flags: int = 0


@dataclass
class ProgSpec:
    name: str
    section: str
    prog_type: int
    insns: bytes
    maps_at: list[tuple[int, str]] = field(default_factory=list)  # (instruction index, map name)

    @property
    def attach_to(self) -> str | None:
        """The raw tracepoint a raw_tracepoint/<event> program attaches to."""
        return self.section.split("/", 1)[1] if self.prog_type == BPF_PROG_TYPE_RAW_TRACEPOINT else None


def _prog_type(section: str) -> int:
    head = section.split("/", 1)[0]
    if head in ("uprobe", "uretprobe", "kprobe", "kretprobe", "uprobe.multi", "uretprobe.multi"):
        return BPF_PROG_TYPE_KPROBE
    if head in ("raw_tracepoint", "raw_tp") and "/" in section:
        return BPF_PROG_TYPE_RAW_TRACEPOINT
    raise ValueError(f"section {section!r}: not a program type this loader knows (uprobe, kprobe, raw_tracepoint/EVENT)")


class BpfObject:
    """A parsed object: its map and program specs, checked before anything touches the kernel."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ObjectInvalid(f"cannot read the BPF object {self.path}: {exc.strerror}",
                                "reinstall gputrace, or unset GPUTRACE_BPF_OBJECT") from None
        try:
            self._parse(data)
        except ObjectInvalid:
            raise
        except Exception as exc:  # pyelftools' ELFError, struct.error, our ValueErrors: the file is not loadable
            raise ObjectInvalid(f"{self.path} is not a BPF object gputrace can load: {exc}",
                                "rebuild it (reinstall gputrace, or clear ~/.cache/gputrace in a checkout)") from None

    def _parse(self, data: bytes) -> None:
        import io

        from elftools.elf.elffile import ELFFile
        from elftools.elf.relocation import RelocationSection
        from elftools.elf.sections import SymbolTableSection

        elf = ELFFile(io.BytesIO(data))
        if elf["e_machine"] != "EM_BPF" or elf["e_type"] != "ET_REL" or not elf.little_endian or elf.elfclass != 64:
            raise ValueError(f"not a 64-bit little-endian relocatable BPF object ({elf['e_machine']}, {elf['e_type']})")
        sections = list(elf.iter_sections())
        names = [s.name for s in sections]
        if ".BTF" not in names:
            raise ValueError("no .BTF section (built without -g?)")
        if ".maps" not in names:
            raise ValueError("no .maps section")
        btf = Btf(elf.get_section_by_name(".BTF").data())
        symtab = next((s for s in sections if isinstance(s, SymbolTableSection)), None)
        if symtab is None:
            raise ValueError("no symbol table")
        syms = list(symtab.iter_symbols())
        maps_idx = names.index(".maps")
        lic = elf.get_section_by_name("license")
        self.license = lic.data().split(b"\0", 1)[0].decode() if lic is not None else "GPL"

        # Maps: the variables of the .maps DATASEC, each a struct of __uint/__type members.
        self.maps: dict[str, MapSpec] = {}
        datasec = btf.get(btf.find("datasec", ".maps"))
        map_syms = {s.name for s in syms if s["st_shndx"] == maps_idx and s["st_info"]["type"] == "STT_OBJECT"}
        for var_id, _off, _size in datasec.extra:
            var = btf.get(var_id)
            if var.kind != "var":
                raise ValueError(f".maps holds a BTF {var.kind}, not a variable")
            if var.name not in map_syms:
                raise ValueError(f"map {var.name} has no symbol in .maps")
            self.maps[var.name] = self._map_spec(btf, var.name, var.size_or_type)
        if not self.maps:
            raise ValueError("no maps in .maps")

        # Programs: global functions of executable sections, with their relocations against maps.
        rels = {s["sh_info"]: s for s in sections if isinstance(s, RelocationSection)}
        self.programs: dict[str, ProgSpec] = {}
        for sym in syms:
            if sym["st_info"]["type"] != "STT_FUNC" or sym["st_info"]["bind"] != "STB_GLOBAL":
                continue
            shndx = sym["st_shndx"]
            if not isinstance(shndx, int):
                raise ValueError(f"function {sym.name} is in no section")
            sec = sections[shndx]
            if sec.name == ".text":
                raise ValueError(f"function {sym.name} is in .text: BPF-to-BPF calls are not supported")
            start, size = sym["st_value"], sym["st_size"]
            body = sec.data()[start:start + size]
            if size == 0 or size % 8 or len(body) != size:
                raise ValueError(f"function {sym.name} has {size} bytes of code, not whole instructions")
            prog = ProgSpec(sym.name, sec.name, _prog_type(sec.name), body)
            for rel in (rels[shndx].iter_relocations() if shndx in rels else ()):
                off = rel["r_offset"]
                if not start <= off < start + size:
                    continue
                target = syms[rel["r_info_sym"]]
                if rel["r_info_type"] != R_BPF_64_64 or target["st_shndx"] != maps_idx or target.name not in self.maps:
                    where = sections[target["st_shndx"]].name if isinstance(target["st_shndx"], int) else target["st_shndx"]
                    raise ValueError(f"{sym.name}: relocation type {rel['r_info_type']} against {target.name or where!r} "
                                     f"({where}): only map references are supported")
                i = (off - start) // 8
                if (off - start) % 8 or body[8 * i] != _LD_IMM64 or 8 * i + 16 > size:
                    raise ValueError(f"{sym.name}: a map relocation at +{off - start:#x} is not on a 64-bit load")
                prog.maps_at.append((i, target.name))
            for i in range(0, size, 8):  # a call into another function would need a relocation we refused above
                code, regs = body[i], body[i + 1]
                if code == 0x85 and (regs >> 4) == 1:
                    raise ValueError(f"{sym.name}: BPF-to-BPF calls are not supported")
            self.programs[sym.name] = prog
        if not self.programs:
            raise ValueError("no programs (global functions in program sections)")

    @staticmethod
    def _map_spec(btf: Btf, name: str, tid: int) -> MapSpec:
        t = btf.get(btf.resolve(tid))
        if t.kind != "struct":
            raise ValueError(f"map {name} is a BTF {t.kind}, not a map definition")
        got: dict[str, object] = {}
        for mname, mtype, _ in t.extra:
            p = btf.get(btf.resolve(mtype))
            if p.kind != "ptr":
                raise ValueError(f"map {name}.{mname} is not declared with __uint or __type")
            if mname in ("type", "max_entries", "map_flags"):
                arr = btf.get(btf.resolve(p.size_or_type))
                if arr.kind != "array":
                    raise ValueError(f"map {name}.{mname} is not an __uint")
                got[mname] = arr.extra[2]
            elif mname in ("key", "value"):
                got[mname] = btf.ctype(p.size_or_type)
            else:
                raise ValueError(f"map {name}: member {mname} is not supported")
        missing = {"type", "max_entries", "key", "value"} - set(got)
        if missing:
            raise ValueError(f"map {name} lacks {', '.join(sorted(missing))}")
        return MapSpec(name, int(got["type"]), got["key"], got["value"], int(got["max_entries"]),
                       int(got.get("map_flags", 0)))

    # --- into the kernel ------------------------------------------------------------------------------------------

    def load(self, *, expected_attach_type: int = 0, max_entries: Mapping[str, int] | None = None,
             attach_raw_tracepoints: bool = True) -> "Loaded":
        """Creates the maps, patches and loads every program (uprobe and kprobe ones with
        `expected_attach_type`), attaches the raw tracepoint ones. All or nothing: on failure
        whatever was created is closed again."""
        loaded = Loaded(self.path)
        try:
            for spec in self.maps.values():
                n = (max_entries or {}).get(spec.name, spec.max_entries)
                loaded.maps[spec.name] = Map(spec.name, _create_map(spec, n), spec.key_type, spec.value_type, owned=True)
            for prog in self.programs.values():
                insns = bytearray(prog.insns)
                for i, map_name in prog.maps_at:
                    insns[8 * i + 1] = (insns[8 * i + 1] & 0x0F) | (BPF_PSEUDO_MAP_FD << 4)
                    struct.pack_into("<i", insns, 8 * i + 4, loaded.maps[map_name].fd)
                eat = expected_attach_type if prog.prog_type == BPF_PROG_TYPE_KPROBE else 0
                loaded.progs[prog.name] = prog_load(bytes(insns), prog.prog_type, eat, name=prog.name,
                                                    license=self.license, what=f"{prog.name} of {self.path.name}")
                if prog.attach_to and attach_raw_tracepoints:
                    loaded.raw_links.append(raw_tracepoint_open(loaded.progs[prog.name], prog.attach_to))
        except BaseException:
            loaded.close()
            raise
        return loaded


@dataclass
class Loaded:
    """The kernel objects of one load: maps by name, program fds by name, raw tracepoint links."""

    path: Path
    maps: dict[str, Map] = field(default_factory=dict)
    progs: dict[str, int] = field(default_factory=dict)
    raw_links: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in [*self.raw_links, *self.progs.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        for m in self.maps.values():
            m.close()
        self.raw_links, self.progs, self.maps = [], {}, {}


# --- the syscalls --------------------------------------------------------------------------------------------------

def _raise_permission(err: int, what: str) -> None:
    if err in (errno.EPERM, errno.EACCES):
        raise PermissionDenied(f"{what}: {os.strerror(err)}", _PERMISSION_HINT)


def _create_map(spec: MapSpec, max_entries: int) -> int:
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into("IIIII", attr, 0, spec.type, ctypes.sizeof(spec.key_type), ctypes.sizeof(spec.value_type),
                     max_entries, spec.flags)
    name = re.sub(r"[^A-Za-z0-9_.]", "_", spec.name)[:15].encode()
    attr[28:28 + len(name)] = name  # map_name
    fd = sys_bpf(BPF_MAP_CREATE, attr)
    if fd < 0:
        err = -fd
        _raise_permission(err, f"creating the BPF map {spec.name}")
        raise ProgramRefused(f"the kernel refused the BPF map {spec.name} (type {spec.type}, {max_entries} entries): "
                             f"{os.strerror(err)}", "run `gputrace doctor` to see what this kernel supports",
                             errno_=err)
    return fd


def kernel_version_code() -> int:
    nums = [int(x) for x in re.findall(r"\d+", os.uname().release)[:3]] + [0, 0, 0]
    return (nums[0] << 16) | (nums[1] << 8) | min(nums[2], 255)


def verifier_reason(log: str) -> str:
    """The verifier's own reason, from the end of its log: the last lines that are not its statistics."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not re.match(r"(processed \d+ insns|verification time|stack depth|"
                                                r"-- END PROG LOAD LOG --)", ln)]
    return "; ".join(lines[-2:])[:400]


def prog_load(insns: bytes, prog_type: int, expected_attach_type: int = 0, *, name: str = "", license: str = "GPL",
              what: str = "a BPF program") -> int:
    """BPF_PROG_LOAD; returns the fd. A refusal is loaded again with the verifier's log, whose reason
    the error carries (ProgramRefused.log has all of it)."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    log = ctypes.create_string_buffer(0)
    for log_level in (0, 1):  # the log only on a retry: it costs time and tells nothing when the load succeeds
        if log_level:
            log = ctypes.create_string_buffer(_LOG_SIZE)
        attr = ctypes.create_string_buffer(ATTR_SIZE)
        struct.pack_into("IIQQIIQII", attr, 0, prog_type, len(insns) // 8, ctypes.addressof(code), ctypes.addressof(lic),
                         log_level, len(log) if log_level else 0, ctypes.addressof(log) if log_level else 0,
                         kernel_version_code(), 0)
        pname = re.sub(r"[^A-Za-z0-9_.]", "_", name)[:15].encode()
        attr[48:48 + len(pname)] = pname  # prog_name
        struct.pack_into("II", attr, 64, 0, expected_attach_type)  # prog_ifindex, expected_attach_type
        fd = sys_bpf(BPF_PROG_LOAD, attr)
        if fd >= 0:
            return fd
        err = -fd
    text = log.value.decode(errors="replace")
    reason = verifier_reason(text)
    if not reason:  # refused before the verifier ran: EPERM/EACCES then means privileges (the verifier's is EACCES)
        _raise_permission(err, f"loading {what}")
    msg = f"the kernel's verifier refused {what}: {reason}" if reason else f"the kernel refused {what}: {os.strerror(err)}"
    raise ProgramRefused(msg, "report it with this reason; GPUTRACE_BPF=bcc compiles the program here with bcc "
                         "instead", log=text, errno_=err)


def raw_tracepoint_open(prog_fd: int, event: str) -> int:
    c_name = ctypes.create_string_buffer(event.encode())
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into("QI", attr, 0, ctypes.addressof(c_name), prog_fd)
    fd = sys_bpf(BPF_RAW_TRACEPOINT_OPEN, attr)
    if fd < 0:
        err = -fd
        _raise_permission(err, f"attaching to the raw tracepoint {event}")
        raise ProgramRefused(f"the kernel refused the raw tracepoint {event}: {os.strerror(err)}",
                             "run `gputrace doctor` to see what this kernel supports", errno_=err)
    return fd
