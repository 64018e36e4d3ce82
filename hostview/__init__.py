"""The host view: every CUDA process of this host as frozen frames (live, recorded or replayed),
its GPUs, and the checkpoint actions on its processes. A library with no user interface: `top`'s
TUI, `top --once`, `record` and the exporter present what it gives."""
