"""Numbers for people: rates, durations, bytes and shares, "-" where a value is not known."""

from __future__ import annotations


def fmt_rate(hz: float | None) -> str:
    if hz is None:
        return "-"
    if hz >= 1e6:
        return f"{hz / 1e6:.2f}M"
    if hz >= 1e4:
        return f"{hz / 1e3:.1f}k"
    if hz >= 100:
        return f"{hz:,.0f}"
    return f"{hz:.1f}"


def fmt_ns(ns: float | None) -> str:
    if ns is None:
        return "-"
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units (the CLI's reports, progress, the TUI), "-" where not known."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(n)


def fmt_pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def fmt_s_per_s(x: float | None) -> str:
    return "not measured" if x is None else f"{fmt_pct(x, 1)} ({fmt_ns(x * 1e9)}/s)"
