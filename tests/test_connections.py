"""The server's HTTP connections (server/connections.py): slow or idle connections are closed on a
deadline, past the connection limit requests are refused at once instead of queueing, and what
the HTTP parser rejects gets an OpenAI-style JSON 400. Against a real uvicorn on loopback, with a
minimal app: the connection layer is the same whatever app it serves."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from depthserve.server.app import DEFAULT_MAX_BODY_BYTES, RequestIdAuthAndLimit
from depthserve.server.connections import MAX_HEADER_BYTES, ConnectionLimits
from tests.live_server import live_server

LIMITS = ConnectionLimits(header_timeout_s=1.0, body_timeout_s=1.5, keep_alive_s=0.5, max_connections=20)


@pytest.fixture(scope="module")
def base():
    """/health, and /echo that reads the body (under the server's own middleware, as every route is)."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request, delay_s: float = 0.0):
        body = await request.body()
        await asyncio.sleep(delay_s)
        return {"bytes": len(body)}

    app.add_middleware(RequestIdAuthAndLimit, api_key=None, max_body_bytes=DEFAULT_MAX_BODY_BYTES)
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



def _answer_to(base: str, data: bytes) -> tuple[bytes, dict]:
    sock = _connect(base)
    sock.sendall(data)
    answer, _ = _until_closed(sock, within=5)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, json.loads(body) if body else {}


def _head(header_bytes: int, end: bool = True) -> bytes:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + b"r" * header_bytes
    return head + (b"\r\n\r\n" if end else b"")


def test_a_request_head_over_the_limit_gets_a_json_431_however_it_arrives(base):
    whole, whole_error = _answer_to(base, _head(60_000))  # parsed whole by h11: refused by the app
    started, started_error = _answer_to(base, _head(MAX_HEADER_BYTES + 100, end=False))  # h11 gives up waiting
    for head, error in ((whole, whole_error), (started, started_error)):
        assert head.startswith(b"HTTP/1.1 431") and b"content-type: application/json" in head.lower(), head
        assert error["error"]["type"] == "request_header_fields_too_large" and str(MAX_HEADER_BYTES) in \
            error["error"]["message"]
    under = httpx.get(f"{base}/health", headers={"X-Request-Id": "r" * (MAX_HEADER_BYTES - 200)})
    assert under.status_code == 200



def _until_closed(sock: socket.socket, within: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and after how many seconds it closed
    (the socket timing out first fails the test)."""
    started, answer = time.monotonic(), b""
    sock.settimeout(within)
    while chunk := sock.recv(4096):
        answer += chunk
    return answer, time.monotonic() - started


def _assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"content-type: application/json" in head.lower(), answer
    error = json.loads(body)["error"]
    assert error["type"] == "request_timeout" and error["code"] == 408 and "body did not arrive" in error["message"]


def test_a_body_sent_a_byte_now_and_then_gets_a_408_on_the_deadline(base):
    """Content-Length 100000, then a byte every 0.2 s: each byte would reset an idle timer, not the
    deadline for the whole body."""
    slow = _connect(base)
    slow.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    started = time.monotonic()
    while time.monotonic() - started < LIMITS.body_timeout_s + 2:
        try:
            slow.sendall(b"a")
        except OSError:
            break
        if _closed_by_server(slow, within=0.2):
            break
    else:
        raise AssertionError("the slow body's connection is still open")
    assert LIMITS.body_timeout_s - 0.2 <= time.monotonic() - started < LIMITS.body_timeout_s + 2
    slow.close()


@pytest.mark.parametrize("request_head", [
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n{",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nabc",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
], ids=["declared-length-never-sent", "absurd-chunk-size", "last-chunk-never-sent"])
def test_a_body_that_never_arrives_gets_a_json_408_and_a_closed_connection(base, request_head):
    sock = _connect(base)
    sock.sendall(request_head)
    answer, closed_after = _until_closed(sock, within=LIMITS.body_timeout_s + 3)
    sock.close()
    _assert_408(answer)
    assert LIMITS.body_timeout_s - 0.2 <= closed_after < LIMITS.body_timeout_s + 2
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_a_slow_body_that_arrives_within_the_deadline_is_answered(base):
    """The deadline is for the whole body, and a complete body stops it: an answer that takes longer
    than the deadline still comes, and the connection serves the next request."""
    sock = _connect(base)
    answer_after = LIMITS.body_timeout_s + 0.5
    sock.sendall(b"POST /echo?delay_s=%g HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nab" % answer_after)
    for part in (b"cd", b"ef"):
        time.sleep(LIMITS.body_timeout_s / 4)
        sock.sendall(part)
    sock.settimeout(LIMITS.body_timeout_s + 5)
    first = sock.recv(4096)
    assert first.startswith(b"HTTP/1.1 200 OK") and first.endswith(b'{"bytes":6}'), first
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK")
    sock.close()
