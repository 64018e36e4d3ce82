"""BPF maps read and written with raw bpf(2) calls, whichever loader created them.

A Map is a file descriptor with the ctypes types of its key and value: the loader of the precompiled
object (tracer/bpfobj.py) builds those types from the object's BTF, bcc from the program's C; the
tracer reads both the same way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from typing import Iterator

from gputrace.base.arch import syscall_number

BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_MAP_LOOKUP_BATCH = 24

ATTR_SIZE = 128  # union bpf_attr, as far as any command here uses it (the kernel takes a shorter one)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_NR_BPF = syscall_number("bpf")


def sys_bpf(cmd: int, attr: ctypes.Array) -> int:
    """bpf(2) on `attr` (a ctypes buffer the kernel may write back into): the result, or -errno."""
    r = _libc.syscall(_NR_BPF, cmd, attr, ctypes.sizeof(attr))
    return r if r >= 0 else -ctypes.get_errno()


@dataclass(frozen=True)
class MapInfo:
    """What the kernel says of a map (BPF_OBJ_GET_INFO_BY_FD)."""

    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def map_info(fd: int) -> MapInfo:
    info = ctypes.create_string_buffer(80)  # struct bpf_map_info up to its name and beyond
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into("IIQ", attr, 0, fd, len(info), ctypes.addressof(info))
    err = sys_bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    if err < 0:
        raise OSError(-err, f"bpf(BPF_OBJ_GET_INFO_BY_FD): {os.strerror(-err)}")
    mtype, _id, key_size, value_size, max_entries, flags = struct.unpack_from("6I", info, 0)
    name = info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")
    return MapInfo(mtype, key_size, value_size, max_entries, flags, name)


class Map:
    """One map: lookups, updates, deletes, key iteration and batched reads, typed by ctypes.

    `owned`: close() closes the descriptor (the object loader's maps); bcc closes its own."""

    def __init__(self, name: str, fd: int, key_type: type, value_type: type, *, owned: bool = False) -> None:
        self.name, self.fd, self.owned = name, fd, owned
        self.key_type, self.value_type = key_type, value_type
        self.key_size, self.value_size = ctypes.sizeof(key_type), ctypes.sizeof(value_type)

    def _key(self, key: object) -> ctypes._SimpleCData:
        return key if isinstance(key, self.key_type) else self.key_type(key)

    def _elem(self, cmd: int, key, value=None, flags: int = 0) -> int:
        attr = ctypes.create_string_buffer(ATTR_SIZE)  # per call: a map may be read from several threads
        struct.pack_into("IIQQQ", attr, 0, self.fd, 0, ctypes.addressof(key),
                         0 if value is None else ctypes.addressof(value), flags)
        return sys_bpf(cmd, attr)

    def lookup(self, key: object):
        """The value at `key` (a new ctypes value), or None where there is none."""
        k, v = self._key(key), self.value_type()
        err = self._elem(BPF_MAP_LOOKUP_ELEM, k, v)
        if err == -errno.ENOENT:
            return None
        if err < 0:
            raise OSError(-err, f"bpf(BPF_MAP_LOOKUP_ELEM) on {self.name}: {os.strerror(-err)}")
        return v

    def lookup_into(self, key, value) -> bool:
        """Reads into `value` (kept buffers, for hot polling); False where `key` has no value."""
        return self._elem(BPF_MAP_LOOKUP_ELEM, key, value) == 0

    def update(self, key: object, value, flags: int = 0) -> None:
        err = self._elem(BPF_MAP_UPDATE_ELEM, self._key(key), value, flags)
        if err < 0:
            raise OSError(-err, f"bpf(BPF_MAP_UPDATE_ELEM) on {self.name}: {os.strerror(-err)}")

    def delete(self, key: object) -> bool:
        """Deletes `key`; False where it was not there."""
        err = self._elem(BPF_MAP_DELETE_ELEM, self._key(key))
        if err == -errno.ENOENT:
            return False
        if err < 0:
            raise OSError(-err, f"bpf(BPF_MAP_DELETE_ELEM) on {self.name}: {os.strerror(-err)}")
        return True

    def keys(self) -> Iterator:
        """Every key, one syscall each (hash maps: in the kernel's order, which deletes may shuffle)."""
        prev, attr = None, ctypes.create_string_buffer(ATTR_SIZE)
        while True:
            nxt = self.key_type()
            struct.pack_into("IIQQ", attr, 0, self.fd, 0, 0 if prev is None else ctypes.addressof(prev),
                             ctypes.addressof(nxt))
            err = sys_bpf(BPF_MAP_GET_NEXT_KEY, attr)
            if err == -errno.ENOENT:
                return
            if err < 0:
                raise OSError(-err, f"bpf(BPF_MAP_GET_NEXT_KEY) on {self.name}: {os.strerror(-err)}")
            yield nxt
            prev = nxt

    def items(self) -> Iterator[tuple]:
        for k in self.keys():
            v = self.lookup(k)
            if v is not None:  # deleted between the two calls
                yield k, v

    def lookup_batch(self, token_in, token_out, keys, values, capacity: int) -> tuple[int, int]:
        """One BPF_MAP_LOOKUP_BATCH into `keys` and `values` (arrays of `capacity`), from
        `token_in` (None: the start): (rows read, 0 or the errno: ENOENT at the map's end)."""
        attr = ctypes.create_string_buffer(ATTR_SIZE)
        struct.pack_into("QQQQIIQQ", attr, 0, 0 if token_in is None else ctypes.addressof(token_in),
                         ctypes.addressof(token_out), ctypes.addressof(keys), ctypes.addressof(values),
                         capacity, self.fd, 0, 0)
        err = sys_bpf(BPF_MAP_LOOKUP_BATCH, attr)
        count = struct.unpack_from("I", attr, 32)[0]
        return count, -err if err < 0 else 0

    def info(self) -> MapInfo:
        return map_info(self.fd)

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1
