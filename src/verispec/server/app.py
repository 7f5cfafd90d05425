"""The app factory: ``create_app(decoder, settings) -> FastAPI``, an OpenAI-compatible server.

    GET  /v1/models, /v1/models/{model}    the one served model, named --model-name
    POST /v1/completions                   text completion (streaming or not)
    POST /v1/chat/completions              chat completion (streaming or not)
    GET  /health                           liveness and queue state (no API key needed)
    GET  /metrics                          Prometheus text (no API key needed)

Everything the app needs is passed in or built here: no module globals, one worker thread and
one metrics registry per app, started and stopped with the app's lifespan. Request bodies are
read here (size-capped, strict JSON) and validated with pydantic; errors go through the one
table in errors.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from .. import __version__
from ..text.decoder import Decoder
from .errors import (
    AuthenticationFailed,
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    HostNotAllowed,
    InvalidJSON,
    ModelNotFound,
    UnsupportedMediaType,
    error_response,
    install_error_handlers,
)
from .generation import GenerationService
from .metrics import RequestMetricsMiddleware, ServerMetrics
from .responses import ChatFormat, CompletionFormat
from .schemas import ChatCompletionRequest, CompletionRequest, chat_params, completion_params
from .settings import ServerSettings
from .worker import GenerationWorker


def create_app(decoder: Decoder, settings: ServerSettings) -> FastAPI:
    """A FastAPI app serving ``decoder`` under ``settings.model_name``."""
    metrics = ServerMetrics()
    metrics.drafting.info({"cross_vocab_rule": decoder.cross_vocab or "none"})
    worker = GenerationWorker(decoder, settings.max_queue, metrics.record_generation,
                              settings.batch_options(decoder.batch_options),
                              num_threads=settings.threads, on_round=metrics.record_round)
    metrics.track_queue(lambda: worker.queue_depth)
    metrics.track_running(lambda: worker.num_running + worker.num_prefilling)
    service = GenerationService(decoder, settings, worker, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="verispec", version=__version__, lifespan=lifespan)
    app.state.worker = worker
    app.state.settings = settings
    app.state.drain = service.drain  # called by http.VerispecServer on SIGTERM / Ctrl-C
    install_error_handlers(app)
    app.include_router(_openai_routes(service, settings),
                       dependencies=[Depends(_api_key_check(settings.api_key))])
    app.include_router(_operations_routes(service, metrics))
    app.add_middleware(RequestGuard, host_names=settings.host_names())
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # outermost: counts refusals
    _document_request_bodies(app)
    return app


def _document_request_bodies(app: FastAPI) -> None:
    """/openapi.json with the POST routes' bodies: they are read by hand (size cap, strict
    JSON), so FastAPI does not see them; their pydantic models are added here, with the models
    they nest under components/schemas, so clients and fuzzers see the real request schema."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/completions", CompletionRequest),
                            ("/v1/chat/completions", ChatCompletionRequest)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas[model.__name__] = body
            document["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = document
        return document

    app.openapi = openapi


class RequestGuard:
    """Pure ASGI, before any route: the Host (and a browser's Origin) must be one this server
    answers to, and a POST body must be declared JSON.

    Why: a server on 127.0.0.1 with no key is reachable from any web page the user visits. A
    cross-site form or fetch can POST text/plain without a CORS preflight, and a DNS-rebinding
    page (evil.example.com resolving to 127.0.0.1) can also read the answer; the first is
    stopped by requiring application/json (which needs a preflight this server never grants),
    the second by the Host check (the browser sends Host: evil.example.com).
    """

    def __init__(self, app, host_names: frozenset[str]) -> None:
        self.app = app
        self.host_names = host_names

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Exception | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                   for name, value in scope["headers"]}
        host = _host_name(headers.get("host", ""))
        if not self._allowed(host):
            return HostNotAllowed(f"Host {headers.get('host', '')!r} is not one this server "
                                  "answers to; connect by one of its names, or start it with "
                                  "--allowed-hosts.", "Host")
        origin = headers.get("origin")
        if origin is not None and not self._allowed(urlsplit(origin).hostname or ""):
            return HostNotAllowed(f"Origin {origin!r} is not allowed: browser pages from other "
                                  "sites may not call this server (--allowed-hosts).", "Origin")
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] == "POST" and content_type != "application/json":
            return UnsupportedMediaType(f"Content-Type {content_type or 'missing'!r} is not "
                                        "accepted: send the body as application/json.",
                                        "Content-Type")
        return None

    def _allowed(self, host: str) -> bool:
        return "*" in self.host_names or host.lower() in self.host_names


