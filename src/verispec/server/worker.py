"""The one thread that runs every generation, one at a time, in arrival order.

The event loop never touches a model: a request becomes a :class:`Job` whose ``start`` callable
(run on the worker thread) encodes the prompt and returns a :class:`verispec.api.TextStream`; the
worker iterates it and hands each verified text delta to the event loop with
``loop.call_soon_threadsafe`` into the job's asyncio queue, so a round's text goes out as soon as
the target has verified it.

Back-pressure: at most ``max_queue`` jobs wait behind the running one; :meth:`submit` raises
ServerOverloaded beyond that. Cancellation: ``job.cancel()`` (a client went away) is checked before
a job starts and between rounds, so an abandoned generation frees the worker within one round.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from ..api import TextStream
from .errors import ServerOverloaded, ServerShuttingDown

logger = logging.getLogger("verispec.server")


class Event(enum.Enum):
    STARTED = "started"  # value: the number of prompt tokens
    DELTA = "delta"  # value: a text delta
    DONE = "done"  # value: the Completion
    ERROR = "error"  # value: the exception (raised while checking or generating)


class FinishHook(Protocol):
    """Called on the worker thread after each generation; outcome: completed, cancelled, failed."""

    def __call__(self, stream: TextStream, outcome: str) -> None: ...


class Job:
    """One request's generation: built on the event loop, run on the worker thread."""

    def __init__(self, start: Callable[[], TextStream], loop: asyncio.AbstractEventLoop) -> None:
        self.start = start
        self.events: asyncio.Queue[tuple[Event, object]] = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, event: Event, value: object) -> None:
        """Called on the worker thread: queue ``(event, value)`` for the event loop."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, (event, value))
        except RuntimeError:  # the loop is closed: nobody will read this job's events
            self.cancel()


class GenerationWorker:
    def __init__(self, max_queue: int, on_finish: FinishHook) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_finish = on_finish
        self._thread: threading.Thread | None = None
        self._running: Job | None = None

    def start(self) -> None:
        assert self._thread is None, "the worker is already started"
        self._thread = threading.Thread(target=self._serve, name="verispec-generation",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drain the queue, end the thread."""
        if self._thread is None:
            return
        self.fail_all(ServerShuttingDown("the server is shutting down; retry later."))
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def fail_all(self, error: Exception) -> None:
        """End the running job and every queued one with ``error`` (their requests answer it:
        a status, or an error event and [DONE] once streaming). Any thread."""
        running = self._running
        if running is not None:
            running.cancel()
            running.post(Event.ERROR, error)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.post(Event.ERROR, error)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ServerOverloaded(f"the server is busy: {self._queue.maxsize} requests are "
                                   "already waiting (--max-queue); retry later.") from None

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:
                continue
            self._running = job
            try:
                self._run(job)
            except Exception:  # a bug in a hook must not kill the only worker thread
                logger.exception("the generation worker caught an unexpected error")
            finally:
                self._running = None

    def _run(self, job: Job) -> None:
        try:
            stream = job.start()
        except Exception as exc:  # handed to the request, whose handler maps it to a status
            job.post(Event.ERROR, exc)
            return
        job.post(Event.STARTED, stream.num_prompt_tokens)
        try:
            for delta in stream:
                if job.cancelled:
                    break
                job.post(Event.DELTA, delta)
        except Exception as exc:  # e.g. NonFiniteError mid-generation: the client gets it
            job.post(Event.ERROR, exc)
            self._on_finish(stream, "failed")
            return
        if job.cancelled:
            self._on_finish(stream, "cancelled")
            return
        job.post(Event.DONE, stream.completion)
        self._on_finish(stream, "completed")
