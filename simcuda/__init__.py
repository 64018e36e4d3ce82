"""gputrace.simcuda."""
