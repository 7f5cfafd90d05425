"""HTTP errors: the server's own exception types and THE table mapping every exception type to a
status code and an OpenAI-style error body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": "..."}}

The table is looked up along the exception's MRO, so a subclass inherits its parent's row unless
it has its own (EmptyPromptError -> its own row; TokenOutOfRangeError -> InputError's row). The
message is the exception's own text: no matching on message text, no fallback that hides an error.
Anything not in the table is a server bug: 500, logged with its traceback.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    ConfigError,
    ContextLengthExceeded,
    EmptyPromptError,
    InputError,
    UnsupportedFeatureError,
    VerispecError,
)

logger = logging.getLogger("verispec.server")


class RequestError(Exception):
    """A request the server refuses; ``param`` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidJSON(RequestError):
    """The body is not one JSON object."""


class ParameterError(RequestError, ConfigError):
    """A field has the right type but a value the server does not accept."""


class UnsupportedParameter(ParameterError):
    """A field asks for an OpenAI feature verispec does not implement (n > 1, logprobs, ...)."""


class AuthenticationFailed(RequestError):
    """--api-key is set and the request's bearer token is missing or different."""


class ModelNotFound(RequestError):
    """The request names a model other than the one served."""


class PromptTooLarge(RequestError):
    """The prompt has more tokens than --max-prompt-tokens."""


class BodyTooLarge(RequestError):
    """The request body has more bytes than the server reads."""


class ServerOverloaded(RequestError):
    """The generation queue is full (--max-queue requests already wait)."""


class ClientDisconnected(RequestError):
    """The client went away before its response was ready; nobody reads this one."""


@dataclass(frozen=True)
class ErrorKind:
    status: int | None  # None: the exception's own status_code (routing errors: 404, 405)
    type: str
    code: str
    headers: tuple[tuple[str, str], ...] = ()


_INVALID = "invalid_request_error"

ERROR_TABLE: dict[type[BaseException], ErrorKind] = {
    InvalidJSON: ErrorKind(400, _INVALID, "invalid_json"),
    ParameterError: ErrorKind(400, _INVALID, "invalid_value"),
    UnsupportedParameter: ErrorKind(400, _INVALID, "unsupported_parameter"),
    ConfigError: ErrorKind(400, _INVALID, "invalid_value"),
    InputError: ErrorKind(400, _INVALID, "invalid_input"),
    EmptyPromptError: ErrorKind(400, _INVALID, "empty_prompt"),
    ContextLengthExceeded: ErrorKind(400, _INVALID, "context_length_exceeded"),
    UnsupportedFeatureError: ErrorKind(400, _INVALID, "unsupported_parameter"),
    AuthenticationFailed: ErrorKind(401, "authentication_error", "invalid_api_key",
                                    (("WWW-Authenticate", "Bearer"),)),
    ModelNotFound: ErrorKind(404, _INVALID, "model_not_found"),
    StarletteHTTPException: ErrorKind(None, _INVALID, "invalid_route"),  # 404, 405
    PromptTooLarge: ErrorKind(413, _INVALID, "prompt_too_large"),
    BodyTooLarge: ErrorKind(413, _INVALID, "request_too_large"),
    pydantic.ValidationError: ErrorKind(422, _INVALID, "validation_error"),
    ClientDisconnected: ErrorKind(499, "client_closed_request", "client_disconnected"),
    ServerOverloaded: ErrorKind(503, "server_overloaded", "queue_full", (("Retry-After", "1"),)),
    VerispecError: ErrorKind(500, "server_error", "internal_error"),  # NonFinite, DraftContract..
    Exception: ErrorKind(500, "server_error", "internal_error"),
}


def error_kind(exc: BaseException) -> ErrorKind:
    """The table row of the nearest class in ``type(exc).__mro__``."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return ERROR_TABLE[Exception]  # BaseException subclasses that are not Exceptions


def error_body(exc: BaseException) -> tuple[int, dict[str, object]]:
    """(status, OpenAI error JSON) for ``exc``; also used for errors in the middle of a stream."""
    kind = error_kind(exc)
    status = kind.status if kind.status is not None else int(getattr(exc, "status_code"))
    message, param = _message(exc), getattr(exc, "param", None)
    if isinstance(exc, pydantic.ValidationError):
        param = ".".join(str(part) for part in exc.errors()[0]["loc"]) or None
    if status >= 500:
        message = f"internal server error ({type(exc).__name__}); see the server log"
    return status, {"error": {"message": message, "type": kind.type, "param": param,
                              "code": kind.code}}


def _message(exc: BaseException) -> str:
    if isinstance(exc, pydantic.ValidationError):
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                    for e in exc.errors()[:3]]
        return "invalid request body: " + "; ".join(problems)
    if isinstance(exc, StarletteHTTPException):
        return (f"{exc.detail} (the routes: GET /v1/models, POST /v1/completions, POST "
                "/v1/chat/completions, GET /health, GET /metrics)")
    return str(exc)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    kind = error_kind(exc)
    status, body = error_body(exc)
    if status >= 500:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(body, status_code=status, headers=dict(kind.headers))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through :data:`ERROR_TABLE` (the 500 row via Starlette's
    ServerErrorMiddleware, which also re-raises it for the server log)."""
    for cls in ERROR_TABLE:
        app.add_exception_handler(cls, _handle)
