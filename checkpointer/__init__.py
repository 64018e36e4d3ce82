"""gputrace.checkpointer."""
