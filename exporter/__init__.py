"""Fleet mode: a Prometheus exporter over the host view (one process per node, every CUDA process of
the node traced at the budget), with each process's container and pod identity. A library with no
user interface of its own; `gputrace export` serves it."""
