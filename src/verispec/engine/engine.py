"""Generations over the batched loop (batch.py): a fixed batch of prompts under one config.

Legend: B batch, K draft tokens, V vocabulary.

:class:`Engine` holds a target and a proposer; ``stream``/``generate`` run a batch of
prompts under one GenerationConfig as a :class:`DecodingRun` (a batch of its own), and ``batch``
opens a :class:`verispec.engine.batch.Batch` that rows join and leave with configs of their own
(what the text layer's TextBatch, and so ``Decoder.generate`` and the server, run on). How a
batch decodes (its depth policy, k, cost ratio) is its config.BatchOptions. The round itself,
propose -> score -> verify -> commit -> emit (Leviathan et al. 2023, Algorithm 1), is
batch.Batch.step; plain decoding is the same loop with k = 0 and no proposer.
Under a grammar (constraints.py) every distribution of the round, the draft's k and the
target's k + 1, is masked by the grammar state its token extends, and the grammar commits and
rolls back with the caches; the output then has exactly the constrained target's law.

The engine knows nothing about tokenisers, HTTP or printing; it sees token ids and the
protocols in models/base.py and proposers/base.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..config import BatchOptions, GenerationConfig
from ..errors import ConfigError, IncompatibleModelsError
from ..models.base import LanguageModel
from ..policy.base import AdaptivePolicy
from ..policy.costs import CostCurve
from ..proposers.base import Proposer
from ..proposers.draft_model import DraftModelProposer
from ..sample.sampling import make_generator
from .batch import Batch, check_prompts
from .constraints import ConstraintSet
from .metrics import GenerationMetrics


@dataclass(frozen=True)
class GenerationResult:
    """token_ids: the new tokens of each row; finish_reasons: "stop", "length" or "error" per
    row; errors: per row, what a row that failed on a fault of its own ("error": non-finite
    logits, a verification fault) failed with, else None (the other rows ran on)."""

    token_ids: list[list[int]]
    finish_reasons: list[str]
    metrics: GenerationMetrics
    errors: list[Exception | None] | None = None


@dataclass(frozen=True)
class Chunk:
    """What one round emitted: new token ids per row (empty for rows already finished)."""

    token_ids: list[list[int]]
    finished: list[bool]


class Engine:
    """Exact speculative decoding of ``target`` with tokens drafted by ``proposer``.

    The draft's vocabulary and device are checked here, at construction, not on the first
    request. ``cost_curve``: the pair's measured pass costs (policy/costs.py), which price the
    depth policy's rounds from the first (None: the policy measures as rounds go).
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None = None,
                 cost_curve: CostCurve | None = None) -> None:
        if proposer is not None and proposer.vocab_size != target.vocab_size:
            raise IncompatibleModelsError(
                f"draft vocab_size={proposer.vocab_size} differs from target vocab_size="
                f"{target.vocab_size}; the draft and the target must share one vocabulary "
                "(the same tokenizer).")
        draft_device = getattr(proposer, "device", None)  # a model-free proposer may omit it
        if draft_device is not None and torch.device(draft_device) != target.device:
            raise IncompatibleModelsError(
                f"the draft is on {draft_device} but the target on {target.device}; "
                "verification compares their probabilities on one device: load both with the "
                "same device=.")
        self.target = target
        self.proposer = proposer
        self.cost_curve = cost_curve
        # adaptive policies with carry_over=True: the latest generation's policy per (policy
        # config, batch-size bucket); a new generation resumes from a copy of it
        self.carried_policies: dict[tuple[object, ...], AdaptivePolicy] = {}

    @classmethod
    def from_draft_model(cls, target: LanguageModel, draft: LanguageModel) -> Engine:
        return cls(target, DraftModelProposer(draft))

    def stream(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
               speculative: bool = True, constraints: ConstraintSet | None = None,
               generator: torch.Generator | None = None,
               options: BatchOptions | None = None) -> DecodingRun:
        """An iterator of per-round :class:`Chunk` s; ``.metrics`` and ``.token_ids`` grow.
        ``constraints``: a grammar per row (constraints.py), applied to draft and target alike.
        ``generator``: what an unseeded run's rows draw from (rejection sampling; default: one
        seeded by the OS); a run with ``config.seed`` races on keyed clocks instead.
        ``options``: the run's batch options (its depth policy, k, cost ratio); None: a fixed
        k, config's num_draft_tokens (default 4)."""
        if not isinstance(config, GenerationConfig):
            raise ConfigError(f"config={config!r:.60} is invalid: expected a verispec."
                              "GenerationConfig, e.g. GenerationConfig(max_new_tokens=32).")
        if options is None:
            options = (BatchOptions() if config.num_draft_tokens is None
                       else BatchOptions(num_draft_tokens=config.num_draft_tokens))
        return DecodingRun(self, check_prompts(prompts, self.target.vocab_size), config,
                           speculative and self.proposer is not None, constraints, generator,
                           options)

    def batch(self, speculative: bool = True, options: BatchOptions | None = None) -> Batch:
        """An empty :class:`verispec.engine.batch.Batch`: rows join with ``add`` (configs,
        generators and grammars of their own) and leave between rounds; ``step`` runs one round.
        ``options``: how it decodes (its depth policy, k, cost ratio: config.BatchOptions;
        None: BatchOptions())."""
        options = BatchOptions() if options is None else options
        if not isinstance(options, BatchOptions):
            raise ConfigError(f"options={options!r:.60} is invalid: expected a verispec."
                              "BatchOptions, e.g. BatchOptions(num_draft_tokens=4).",
                              field="options")
        return Batch(self.target, self.proposer if speculative else None, options,
                     self.carried_policies, self.cost_curve)

    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 speculative: bool = True, constraints: ConstraintSet | None = None,
                 generator: torch.Generator | None = None,
                 options: BatchOptions | None = None) -> GenerationResult:
        """:meth:`stream` run to the end. A row that failed on a fault of its own
        (NonFiniteError, ...) raises its error once every row has ended; ``stream``'s
        DecodingRun.result() gives each row's outcome instead."""
        run = self.stream(prompts, config, speculative, constraints, generator, options)
        for _ in run:
            pass
        result = run.result()
        failed = [error for error in result.errors or [] if error is not None]
        if failed:
            raise failed[0]
        return result


