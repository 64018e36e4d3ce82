"""What makes a device-only rollback unsafe, as checkpointer/rollback.py reads it from the shim's
status and the process's memory map: each hazard alone, none for a program that allocates once and
is idle, and a manifest that cannot tell (old, or tampered with) counted as a hazard, never as safe."""

from __future__ import annotations

from gputrace.checkpointer import rollback

MAPS_PLAIN = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
MAPS_TORCH = MAPS_PLAIN + ("7f1000000000-7f1000001000 r-xp 00000000 08:01 43 "
                           "/opt/venv/lib/python3.12/site-packages/torch/lib/libc10_cuda.so\n")
CALLS = {"cuMemAlloc_v2": 3, "cuMemFree_v2": 1, "cuLaunchKernel": 500, "cuMemcpyDtoH_v2": 20, "cuCtxGetCurrent": 9}


def status(calls: dict, **kw) -> dict:
    return {"calls": calls, "in_flight": 0, "waiting": 0, **kw}


def kinds(found: list[rollback.Hazard]) -> list[str]:
    return [h.kind for h in found]


def test_a_program_that_allocated_once_and_is_idle_shows_nothing():
    assert rollback.counts(CALLS) == (3, 1, 520)
    assert rollback.hazards({"calls": CALLS}, status(CALLS), status(CALLS), MAPS_PLAIN) == []
    # Launches and copies since the checkpoint are what a rollback undoes: not a hazard in themselves.
    later = {**CALLS, "cuLaunchKernel": 900}
    assert rollback.hazards({"calls": CALLS}, status(later), status(later), MAPS_PLAIN) == []


def test_allocations_made_or_freed_since_the_checkpoint():
    churned = {**CALLS, "cuMemAlloc_v2": 7, "cuMemFree_v2": 5}
    (h,) = rollback.hazards({"calls": CALLS}, status(churned), status(churned), MAPS_PLAIN)
    assert h.kind == "allocations" and "made 4 allocation(s) and freed 4" in h.what
    # An allocation and a free that leave the same total still count: the addresses may now hold other data.
    vmm = {**CALLS, "cuMemUnmap": 1, "cuMemMap": 1}
    assert kinds(rollback.hazards({"calls": CALLS}, status(vmm), status(vmm), MAPS_PLAIN)) == ["allocations"]


def test_a_caching_allocator_is_seen_by_its_library():
    (h,) = rollback.hazards({"calls": CALLS}, status(CALLS), status(CALLS), MAPS_TORCH)
    assert h.kind == "allocator" and "PyTorch's caching allocator" in h.what
    assert rollback.allocators(MAPS_TORCH + MAPS_TORCH) == ["PyTorch's caching allocator"]


def test_work_in_flight():
    moving = {**CALLS, "cuLaunchKernel": 510}
    (h,) = rollback.hazards({"calls": CALLS}, status(CALLS), status(moving), MAPS_PLAIN)
    assert h.kind == "in-flight" and "10 launch(es)" in h.what
    (h,) = rollback.hazards({"calls": CALLS}, status(CALLS), status(CALLS, waiting=2), MAPS_PLAIN)
    assert h.kind == "in-flight" and "in flight" in h.what


def test_a_checkpoint_that_cannot_tell_is_a_hazard():
    for manifest in ({}, {"calls": None}, {"calls": {"cuMemAlloc_v2": "3"}}, {"calls": {"cuMemAlloc_v2": 3.5}}):
        assert kinds(rollback.hazards(manifest, status(CALLS), status(CALLS), MAPS_PLAIN)) == ["unknown"], manifest


def test_the_refusal_names_each_hazard_the_consequence_and_the_way_out():
    found = rollback.hazards({"calls": CALLS}, status({**CALLS, "cuMemAlloc_v2": 4}),
                             status({**CALLS, "cuMemAlloc_v2": 4, "cuLaunchKernel": 501}), MAPS_TORCH)
    assert kinds(found) == ["allocations", "allocator", "in-flight"]
    err = rollback.refusal(77, "/ck", found)
    assert all(h.what in err.msg for h in found) and "may crash or compute with stale data" in err.msg
    assert "gputrace checkpoint --full --leave-running -p 77" in err.hint and "--force" in err.hint
    assert "not touched" in err.hint
