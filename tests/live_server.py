"""Run an app under a real uvicorn on loopback (in a thread) for the server tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from depthserve.server.connections import ConnectionLimits, uvicorn_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def live_server(app, limits: ConnectionLimits = ConnectionLimits()) -> Iterator[str]:
    """Serve `app` as `depthserve serve` does until the block ends; yields the base URL once /health answers."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            httpx.get(f"{base}/health")
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def metric_value(base: str, name: str, **labels) -> float:
    """A sample of /metrics (0.0 when absent), parsed with the prometheus text parser."""
    text = httpx.get(f"{base}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def wait_for_log_lines(caplog, logger: str, wanted, timeout: float = 10.0) -> list[str]:
    """The messages `logger` has written once one satisfies `wanted` (or at the timeout). The server's
    access line is written after the response has gone out, so a client may hold the reply before it."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [record.getMessage() for record in caplog.records if record.name == logger]
        if any(wanted(line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def wait_idle(llm, timeout: float = 10.0) -> None:
    """Until the AsyncLLM has no request in flight (aborts land at the engine's next step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not llm.engine.has_unfinished_requests() and llm.num_requests == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")
