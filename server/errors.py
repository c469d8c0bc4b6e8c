"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, for every failure.

Internal errors are logged with their traceback and answered with a generic message: no paths
or stack traces reach a client.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specserve.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def _validation_param(errors: list[dict]) -> str | None:
    if not errors:
        return None
    loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    # drop pydantic's union-branch markers ("str", "list[TextPart]", "function-after[...]")
    loc = [p for p in loc if not re.match(r"^(str|int|float|list\[.*\]|function-.*|type=.*|"
                                          r"dict\[.*\]|union\[.*\]|tagged-union\[.*\])$", p)]
    return ".".join(loc) or None


def _validation_message(errors: list[dict]) -> str:
    if not errors:
        return "invalid request"
    first = errors[0]
    where = _validation_param([first])
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    if first.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {where}"
    if first.get("type") == "model_attributes_type":
        return "the request body must be a JSON object"
    return f"{where}: {msg}" if where else msg


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors of a request: the deepest error first (of a
    union's branches, the one that got furthest says most)."""
    errors = sorted(errors, key=lambda e: -len(e.get("loc", ())))
    return _validation_message(errors), _validation_param(errors)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = describe_validation(exc.errors())
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = {404: "no such route", 405: "method not allowed"}.get(exc.status_code,
                                                                         str(exc.detail))
        return error_response(exc.status_code, message, None, getattr(exc, "code", None),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", None, "internal_error")
