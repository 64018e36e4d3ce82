"""Serving the metrics: an HTTP endpoint (prometheus_client's own server) while the host view's
frames come in."""

from __future__ import annotations

import errno
import time
from typing import Callable, Protocol

from gputrace.base.errors import GputraceError, UsageError
from gputrace.hostview.model import HostSnapshot
from gputrace.tracer.calibrate import Calibration

from .metrics import FleetMetrics


class Frames(Protocol):
    calibration: Calibration | None

    def frames(self): ...
    def close(self) -> None: ...


def parse_listen(text: str) -> tuple[str, int]:
    """ADDR:PORT, :PORT (every address) or [IPv6]:PORT."""
    host, sep, port = text.rpartition(":")
    hint = "give ADDR:PORT, e.g. --listen 0.0.0.0:9400 or --listen :9400"
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen {text}: not ADDR:PORT", hint)
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def serve(source: Frames, metrics: FleetMetrics, addr: str, port: int, *, duration_s: float | None = None,
          on_ready: Callable[[int], None] = lambda port: None,
          on_frame: Callable[[HostSnapshot], None] = lambda frame: None,
          start: Callable[[], None] = lambda: None) -> None:
    """Serves /metrics on addr:port until the source ends, `duration_s` has passed, or Ctrl-C.
    `start` runs once the port is bound (the source's set-up: loading the BPF program and
    calibrating take seconds, and minutes on a loaded host, which a port already taken must not
    cost before it is said); `on_ready` gets the port bound (port 0 picks a free one)."""
    from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    ProcessCollector(registry=registry)  # the exporter's own CPU and memory: process_cpu_seconds_total, ...
    try:
        server, _ = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        hint = ("another exporter (a second gputrace, a dcgm-exporter) holds it: choose another port"
                if exc.errno == errno.EADDRINUSE else "check the address: it must be one of this host's")
        raise GputraceError(f"cannot listen on {addr}:{port}: {exc.strerror}", hint) from None
    t0 = time.monotonic()
    try:
        start()
        on_ready(server.server_address[1])
        t0 = time.monotonic()
        for frame in source.frames():
            metrics.update(frame, source.calibration)
            on_frame(frame)
            if duration_s is not None and time.monotonic() - t0 >= duration_s:
                break
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
        server.shutdown()
        server.server_close()
