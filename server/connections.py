"""How the server holds its HTTP connections (uvicorn's h11 protocol underneath).

uvicorn by itself waits forever for a request's headers (a client that opens connections and sends
a byte now and then holds them all: slowloris) and answers what it cannot parse (a negative
Content-Length, a broken request line) with a plain-text 400. Here:
- a connection has `header_timeout_s` from opening, or from its previous response, to finish
  sending a request's headers, then the server closes it;
- a request's body has `body_timeout_s` from the end of its headers to arrive in full (a body sent a
  byte now and then, a declared length never sent, an absurd chunk size never filled): past it the
  server answers 408 with an OpenAI-style JSON error body (or, if the response has started, just
  closes) and closes the connection;
- an idle keep-alive connection is closed after `keep_alive_s` (uvicorn's own timer);
- beyond `max_connections` open connections, requests are answered 503 at once (uvicorn's
  `limit_concurrency`) instead of queueing;
- a request the HTTP parser rejects gets a 400 with an OpenAI-style JSON error body;
- a request head (request line and headers) over MAX_HEADER_BYTES gets a 431 with that body, whether
  it arrives in one read (the app refuses it, server/app.py) or in pieces (h11 refuses it): without
  the app's check the same head was refused or served depending on how the socket split it;
- on shutdown (Ctrl-C, SIGTERM) requests still running get `shutdown_grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Literal

from uvicorn.protocols.http.h11_impl import H11Protocol

Awaited = Literal["headers", "body"]  # what a connection waits for from its client

MAX_HEADER_BYTES = 16 * 1024  # h11's own default, stated so that the app applies the same limit


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 20.0  # the default 4 MB body limit at 200 KB/s
    keep_alive_s: float = 5.0
    max_connections: int = 1000
    shutdown_grace_s: float = 5.0


def uvicorn_config(app, host: str, port: int, log_level: str, limits: ConnectionLimits = ConnectionLimits()):
    import uvicorn

    protocol = type("LimitedH11Protocol", (DeadlineProtocol,), {"header_timeout_s": limits.header_timeout_s,
                                                                "body_timeout_s": limits.body_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,  # ours is the access line
                          http=protocol, h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=limits.keep_alive_s,
                          limit_concurrency=limits.max_connections,
                          timeout_graceful_shutdown=limits.shutdown_grace_s)


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with one deadline at a time: for the next request's headers while no
    request is being answered, for the request's body while it is still arriving."""

    header_timeout_s: float = ConnectionLimits.header_timeout_s
    body_timeout_s: float = ConnectionLimits.body_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: Awaited | None = None  # what the deadline is for
        super().connection_made(transport)
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        self._stop_deadline()  # the next request's headers get a deadline of their own
        super().on_response_complete()  # (a pipelined request may start here)
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:  # h11 gave up waiting for the head's end
            self._send_error(431, "Request Header Fields Too Large", head_too_large_message(),
                             "request_header_fields_too_large")
        else:
            self._send_error(400, "Bad Request", f"malformed HTTP request: {msg}", "invalid_request_error")
        self.transport.close()

    def _send_error(self, status: int, reason: str, message: str, err_type: str) -> None:
        """A last response with the OpenAI error body, written past h11 (the connection closes after it)."""
        body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}}).encode()
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close"
                             f"\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)

    def _waiting_for(self) -> Awaited | None:
        """What the connection waits for from the client: a request's "headers" (none is being
        answered; a body still arriving after its response counts as the next request's head), the
        "body" of the request being answered, or nothing."""
        if self.cycle is None or self.cycle.response_complete:
            return "headers"
        return "body" if self.cycle.more_body else None

    def _update_deadline(self) -> None:
        """Arm the deadline when the connection starts waiting for something else; keep it while it
        waits for the same thing (bytes trickling in do not extend it)."""
        awaiting = None if self.transport.is_closing() else self._waiting_for()
        if awaiting == self._awaiting and (awaiting is None or self._deadline is not None):
            return
        self._stop_deadline()
        if awaiting is not None:
            timeout = self.header_timeout_s if awaiting == "headers" else self.body_timeout_s
            self._awaiting, self._deadline = awaiting, self.loop.call_later(timeout, self._too_slow)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._awaiting = None, None

    def _too_slow(self) -> None:
        awaiting, self._deadline, self._awaiting = self._awaiting, None, None
        if self.transport.is_closing() or self._waiting_for() != awaiting:
            return
        if awaiting == "body" and not self.cycle.response_started:
            self._send_error(408, "Request Timeout", f"the request body did not arrive within "
                             f"{self.body_timeout_s:g} s of its headers", "request_timeout")
        self.transport.close()  # the app reading the body sees the client gone


def head_too_large_message() -> str:
    return f"the request line and headers are larger than this server's limit of {MAX_HEADER_BYTES} bytes"


def request_head_bytes(scope: dict) -> int:
    """The size of an HTTP/1.1 request head as sent (request line, headers, the blank line)."""
    target = len(scope.get("raw_path") or scope["path"].encode()) + (len(scope["query_string"]) + 1
                                                                    if scope.get("query_string") else 0)
    request_line = len(scope.get("method", "GET")) + 1 + target + len(" HTTP/1.1\r\n")
    return request_line + sum(len(k) + 2 + len(v) + 2 for k, v in scope.get("headers", [])) + 2
