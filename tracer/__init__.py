"""The tracer: libcuda symbols, eBPF uprobe attach, in-kernel aggregation, snapshots and the audit.

A library with no user interface; the CLI and the TUI use it.
"""
