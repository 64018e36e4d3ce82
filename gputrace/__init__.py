"""gputrace: what GPU checkpointing would cost a CUDA job, measured with eBPF; then the checkpointer."""

__version__ = "0.1.0"
