"""The proposer protocol: draft k tokens, then learn which were kept.

Legend: B batch, K draft tokens, V vocabulary.

Contract of a :class:`Proposal`: ``draft_probs`` are exactly the fp32 distributions the draft
tokens were drawn from, after the same temperature / top-k / top-p processing the target gets
(verispec.sampling.to_probs); ``None`` means the proposal is deterministic (greedy, n-gram) and
is verified as a point mass. A proposer that reports any other distribution silently breaks the
exactness of speculative sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingConfig


@dataclass(frozen=True)
class Proposal:
    """draft_tokens [B, K] int64; draft_probs [B, K, V] fp32 or None (deterministic)."""

    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None


class RoundConstraint(Protocol):
    """A grammar's view of one round (constraints.ConstraintSet): the allowed tokens at the
    current draft depth, and the draft tokens that extend it."""

    def allowed(self) -> torch.Tensor:
        """[B, V] bool: the tokens the next draft token may be."""

    def advance(self, tokens: Sequence[int]) -> None:
        """One drawn draft token per row (host ints)."""


class ProposerSession(Protocol):
    """One generation's proposer state, synchronised with the committed sequence."""

    def propose(self, num_draft_tokens: int, generator: torch.Generator,
                constraint: RoundConstraint | None = None) -> Proposal:
        """Draft up to ``num_draft_tokens`` >= 1 tokens per row after the committed sequence:
        a [B, K] proposal with K <= num_draft_tokens, the same K for every row (a draft model
        always gives all of them; an n-gram lookup may find fewer, K = 0 making the round a
        plain decoding step). A sampling proposer given a ``constraint`` draws each token under
        ``constraint.allowed()`` and reports it with ``advance``; a deterministic one may
        ignore it (the engine checks and cuts its tokens)."""

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        """num_accepted [B] of the last proposal were kept, then next_tokens [B] was appended;
        host ints, one per row. Called every round, also rounds where propose was not called
        (num_accepted is then 0)."""


class Proposer(Protocol):
    """Opens a :class:`ProposerSession` per generation. ``vocab_size`` must equal the target's;
    ``device``, where draft_probs live, must be the target's (None: a proposer with no model,
    whose proposals carry no probs; it may leave the attribute out)."""

    vocab_size: int
    device: torch.device | None

    def start(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> ProposerSession:
        ...