def _host_name(host: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1', 'localhost' -> 'localhost'."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _openai_routes(service: GenerationService, settings: ServerSettings) -> APIRouter:
    router = APIRouter(prefix="/v1")
    model_card = {"id": settings.model_name, "object": "model", "created": int(time.time()),
                  "owned_by": "verispec"}

    @router.get("/models")
    async def list_models() -> dict[str, object]:
        return {"object": "list", "data": [model_card]}

    @router.get("/models/{model:path}")
    async def get_model(model: str) -> dict[str, object]:
        _check_model(model, settings.model_name)
        return model_card

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body = CompletionRequest.model_validate(await _read_json(request, settings))
        _check_model(body.model, settings.model_name)
        params = completion_params(body, settings.max_tokens_limit, settings.max_choices)
        return await service.respond(request, params, CompletionFormat)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = ChatCompletionRequest.model_validate(await _read_json(request, settings))
        _check_model(body.model, settings.model_name)
        params = chat_params(body, settings.max_tokens_limit, settings.max_choices)
        return await service.respond(request, params, ChatFormat)

    return router


def _operations_routes(service: GenerationService, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": service.settings.model_name,
                "speculative": service.speculative,
                "num_draft_tokens": service.decoder.num_draft_tokens if service.speculative else 0,
                "busy": service.worker.busy, "running": service.worker.num_running,
                "prefilling": service.worker.num_prefilling,
                "queue_depth": service.worker.queue_depth}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_key_check(api_key: str | None):
    """A dependency: with --api-key, require 'Authorization: Bearer <key>' (constant-time)."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationFailed("missing API key: send 'Authorization: Bearer <key>' "
                                       "with the key the server was started with (--api-key).")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise AuthenticationFailed("wrong API key: the bearer token does not match the "
                                       "server's --api-key.")

    return check


def _check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise ModelNotFound(f"model {model!r} is not served here; this server serves {served!r} "
                            "(see GET /v1/models).", "model")


MAX_JSON_DEPTH = 32  # OpenAI's bodies nest 5 deep (messages -> content parts -> fields)


async def _read_json(request: Request, settings) -> object:
    """The body as JSON: at most --max-body-bytes (413), within --body-timeout seconds (408),
    nested at most MAX_JSON_DEPTH deep; NaN/Infinity are not JSON (400). A client that goes
    away mid-upload is ClientDisconnected (499, nothing logged as a fault)."""
    max_bytes = settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body has {declared} bytes, more than this server reads "
                           f"({max_bytes}); shorten the prompt.")
    try:
        raw = await asyncio.wait_for(_read_body(request, max_bytes), settings.body_timeout)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {settings.body_timeout:g} s "
                          "(--body-timeout); send it at once.") from None
    except ClientDisconnect:
        raise ClientDisconnected("the client closed the connection while sending its body"
                                 ) from None
    _check_depth(raw)
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN/Infinity
        raise InvalidJSON(f"the body is not valid JSON ({exc}); send one JSON object.") from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the body has more than {max_bytes} bytes, more than this server "
                               "reads; shorten the prompt.")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_depth(raw: bytes) -> None:
    """InvalidJSON if brackets nest deeper than MAX_JSON_DEPTH (outside strings), before the
    parser recurses into them (Python's json raises RecursionError near depth 1000)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # C-speed: most bodies stop here
        return
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise InvalidJSON(f"the body nests deeper than {MAX_JSON_DEPTH} levels; send a "
                                  "flat OpenAI request object.")
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")
