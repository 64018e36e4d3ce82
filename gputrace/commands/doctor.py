"""`gputrace doctor` (being written)."""
