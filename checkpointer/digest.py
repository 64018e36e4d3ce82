"""The chunk digest the shim computes on the GPU (shim/digest.cu defines it), computed here on the CPU.

The shim hashes every chunk of device memory at checkpoint and restore time, on the device, to copy
only the chunks that changed.  This module is the definition's second, independent implementation:
the tests hold simcuda's and the GPU's digests against it, and `bench/digest_gpu.py` checks the PTX
the shim loads with it.  Numpy (where present) makes it fast enough for GiBs; without it, pure
Python handles the tests' MiBs.

A digest is 128 bits: two 64-bit sums of keyed MurmurHash3 finalizers, one term per 8-byte word,
each term keyed by the word's position.  Modelling the finalizer's outputs as random, a chunk that
changed keeps both sums with probability 2^-128 (each sum alone: 2^-64).
"""

from __future__ import annotations

M64 = (1 << 64) - 1
K1 = 0x9E3779B97F4A7C15
K2 = 0xC2B2AE3D27D4EB4F
S1 = 0x243F6A8885A308D3
S2 = 0x13198A2E03707344
ALGO = "gputrace-fmix128"


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    x ^= x >> 33
    return x


def _sums_py(words: list[int]) -> tuple[int, int]:
    a = b = 0
    for j, w in enumerate(words, 1):
        a += fmix64(((w ^ S1) + K1 * j) & M64)
        b += fmix64(((w ^ S2) + K2 * j) & M64)
    return a & M64, b & M64


def _sums_np(np, buf: bytes) -> tuple[int, int]:
    w = np.frombuffer(buf, dtype="<u8")
    j = np.arange(1, len(w) + 1, dtype=np.uint64)

    def fm(x):
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
        return x

    with np.errstate(over="ignore"):
        a = fm((w ^ np.uint64(S1)) + np.uint64(K1) * j).sum(dtype=np.uint64)
        b = fm((w ^ np.uint64(S2)) + np.uint64(K2) * j).sum(dtype=np.uint64)
    return int(a), int(b)


def digest(chunk: bytes | memoryview) -> tuple[int, int]:
    """The digest (a, b) of one chunk's bytes."""
    buf = bytes(chunk)
    n = len(buf)
    if n % 8:
        buf += bytes(8 - n % 8)
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        a, b = _sums_np(np, buf)
    else:
        a, b = _sums_py([int.from_bytes(buf[i:i + 8], "little") for i in range(0, len(buf), 8)])
    return fmix64((a + n * K2) & M64), fmix64(b ^ n)


def digests(data: bytes | memoryview, chunk_bytes: int) -> list[tuple[int, int]]:
    """The digest of each `chunk_bytes` piece of `data` (the last one may be shorter)."""
    mv = memoryview(data)
    return [digest(mv[o:o + chunk_bytes]) for o in range(0, len(mv), chunk_bytes)]
