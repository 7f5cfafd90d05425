"""One sequence of a batch: its settings, its random numbers, what it has emitted, its metrics.

A :class:`Row` is what the engine's :class:`verispec.engine.batch.Batch` keeps per sequence, and
what a caller holds to read a generation's progress: rows join a batch with their own
GenerationConfig (sampling, stop tokens, max_new_tokens, min_new_tokens, a cap on its depth) and
their own torch.Generator, and leave it when they finish or are removed. What this is not: the
round (batch.py) or text (text/stream.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import GenerationConfig
from ..sample.penalties import process_logits, seen_tokens
from ..sample.seeded import RaceClocks, stream_key
from .metrics import GenerationMetrics, MetricsRecorder

_ids = itertools.count()


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's processed distribution at its
    position (bias, penalties, min_new_tokens, grammar mask, temperature, top-k/p, min-p:
    sample.sampling.to_logprobs; at temperature 0 the processed logits at temperature 1), and
    the ``top`` most likely (token id, logprob) pairs there, most likely first (as many as the
    config's ``logprobs`` asks). -inf for a token the distribution excludes."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logprobs: torch.Tensor, tokens: Sequence[int], num_top: int
                   ) -> list[TokenLogprob]:
    """logprobs [C, V] fp32 (one distribution per token), tokens C ids -> each token's
    TokenLogprob with the ``num_top`` most likely (id, logprob) pairs of its row."""
    index = torch.tensor(list(tokens), dtype=torch.int64, device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, index)[:, 0].tolist()  # [C]
    if num_top:
        top = torch.topk(logprobs, num_top, dim=-1)  # sorted, most likely first
        pairs = [tuple(zip(ids, values)) for ids, values
                 in zip(top.indices.tolist(), top.values.tolist())]
    else:
        pairs = [()] * len(chosen)
    return [TokenLogprob(int(token), value, row_pairs)
            for token, value, row_pairs in zip(tokens, chosen, pairs)]


class Row:
    """One sequence in a batch. ``token_ids``: its new tokens so far; ``finished`` once it hit a
    stop token (``finish_reason`` "stop") or max_new_tokens ("length"), was removed
    ("cancelled"), or failed on a fault of its own ("error", with ``error``: non-finite
    logits, a verification fault, its grammar's dead end; its batch mates go on);
    ``metrics``: the rounds it took part in.

    Its depth each round is its batch's (the depth policy's choice, or the batch's fixed k),
    capped by its config's num_draft_tokens; ``cost_ratio``: its batch's (BatchOptions).

    A seeded sampled row (``keyed``) draws each token from the clocks of its position
    (sample/seeded.py), keyed by its seed and ``lane``: its text is then a function of its prompt,
    seed and settings whatever k, proposer, depth policy or batch mates. Other sampled rows
    draw from ``generator`` (rejection sampling)."""

    def __init__(self, prompt: list[int], config: GenerationConfig, generator: torch.Generator,
                 lane: int = 0, cost_ratio: float | None = None) -> None:
        self.id = next(_ids)
        self.prompt = prompt
        self.config = config
        self.generator = generator
        keyed = config.seed is not None and not config.sampling.is_greedy
        self.key = stream_key(config.seed, lane) if keyed else None
        self._clocks: dict[int, RaceClocks] = {}  # position -> its clocks, until emitted
        self.stop_ids = frozenset(config.stop_token_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token_ids entry when config.logprobs
        self._prompt_seen: torch.Tensor | None = None  # [V] bool, for a repetition penalty
        self.num_generated = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.error: Exception | None = None  # what it failed with (finish_reason "error")
        self.recorder = MetricsRecorder(cost_ratio)

    @property
    def metrics(self) -> GenerationMetrics:
        return self.recorder.snapshot()

    @property
    def is_greedy(self) -> bool:
        return self.config.sampling.is_greedy

    @property
    def keyed(self) -> bool:
        """Whether its tokens are races on position-keyed clocks (a seeded sampled row)."""
        return self.key is not None

    def clocks(self, step: int, vocab_size: int) -> RaceClocks:
        """The clocks of this round's position ``step`` (new token num_generated + step),
        drawn once and shared by the draft's race and the target's."""
        assert self.key is not None
        position = self.num_generated + step
        clocks = self._clocks.get(position)
        if clocks is None:
            clocks = self._clocks[position] = RaceClocks(self.key, position, vocab_size)
        return clocks

    def num_draft_tokens(self, batch_k: int) -> int:
        """This round's k: the batch's depth ``batch_k`` under the row's cap, never drafting past
        max_new_tokens (the last token of a row always comes from the target)."""
        cap = self.config.num_draft_tokens
        k = batch_k if cap is None else min(batch_k, cap)
        return max(0, min(k, self.config.max_new_tokens - self.num_generated - 1))

    def num_banned_positions(self) -> int:
        """min_new_tokens: how many of this round's leading positions may not be a stop token."""
        if not self.stop_ids:
            return 0
        return max(0, self.config.min_new_tokens - self.num_generated)

    def process_logits(self, logits: torch.Tensor, drafted: Sequence[int] = ()) -> torch.Tensor:
        """Its logits [P, V] reshaped by its penalties and logit bias, position j counting its
        tokens so far and drafted[:j] (sample.penalties.process_logits) -> [P, V] fp32. The
        target's block and each draft step (proposers.base.LogitProcessor) call this."""
        return process_logits(logits, self.config.penalty, self._seen_for(logits), self.token_ids,
                            drafted)

    @property
    def processes_draft(self) -> bool:
        """Whether a draft's steps for this row need process_draft: penalties, a logit bias, or
        stop tokens min_new_tokens still bans."""
        return self.config.penalty.active or self.num_banned_positions() > 0

    def process_draft(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """One draft step's logits [V] after ``drafted`` (this round's draft tokens so far),
        processed as the target's position len(drafted) will be: penalties and bias, then the
        stop tokens min_new_tokens bans there (verification.ban_early_stops) -> [V] fp32.
        The draft then never proposes a token the target gives probability 0."""
        processed = process_logits(logits[None], self.config.penalty, self._seen_for(logits),
                              [*self.token_ids, *drafted])[0]
        if len(drafted) < self.num_banned_positions():  # out of place: processed may be logits
            stop_ids = torch.tensor(sorted(self.stop_ids), device=processed.device)
            processed = processed.index_fill(0, stop_ids, -torch.inf)
        return processed

    def _seen_for(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.config.penalty.repetition_penalty == 1.0:
            return None
        if self._prompt_seen is None:
            self._prompt_seen = seen_tokens(self.prompt, logits.shape[-1], logits.device)
        return self._prompt_seen

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Take a round's accepted + recovered/bonus tokens (and, when the config asks for
        them, their logprobs), cut at max_new_tokens and after the first stop token (which is
        kept); returns what was taken."""
        new = tokens[: self.config.max_new_tokens - self.num_generated]
        for i, token in enumerate(new):
            if token in self.stop_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.num_generated += len(new)
        self.token_ids.extend(new)
        if logprobs is not None:
            self.logprobs.extend(logprobs[: len(new)])
        for position in [p for p in self._clocks if p < self.num_generated]:
            del self._clocks[position]
        if self.finish_reason is None and self.num_generated >= self.config.max_new_tokens:
            self.finish_reason = "length"
        self.finished = self.finish_reason is not None
        return new

    def cancel(self) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, "cancelled"

    def fail(self, error: Exception) -> None:
        """It ends on a fault of its own, ``error``: finish_reason "error"."""
        if not self.finished:
            self.finished, self.finish_reason, self.error = True, "error", error
