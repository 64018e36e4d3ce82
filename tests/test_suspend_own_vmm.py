"""Suspend and resume of a program that maps VMM memory itself (cuMemAddressReserve, cuMemCreate,
cuMemMap, cuMemSetAccess), as PyTorch with expandable_segments and XLA do: suspend unmaps each mapping
and releases each physical allocation (the driver has the memory back) while the program's reservations
stay; resume creates each allocation again with the same properties, maps it at the same addresses and
offsets, and the handles the program holds keep working (the shim translates them to the driver's)."""

from __future__ import annotations

import json
import threading

import pytest

from gputrace.base.errors import CheckpointError, NotSuspendable
from gputrace.checkpointer import resume, suspend
from gputrace.shim import client

from shimtest import ask, start_pattern, procs, shim_dir  # noqa: F401  (fixtures)

G = 2 << 20  # simcuda's VMM granularity
OWN_PHYS = 5 * G  # --own-vmm: allocations A (2 G), B (2 G), C (1 G)


start = start_pattern


def own(status: dict, kind: str) -> list[dict]:
    return sorted((a for a in status["allocations"] if a["kind"] == kind), key=lambda a: (a["base"], a.get("handle", 0)))


def quit_ok(p) -> None:
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, p.stderr.read()  # cuMemUnmap, cuMemRelease (old handles), cuMemAddressFree


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staging"])
@pytest.mark.parametrize("vmm", [True, False], ids=["suspendable", "checkpointable"])
def test_own_mappings_are_released_and_made_again_at_the_same_addresses(procs, shim_dir, direct, vmm):
    p = start(procs, "--own-vmm", vmm=vmm)
    ready = json.loads(p.stdout.readline())
    before = client.status(p.pid)
    maps, phys, reserves = own(before, "vmm_map"), own(before, "vmm_phys"), own(before, "va_reserve")
    assert len(maps) == 4 and len(phys) == 3 and len(reserves) == 2
    assert sum(a["size"] for a in phys) == OWN_PHYS
    # One allocation mapped at two offsets: B's second granule first, then its first.
    b = [m for m in maps if m["size"] == G and m["offset"] == G]
    assert len(b) == 1 and any(m["handle"] == b[0]["handle"] and m["offset"] == 0 for m in maps)
    free0 = ask(p, "meminfo")["free"]

    rep = suspend(p.pid, direct=direct)
    assert rep.allocations == 4 and rep.bytes == ready["bytes"] and rep.direct == direct
    assert rep.reserved_bytes == OWN_PHYS
    assert ask(p, "meminfo")["free"] == free0 + OWN_PHYS  # the driver has all of it back
    st = client.status(p.pid)
    assert st["suspended"] and st["paused"]
    assert all(a["suspended"] for a in own(st, "vmm_map") + own(st, "vmm_phys"))
    assert own(st, "va_reserve") == reserves  # the program's reservations stay
    assert ask(p, "props") == {"handles": 3, "same": 3}  # ungated: answered for the handles it holds

    got: dict = {}
    th = threading.Thread(target=lambda: got.update(ask(p, "sum")))
    th.start()
    with client.Connection(p.pid) as c:
        while c.status()["waiting"] == 0:  # the job's next call waits at the gate
            assert th.is_alive()
    rr = resume(p.pid, direct=direct)
    th.join(60)
    assert got["sum"] == ready["sum"]  # the data, at the same addresses
    assert rr.allocations == 4 and rr.bytes == ready["bytes"]
    after = client.status(p.pid)
    assert not after["suspended"] and not after["paused"]
    assert ask(p, "meminfo")["free"] == free0
    strip = ("suspended", "driver_handle")
    assert [{k: v for k, v in a.items() if k not in strip} for a in own(after, "vmm_map")] == \
        [{k: v for k, v in a.items() if k not in strip} for a in maps]
    # The program still holds its old handles: the same values, now standing for new allocations.
    assert [a["handle"] for a in own(after, "vmm_phys")] == [a["handle"] for a in phys]
    assert not any(a["suspended"] for a in own(after, "vmm_map") + own(after, "vmm_phys"))
    assert ask(p, "props") == {"handles": 3, "same": 3}

    # Its handles work in later calls: unmapped and mapped again with them, the data are still there.
    assert ask(p, "remap")["sum"] == ready["sum"]
    g = ask(p, "grow")  # a new allocation after the suspension, beside the recreated ones
    assert g["sum"] != ready["sum"]
    handles = [a["handle"] for a in own(client.status(p.pid), "vmm_phys")]
    assert len(set(handles)) == len(handles) == 4
    s2 = ask(p, "fill 5")["sum"]
    rep2 = suspend(p.pid, direct=direct)
    assert rep2.allocations == 5 and rep2.reserved_bytes == OWN_PHYS + G
    resume(p.pid, direct=direct)
    assert ask(p, "sum")["sum"] == s2 and ask(p, "remap")["sum"] == s2
    quit_ok(p)


