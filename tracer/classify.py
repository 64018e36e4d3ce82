"""Which of four classes a CUDA driver API function belongs to, by a rule table the audit can show.

The overhead model (docs/architecture.md, The audit) needs, per process, calls/s of the classes a checkpointing layer would
intercept and the time spent blocked waiting for the GPU. So the classes are about *cost*, not about
the API reference's chapters:

- SUBMISSION: puts work on the GPU or on a stream (launches, copies, memsets, event records, stream
  waits and writes). A layer intercepts these to track what the GPU is doing.
- SYNC: blocks the calling thread until the GPU has finished something. Time in these is the slack
  in which a layer's added CPU cost can hide.
- STATE: creates, destroys or changes state a checkpointer must track to restore the job
  (contexts, allocations, mappings, modules, streams, events, graphs, pools, IPC and interop handles).
- QUERY: only reads (getters, attribute and occupancy queries, non-blocking completion polls).

Names are classified on their base name: the ABI suffixes `_v2`, `_v3`, `_ptsz` and `_ptds` (in any
combination, e.g. `cuMemcpyHtoDAsync_v2_ptsz`) select an ABI variant, never change what a call does.

`RULES` is checked in order; the first rule whose pattern matches the whole base name wins. A name no
rule matches is `DEFAULT_CLASS` = STATE: a checkpointer must intercept any call it cannot prove to be
read-only, so counting an unknown function as state errs toward a higher predicted cost, never lower.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Any, Mapping


class FunctionClass(str, enum.Enum):
    SUBMISSION = "submission"
    SYNC = "synchronization"
    STATE = "state"
    QUERY = "query"


CLASS_ORDER: tuple[FunctionClass, ...] = (
    FunctionClass.SUBMISSION,
    FunctionClass.SYNC,
    FunctionClass.STATE,
    FunctionClass.QUERY,
)

DEFAULT_CLASS = FunctionClass.STATE


@dataclass(frozen=True)
class Rule:
    cls: FunctionClass
    pattern: str  # regular expression, matched against the whole base name
    why: str


_SUB, _SYNC, _STATE, _QUERY = FunctionClass.SUBMISSION, FunctionClass.SYNC, FunctionClass.STATE, FunctionClass.QUERY

RULES: tuple[Rule, ...] = (
    # --- synchronization: the caller blocks until the GPU is done.
    Rule(_SYNC, r"cu(Ctx|Stream|Event)Synchronize", "blocks the calling thread until the GPU work it names completes"),
    Rule(_SYNC, r"cuFlushGPUDirectRDMAWrites", "blocks until outstanding GPUDirect RDMA writes are visible"),
    # --- submission: work enqueued on the GPU or a stream.
    Rule(_SUB, r"cuLaunch\w*", "kernel launches (incl. cooperative, Ex, legacy Grid) and host functions enqueued on a stream"),
    Rule(
        _SUB,
        r"cuMem(cpy|set)\w*",
        "copies and memsets. The synchronous copies (no Async in the name) enqueue on the legacy or "
        "per-thread stream and then wait for the work before them: they are submissions, and their time "
        "is counted as wait (`waits`), not driver CPU time",
    ),
    Rule(
        _SUB,
        r"cuEventRecord\w*|cu(Green)?Ctx(Record|Wait)Event|cuStreamWaitEvent",
        "event records and waits are ordering work executed by the GPU; the host does not block",
    ),
    Rule(_SUB, r"cuStream(WaitValue|WriteValue)(32|64)|cuStreamBatchMemOp", "stream memory operations executed by the GPU"),
    Rule(_SUB, r"cuStreamAddCallback", "host callback enqueued on a stream (the legacy form of cuLaunchHostFunc)"),
    Rule(_SUB, r"cuGraph(Launch|Upload)", "graph launch, and the upload that is stream-ordered work ahead of it"),
    Rule(
        _SUB,
        r"cuMem(Prefetch|PrefetchBatch|DiscardBatch|DiscardAndPrefetchBatch|BatchDecompress)Async",
        "stream-ordered migration, discard and decompression work",
    ),
    Rule(_SUB, r"cu(Signal|Wait)ExternalSemaphoresAsync", "external semaphore signal/wait enqueued on a stream"),
    # --- getters with side effects, listed before the generic QUERY rules that would take them.
    Rule(
        _STATE,
        r"cuIpcGet(Mem|Event)Handle|cuMemGetHandleForAddressRange|cuExternalMemoryGetMapped\w*",
        "named like getters, but export device memory to other processes or map external memory in",
    ),
    # --- query: only reads, never blocks.
    Rule(
        _QUERY,
        r"cu(Stream|Event)Query|cuEventElapsedTime",
        "non-blocking completion polls: they return CUDA_ERROR_NOT_READY instead of waiting, so a polling "
        "loop shows as a high query rate, and its time is CPU time, not slack",
    ),
    Rule(_QUERY, r"cu\w*Get([A-Z0-9_]\w*)?", "getters: attributes, handles, versions, error strings, cuGetProcAddress"),
    Rule(_QUERY, r"cu\w*Is[A-Z]\w*", "predicates such as cuStreamIsCapturing and cuFuncIsLoaded"),
    Rule(_QUERY, r"cuOccupancy\w*", "occupancy calculators"),
    Rule(_QUERY, r"cuDevice(CanAccessPeer|ComputeCapability|TotalMem)", "device getters not named Get"),
    Rule(
        _QUERY,
        r"cu(Module|Library)Enumerate\w*|cuGraphDebugDotPrint|cuGraphNodeFindInClone|cuLogs(Current|DumpTo\w*)",
        "read driver objects or logs without changing them",
    ),
    Rule(
        _QUERY,
        r"cuTensorMap\w*|cuDev(Sm)?Resource\w*",
        "host-side encoders of descriptors: they write only the caller's structs, not driver state",
    ),
    Rule(_QUERY, r"cuProfiler\w*", "profiler start/stop: no state a checkpointer saves or restores"),
    Rule(_QUERY, r"cudbg\w*", "debugger hook symbols, not driver API calls; nothing in them for a checkpointer to track"),
    # --- state: what remains of each family changes state a restore must replay.
    Rule(_STATE, r"cuInit", "initialises the driver"),
    Rule(
        _STATE,
        r"cu(Ctx|DevicePrimaryCtx|GreenCtx)\w*",
        "contexts: create, destroy, make current, push, pop, limits, flags, peer access",
    ),
    Rule(_STATE, r"cuDevice\w*", "device-wide settings: memory pools, graph memory, notifications"),
    Rule(
        _STATE,
        r"cu(Mem|Pointer)\w*",
        "allocations and frees (also stream-ordered ones), virtual memory (create, map, unmap, release, "
        "reserve, set access), host allocation and registration, pools, advice, shareable handles, pointer attributes",
    ),
    Rule(
        _STATE,
        r"cu(Module|Library|Link|Func|Kernel|Param)\w*",
        "code: loading and unloading modules and libraries, function attributes, legacy launch parameters",
    ),
    Rule(_STATE, r"cu(Stream|Event)\w*", "stream and event creation and destruction, capture, attributes, attached memory"),
    Rule(
        _STATE,
        r"cuIpc\w*|cu(Import|Destroy)External\w*|cuGraphics\w*|cuMulticast\w*|cu(GL|EGL|VDPAU)\w*",
        "memory shared with other processes, devices or graphics APIs (GL, EGL, VDPAU interop)",
    ),
    Rule(_STATE, r"cu(Graph|UserObject)\w*", "building, instantiating, updating and destroying graphs"),
    Rule(_STATE, r"cu(Array|Array3D|MipmappedArray|TexRef|SurfRef|TexObject|SurfObject)\w*", "arrays, textures, surfaces"),
    Rule(
        _STATE,
        r"cu(Checkpoint|Coredump|Logs)\w*|cuThreadExchangeStreamCaptureMode",
        "driver-level process settings: its own checkpoint API, coredump and log settings, capture mode",
    ),
)

_COMPILED = tuple((re.compile(rule.pattern), rule) for rule in RULES)
_SUFFIXES = re.compile(r"(?:_v\d+|_ptsz|_ptds)+$")


def base_name(name: str) -> str:
    """`cuMemcpyHtoDAsync_v2_ptsz` -> `cuMemcpyHtoDAsync`."""
    return _SUFFIXES.sub("", name)


def rule_for(name: str) -> Rule | None:
    """The first rule matching `name`'s base name, or None when the default applies."""
    base = base_name(name)
    for regex, rule in _COMPILED:
        if regex.fullmatch(base):
            return rule
    return None


def classify(name: str) -> FunctionClass:
    rule = rule_for(name)
    return rule.cls if rule else DEFAULT_CLASS


_BLOCKING = re.compile(r"cuMemcpy\w*")


@functools.lru_cache(maxsize=4096)
def waits(name: str) -> bool:
    """Whether time in `name` is time the calling thread waits for the GPU: the synchronization
    calls, and the synchronous copies, which wait for the work queued before them (a loop whose
    only wait is a cuMemcpyDtoH has its slack there). A layer's cost added before such a call hides
    in that wait; counting it as driver CPU time would put the audit's lower bound above what the
    layer can cost. (Synchronous memsets do not wait: the driver documents them as asynchronous
    to the host, except into pinned host or managed memory.)"""
    if classify(name) is FunctionClass.SYNC:
        return True
    base = base_name(name)
    return bool(_BLOCKING.fullmatch(base)) and "Async" not in base


def waiting_ids(functions: Mapping[int, Any]) -> frozenset[int]:
    """The ids of those of `functions` (id -> an object with a `name`) whose calls wait (`waits`)."""
    return frozenset(i for i, f in functions.items() if waits(f.name))

