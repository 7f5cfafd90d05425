"""One sequence of a batch: its settings, its random numbers, what it has emitted, its metrics.

A :class:`Row` is what the engine's :class:`verispec.engine.Batch` keeps per sequence, and what
a caller holds to read a generation's progress: rows join a batch with their own
GenerationConfig (sampling, stop tokens, max_new_tokens, min_new_tokens, depth) and their own
torch.Generator, and leave it when they finish or are removed. What this is not: the round
(engine.py) or text (text_stream.py).
"""

from __future__ import annotations

import itertools
import torch

from .config import GenerationConfig
from .metrics import GenerationMetrics, MetricsRecorder

_ids = itertools.count()


class Row:
    """One sequence in a batch. ``token_ids``: its new tokens so far; ``finished`` once it hit a
    stop token (``finish_reason`` "stop") or max_new_tokens ("length"), or was removed
    ("cancelled"); ``metrics``: the rounds it took part in.

    ``follows_policy``: its depth is the batch's adaptive policy's choice each round; else it
    is its config's num_draft_tokens. A seeded sampled row keeps a fixed k under a policy that
    picks k from timings: its random numbers, and so its tokens, would otherwise depend on the
    machine's load and on the other rows."""

    def __init__(self, prompt: list[int], config: GenerationConfig, generator: torch.Generator,
                 follows_policy: bool) -> None:
        self.id = next(_ids)
        self.prompt = prompt
        self.config = config
        self.generator = generator
        self.follows_policy = follows_policy
        self.stop_ids = frozenset(config.stop_token_ids)
        self.token_ids: list[int] = []
        self.num_generated = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.recorder = MetricsRecorder(config.cost_ratio)

    @property
    def metrics(self) -> GenerationMetrics:
        return self.recorder.snapshot()

    @property
    def is_greedy(self) -> bool:
        return self.config.sampling.is_greedy

    def num_draft_tokens(self, policy_k: int | None) -> int:
        """This round's k: the policy's (or its fixed) depth, never drafting past
        max_new_tokens (the last token of a row always comes from the target)."""
        k = policy_k if self.follows_policy and policy_k is not None else (
            self.config.num_draft_tokens)
        return max(0, min(k, self.config.max_new_tokens - self.num_generated - 1))

    def num_banned_positions(self) -> int:
        """min_new_tokens: how many of this round's leading positions may not be a stop token."""
        if not self.stop_ids:
            return 0
        return max(0, self.config.min_new_tokens - self.num_generated)

    def emit(self, tokens: list[int]) -> list[int]:
        """Take a round's accepted + recovered/bonus tokens, cut at max_new_tokens and after the
        first stop token (which is kept); returns what was taken."""
        new = tokens[: self.config.max_new_tokens - self.num_generated]
        for i, token in enumerate(new):
            if token in self.stop_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.num_generated += len(new)
        self.token_ids.extend(new)
        if self.finish_reason is None and self.num_generated >= self.config.max_new_tokens:
            self.finish_reason = "length"
        self.finished = self.finish_reason is not None
        return new

    def cancel(self) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, "cancelled"
