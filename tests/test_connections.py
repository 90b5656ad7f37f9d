"""The server's HTTP connections (server/connections.py): slow or idle connections are closed on a
deadline, past the connection limit requests are refused at once instead of queueing, and what
the HTTP parser rejects gets an OpenAI-style JSON 400. Against a real uvicorn on loopback, with a
minimal app: the connection layer is the same whatever app it serves."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fastapi import FastAPI

from depthserve.server.connections import ConnectionLimits
from tests.live_server import live_server

LIMITS = ConnectionLimits(header_timeout_s=1.0, keep_alive_s=0.5, max_connections=20)


@pytest.fixture(scope="module")
def base():
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    with live_server(app, LIMITS) as url:
        yield url


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes the connection within `within` seconds (what it still sends, read and dropped)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096) == b"":
                return True
        except (socket.timeout, TimeoutError):
            return False
        except ConnectionResetError:
            return True
    return False


def test_a_request_whose_headers_never_finish_is_closed_on_the_deadline(base):
    slow = _connect(base)
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    started = time.monotonic()
    assert _closed_by_server(slow, within=LIMITS.header_timeout_s + 2)
    assert LIMITS.header_timeout_s - 0.2 <= time.monotonic() - started
    slow.close()


def test_a_byte_now_and_then_does_not_keep_a_connection(base):
    """slowloris: each byte would reset an idle timer, not the deadline for the whole header."""
    slow = _connect(base)
    started = time.monotonic()
    closed = False
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        if _closed_by_server(slow, within=0.2):
            closed = True
            break
    assert closed and time.monotonic() - started < LIMITS.header_timeout_s + 2
    slow.close()


def test_more_idle_connections_than_the_limit_are_refused_fast_then_reaped(base):
    idle = [_connect(base) for _ in range(LIMITS.max_connections + 5)]
    for sock in idle:
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # headers begun, never finished
    time.sleep(0.1)
    started = time.monotonic()
    refused = httpx.get(f"{base}/health", timeout=5)
    assert refused.status_code == 503 and time.monotonic() - started < 1.0  # answered, not queued
    assert all(_closed_by_server(sock, within=LIMITS.header_timeout_s + 2) for sock in idle)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    for sock in idle:
        sock.close()


def test_a_kept_alive_connection_is_closed_when_idle_and_serves_until_then(base):
    with httpx.Client(base_url=base, timeout=5) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health").status_code == 200  # the same connection, within keep-alive
    sock = _connect(base)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK")
    assert _closed_by_server(sock, within=LIMITS.keep_alive_s + 2)
    sock.close()


@pytest.mark.parametrize("request_head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"NOT A REQUEST LINE\r\n\r\n",
], ids=["negative-length", "two-lengths", "request-line"])
def test_what_the_http_parser_rejects_gets_a_json_400(base, request_head):
    sock = _connect(base)
    sock.sendall(request_head)
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")
