"""The one thread that runs every generation: continuous batching over a TextBatch.

The event loop never touches a model: a request becomes a :class:`Job` whose ``prepare``
callable (run on the worker thread) encodes and checks the prompt. Between rounds the worker
hands the jobs it takes off its queue to the running :class:`verispec.text.batch.TextBatch`
(``submit``, while the batch has room: BatchOptions.max_batch_size) and lets the batch admit
them (``admit``: the batch's prefill budget a gap, long prompts prefilled in chunks while the
others decode; text/admission.py), runs one round for all rows, and hands every row's verified
text delta to its request's event loop queue in one ``loop.call_soon_threadsafe`` per round, so
every row's text goes out as soon as its round is verified. The worker keeps threads, queues
and events; what joins when is the batch's.

Faults: a row's own fault (its grammar's dead end, non-finite logits, a verification fault, its
text's tokenizer) fails that row's request alone with its typed error (TextBatch: a Completion
with ``error``), posted as its ERROR; its batch mates go on unchanged. A fault of what the rows
share (a model's pass, its cache, a backend error, out of memory) raises from the round: every
running request gets BatchFailed (a 500 naming the cause) and a new batch starts.

Back-pressure: at most ``max_queue`` jobs wait for a place in the batch; :meth:`submit` raises
ServerOverloaded beyond that. Cancellation: ``job.cancel()`` (a client went away) is checked
before a job joins and between rounds, and a cancelled row leaves the batch before the next
round: a disconnect frees its place within one round.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from ..config import BatchOptions
from ..text.batch import PendingRow, TextBatch, TextRow, TokenLogprob
from ..text.decoder import Decoder
from ..text.stream import Completion
from .errors import BatchFailed, ServerOverloaded, ServerShuttingDown

logger = logging.getLogger("verispec.server")


class Event(enum.Enum):
    STARTED = "started"  # value: the row's tag (its PendingRow's: the request's)
    DELTA = "delta"  # value: a Delta
    DONE = "done"  # value: the Completion
    ERROR = "error"  # value: the exception (raised while checking or generating)


class Delta(NamedTuple):
    """A round's new text for a row, and the logprobs of the tokens that text newly shows
    (RowText.num_tokens_shown; empty when the row does not ask for them)."""

    text: str
    logprobs: list[TokenLogprob]


class Finished(NamedTuple):
    """What a job's ``prepare`` returns when it needs no generation (an echo with max_tokens
    0): its tag and Completion, posted at once; no row joins."""

    tag: object
    completion: Completion


class FinishHook(Protocol):
    """Called on the worker thread after each generation; outcome: completed, cancelled, failed."""

    def __call__(self, row: TextRow, outcome: str) -> None: ...


class RoundHook(Protocol):
    """Called on the worker thread after each round: the rows it ran and its depth (0: a plain
    round)."""

    def __call__(self, num_rows: int, num_draft_tokens: int) -> None: ...


class Job:
    """One request's generation: built on the event loop, run on the worker thread. ``prepare``
    checks and encodes the request's row (raising the request's typed error if it is bad); the
    worker then adds it to the batch with the other rows joining in the same gap."""

    def __init__(self, prepare: Callable[[TextBatch], PendingRow | Finished],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.prepare = prepare
        self.tag: object = None  # its PendingRow's tag, posted with STARTED (worker thread)
        self.events: asyncio.Queue[tuple[Event, object]] = asyncio.Queue()
        self.num_logprobs_sent = 0  # the row's logprobs posted so far (worker thread)
        self._loop = loop
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, event: Event, value: object) -> None:
        """Called on the worker thread: queue ``(event, value)`` for the event loop."""
        post_all([(self, event, value)])


def post_all(posts: list[tuple[Job, Event, object]]) -> None:
    """Queue each job's event for its event loop with one wake-up per loop (a round's deltas
    for all its rows go out together, not as one cross-thread call each)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event, object]]] = {}
    for post in posts:
        by_loop.setdefault(post[0]._loop, []).append(post)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop is closed: nobody will read these jobs' events
            for job, _, _ in items:
                job.cancel()


