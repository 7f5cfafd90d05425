"""Admission: which waiting rows join a TextBatch in a gap between two rounds.

Rows wait in order (TextBatch.submit) and join between rounds under the batch's options
(config.BatchOptions): at most ``max_batch_size`` rows, and at most ``prefill_budget`` prompt
tokens prefilled a gap, so that a burst of joining prompts goes in over several gaps instead of
stalling the running rows. Each gap (:meth:`Admission.gap`):
  1. feed: the prompts being prefilled apart (engine/prefill.py) take the budget first, oldest
     first (all of what is left when no row runs: nobody waits). A prefill whose last chunk went
     in during an earlier gap joins now: while rows run it joins in a gap of its own, since its
     join grows every slot of the batch's cache, a pause of its own;
  2. take: waiting rows, in order, while there is room and budget left (the first one whatever
     its length, when nothing else joins or runs). A prompt longer than the budget left, while
     rows will run the next round, is prefilled apart a budget's worth a gap instead, where the
     target's backend can (Batch.start_prefill), and joins once all of it is in;
  3. the rows taken join (TextBatch.admit): the prefilled ones with their caches copied in,
     the others together in one prefill pass.

What this is not: the joins themselves (TextBatch, engine/batch.py) or threads and queues (the
server's worker hands its requests to the batch and waits on events).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..config import BatchOptions
from ..engine.prefill import ChunkedPrefill
from .inputs import PendingRow


class Admission:
    """The rows waiting to join one batch, and the prefills under way; see the module
    docstring. Not thread-safe: the batch's thread calls it."""

    def __init__(self, options: BatchOptions) -> None:
        self.prefill_budget = options.prefill_budget
        self.max_batch_size = options.max_batch_size
        self.waiting: deque[PendingRow] = deque()  # in the order they came
        self.prefilling: list[tuple[PendingRow, ChunkedPrefill]] = []  # oldest first

    def __len__(self) -> int:
        """Rows not yet in the batch: waiting, or being prefilled apart."""
        return len(self.waiting) + len(self.prefilling)

    def has_room(self, num_running: int) -> bool:
        """Whether one more row may wait to join a batch of ``num_running`` rows."""
        return self.max_batch_size is None or num_running + len(self) < self.max_batch_size

    def withdraw(self, pending: PendingRow) -> bool:
        """A row leaves before it joined (its request was cancelled); False: it is not here."""
        if any(item is pending for item in self.waiting):
            self.waiting = deque(item for item in self.waiting if item is not pending)
            return True
        kept = [entry for entry in self.prefilling if entry[0] is not pending]
        found, self.prefilling = len(kept) < len(self.prefilling), kept
        return found

    def gap(self, num_running: int, start_prefill: Callable[[PendingRow], ChunkedPrefill | None]
            ) -> tuple[list[tuple[PendingRow, ChunkedPrefill]], list[PendingRow]]:
        """One gap beside ``num_running`` running rows -> (the prefills that join now, the rows
        that join whole), both taken off; ``start_prefill``: a row's prefill apart, or None
        where the backend cannot (TextBatch.start_prefill)."""
        fed, ready = self._feed(num_running)
        joining: list[PendingRow] = []
        while self.waiting and fed < self.prefill_budget and (
                self.max_batch_size is None
                or num_running + len(self.prefilling) + len(ready) + len(joining)
                < self.max_batch_size):
            pending = self.waiting.popleft()
            num_tokens = len(pending.prepared.prompt_ids)
            left = self.prefill_budget - fed
            rows_next_round = num_running or ready or joining
            chunked = start_prefill(pending) if rows_next_round and num_tokens > left else None
            if chunked is None:
                joining.append(pending)
                fed += num_tokens
                continue
            self.prefilling.append((pending, chunked))
            fed += chunked.advance(left)
        return ready, joining

    def _feed(self, num_running: int) -> tuple[int, list[tuple[PendingRow, ChunkedPrefill]]]:
        """Step 1: feed the prefills under way -> (the tokens fed, the prefills that join now,
        taken off the list)."""
        fed, ready = 0, []
        for entry in list(self.prefilling):
            chunked = entry[1]
            was_done = chunked.done
            fed += chunked.advance(self.prefill_budget - fed if num_running
                                   else chunked.num_remaining)
            if chunked.done and (was_done or not num_running):
                self.prefilling.remove(entry)
                ready.append(entry)
        return fed, ready
