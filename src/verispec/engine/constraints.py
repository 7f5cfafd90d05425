"""Structured output under exact speculation: one grammar per row, masking both sides alike.

Legend: B batch, K draft tokens this round, V vocabulary.

A constraint (a JSON schema, any JSON object, a regular expression, a Lark grammar) is a set of
allowed next tokens at every step, computed by llguidance (a maintained grammar engine with
token masks and rollback; xgrammar, the other candidate, installs triton, a CUDA compiler, on a
CPU machine). The constrained target's distribution at a step is the target's, renormalised
over the allowed tokens; speculative decoding stays exact for it when:

  * the draft samples each token from ITS distribution masked by the grammar state the token
    extends (sample.sampling.sample_from_logits with ``allowed``: the probabilities it reports are
    the masked ones it drew from), and a deterministic draft (n-gram) is cut where its proposal
    leaves the grammar;
  * the target's k + 1 distributions are masked with the states after 0 .. k draft tokens (the
    same masks: the draft's step i mask is the target's position i mask);
  * rejection sampling runs between the two masked distributions (sample/rejection.py, unchanged);
  * the grammar rolls back to the accepted prefix, as the KV caches do, and takes the
    recovered or bonus token.

One round with this module (see batch.Batch.step):

    constraints.start_round()
    propose: for each draft step, allowed() -> mask, sample, advance(tokens)
    k = constraints.cover(draft_tokens)        # deterministic proposals: checked, cut, advanced
    allowed = constraints.round_masks()        # [B, K+1, V] for the target
    verify ...
    constraints.commit(num_accepted, next_tokens)

A row without a grammar allows every token. A row whose grammar has finished allows only its
stop tokens: the engine stops it at the first one, or under ignore_eos (no stop tokens for the
engine) its text does (ConstraintSet.end_token_ids). A row whose grammar reaches a dead end (the
grammar engine allows no next token: an empty language, a rule that can never end) or refuses
a token is a fault of that row alone: the set records its error (``faults``, which the engine
takes each round to fail the row) and treats the row as free from then on, so its batch mates'
masks and draws are untouched.

What this is not: compiling a response_format into a grammar, or the grammar engine's view of a
tokenizer (text/grammar.py); a ConstraintSet sees only token ids and the GrammarIndex protocol.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import ConstraintDeadEnd


class GrammarIndex(Protocol):
    """What a ConstraintSet reads of the grammar engine's view of a tokenizer (built from the
    tokenizer by text/grammar.py's TokenizerIndex; the engine never sees the tokenizer)."""

    vocab_size: int
    stop_token_ids: list[int]  # the ids that end a generation, sorted
    executor: Any  # fills a batch's masks in one call (unsafe_compute_mask_ptr)

    def matcher(self, grammar: Any) -> Any:
        """A fresh grammar state (llguidance's LLMatcher) for one compiled grammar (a hashable
        value: a ConstraintSet compiles each distinct grammar once and copies its state)."""
        ...


