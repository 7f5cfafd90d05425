"""From checked request parameters to an HTTP response: queue a job on the worker, wait for its
events, answer with one JSON body or a stream of server-sent events.

The event loop only waits and formats; encoding, checks that need the tokenizer (prompt size,
context window) and generation all run on the worker thread. Errors raised there come back as
events and are raised here, so the one table in errors.py picks the status. A client that goes
away stops its generation: before streaming starts, a watcher task notices the disconnect; once
streaming, Starlette cancels the body iterator, whose ``finally`` cancels the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ..api import Completion, Decoder, TextStream
from .errors import ClientDisconnected, PromptTooLarge, error_body
from .metrics import ServerMetrics
from .responses import DONE_LINE, ChatFormat, CompletionFormat, sse
from .schemas import GenerationParams
from .settings import ServerSettings
from .worker import Event, GenerationWorker, Job

logger = logging.getLogger("verispec.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class FirstTokenClock:
    """Observes the time to the first text delta of one request, once."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics, self.endpoint = metrics, endpoint
        self.started = time.perf_counter()
        self.seen = False

    def tick(self) -> None:
        if not self.seen:
            self.seen = True
            self.metrics.observe_first_token(self.endpoint, time.perf_counter() - self.started)


class GenerationService:
    def __init__(self, decoder: Decoder, settings: ServerSettings, worker: GenerationWorker,
                 metrics: ServerMetrics) -> None:
        self.decoder = decoder
        self.settings = settings
        self.worker = worker
        self.metrics = metrics
        self.speculative = decoder.engine.proposer is not None  # a draft model or n-grams

    def num_draft_tokens(self, params: GenerationParams) -> int:
        """The k a request runs with; 0 when the server decodes without a draft."""
        if not self.speculative:
            return 0
        return params.num_draft_tokens or self.decoder.num_draft_tokens

    async def respond(self, request: Request, params: GenerationParams,
                      response_format: type[CompletionFormat | ChatFormat]) -> Response:
        fmt = response_format(self.settings.model_name, self.num_draft_tokens(params))
        clock = FirstTokenClock(self.metrics, request.scope["route"].path)
        job = Job(partial(self._start_stream, params), asyncio.get_running_loop())
        self.worker.submit(job)  # ServerOverloaded -> 503
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await _next_event(job, watcher)  # STARTED, or the error that stopped it
            if params.stream:
                return StreamingResponse(_sse(job, fmt, clock), media_type="text/event-stream",
                                         headers=SSE_HEADERS)
            return JSONResponse(fmt.body(await _collect(job, watcher, clock)))
        except BaseException:
            job.cancel()
            raise
        finally:
            watcher.cancel()

    def _start_stream(self, params: GenerationParams) -> TextStream:
        """Runs on the worker thread: encode, check sizes, start the generation."""
        prompt_ids = params.prompt.encode(self.decoder.tokenizer)
        if len(prompt_ids) > self.settings.max_prompt_tokens:
            raise PromptTooLarge(f"the prompt has {len(prompt_ids)} tokens, more than this "
                                 f"server's --max-prompt-tokens={self.settings.max_prompt_tokens};"
                                 " shorten it.", params.prompt.param)
        max_tokens = params.max_tokens or self._room(len(prompt_ids), params)
        return self.decoder.stream(
            prompt_ids, max_new_tokens=max_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop=params.stop,
            num_draft_tokens=params.num_draft_tokens, speculative=self.speculative,
            ignore_eos=params.ignore_eos,
            min_new_tokens=min(params.min_tokens, max_tokens))

    def _room(self, num_prompt_tokens: int, params: GenerationParams) -> int:
        """max_tokens when the request omits it: what fits after the prompt (and k draft
        positions), at most --max-tokens-limit; at least 1, so an overlong prompt still gets
        the library's ContextLengthExceeded."""
        models = [self.decoder.target] + (
            [self.decoder.draft] if self.decoder.draft is not None else [])
        windows = [lm.max_positions for lm in models if lm.max_positions is not None]
        limit = self.settings.max_tokens_limit
        if windows:
            limit = min(limit, min(windows) - num_prompt_tokens - self.num_draft_tokens(params))
        return max(1, limit)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(job: Job, watcher: asyncio.Future) -> tuple[Event, object]:
    """The job's next event; raises the job's error, or ClientDisconnected."""
    getter = asyncio.ensure_future(job.events.get())
    try:
        done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter not in done:
        raise ClientDisconnected("the client closed the connection before the response was ready")
    event, value = getter.result()
    if event is Event.ERROR:
        raise value  # type: ignore[misc]
    return event, value


async def _collect(job: Job, watcher: asyncio.Future, clock: FirstTokenClock) -> Completion:
    while True:
        event, value = await _next_event(job, watcher)
        if event is Event.DELTA:
            clock.tick()
        elif event is Event.DONE:
            assert isinstance(value, Completion)
            return value


async def _sse(job: Job, fmt: CompletionFormat | ChatFormat, clock: FirstTokenClock):
    """The event stream: opening chunks, one chunk per verified delta, a final chunk with
    finish_reason, usage and speculation, then [DONE]. An error after the headers went out is
    sent as one {"error": ...} event (the openai client raises it)."""
    try:
        for chunk in fmt.opening_chunks():
            yield sse(chunk)
        while True:
            event, value = await job.events.get()
            if event is Event.DELTA:
                clock.tick()
                yield sse(fmt.delta_chunk(value))
            elif event is Event.DONE:
                yield sse(fmt.final_chunk(value))
                yield DONE_LINE
                return
            elif event is Event.ERROR:
                status, body = error_body(value)
                if status >= 500:
                    logger.error("generation failed mid-stream", exc_info=value)
                yield sse(body)
                return
    finally:
        job.cancel()  # a no-op when the job finished; stops it when the client went away
