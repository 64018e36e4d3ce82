"""`gputrace attach` (being written)."""