class ConstraintSet:
    """The grammar state of each row (None: unconstrained), tracking the committed tokens plus
    the draft tokens advanced this round. See the module docstring for the round protocol."""

    def __init__(self, index: GrammarIndex, grammars: Sequence[Hashable | None]) -> None:
        self.index = index
        compiled: dict[Hashable, Any] = {}  # a grammar's first matcher; copies for the rest
        self.matchers = []
        for grammar in grammars:
            if grammar is None:
                self.matchers.append(None)
            elif grammar in compiled:  # a copy is far cheaper than compiling again
                self.matchers.append(compiled[grammar].deep_copy())
            else:
                compiled[grammar] = index.matcher(grammar)
                self.matchers.append(compiled[grammar])
        self.vocab_size = index.vocab_size
        self._all = torch.ones(index.vocab_size, dtype=torch.bool)
        stops = torch.zeros(index.vocab_size, dtype=torch.bool)
        stops[index.stop_token_ids] = True
        self._stops_only = stops
        self._masks: dict[int, torch.Tensor] = {}  # depth this round -> [B, V]
        self._advanced = 0  # draft tokens advanced this round
        self._consumed = [0] * len(self.matchers)  # of those, taken by each row's grammar (a
        # finished grammar takes no more: the row has ended at its stop token)
        self.faults: dict[int, Exception] = {}  # row -> its grammar's fault (take_faults)
        self.mask_seconds = 0.0  # time spent computing masks (the grammar's cost)
        self.num_masks = 0  # masks computed (one per row-less step: [B, V] at a time)

    def forced_lengths(self) -> list[int]:
        """Tokens each row's grammar forces before anything else may follow (0 unconstrained):
        a lower bound on the tokens its output needs."""
        return [0 if m is None else len(m.compute_ff_tokens()) for m in self.matchers]

    @property
    def active(self) -> bool:
        return any(m is not None for m in self.matchers)

    def end_token_ids(self, row: int) -> frozenset[int]:
        """The tokens that end a row's output: its grammar's end-of-generation tokens (allowed
        only where the grammar accepts; once it is complete, nothing else is), none for a free
        row. Under ignore_eos the engine does not stop at them, so the text ends there
        (text.stream.RowText) rather than run to max_new_tokens on end tokens."""
        if self.matchers[row] is None:
            return frozenset()
        return frozenset(self.index.stop_token_ids)

    def add_rows(self, other: ConstraintSet | None, num_rows: int) -> None:
        """Rows joining the batch between rounds: ``other``'s rows (a set over the same
        tokenizer index), or ``num_rows`` unconstrained ones when None."""
        if other is None:
            self.matchers += [None] * num_rows
        else:
            assert other.index is self.index and len(other.matchers) == num_rows
            self.matchers += other.matchers
        self.start_round()

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order (rows leaving the batch between rounds)."""
        self.matchers = [self.matchers[row] for row in rows]
        self.start_round()

    def take_faults(self) -> dict[int, Exception]:
        """The rows whose grammar failed since the last call, each with its error; those rows
        are free from then on (the engine fails them before they leave)."""
        faults, self.faults = self.faults, {}
        return faults

    def release(self, row: int) -> None:
        """The row leaves its grammar (it failed): it allows every token from now on."""
        self.matchers[row] = None

    def _fail(self, row: int, error: Exception) -> None:
        self.faults.setdefault(row, error)
        self.release(row)

    def start_round(self) -> None:
        self._masks, self._advanced = {}, 0
        self._consumed = [0] * len(self.matchers)

    def allowed(self) -> torch.Tensor:
        """The mask at the current depth: [B, V] bool (CPU), True where a token is allowed."""
        if self._advanced not in self._masks:
            self._masks[self._advanced] = self._compute()
        return self._masks[self._advanced]

    def advance(self, tokens: Sequence[int]) -> None:
        """One draft token per row (host ints) joins each row's grammar state."""
        for row, (matcher, token) in enumerate(zip(self.matchers, tokens)):
            if matcher is not None and not matcher.is_stopped():
                if not matcher.consume_token(int(token)):
                    self._fail(row, _refused(matcher, token))
                    continue
                self._consumed[row] += 1
        self._advanced += 1

    def cover(self, draft_tokens: torch.Tensor) -> int:
        """Draft tokens [B, K] of which the first ``advanced`` were advanced as they were drawn
        (a draft model); the rest (a deterministic proposal) are checked against the grammar and
        advanced up to the first position where some row's token is not allowed. -> the number
        of draft positions kept (the engine cuts the proposal there)."""
        rows = draft_tokens.tolist()
        for position in range(self._advanced, draft_tokens.shape[1]):
            mask = self.allowed()
            if not all(mask[b, row[position]] for b, row in enumerate(rows)):
                return position
            self.advance([row[position] for row in rows])
        return draft_tokens.shape[1]

    def round_masks(self) -> torch.Tensor:
        """The masks at depths 0 .. advanced: [B, K+1, V] bool, for the target's k + 1
        distributions."""
        self.allowed()  # the depth after the last draft token
        # every draft token was drawn (or checked) under the mask of its depth
        assert all(depth in self._masks for depth in range(self._advanced + 1))
        return torch.stack([self._masks[depth] for depth in range(self._advanced + 1)], dim=1)

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """Roll each row back to its accepted prefix and append its recovered or bonus token."""
        for row, (matcher, accepted, token) in enumerate(zip(self.matchers, num_accepted,
                                                             next_tokens)):
            if matcher is None:
                continue
            if self._consumed[row] > accepted and not matcher.rollback(
                    self._consumed[row] - accepted):
                self._fail(row, AssertionError(f"row {row}: the grammar could not roll back "
                                               f"({_first_line(matcher.get_error())})"))
            elif not matcher.is_stopped() and not matcher.consume_token(int(token)):
                self._fail(row, _refused(matcher, token))
        self.start_round()

    def _compute(self) -> torch.Tensor:
        """Every row's mask in one call to llguidance (bits, 32 tokens an int32), unpacked."""
        started = time.perf_counter()
        num_rows, words = len(self.matchers), (self.vocab_size + 31) // 32
        bits = torch.full((num_rows, words), -1, dtype=torch.int32)  # all allowed: free rows
        live = [(m, row) for row, m in enumerate(self.matchers)
                if m is not None and not m.is_stopped()]
        if len(live) == 1:  # one row (a server request): no executor round trip
            matcher, row = live[0]
            matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), words * 4)
        elif live:
            self.index.executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), words * 4,
                                                        num_rows)
        # token 32 w + j is bit j of word w (little-endian): one numpy call unpacks them all
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked[:, : self.vocab_size].astype(np.bool_))  # [B, V]
        for row, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            if matcher.is_error():  # a dead end (the engine then allows only a stop): it fails
                self._fail(row, ConstraintDeadEnd(
                    "response_format allows no next token after the text generated so far: "
                    "the grammar cannot be completed (its language is empty, or a rule can "
                    f"never end): {_first_line(matcher.get_error())}. Fix the grammar.",
                    field="response_format"))
                allowed[row] = self._all
            elif matcher.is_stopped():  # finished: only a stop token
                allowed[row] = self._stops_only
        self.mask_seconds += time.perf_counter() - started
        self.num_masks += 1
        return allowed



def _refused(matcher: Any, token: int) -> Exception:
    """The fault of a row whose grammar refused ``token``: a dead end when the grammar engine
    is in an error state, else a token drawn outside its mask (a bug)."""
    if matcher.is_error():
        return ConstraintDeadEnd(f"response_format cannot be completed: the grammar engine "
                                 f"stopped ({_first_line(matcher.get_error())}). Fix the "
                                 "grammar.", field="response_format")
    return AssertionError(f"token {token} left the grammar ({_first_line(matcher.get_error())})")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "no message"
