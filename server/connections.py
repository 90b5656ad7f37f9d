"""How the server holds its HTTP connections (uvicorn's h11 protocol underneath).

uvicorn by itself waits forever for a request's headers (a client that opens connections and sends
a byte now and then holds them all: slowloris) and answers what it cannot parse (a negative
Content-Length, a broken request line) with a plain-text 400. Here:
- a connection has `header_timeout_s` from opening, or from its previous response, to finish
  sending a request's headers, then the server closes it;
- an idle keep-alive connection is closed after `keep_alive_s` (uvicorn's own timer);
- beyond `max_connections` open connections, requests are answered 503 at once (uvicorn's
  `limit_concurrency`) instead of queueing;
- a request the HTTP parser rejects gets a 400 with an OpenAI-style JSON error body.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 1000


def uvicorn_config(app, host: str, port: int, log_level: str, limits: ConnectionLimits = ConnectionLimits()):
    import uvicorn

    protocol = type("LimitedH11Protocol", (HeaderTimeoutProtocol,), {"header_timeout_s": limits.header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,  # ours is the access line
                          http=protocol, timeout_keep_alive=limits.keep_alive_s,
                          limit_concurrency=limits.max_connections)


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s: float = ConnectionLimits.header_timeout_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_headers():
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (a pipelined request may start here)
        if not self.transport.is_closing() and self._waiting_for_headers():
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()
