"""gputrace.tui."""
