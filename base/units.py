"""Numbers for people: rates, durations, bytes and shares, "-" where a value is not known."""

from __future__ import annotations


def _scaled(x: float | None, steps: tuple[tuple[float, float, str], ...], last: str) -> str:
    """x by the first step (threshold, divisor, format of the divided value) it reaches, else `last`."""
    if x is None:
        return "-"
    for at, div, fmt in steps:
        if x >= at:
            return fmt.format(x / div)
    return last.format(x)


def fmt_rate(hz: float | None) -> str:
    return _scaled(hz, ((1e6, 1e6, "{:.2f}M"), (1e4, 1e3, "{:.1f}k"), (100, 1, "{:,.0f}")), "{:.1f}")


def fmt_rate_or(hz: float | None, not_known: str | None) -> str:
    """A rate, or "not known" where its reason is given (tracer/model.py, unknown_reason): a rate
    whose interval is wider than half of it is never shown as a figure."""
    return "not known" if not_known else fmt_rate(hz)


def fmt_ns(ns: float | None) -> str:
    return _scaled(ns, ((1e9, 1e9, "{:.2f} s"), (1e6, 1e6, "{:.2f} ms"), (1e3, 1e3, "{:.2f} µs")), "{:.0f} ns")


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
