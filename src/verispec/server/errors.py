"""HTTP errors: the server's own exception types and THE table mapping every exception type to a
status code and an OpenAI-style error body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": "..."}}

The table is looked up along the exception's MRO, so a subclass inherits its parent's row unless
it has its own (EmptyPromptError -> its own row; TokenOutOfRangeError -> InputError's row). The
message is the exception's own text: no matching on message text, no fallback that hides an error.
Anything not in the table is a server bug: 500, logged with its traceback.

``param`` names the request field at fault: a RequestError's own, a pydantic error's location,
or the ``field`` of the library's error (ConfigError, InputError, ContextLengthExceeded: set
where the library checks the value), spelled as the request spells it (REQUEST_FIELDS).
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
    """The generation queue is full (--max-queue requests already wait): an expected state, not a
    fault (logged at INFO, one line)."""


class ServerShuttingDown(ServerOverloaded):
    """The server is draining (SIGTERM or Ctrl-C): no new requests; running ones were cut."""


class HostNotAllowed(RequestError):
    """The Host (or a browser's Origin) is not one this server answers to (--allowed-hosts)."""


class UnsupportedMediaType(RequestError):
    """A POST body that is not declared application/json."""


class BodyTimeout(RequestError):
    """The client did not send its whole body within --body-timeout seconds."""


class BatchFailed(RequestError):
    """The generation batch running the request failed in work its requests share (a model's
    forward pass, its cache, a backend error, out of memory): every request in it ends with
    this 500, its cause logged with its traceback; the worker starts a new batch. A fault of
    one request's own (its grammar, its logits) is that request's error alone."""


class ClientDisconnected(RequestError):
    """The client went away before its response was ready; nobody reads this one."""


@dataclass(frozen=True)
class ErrorKind:
    status: int | None  # None: the exception's own status_code (routing errors: 404, 405)
    type: str
    code: str
    headers: tuple[tuple[str, str], ...] = ()
    fault: bool = False  # a server bug: generic message, ERROR log with the traceback


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
    HostNotAllowed: ErrorKind(403, _INVALID, "host_not_allowed"),
    ModelNotFound: ErrorKind(404, _INVALID, "model_not_found"),
    BodyTimeout: ErrorKind(408, _INVALID, "request_timeout"),
    StarletteHTTPException: ErrorKind(None, _INVALID, "invalid_route"),  # 404, 405
    PromptTooLarge: ErrorKind(413, _INVALID, "prompt_too_large"),
    BodyTooLarge: ErrorKind(413, _INVALID, "request_too_large"),
    UnsupportedMediaType: ErrorKind(415, _INVALID, "unsupported_media_type"),
    pydantic.ValidationError: ErrorKind(422, _INVALID, "validation_error"),
    ClientDisconnected: ErrorKind(499, "client_closed_request", "client_disconnected"),
    BatchFailed: ErrorKind(500, "server_error", "batch_failed"),
    ServerOverloaded: ErrorKind(503, "server_overloaded", "queue_full", (("Retry-After", "1"),)),
    ServerShuttingDown: ErrorKind(503, "server_overloaded", "shutting_down",
                                  (("Retry-After", "5"),)),
    VerispecError: ErrorKind(500, "server_error", "internal_error", fault=True),  # DraftContract
    Exception: ErrorKind(500, "server_error", "internal_error", fault=True),
}


def error_kind(exc: BaseException) -> ErrorKind:
    """The table row of the nearest class in ``type(exc).__mro__``."""
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return ERROR_TABLE[Exception]  # BaseException subclasses that are not Exceptions


CHAT_PATH = "/v1/chat/completions"
# a library field (VerispecError.field) -> the request field that sets it, where the names differ
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                  "num_top": "logprobs"}
# /v1/chat/completions sends the prompt as messages, and the logprobs' count as top_logprobs
CHAT_REQUEST_FIELDS = {**REQUEST_FIELDS, "prompt": "messages", "logprobs": "top_logprobs",
                       "num_top": "top_logprobs"}


def error_param(exc: BaseException, path: str | None = None) -> str | None:
    """The request field ``exc`` is about (None: the request as a whole), as the endpoint at
    ``path`` names it."""
    if isinstance(exc, pydantic.ValidationError):
        return ".".join(str(part) for part in exc.errors()[0]["loc"]) or None
    param = getattr(exc, "param", None)
    if param is None and isinstance(exc, VerispecError) and exc.field is not None:
        names = CHAT_REQUEST_FIELDS if path == CHAT_PATH else REQUEST_FIELDS
        param = names.get(exc.field, exc.field)
    return param


def error_body(exc: BaseException, path: str | None = None) -> tuple[int, dict[str, object]]:
    """(status, OpenAI error JSON) for ``exc`` raised answering a request to ``path``; also
    used for errors in the middle of a stream."""
    kind = error_kind(exc)
    status = kind.status if kind.status is not None else int(exc.status_code)
    message, param = _message(exc), error_param(exc, path)
    if kind.fault:
        message = f"internal server error ({type(exc).__name__}); see the server log"
        param = None
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


def log_error(where: str, exc: BaseException) -> None:
    """A fault: ERROR with its traceback. An expected refusal (overload, shutdown): INFO, one
    line. Client errors (4xx) are the access log's business."""
    kind = error_kind(exc)
    if kind.fault:
        logger.error("%s failed", where, exc_info=exc)
    elif (kind.status or 0) >= 500:
        logger.info("%s: %s (%s)", where, type(exc).__name__, exc)


def error_response(exc: BaseException, path: str | None = None) -> JSONResponse:
    """The OpenAI error JSON response for ``exc`` (raised answering a request to ``path``),
    with its row's headers."""
    status, body = error_body(exc, path)
    return JSONResponse(body, status_code=status, headers=dict(error_kind(exc).headers))


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    log_error(f"{request.method} {request.url.path}", exc)
    return error_response(exc, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through :data:`ERROR_TABLE` (the 500 row via Starlette's
    ServerErrorMiddleware, which also re-raises it for the server log)."""
    for cls in ERROR_TABLE:
        app.add_exception_handler(cls, _handle)
