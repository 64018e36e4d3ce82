"""gputrace.bpf."""