def test_the_programs_old_handles_stand_for_the_drivers_new_ones(procs, shim_dir):
    """The driver hands out new handles on resume; the program's are mapped to them, and calls with
    the old values reach the new allocations (a handle of the wrong allocation would fail cuMemMap or
    change the data)."""
    p = start(procs, "--own-vmm")
    ready = json.loads(p.stdout.readline())
    phys = own(client.status(p.pid), "vmm_phys")
    assert all(a["driver_handle"] == a["handle"] for a in phys)
    suspend(p.pid)
    resume(p.pid)
    after = own(client.status(p.pid), "vmm_phys")
    assert [a["handle"] for a in after] == [a["handle"] for a in phys]
    assert len({a["driver_handle"] for a in after}) == 3
    for _ in range(3):  # each round the driver's handles change again
        suspend(p.pid)
        resume(p.pid)
        assert ask(p, "remap")["sum"] == ready["sum"]
    assert any(a["driver_handle"] != a["handle"] for a in own(client.status(p.pid), "vmm_phys"))
    quit_ok(p)


def test_a_mixed_program_is_suspended_whole(procs, shim_dir):
    """cuMemAlloc memory served through the VMM API by the shim, beside the program's own mappings."""
    p = start(procs, "--mixed", "--size", str(3 << 20))
    ready = json.loads(p.stdout.readline())
    before = client.status(p.pid)
    served = [a for a in before["allocations"] if a["kind"] == "device"]
    assert len(served) == 2 and all(a["reserved"] for a in served)
    free0 = ask(p, "meminfo")["free"]
    rep = suspend(p.pid)
    assert rep.allocations == 6 and rep.bytes == ready["bytes"]
    assert rep.reserved_bytes == sum(a["reserved"] for a in served) + OWN_PHYS
    assert ask(p, "meminfo")["free"] == free0 + rep.reserved_bytes
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"] and ask(p, "meminfo")["free"] == free0
    assert ask(p, "remap")["sum"] == ready["sum"]
    quit_ok(p)


def test_memory_that_cannot_be_carried_is_refused_with_nothing_changed(procs, shim_dir):
    """A physical allocation mapped nowhere: its data cannot be copied out, so it cannot be released and
    made again. Refused before anything is released; the job runs on as it was."""
    p = start(procs, "--own-vmm", "--spare-handle")
    ready = json.loads(p.stdout.readline())
    before = client.status(p.pid)
    free0 = ask(p, "meminfo")["free"]
    with pytest.raises(NotSuspendable, match=r"the program's VMM physical allocation .* is not wholly mapped") as e:
        suspend(p.pid)
    assert "--backend driver" in e.value.hint and f"checkpoint -p {p.pid}" in e.value.hint
    st = client.status(p.pid)
    assert not st["suspended"] and not st["paused"] and p.poll() is None
    assert st["allocations"] == before["allocations"]  # nothing released, nothing marked
    assert ask(p, "meminfo")["free"] == free0 and ask(p, "sum")["sum"] == ready["sum"]
    # Pitched and stream-ordered memory beside the program's own mapping: refused the same way.
    q = start(procs)
    ready_q = json.loads(q.stdout.readline())
    with pytest.raises(NotSuspendable, match="pitched allocation"):
        suspend(q.pid)
    assert not client.status(q.pid)["paused"] and ask(q, "sum")["sum"] == ready_q["sum"]
    quit_ok(p)


def test_a_mapping_whose_allocation_the_program_released_is_refused(procs, shim_dir):
    """cuMemRelease while mapped: the memory lives on in the mapping, but the shim no longer knows what to
    make it again with. Refused, nothing changed; the job frees everything at exit as usual."""
    p = start(procs, "--mixed", "--release-early")
    ready = json.loads(p.stdout.readline())
    free0 = ask(p, "meminfo")["free"]
    with pytest.raises(NotSuspendable, match=r"mapping at .* maps a physical allocation the shim has no record of"):
        suspend(p.pid)
    st = client.status(p.pid)
    assert not st["suspended"] and not st["paused"]
    assert not any(a.get("suspended") for a in st["allocations"])  # the shim's own allocations untouched too
    assert ask(p, "meminfo")["free"] == free0 and ask(p, "sum")["sum"] == ready["sum"]
    quit_ok(p)


def test_a_failed_copy_gives_the_job_back_whole_or_leaves_it_suspended_whole(procs, shim_dir, monkeypatch):
    """simcuda fails every asynchronous copy of exactly 3 MiB: the shim's, when its chunk cuts A's 4 MiB
    mapping there (the workload's own copies are synchronous). A suspend whose copy fails releases
    nothing; a resume whose copy back fails releases again what it had made, and a later resume works."""
    monkeypatch.setenv("SIMCUDA_FAIL_COPY_BYTES", str(3 << 20))
    p = start(procs, "--mixed")
    ready = json.loads(p.stdout.readline())
    free0 = ask(p, "meminfo")["free"]
    with pytest.raises(CheckpointError, match="copy failed"):
        suspend(p.pid, chunk=3 << 20)
    st = client.status(p.pid)
    assert not st["suspended"] and not st["paused"] and not any(a.get("suspended") for a in st["allocations"])
    assert ask(p, "meminfo")["free"] == free0 and ask(p, "sum")["sum"] == ready["sum"]

    rep = suspend(p.pid)
    freed = ask(p, "meminfo")["free"]
    assert freed == free0 + rep.reserved_bytes
    with pytest.raises(CheckpointError, match="could not resume"):
        resume(p.pid, chunk=3 << 20)
    st = client.status(p.pid)
    assert st["suspended"] and all(a["suspended"] for a in own(st, "vmm_map") + own(st, "vmm_phys"))
    assert ask(p, "meminfo")["free"] == freed  # what the failed resume made is given back again
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"] and ask(p, "meminfo")["free"] == free0
    assert ask(p, "remap")["sum"] == ready["sum"]
    quit_ok(p)
