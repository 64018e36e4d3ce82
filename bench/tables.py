"""Markdown tables more than one benchmark writes."""

from __future__ import annotations


def shim_cost_rows(cases: dict) -> list[str]:
    """The shim's added cost per intercepted call, a row per case (bench/shim_sim.py, bench/shim_gpu.py)."""
    rows = ["| case | function | driver ns | through shim ns | added ns (p10..p90) |", "|---|---|---:|---:|---:|"]
    for name, v in cases.items():
        rows.append(f"| {name} | {v['function']}{'' if v['wrapped'] else ' (not wrapped)'} | {v['driver_ns']:.1f} | "
                    f"{v['shim_ns']:.1f} | {v['added_ns_median']:.1f} ({v['added_ns_p10']:.1f}..{v['added_ns_p90']:.1f}) |")
    return rows
