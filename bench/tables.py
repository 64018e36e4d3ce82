"""Markdown tables more than one benchmark writes."""

from __future__ import annotations


def shim_cost_rows(cases: dict) -> list[str]:
    """The shim's added cost per intercepted call, a row per case (bench/shim_sim.py, bench/shim_gpu.py)."""
    rows = ["| case | function | driver ns | through shim ns | added ns (p10..p90) |", "|---|---|---:|---:|---:|"]
    for name, v in cases.items():
        rows.append(f"| {name} | {v['function']}{'' if v['wrapped'] else ' (not wrapped)'} | {v['driver_ns']:.1f} | "
                    f"{v['shim_ns']:.1f} | {v['added_ns_median']:.1f} ({v['added_ns_p10']:.1f}..{v['added_ns_p90']:.1f}) |")
    return rows


def served_async_rows(per_call: dict) -> list[str]:
    """The stream-ordered pair served through the VMM API (--suspendable), where it was measured."""
    v = per_call.get("served_through_vmm")
    if not v:
        return []
    return ["", f"Under `--suspendable` (GPUTRACE_SHIM_VMM=1) a cuMemAllocAsync of 1 MiB and its cuMemFreeAsync are "
                f"served through the VMM API: {v['shim_ns'] / 1e3:.1f} us a pair against the driver's "
                f"{v['driver_ns'] / 1e3:.1f} us (added {v['added_ns_median'] / 1e3:.1f} us, p10..p90 "
                f"{v['added_ns_p10'] / 1e3:.1f}..{v['added_ns_p90'] / 1e3:.1f})."]
