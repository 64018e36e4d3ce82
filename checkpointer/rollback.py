"""When a rollback of device memory alone is safe, as far as this tool can see.

`restore -p PID DIR --device-only` writes a GPU-memory checkpoint's bytes back into the live
process; its host state goes on. That is consistent only where nothing the host still uses was
written since the checkpoint, and nothing in a loop of allocations guarantees it: a caching
allocator (PyTorch's, CuPy's pool, XLA's BFC, the driver's stream-ordered pools) hands the blocks
of freed tensors to new ones, so the checkpoint's bytes land under tensors that did not exist then
(a training job died of exactly this: labels overwritten by old activations). What the tool can see,
each a refusal (`check`):

- allocations made or freed since the checkpoint: the shim counts every allocating and freeing
  driver call, the checkpoint's manifest holds the counts it saw, and the restore compares them
  with the counts under the closed gate;
- an allocator that sub-allocates and reuses blocks out of the driver's sight: a framework's
  library mapped in the process (`ALLOCATORS`). Its segments are allocated once, so the counts above
  stay still while tensors come and go inside them; the driver's own pools (stream-ordered memory)
  and a program's VMM mappings show in those counts, each allocation and free a driver call;
- work in flight: the job submitted work (launches, copies) in the moments before the gate closed,
  so its host side is inside a step whose values it already holds.

What it cannot see (a program that reuses its own buffers for other data without any driver call)
is why the rollback stays an explicit request, and `--force` skips these checks (unsafe: the job may
crash or compute with stale data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gputrace.base.errors import CheckpointError

# Driver calls that make or free device memory (the shim counts each, per name, in its status).
ALLOCS = ("cuMemAlloc", "cuMemAlloc_v2", "cuMemAllocPitch", "cuMemAllocPitch_v2", "cuMemAllocManaged",
          "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz",
          "cuMemCreate", "cuMemMap", "cuMemAddressReserve")
FREES = ("cuMemFree", "cuMemFree_v2", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", "cuMemRelease", "cuMemUnmap",
         "cuMemAddressFree")
# Libraries whose allocator caches device memory and hands freed blocks to new tensors.
ALLOCATORS = (("libc10_cuda", "PyTorch's caching allocator"),
              ("cupy_backends", "CuPy's memory pool"), ("/cupy/", "CuPy's memory pool"),
              ("libxla", "XLA's allocator (JAX)"), ("jaxlib", "XLA's allocator (JAX)"),
              ("xla_extension", "XLA's allocator (JAX)"),
              ("libtensorflow", "TensorFlow's allocator"), ("librmm", "RAPIDS' memory manager"))


def is_submission(name: str) -> bool:
    """A call that puts work on the device: a launch, a copy or a set."""
    return name.startswith(("cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset"))


def counts(calls: dict) -> tuple[int, int, int]:
    """(allocating calls, freeing calls, submissions) in the shim's per-function call counts."""
    allocs = sum(int(calls.get(f, 0)) for f in ALLOCS)
    frees = sum(int(calls.get(f, 0)) for f in FREES)
    subs = sum(int(n) for f, n in calls.items() if is_submission(f))
    return allocs, frees, subs


def allocators(maps: str) -> list[str]:
    """The caching allocators whose libraries a process maps (its /proc/PID/maps text)."""
    found = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        for pattern, what in ALLOCATORS:
            if pattern in parts[5] and what not in found:
                found.append(what)
    return found


@dataclass(frozen=True)
class Hazard:
    kind: str   # "allocations", "allocator", "in-flight", "unknown"
    what: str   # a clause for the message


def hazards(manifest: dict, before: dict, now: dict, maps: str) -> list[Hazard]:
    """Why a device-only rollback of the process is unsafe: `manifest` the checkpoint's, `before` the
    shim's status a moment before the gate closed, `now` its status under the closed gate, `maps` the
    process's memory map. Empty: nothing this tool can see."""
    out = []
    calls = now.get("calls") or {}
    then = manifest.get("calls")
    a1, f1, s1 = counts(calls)
    if not isinstance(then, dict) or not all(isinstance(k, str) and type(v) is int for k, v in then.items()):
        out.append(Hazard("unknown", "the checkpoint does not record the process's allocation calls (taken by an "
                                     "older gputrace), so what was allocated since cannot be told"))
    else:
        a0, f0, _ = counts(then)
        if (a1, f1) != (a0, f0):
            out.append(Hazard("allocations", f"it made {a1 - a0} allocation(s) and freed {f1 - f0} since the "
                                             "checkpoint, so its pointers may now name other data"))
    libs = allocators(maps)
    if libs:
        out.append(Hazard("allocator", "its allocator hands freed blocks to new data without a driver call ("
                                       + ", ".join(libs) + (" is" if len(libs) == 1 else " are") + " loaded)"))
    moving = s1 - counts(before.get("calls") or {})[2]
    if moving > 0:
        out.append(Hazard("in-flight", f"it is running work: {moving} launch(es) or copies in the moments before it "
                                       "was stopped, so its host side is in the middle of a step"))
    elif now.get("in_flight") or now.get("waiting"):
        out.append(Hazard("in-flight", "it had driver calls in flight when it was stopped"))
    return out


def changed_allocations(what: str) -> Hazard:
    """The process's allocations differ from the checkpoint's (`what`: which): it allocated or freed
    since, and a rollback would write into memory that now holds other data, or miss some."""
    return Hazard("allocations", f"its allocations are not the checkpoint's ({what})")


class UnsafeRollback(CheckpointError):
    """A device-only rollback refused: what the tool saw that makes it unsafe."""


def refusal(pid: int, path: Path, found: list[Hazard]) -> UnsafeRollback:
    return UnsafeRollback(
        f"refusing to roll back only the device memory of process {pid} to {path}: " + "; ".join(h.what for h in found)
        + ". Its host state would go on with device data from another moment: it may crash or compute with stale data",
        f"bring back the whole process instead: `gputrace checkpoint --full --leave-running -p {pid}`, then "
        f"`gputrace restore -p {pid} DIR` (in `gputrace top`: c, then r); `--force` rolls the device memory back "
        "anyway (unsafe); the job was not touched")