class DecodingRun:
    """One generation of a fixed batch under one config. Iterate it for :class:`Chunk` s (one
    per round); read ``result()`` at the end. ``config.seed`` fixes the whole batch's tokens:
    sampled row i races on the clocks of (seed, lane i) (sample/seeded.py), so its text does not
    depend on k, the proposer or the other rows; a greedy batch draws nothing, and without a
    seed every row draws from one generator seeded by the OS."""

    def __init__(self, decoder: Engine, prompts: list[list[int]],
                 config: GenerationConfig, speculative: bool,
                 constraints: ConstraintSet | None = None,
                 generator: torch.Generator | None = None,
                 options: BatchOptions | None = None) -> None:
        self.config = config
        self.batch = decoder.batch(speculative, options)
        if generator is None:
            generator = make_generator(config.seed, decoder.target.device)
        self.rows = self.batch.add(prompts, [config] * len(prompts),
                                   [generator] * len(prompts), constraints,
                                   lanes=range(len(prompts)), checked=True)
        self.token_ids = [row.token_ids for row in self.rows]  # grow as rounds emit
        self._position = {row.id: index for index, row in enumerate(self.rows)}

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if not self.batch.rows:
            raise StopIteration
        new_ids: list[list[int]] = [[] for _ in self.rows]
        for row, new in self.batch.step():
            new_ids[self._position[row.id]] = new
        return Chunk(new_ids, [row.finished for row in self.rows])

    @property
    def num_draft_tokens(self) -> int:
        """The depth the next round would draft: the policy's latest choice under one, the
        batch's k otherwise (each under the config's cap), 0 for plain decoding."""
        if not self.batch.speculative:
            return 0
        policy = self.batch.last_policy
        k = self.batch.options.num_draft_tokens if policy is None else policy.num_draft_tokens
        cap = self.config.num_draft_tokens
        return k if cap is None else min(k, cap)

    @property
    def finished(self) -> list[bool]:
        return [row.finished for row in self.rows]

    @property
    def metrics(self) -> GenerationMetrics:
        """The metrics so far (a frozen snapshot)."""
        return self.batch.recorder.snapshot()

    def result(self) -> GenerationResult:
        reasons = [row.finish_reason if row.finish_reason in ("stop", "error") else "length"
                   for row in self.rows]
        return GenerationResult(self.token_ids, reasons, self.metrics,
                                [row.error for row in self.rows])
