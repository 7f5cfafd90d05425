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

import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..api import Decoder
from .errors import (
    AuthenticationFailed,
    BodyTooLarge,
    InvalidJSON,
    ModelNotFound,
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
    worker = GenerationWorker(settings.max_queue, metrics.record_generation)
    metrics.track_queue(lambda: worker.queue_depth)
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
    install_error_handlers(app)
    app.include_router(_openai_routes(service, settings),
                       dependencies=[Depends(_api_key_check(settings.api_key))])
    app.include_router(_operations_routes(service, metrics))
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app


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
        body = CompletionRequest.model_validate(await _read_json(request,
                                                                 settings.max_body_bytes))
        _check_model(body.model, settings.model_name)
        params = completion_params(body, settings.max_tokens_limit)
        return await service.respond(request, params, CompletionFormat)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = ChatCompletionRequest.model_validate(await _read_json(request,
                                                                     settings.max_body_bytes))
        _check_model(body.model, settings.model_name)
        params = chat_params(body, settings.max_tokens_limit)
        return await service.respond(request, params, ChatFormat)

    return router


def _operations_routes(service: GenerationService, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": service.settings.model_name,
                "speculative": service.speculative,
                "num_draft_tokens": service.decoder.num_draft_tokens if service.speculative else 0,
                "busy": service.worker.busy, "queue_depth": service.worker.queue_depth}

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


async def _read_json(request: Request, max_bytes: int) -> object:
    """The body as JSON, at most ``max_bytes`` (413 beyond); NaN/Infinity are not JSON (400)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body has {declared} bytes, more than this server reads "
                           f"({max_bytes}); shorten the prompt.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the body has more than {max_bytes} bytes, more than this server "
                               "reads; shorten the prompt.")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN/Infinity
        raise InvalidJSON(f"the body is not valid JSON ({exc}); send one JSON object.") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")
