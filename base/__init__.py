"""The ground floor under every layer: errors with hints, processes, native builds, bcc loading,
numbers for people. It imports nothing of gputrace's."""
