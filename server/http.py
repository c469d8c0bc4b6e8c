"""HTTP/1.1 limits uvicorn's httptools protocol lacks: head size, request-line size, header and
body read deadlines, a connection cap, and OpenAI-shaped bodies for the errors it answers itself.

What uvicorn already offers is used as is: the keep-alive timeout (`timeout_keep_alive`), the
parser, flow control, pipelining. httptools has no limit on the size of a request head (a 32 MB
header is buffered whole), and uvicorn has no read timeouts at all, so `LimitedHttpToolsProtocol`
adds them where the bytes arrive. `limit_concurrency`'s check is replaced by one that marks the
request (scope key OVER_CAPACITY) and lets the app answer an OpenAI-shaped 503, probes exempt.
Without httptools `uvicorn_options` falls back to h11 with its own head limit
(`h11_max_incomplete_event_size`) and uvicorn's plain-text errors.

Must not touch the routes, the engine or a request's body: it only counts and times bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial

from server.errors import error_body

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn[standard] ships httptools
    httptools = None
    HttpToolsProtocol = object

OVER_CAPACITY = "specserve.over_capacity"  # scope key: more connections than the cap
TIMED_OUT = "specserve.timed_out"  # scope key: the body did not arrive in time (408)


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 << 10  # request line + headers
    max_request_line_bytes: int = 8 << 10  # the request target, in practice
    header_timeout_s: float = 10.0  # first byte of a request (or the connection) -> headers
    body_timeout_s: float = 60.0  # end of headers -> end of body
    keep_alive_timeout_s: float = 5.0  # idle between requests
    max_connections: int = 1024

    @classmethod
    def of(cls, server_config) -> HttpLimits:
        return cls(**{name: getattr(server_config, name)
                      for name in cls.__dataclass_fields__})


class HeadRejected(Exception):
    """Raised from a parser callback to stop parsing; answered with `status`."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def raw_error(status: int, message: str, code: str | None) -> bytes:
    """A whole OpenAI-shaped error response that closes the connection, as bytes."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `HttpLimits`.

    The head (request line and headers) is counted as it arrives, before httptools buffers it;
    the header deadline runs from the connection or a request's first byte to the end of its
    headers, the body deadline from there to the end of its body (total times, so a client
    trickling one byte a second cannot hold a connection). A response sent before its request's
    body was read (an early 413 or 401) closes the connection instead of draining the body."""

    def __init__(self, *args, limits: HttpLimits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.limit_concurrency = None  # replaced by the check in on_headers_complete
        self._head_open = True  # between the end of a request and the end of the next head
        self._head_bytes = 0  # bytes received while a head is open (a bound, body included)
        self._head_size = 0  # the open head's request target and headers, exactly
        self._deadline = None  # the armed header or body timer

    # -- timers ----------------------------------------------------------------------------
    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._timed_out, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self, what: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if what == "body" else None
        if cycle is not None and not cycle.response_complete:
            self.scope[TIMED_OUT] = True
            cycle.disconnected = True  # the app reads http.disconnect; its sends are dropped
            cycle.message_event.set()
        if cycle is None or not cycle.response_started:
            seconds = (self.limits.body_timeout_s if what == "body"
                       else self.limits.header_timeout_s)
            self.transport.write(raw_error(408, f"the request {what} did not arrive within "
                                                f"{seconds:g}s", "request_timeout"))
        self.transport.close()

    # -- bytes in --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "headers")

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._head_open:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no websockets here
        except httptools.HttpParserError as exc:
            rejected = exc.__context__ if isinstance(exc.__context__, HeadRejected) else None
            self._reject(rejected or HeadRejected(400, "invalid HTTP request", "invalid_http"))
            return
        if self._head_open and self._head_bytes > self.limits.max_header_bytes:
            self._reject(self._head_too_large())

    def _head_too_large(self) -> HeadRejected:
        return HeadRejected(431, f"the request headers exceed {self.limits.max_header_bytes} "
                                 "bytes", "headers_too_large")

    def _reject(self, rejected: HeadRejected) -> None:
        self.logger.warning("HTTP request refused: %s", rejected.message)
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(raw_error(rejected.status, rejected.message, rejected.code))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._reject(HeadRejected(400, msg, "invalid_http"))

    # -- parser callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        if self._deadline is None:
            self._arm(self.limits.header_timeout_s, "headers")

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            raise HeadRejected(414, f"the request line exceeds "
                                    f"{self.limits.max_request_line_bytes} bytes", "uri_too_long")
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self.limits.max_header_bytes:
            raise self._head_too_large()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._arm(self.limits.body_timeout_s, "body")
        cap = self.limits.max_connections
        self.scope[OVER_CAPACITY] = len(self.connections) > cap or len(self.tasks) >= cap
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._head_open, self._head_bytes = True, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self.cycle is not None and self.cycle.more_body:  # answered before the body was read
            self.transport.close()
            return
        super().on_response_complete()


def uvicorn_options(limits: HttpLimits) -> dict:
    """Keyword arguments of uvicorn.Config that apply `limits`."""
    options = {"timeout_keep_alive": limits.keep_alive_timeout_s}
    if httptools is None:  # pragma: no cover
        return {**options, "http": "h11", "h11_max_incomplete_event_size": limits.max_header_bytes,
                "limit_concurrency": limits.max_connections}
    return {**options, "http": partial(LimitedHttpToolsProtocol, limits=limits)}
