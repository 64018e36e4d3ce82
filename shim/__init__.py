"""gputrace.shim."""