def _shown_logprobs(job: Job, row: TextRow) -> list[TokenLogprob]:
    """The logprobs of the row's tokens that its text now shows and that were not posted yet
    (none when it does not ask for them); a stop string may still cut the others."""
    if row.logprobs is None:
        return []
    if row.completion is not None:  # its text is complete: the tokens it kept
        shown, logprobs = len(row.completion.token_ids), row.completion.logprobs or []
    else:
        shown, logprobs = min(row.text.num_tokens_shown(), len(row.logprobs)), row.logprobs
    new = logprobs[job.num_logprobs_sent : shown]
    job.num_logprobs_sent = max(job.num_logprobs_sent, shown)
    return new


def _deliver(posts: list[tuple[Job, Event, object]]) -> None:
    """On the event loop: put each event in its job's queue."""
    for job, event, value in posts:
        job.events.put_nowait((event, value))


class GenerationWorker:
    """Continuous batching on one thread; see the module docstring. ``decoder`` opens the
    batch (speculative when it has a draft and ``speculative``) under ``options`` (default:
    the decoder's batch_options; the server's set its prefill budget and batch size)."""

    def __init__(self, decoder: Decoder, max_queue: int, on_finish: FinishHook,
                 options: BatchOptions | None = None, speculative: bool = True,
                 num_threads: int | None = None, on_round: RoundHook | None = None) -> None:
        self._decoder = decoder
        self.options = decoder.batch_options if options is None else options
        self._num_threads = num_threads  # torch's intra-op threads, set on the worker thread
        self._speculative = speculative and decoder.speculative
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_finish = on_finish
        self._on_round = on_round
        self._thread: threading.Thread | None = None
        self._running: dict[int, tuple[Job, TextRow]] = {}  # row id -> its job; worker thread
        # jobs handed to the batch that have not joined yet (waiting, or prefilled apart)
        self._waiting: list[tuple[Job, PendingRow]] = []
        self._num_prefilling = 0  # of those, being prefilled apart (after the latest gap)
        self._lock = threading.Lock()  # guards _running's and _waiting's membership
        self._stopping = False
        self.num_rounds = 0  # rounds run, and rows over them: the mean batch size
        self.num_row_rounds = 0

    def start(self) -> None:
        assert self._thread is None, "the worker is already started"
        self._thread = threading.Thread(target=self._serve, name="verispec-generation",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running jobs, drain the queue, end the thread."""
        if self._thread is None:
            return
        self.fail_all(ServerShuttingDown("the server is shutting down; retry later."))
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def fail_all(self, error: Exception) -> None:
        """End every running job and every queued one with ``error`` (their requests answer it:
        a status, or an error event and [DONE] once streaming). Any thread."""
        with self._lock:
            running = [job for job, _ in self._running.values()]
            running += [job for job, _ in self._waiting]
        for job in running:
            job.cancel()
            job.post(Event.ERROR, error)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.post(Event.ERROR, error)

    @property
    def alive(self) -> bool:
        """The generation thread is running: started and not ended (a health check asks)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a place: queued, or handed to the batch and not yet in (those
        being prefilled apart are counted by num_prefilling)."""
        return self._queue.qsize() + max(0, len(self._waiting) - self._num_prefilling)

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_prefilling(self) -> int:
        """Requests whose long prompts are being prefilled apart before they join."""
        return self._num_prefilling

    def submit_all(self, jobs: list[Job]) -> None:
        """Queue a request's jobs (one per choice) all or none: ServerOverloaded when the queue
        has no room for all of them. Called from the event loop only, so the room counted here
        can only grow (the worker takes jobs off) before they are put."""
        room = self._queue.maxsize - self._queue.qsize()
        if self._queue.maxsize > 0 and room < len(jobs):
            raise ServerOverloaded(f"the server is busy: {self._queue.qsize()} requests are "
                                   f"already waiting (--max-queue {self._queue.maxsize}); retry "
                                   "later.")
        for job in jobs:
            self._queue.put_nowait(job)

    def _serve(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        batch = self._new_batch()
        while not self._stopping:
            try:
                self._take_jobs(batch)
                self._drop_cancelled(batch)
                self._join(batch)
                if len(batch):
                    self._round(batch)
            except Exception as exc:  # a fault mid-round: its rows get it, the batch restarts
                logger.exception("the generation worker caught an error in a round")
                self._fail_running(exc)
                batch = self._new_batch()

    def _new_batch(self) -> TextBatch:
        return self._decoder.open_batch(self._speculative, self.options)

    def _take_jobs(self, batch: TextBatch) -> None:
        """Hand queued jobs to the batch while it has room: block for one when it has nothing
        to run or admit. Each is checked on its own (a bad request gets its error, the others
        go on); the batch admits those that pass in their turn (:meth:`_join`)."""
        while batch.has_room():
            try:
                job = self._queue.get(block=batch.idle)
            except queue.Empty:
                break
            if job is None:  # stop() was called
                self._stopping = True
                break
            if job.cancelled:
                continue
            try:
                pending = job.prepare(batch)
            except Exception as exc:  # handed to the request, whose handler maps it to a status
                job.post(Event.ERROR, exc)
                continue
            if isinstance(pending, Finished):
                post_all([(job, Event.STARTED, pending.tag), (job, Event.DONE,
                                                               pending.completion)])
                continue
            job.tag, pending = pending.tag, pending._replace(tag=job)
            with self._lock:
                self._waiting.append((job, pending))
            batch.submit(pending)

    def _join(self, batch: TextBatch) -> None:
        """A gap: the rows whose turn it is join (TextBatch.admit), and their requests hear
        it. A fault there (checks passed) raises: the batch restarts, see _serve."""
        rows = batch.admit()
        self._num_prefilling = batch.num_prefilling
        if not rows:
            return
        with self._lock:
            joined = {id(row.tag) for row in rows}
            self._waiting = [entry for entry in self._waiting if id(entry[0]) not in joined]
            for row in rows:
                self._running[row.row.id] = (row.tag, row)
        post_all([(row.tag, Event.STARTED, row.tag.tag) for row in rows])

    def _drop_cancelled(self, batch: TextBatch) -> None:
        """Rows whose client went away leave the batch before the next round, and jobs that
        have not joined yet leave it before they do."""
        for row_id, (job, row) in list(self._running.items()):
            if job.cancelled:
                batch.remove(row)
                self._finish(row_id, "cancelled")
        with self._lock:
            cancelled = [entry for entry in self._waiting if entry[0].cancelled]
            self._waiting = [entry for entry in self._waiting if not entry[0].cancelled]
        for _, pending in cancelled:
            batch.withdraw(pending)
        self._num_prefilling = batch.num_prefilling

    def _round(self, batch: TextBatch) -> None:
        num_rows = len(batch)
        self.num_rounds += 1
        self.num_row_rounds += num_rows
        posts: list[tuple[Job, Event, object]] = []
        ended = []
        for row, delta in batch.step():
            job = self._running[row.row.id][0]
            if delta:
                posts.append((job, Event.DELTA, Delta(delta, _shown_logprobs(job, row))))
            if row.completion is None:
                continue
            error = row.completion.error  # a fault of its own: its request alone gets it
            posts.append((job, Event.DONE, row.completion) if error is None
                         else (job, Event.ERROR, error))
            ended.append((row.row.id, "completed" if error is None else "failed"))
        # The books close before the events go out: a client that has read its row's end
        # finds the worker and /metrics already without that row.
        for row_id, outcome in ended:
            self._finish(row_id, outcome)
        if self._on_round is not None:
            try:
                self._on_round(num_rows, batch.num_draft_tokens)
            except Exception:  # a bug in a hook must not kill the only worker thread
                logger.exception("the generation worker's round hook failed")
        post_all(posts)

    def _finish(self, row_id: int, outcome: str) -> None:
        with self._lock:
            _, row = self._running.pop(row_id)
        try:
            self._on_finish(row, outcome)
        except Exception:  # a bug in a hook must not kill the only worker thread
            logger.exception("the generation worker's finish hook failed")

    def _fail_running(self, cause: Exception) -> None:
        """A round or a join failed in work its rows share (a model's pass, its cache): every
        running request gets BatchFailed naming ``cause``, and so does every one that had not
        joined yet (its prefill belonged to the failed batch's model state as much as the
        rows')."""
        error = BatchFailed(f"the generation batch running this request failed in a step its "
                            f"requests share ({type(cause).__name__}; see the server log), and "
                            "every request in it was ended; the server goes on serving: retry "
                            "the request.")
        error.__cause__ = cause
        for row_id, (job, _) in list(self._running.items()):
            self._finish(row_id, "failed")
            job.post(Event.ERROR, error)
        with self._lock:
            waiting, self._waiting = self._waiting, []
        self._num_prefilling = 0
        for job, _ in waiting:
            job.post(Event.ERROR, error)
