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

from ..api import Completion, Decoder
from ..batch_text import PendingRow, TextBatch
from .errors import ClientDisconnected, PromptTooLarge, ServerShuttingDown, error_body, log_error
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
        self.draining = False

    def drain(self) -> None:
        """Shutdown has begun (SIGTERM, Ctrl-C): refuse new requests now; after
        --drain-timeout seconds, end the running and queued ones with ServerShuttingDown (an
        error event and [DONE] for a stream), so no response is cut off without a word."""
        if self.draining:
            return
        self.draining = True
        error = ServerShuttingDown(f"the server shut down before this request finished (it "
                                   f"had {self.settings.drain_timeout:g} s); retry it.")
        asyncio.get_running_loop().call_later(self.settings.drain_timeout,
                                              self.worker.fail_all, error)

    def depth_policy(self, params: GenerationParams) -> str | None:
        """The adaptive policy a request runs under: None for a fixed k. A seeded sampled
        request runs at a fixed k when the policy picks depths from timings (goodput's measured
        costs) or from earlier requests (carry-over): those would change which random numbers
        its tokens use, and the seed would not fix its output."""
        policy = self.decoder.adaptive
        if not self.speculative or policy is None:
            return None
        if params.seed is not None and params.temperature > 0 and not policy.reproducible:
            return None
        return self.settings.depth_policy

    def num_draft_tokens(self, params: GenerationParams) -> int:
        """The k a request runs with; 0 when the server decodes without a draft."""
        if not self.speculative:
            return 0
        return params.num_draft_tokens or self.decoder.num_draft_tokens

    async def respond(self, request: Request, params: GenerationParams,
                      response_format: type[CompletionFormat | ChatFormat]) -> Response:
        if self.draining:
            raise ServerShuttingDown("the server is shutting down; retry later.")
        fmt = response_format(self.settings.model_name, self.num_draft_tokens(params),
                              self.depth_policy(params), params.tool_names)
        clock = FirstTokenClock(self.metrics, request.scope["route"].path)
        job = Job(partial(self._prepare_row, params), asyncio.get_running_loop())
        self.worker.submit(job)  # ServerOverloaded -> 503
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await _next_event(job, watcher)  # STARTED, or the error that stopped it
            if params.stream:
                return StreamingResponse(_sse(job, fmt, clock, params.include_usage),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(fmt.body(await _collect(job, watcher, clock)))
        except BaseException:
            job.cancel()
            raise
        finally:
            watcher.cancel()

    def _prepare_row(self, params: GenerationParams, batch: TextBatch) -> PendingRow:
        """Runs on the worker thread: encode and check sizes (the worker then joins the batch's
        pending rows together)."""
        prompt_ids = params.prompt.encode(self.decoder.tokenizer)
        if len(prompt_ids) > self.settings.max_prompt_tokens:
            raise PromptTooLarge(f"the prompt has {len(prompt_ids)} tokens, more than this "
                                 f"server's --max-prompt-tokens={self.settings.max_prompt_tokens};"
                                 " shorten it.", params.prompt.param)
        max_tokens = params.max_tokens or self._room(len(prompt_ids), params)
        return batch.prepare(
            prompt_ids, max_new_tokens=max_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop=params.stop,
            num_draft_tokens=params.num_draft_tokens,
            adaptive=None if self.depth_policy(params) else False, ignore_eos=params.ignore_eos,
            response_format=params.grammar,
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


async def _sse(job: Job, fmt: CompletionFormat | ChatFormat, clock: FirstTokenClock,
               include_usage: bool):
    """The event stream: opening chunks, one chunk per verified delta, a finishing chunk with
    finish_reason and speculation, the usage chunk if asked for, then [DONE]. An error after the
    headers went out (a fault, or the server shutting down) is sent as one {"error": ...} event
    (the openai client raises it), then [DONE]."""
    try:
        for chunk in fmt.opening_chunks():
            yield sse(chunk)
        while True:
            event, value = await job.events.get()
            if event is Event.DELTA:
                clock.tick()
                chunk = fmt.delta_chunk(value)
                if chunk is not None:  # None: a tool call, sent whole at the end
                    yield sse(chunk)
            elif event is Event.DONE:
                for chunk in fmt.final_chunks(value):
                    yield sse(chunk)
                if include_usage:
                    yield sse(fmt.usage_chunk(value))
                yield DONE_LINE
                return
            elif event is Event.ERROR:
                log_error("a streamed generation", value)
                yield sse(error_body(value)[1])
                yield DONE_LINE
                return
    finally:
        job.cancel()  # a no-op when the job finished; stops it when the client went away
