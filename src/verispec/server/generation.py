"""From checked request parameters to an HTTP response: queue a job on the worker for each of
the request's choices (prompts x n; usually one), wait for their events, answer with one JSON
body or a stream of server-sent events.

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

from ..text.batch import GenerationMetrics, PendingRow, TextBatch
from ..text.decoder import Completion, Decoder
from ..text.inputs import RequestSettings
from .errors import ClientDisconnected, PromptTooLarge, ServerShuttingDown, error_body, log_error
from .logprobs import Echo, TextOffsets, TokenTexts
from .metrics import ServerMetrics
from .prompts import Prompt
from .responses import DONE_LINE, ChatFormat, CompletionFormat, sse
from .schemas import GenerationParams
from .settings import ServerSettings
from .worker import Event, Finished, GenerationWorker, Job

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
        self.speculative = decoder.speculative  # a draft model or n-grams
        options = worker.options  # the batch's: every request runs under its depth policy
        # the depth policy the responses name (None: fixed k); a seeded request follows it
        # like any other: its text does not depend on the depths (sample/seeded.py)
        self.depth_policy = (settings.depth_policy if self.speculative
                             and options.adaptive is not None else None)
        self.num_draft_tokens = options.num_draft_tokens if self.speculative else 0
        self.draining = False
        self.token_texts = TokenTexts(decoder.tokenizer)  # logprobs' token texts, cached

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

    def first_depth(self, settings: RequestSettings) -> int:
        """The k a request starts at: the batch's under the request's cap; 0 when the server
        decodes without a draft."""
        cap = settings.num_draft_tokens
        return self.num_draft_tokens if cap is None else min(self.num_draft_tokens, cap)

    async def respond(self, request: Request, params: GenerationParams,
                      response_format: type[CompletionFormat | ChatFormat]) -> Response:
        if self.draining:
            raise ServerShuttingDown("the server is shutting down; retry later.")
        fmt = response_format(self.settings.model_name, self.first_depth(params.settings),
                              self.depth_policy, params.tool_names, params.n,
                              None if params.logprobs is None else self.token_texts,
                              self.decoder.cross_vocab)
        clock = FirstTokenClock(self.metrics, request.scope["route"].path)
        loop = asyncio.get_running_loop()
        choices = Choices([Job(partial(self._prepare_row, params, *params.choice(index)), loop)
                           for index in range(params.num_choices)])
        self.worker.submit_all(choices.jobs)  # ServerOverloaded -> 503
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await choices.started(watcher)  # every choice's row joined, or the first error
            if params.stream:
                return StreamingResponse(_sse(choices, fmt, clock, params.include_usage),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(fmt.body(await _collect(choices, watcher, clock), choices.tags))
        except BaseException:
            choices.cancel()
            raise
        finally:
            watcher.cancel()

    def _prepare_row(self, params: GenerationParams, prompt: Prompt,
                     settings: RequestSettings, batch: TextBatch) -> PendingRow | Finished:
        """Runs on the worker thread: encode and check sizes (the prompt's ids once, by the
        batch), score an echoed prompt (the worker then hands the row to the batch; with
        max_tokens 0 none joins)."""
        prompt_ids = prompt.encode(self.decoder)
        if len(prompt_ids) > self.settings.max_prompt_tokens:
            raise PromptTooLarge(f"the prompt has {len(prompt_ids)} tokens, more than this "
                                 f"server's --max-prompt-tokens={self.settings.max_prompt_tokens};"
                                 " shorten it.", prompt.param)
        if params.max_tokens == 0:  # echo only: the prompt scored, nothing generated
            prompt_ids = self.decoder.encode(prompt_ids)
            return Finished(self._echo(params, prompt, prompt_ids),
                            Completion("", [], "length", GenerationMetrics(), len(prompt_ids),
                                       None if params.logprobs is None else []))
        pending = batch.prepare(prompt_ids, settings=settings)
        prompt_ids = pending.prepared.prompt_ids
        return pending._replace(tag=self._echo(params, prompt, prompt_ids))

    def _echo(self, params: GenerationParams, prompt: Prompt, prompt_ids: list[int]
              ) -> Echo | None:
        """What a completions choice with echo puts first: the prompt's text, and with
        logprobs its tokens scored by the target (one pass, Decoder.prompt_logprobs) and their
        offsets in that text; ``prompt_ids``: checked already."""
        if not params.echo:
            return None
        text = prompt.echo_text(self.decoder, prompt_ids)
        if params.logprobs is None:
            return Echo(text, prompt_ids, None)
        offsets = TextOffsets(self.decoder.tokenizer, end=len(text),
                              skip_special_tokens=not prompt.echo_shows_special_tokens)
        return Echo(text, prompt_ids, self.decoder.prompt_logprobs(prompt_ids, params.logprobs,
                                                                   checked=True),
                    offsets(prompt_ids))


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Choices:
    """A request's jobs, one per choice (GenerationParams.choice), and their events merged in
    the order they come: each job's own events stay in order. The request fails as a whole:
    the first error of any choice is raised, and :meth:`cancel` stops every choice."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self._getters: dict[int, asyncio.Future] = {}  # choice -> its pending events.get()
        self._finished: set[int] = set()  # choices whose DONE came
        self._early: list[tuple[int, Event, object]] = []  # taken before every choice started
        self.tags: list[object] = [None] * len(jobs)  # each choice's row tag (its Echo or None)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()
        for getter in self._getters.values():
            getter.cancel()

    async def started(self, watcher: asyncio.Future) -> None:
        """Return once every choice's row has joined the batch; raise the first error (or
        ClientDisconnected). Events of rows that joined earlier are kept for :meth:`next`."""
        waiting = set(range(len(self.jobs)))
        while waiting:
            index, event, value = await self._take(watcher)
            if event is Event.STARTED:
                waiting.discard(index)
                self.tags[index] = value
            else:
                self._early.append((index, event, value))

    async def next(self, watcher: asyncio.Future | None = None
                   ) -> tuple[int, Event, object] | None:
        """The next (choice, event, value) after STARTED; None once every choice is DONE.
        Raises a choice's error, or ClientDisconnected when ``watcher`` ends first."""
        if self._early:
            return self._early.pop(0)
        if len(self._finished) == len(self.jobs):
            return None
        return await self._take(watcher)

    async def _take(self, watcher: asyncio.Future | None) -> tuple[int, Event, object]:
        if len(self.jobs) == 1 and watcher is None and not self._getters:
            # one choice, streaming (most requests): its queue alone, no futures to wait on
            return self._taken(0, await self.jobs[0].events.get())
        for index, job in enumerate(self.jobs):
            if index not in self._getters and index not in self._finished:
                self._getters[index] = asyncio.ensure_future(job.events.get())
        waited = set(self._getters.values()) | ({watcher} if watcher is not None else set())
        done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        for index, getter in sorted(self._getters.items()):  # lowest choice first
            if getter in done:
                del self._getters[index]
                return self._taken(index, getter.result())
        raise ClientDisconnected("the client closed the connection before the response was ready")

    def _taken(self, index: int, item: tuple[Event, object]) -> tuple[int, Event, object]:
        event, value = item
        if event is Event.ERROR:
            raise value  # type: ignore[misc]
        if event is Event.DONE:
            self._finished.add(index)
        return index, event, value


