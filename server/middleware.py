"""Pure ASGI middleware: request id with access log and HTTP metrics, API-key auth, body size
limit, the connection cap's 503.

Pure ASGI (not Starlette's BaseHTTPMiddleware, which breaks disconnect detection for streams):
each wraps `send`/`receive` and passes everything else through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import error_body
from server.http import OVER_CAPACITY, TIMED_OUT

if TYPE_CHECKING:
    from server.metrics import Metrics

log = logging.getLogger("specserve.access")
OPEN_PATHS = ("/health", "/ready", "/docs", "/openapi.json", "/redoc")
TENANT = "specserve.tenant"  # scope["state"] key: who the API key says sent the request
REQUEST_ID = "specserve.request_id"  # scope["state"] key: the id echoed in X-Request-Id


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class AccessMiddleware:
    """Request id, access log and HTTP metrics, from one look at each response's status.

    Echoes X-Request-Id (or makes one) in the response and the access log; only the log reads
    it (engine request ids never come from a client). The outermost layer, so it also sees the
    401s and 413s of the layers inside. Probes and scrapes are logged at DEBUG: a probe every
    few seconds would bury the requests at INFO."""

    METRIC_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models",
                               "/health", "/ready", "/metrics"})
    QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = _header(scope, b"x-request-id")
        request_id = incoming if incoming and len(incoming) <= 128 else uuid.uuid4().hex
        scope.setdefault("state", {})[REQUEST_ID] = request_id
        started, status, left = time.perf_counter(), [0], [False]

        async def watching_receive():
            message = await receive()
            if message["type"] == "http.disconnect" and not status[0]:
                left[0] = True  # whatever the app answers now, nobody reads it
            return message

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message)
                message["headers"] = list(message.get("headers", ())) + [
                    (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, watching_receive, send_with_id)
        finally:
            # 408: server.http timed the body out; 499 (nginx's): the client left first
            code = 408 if scope.get(TIMED_OUT) else 499 if left[0] else status[0]
            self._record(scope["method"], scope["path"], request_id, code,
                         time.perf_counter() - started)

    def _record(self, method: str, path: str, request_id: str, status: int,
                latency_s: float) -> None:
        level = logging.DEBUG if path in self.QUIET_PATHS else logging.INFO
        log.log(level, "%s %s %s %d %.1fms", request_id, method, path, status, latency_s * 1e3)
        route = path if path in self.METRIC_ROUTES else "other"
        self.metrics.observe_http(route, status or 499)  # none sent: the client left (nginx's 499)


class AuthMiddleware:
    """`Authorization: Bearer KEY` on every route but the probes and docs when keys are
    configured (constant-time); /metrics included, so it is not public.

    The key's tenant id (a hash of the key, never the key) goes to scope["state"][TENANT]:
    the prefix cache is partitioned by it."""

    def __init__(self, app, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.tenants = [hashlib.sha256(b"specserve-tenant\0" + k).hexdigest()[:32]
                        for k in self.keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"].startswith(OPEN_PATHS):
            return await self.app(scope, receive, send)
        header = _header(scope, b"authorization") or ""
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # every key compared (no short-circuit), so the time says nothing about which matched
        matches = [hmac.compare_digest(given, key) for key in self.keys]
        if scheme.lower() != "bearer" or not given or not any(matches):
            message = ("missing API key: send Authorization: Bearer <key>" if not header
                       else "invalid API key")
            return await send_json(send, 401, error_body(401, message, None, "invalid_api_key"),
                                   [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})[TENANT] = self.tenants[matches.index(True)]
        return await self.app(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    """Raised from inside the app's body read: FastAPI passes HTTP exceptions through to the
    error handlers (any other exception there becomes a 400 "error parsing the body")."""

    code = "body_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes} bytes")


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen, started = [0], [False]

        async def counting_receive():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:  # read outside FastAPI's handlers
            if not started[0]:
                await self._reject(send)

    async def _reject(self, send):
        exc = BodyTooLarge(self.max_bytes)
        await send_json(send, 413, error_body(413, exc.detail, None, exc.code))


class ConnectionCapMiddleware:
    """An OpenAI-shaped 503 that closes the connection, for requests server.http marked as over
    the connection cap. Probes are answered anyway: a flood must not make the liveness probe
    restart a healthy server."""

    PROBES = ("/health", "/ready")

    def __init__(self, app, retry_after_s: int) -> None:
        self.app, self.retry_after_s = app, retry_after_s

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or not scope.get(OVER_CAPACITY)
                or scope["path"] in self.PROBES):
            return await self.app(scope, receive, send)
        body = error_body(503, "too many open connections; retry later", None,
                          "too_many_connections")
        await send_json(send, 503, body, [(b"retry-after", str(self.retry_after_s).encode()),
                                          (b"connection", b"close")])