async def _collect(choices: Choices, watcher: asyncio.Future, clock: FirstTokenClock
                   ) -> list[Completion]:
    """Every choice's Completion, in choice order."""
    completions: dict[int, Completion] = {}
    while (item := await choices.next(watcher)) is not None:
        index, event, value = item
        if event is Event.DELTA:
            clock.tick()
        elif event is Event.DONE:
            assert isinstance(value, Completion)
            completions[index] = value
    return [completions[index] for index in range(len(choices.jobs))]


async def _sse(choices: Choices, fmt: CompletionFormat | ChatFormat, clock: FirstTokenClock,
               include_usage: bool):
    """The event stream: opening chunks, one chunk per verified delta of each choice, a
    finishing chunk per choice with its finish_reason and speculation, the usage chunk if asked
    for, then [DONE]. An error after the headers went out (a fault, or the server shutting down)
    is sent as one {"error": ...} event (the openai client raises it), then [DONE]."""
    completions: dict[int, Completion] = {}
    try:
        for chunk in fmt.opening_chunks(choices.tags):
            yield sse(chunk)
        while (item := await choices.next()) is not None:
            index, event, value = item
            if event is Event.DELTA:
                clock.tick()
                chunk = fmt.delta_chunk(value, index)
                if chunk is not None:  # None: a tool call, sent whole at the end
                    yield sse(chunk)
            elif event is Event.DONE:
                completions[index] = value
                for chunk in fmt.final_chunks(value, index):
                    yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk([completions[i] for i in range(len(choices.jobs))]))
        yield DONE_LINE
    except Exception as exc:  # a choice's error: the response is already streaming
        log_error("a streamed generation", exc)
        yield sse(error_body(exc)[1])
        yield DONE_LINE
    finally:
        choices.cancel()  # a no-op when every choice finished; stops them when the client left
