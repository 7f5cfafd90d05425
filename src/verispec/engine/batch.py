"""The speculative decoding loop over a batch whose rows join and leave between rounds.

Legend: B rows, K draft tokens this round (the largest row's k), V vocabulary.

Each round (Leviathan et al. 2023, Algorithm 1, batched with ragged depths):
  1. propose: the proposer drafts k_b tokens for each row b, under the row's own sampling
              settings and from the row's own generator (proposers.base.DraftPlan);
  2. score:   the target runs ONE pass over [last committed token, d_1 .. d_K] for every row
              -> K+1 logits per row; each row's are reshaped by its penalties and logit bias
              (position j counting d_1 .. d_j, sample/penalties.py) and processed by
              sample.sampling.to_probs under its own settings (at temperature 0 only their
              argmax, sample.sampling.greedy_tokens);
  3. verify:  greedy rows by sample.greedy.verify_greedy_rows (no random numbers), seeded
              sampled rows against the target's race winners on their keyed clocks
              (sample/seeded.py), other sampled rows by block or token-wise rejection sampling
              with uniforms from their own generators, each reading only its first k_b
              draft tokens and k_b + 1 distributions (steps 2-3 row by row:
              verification.py);
  4. commit:  both sides rewind each row to its accepted prefix and append the new token (a
              round that only measures drafting for the depth policy keeps the first token
              of every row: policy.scheduler.Scheduler._measuring);
  5. emit:    each row's new tokens (and their logprobs where asked), cut at its first stop
              token and at its max_new_tokens; finished rows leave the batch.
Between rounds rows join (:meth:`Batch.add`: one prefill for the joining rows, the others'
caches untouched) and leave (:meth:`Batch.remove`, or by finishing).

Faults: a fault of one row's own work (its drafting or processing, non-finite logits, its rule's
arithmetic, its grammar's dead end, its logprobs) fails that row alone (Row.fail,
finish_reason "error", Row.error): it takes no token that round and leaves, and its batch
mates' tokens are exactly what they would have been (verification.py, Proposal.faults). A
fault of the work the rows share (the models' passes, their caches, the proposer's state)
raises from :meth:`Batch.step`: the batch is then unusable.

Exactness per row: a row's tokens are drawn from its own distributions with its own random
numbers, so its output law is the target's whatever the other rows do. A seeded row's tokens
are the target's samples at their positions on clocks keyed by its seed, so they are the same
whatever k, proposer, policy or batch mates (they could differ only where batched arithmetic
rounds its logits differently enough to flip a race).
Depth: before each round the scheduler (policy/scheduler.py) plans each row's k from the batch's
options (config.BatchOptions): its depth policy (policy/; one per batch-size bucket, and it may
choose k = 0: a plain round for the whole batch) or its fixed k, under each row's own cap
(rows.Row); after it, the round is reported back to it, with its seconds by step from a
clock.RoundClock.

The loop knows nothing about tokenisers, HTTP or printing; it sees token ids and the protocols
in models/base.py and proposers/base.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..config import BatchOptions, GenerationConfig
from ..models.base import LanguageModel
from ..policy.base import AdaptivePolicy
from ..policy.costs import CostCurve
from ..policy.scheduler import RoundReport, Scheduler
from ..proposers.base import DraftPlan, Proposer
from ..sample.checks import check_prompts, check_stop_token_ids
from .clock import RoundClock, step_capturers, timed
from .constraints import ConstraintSet
from .metrics import MetricsRecorder
from .prefill import ChunkedPrefill
from .rows import Row
from .scorer import TargetScorer
from .verification import (
    RowFaults,
    ban_early_stops,
    emitted_logprobs,
    process_target_logits,
    target_outputs,
    verify_batch,
)


class Batch:
    """Rows decoded together, round by round; see the module docstring.

    ``options``: how it decodes (config.BatchOptions: the depth policy, built per batch-size
    bucket, its k, its metrics' cost ratio; None: the defaults); ``carried``: where policies
    with carry_over are kept between batches (Engine.carried_policies);
    ``cost_curve``: the pair's measured pass costs, which price a one-row bucket's policy.
    ``recorder``: the whole batch's rounds; each row has its own.
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None,
                 options: BatchOptions | None = None,
                 carried: dict[tuple[object, ...], AdaptivePolicy] | None = None,
                 cost_curve: CostCurve | None = None) -> None:
        self.target = target  # the model; its logits, and verification, live on its device
        self.scorer = TargetScorer(target.new_session(), [])
        self.proposer = None if proposer is None else proposer.start([])
        self.rows: list[Row] = []
        self.constraints: ConstraintSet | None = None  # each row's grammar (None: free rows)
        options = BatchOptions() if options is None else options
        self.recorder = MetricsRecorder(options.cost_ratio)
        windows = [lm.max_positions for lm in (target, proposer) if lm is not None
                   and lm.max_positions is not None]
        self.scheduler = Scheduler(options, carried, proposer is not None,
                                   min(windows) if windows else None, cost_curve)
        self._capturers = step_capturers(target, proposer)  # a capture makes a first use

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def options(self) -> BatchOptions:
        return self.scheduler.options

    @property
    def last_policy(self) -> AdaptivePolicy | None:
        """The depth policy of the latest round (None: the batch's fixed k)."""
        return self.scheduler.last_policy

    @property
    def last_num_draft_tokens(self) -> int:
        """The width of the latest round (0: plain)."""
        return self.scheduler.last_num_draft_tokens

    @property
    def speculative(self) -> bool:
        return self.proposer is not None

    def add(self, prompts: Sequence[Sequence[int]], configs: Sequence[GenerationConfig],
            generators: Sequence[torch.Generator],
            constraints: ConstraintSet | None = None,
            prefilled: Sequence[ChunkedPrefill] | None = None,
            lanes: Sequence[int] | None = None, checked: bool = False) -> list[Row]:
        """Rows joining between rounds: one prompt (token ids), config and generator each;
        ``constraints``: their grammars (a ConstraintSet over these rows) or None. The joining
        rows are prefilled in one pass, or with ``prefilled`` (one finished chunked prefill of
        each prompt, :meth:`start_prefill`) their target caches are copied in; the rows already
        here are not touched. ``lanes``: with a seed shared by several rows, what tells their
        clocks apart (rows.Row; default 0 each: rows seeded one by one). ``checked``: the
        prompts passed check_prompts already (Engine.stream, Decoder.encode)."""
        if not checked:  # else lists of ints already
            prompts = check_prompts(prompts, self.vocab_size)
        assert len(configs) == len(prompts) == len(generators)
        for config in configs:
            check_stop_token_ids(config.stop_token_ids, self.vocab_size)
        lanes = [0] * len(prompts) if lanes is None else list(lanes)
        rows = [Row(prompt, config, generator, lane, self.options.cost_ratio)
                for prompt, config, generator, lane in zip(prompts, configs, generators, lanes)]
        if prefilled is None:
            self.scheduler.target_joined(self.scorer.add_rows(prompts))
        else:
            assert len(prefilled) == len(prompts) and all(
                p.done and p.prompt_ids == list(prompt) for p, prompt in zip(prefilled, prompts))
            self.scorer.adopt_rows([p.session for p in prefilled], prompts)
        if self.proposer is not None:
            defer = self.scheduler.defers_draft()
            started = time.perf_counter()
            self.proposer.add_rows(prompts, defer=defer)
            if not defer:  # the policy prices it as a cost of drafting
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.scheduler.draft_joined(time.perf_counter() - started,
                                            sum(config.max_new_tokens for config in configs))
        joining = constraints if constraints is not None and constraints.active else None
        if self.constraints is None and joining is not None:
            self.constraints = ConstraintSet(joining.index, [None] * len(self.rows))
        if self.constraints is not None:
            self.constraints.add_rows(joining, len(rows))
        self.rows += rows
        return rows

    def start_prefill(self, prompt: Sequence[int], checked: bool = False
                      ) -> ChunkedPrefill | None:
        """A long prompt's target prefill to run apart, a chunk between rounds, before it joins
        with :meth:`add`'s ``prefilled``; None where the target's backend cannot take a row
        prefilled apart. The batch's own session is asked: a backend that holds one live
        session a model (llama.cpp) must not be asked for another. ``checked``: as add's."""
        if not self.scorer.adopts_rows:
            return None
        return ChunkedPrefill(self.target,
                              prompt if checked else check_prompts([prompt], self.vocab_size)[0])

    def remove(self, rows: Sequence[Row]) -> None:
        """Rows leaving between rounds (a cancelled request): they end as "cancelled"."""
        leaving = {row.id for row in rows}
        for row in rows:
            row.cancel()
        self._keep([i for i, row in enumerate(self.rows) if row.id not in leaving])

    def step(self) -> list[tuple[Row, list[int]]]:
        """One round over every row: [(row, its new tokens)]; rows that finish leave."""
        assert self.rows, "a round needs at least one row"
        plan = self.scheduler.plan(self.rows)
        if plan.catch_up:  # the tokens of plain rounds, before the round's clock starts
            self.scheduler.draft_caught_up(timed(self.device, self.proposer.catch_up))
        clock = RoundClock(self._capturers)
        faults: RowFaults = {}  # rows failing on faults of their own this round -> errors
        # 1. propose (under a grammar: each draft token drawn from its masked distribution)
        draft_tokens, draft_probs, num_draft, allowed = self._propose(plan.num_draft_tokens,
                                                                      faults)
        clock.drafted(draft_tokens)
        # 2. score: one target pass over each row's pending token and its k_b draft tokens
        target_logits = ban_early_stops(self.rows, process_target_logits(
            self.rows, self.scorer.score(draft_tokens, num_draft), draft_tokens, num_draft,
            faults))  # [B, K+1, V]
        target_out = target_outputs(self.rows, target_logits, allowed, faults)
        clock.scored(target_logits)
        # 3. verify each row on its first k_b tokens
        measured, output_tokens = verify_batch(self.rows, draft_tokens, draft_probs, num_draft,
                                               target_out, self.vocab_size, faults)
        # a round that only measures drafting keeps each row's first token: rows in step stay so
        num_accepted = [0] * len(self.rows) if plan.measuring else measured
        # 4. commit / rewind both sides (and the grammar) to the accepted prefix + the new token
        self._commit(num_accepted, [row[n] for row, n in zip(output_tokens, num_accepted)],
                     faults)
        # 5. emit (with their logprobs, for the rows that ask); a failed row takes nothing
        emitted = self._emit(target_logits, allowed, output_tokens, num_accepted, faults)
        self._record(_without_failed(RoundReport(
            draft_tokens.shape[1], plan.num_draft_tokens, num_draft, measured, clock.stop(),
            clock.captured), faults), emitted, plan.measuring)
        self._keep([i for i, row in enumerate(self.rows) if not row.finished])
        return emitted

    def _emit(self, target_logits: torch.Tensor, allowed: torch.Tensor | None,
              output_tokens: list[list[int]], num_accepted: list[int], faults: RowFaults
              ) -> list[tuple[Row, list[int]]]:
        """Step 5: each row takes output_tokens[b][: n_b + 1], its accepted tokens and the
        next one, with their logprobs where its config asks (from target_logits [B, K+1, V]
        and the grammar's masks allowed [B, K+1, V] or None); a row in ``faults`` (its
        logprobs or its grammar failed too) takes none and ends with its error."""
        logprobs = emitted_logprobs(self.rows, target_logits, allowed, output_tokens,
                                    num_accepted, faults)
        self._take_constraint_faults(faults)
        return [(row, _emit_or_fail(row, tokens[: n + 1], row_logprobs, faults.get(b)))
                for b, (row, tokens, n, row_logprobs)
                in enumerate(zip(self.rows, output_tokens, num_accepted, logprobs))]

    def _commit(self, num_accepted: list[int], next_tokens: list[int],
                faults: RowFaults) -> None:
        """Each side keeps its row's accepted prefix, then the recovered or bonus token (a
        failed row's placeholder: it leaves after this round, its grammar released first)."""
        if self.constraints is not None:
            for b in faults:
                self.constraints.release(b)
        self.scorer.commit(num_accepted, next_tokens)
        if self.proposer is not None:
            self.proposer.commit(num_accepted, next_tokens)
        if self.constraints is not None:
            self.constraints.commit(num_accepted, next_tokens)

    def _active_constraints(self) -> ConstraintSet | None:
        return self.constraints if self.constraints is not None and (
            self.constraints.active) else None

    def _propose(self, num_draft: list[int], faults: RowFaults) -> tuple[
            torch.Tensor, torch.Tensor | None, list[int], torch.Tensor | None]:
        """Step 1 -> draft_tokens [B, K], draft_probs [B, K, V] or None, each row's k_b <= K,
        and the grammar's masks for the target's K + 1 positions [B, K+1, V] (None: free
        rows). A deterministic proposal is cut where it leaves the grammar. A row whose
        grammar reached a dead end joins ``faults`` (its masks then allow every token)."""
        draft_tokens, draft_probs, num_draft = self._draft(num_draft, faults)
        constraints = self._active_constraints()
        if constraints is None:
            return draft_tokens, draft_probs, num_draft, None
        kept = constraints.cover(draft_tokens)
        draft_probs = None if draft_probs is None else draft_probs[:, :kept]
        masks = constraints.round_masks()
        self._take_constraint_faults(faults)
        return draft_tokens[:, :kept], draft_probs, [min(k, kept) for k in num_draft], masks

    def _take_constraint_faults(self, faults: RowFaults) -> None:
        """The rows whose grammar failed (ConstraintSet.take_faults) join ``faults``."""
        if self.constraints is not None:
            for b, error in self.constraints.take_faults().items():
                faults.setdefault(b, error)

    def _draft(self, num_draft: list[int], faults: RowFaults
               ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """-> draft_tokens [B, K], draft_probs [B, K, V] or None, each row's k_b <= K (a
        proposer may find fewer than asked: an n-gram lookup); the rows whose drafting failed
        join ``faults`` (Proposal.faults)."""
        constraints = self._active_constraints()
        if constraints is not None:
            constraints.start_round()
        if self.proposer is None or max(num_draft) == 0:
            return (torch.empty((len(self.rows), 0), dtype=torch.int64, device=self.device),
                    None, [0] * len(self.rows))
        keyed = [row if row.keyed else None for row in self.rows]
        processors = [row if row.processes_draft else None for row in self.rows]
        plan = DraftPlan(num_draft, [row.config.sampling for row in self.rows],
                         [row.generator for row in self.rows],
                         keyed if any(row is not None for row in keyed) else None,
                         processors if any(row is not None for row in processors) else None)
        proposal = self.proposer.propose(plan, constraints)
        for b, error in proposal.faults.items():
            faults.setdefault(b, error)
        width = proposal.draft_tokens.shape[1]
        found = proposal.num_proposed or [width] * len(num_draft)
        num_draft = [min(k, width, n) for k, n in zip(num_draft, found)]
        # tokens meet the target's probs on its device (an n-gram lookup proposes host tensors;
        # the draft's probs are on the draft's device, which load() makes the target's)
        return proposal.draft_tokens.to(self.device), proposal.draft_probs, num_draft

    def _record(self, report: RoundReport, emitted: list[tuple[Row, list[int]]],
                measuring: bool) -> None:
        """Add the round to the batch's and each row's metrics, and report it to the scheduler.
        In a measuring round each row's metrics count a plain round (it kept no draft token);
        the batch's and the policy's count what was verified."""
        width, times = report.width, report.times
        reached, accepted_at = [0] * width, [0] * width
        for (row, new), k, n in zip(emitted, report.num_draft, report.num_accepted):
            row_reached = [1 if n >= j else 0 for j in range(k)]  # position j tested
            row_accepted = [1 if n > j else 0 for j in range(k)]
            if measuring:
                row.recorder.record_round(0, 1, 0, len(new), [], [], times)
            else:
                row.recorder.record_round(k, 1, n, len(new), row_reached, row_accepted, times)
            for j in range(k):
                reached[j] += row_reached[j]
                accepted_at[j] += row_accepted[j]
        self.recorder.record_round(width, len(emitted), sum(report.num_accepted),
                                   sum(len(new) for _, new in emitted), reached, accepted_at,
                                   times, num_drafted=sum(report.num_draft))
        self.scheduler.report(report, len(emitted))

    def _keep(self, indices: list[int]) -> None:
        """Keep these rows on every side; the others leave. The rows that stay keep their places
        where they can: the last ones fill the places of those leaving (a cache moves only
        them), so the batch's order is not kept."""
        if len(indices) == len(self.rows):
            return
        indices = fill_from_the_end(indices)
        self.scorer.keep_rows(indices)
        if self.proposer is not None:
            self.proposer.keep_rows(indices)
        if self.constraints is not None:
            self.constraints.keep_rows(indices)
        self.rows = [self.rows[i] for i in indices]


def _emit_or_fail(row: Row, tokens: list[int], logprobs: list | None,
                  error: Exception | None) -> list[int]:
    """Step 5 for one row: its tokens taken (Row.emit), or, for a row that failed this round
    with ``error``, none: it ends with the error (Row.fail)."""
    if error is None:
        return row.emit(tokens, logprobs)
    row.fail(error)
    return []


def _without_failed(report: RoundReport, faults: RowFaults) -> RoundReport:
    """The round as the depth policy should see it: a failed row asked, drafted and accepted
    nothing (it says nothing about the draft's acceptance)."""
    if not faults:
        return report
    keep = [b not in faults for b in range(len(report.asked))]
    return replace(report, asked=[k if ok else 0 for k, ok in zip(report.asked, keep)],
                   num_draft=[k if ok else 0 for k, ok in zip(report.num_draft, keep)],
                   num_accepted=[n if ok else 0 for n, ok in zip(report.num_accepted, keep)])


def fill_from_the_end(kept: list[int]) -> list[int]:
    """An order of the rows ``kept`` (ascending) in which a row below len(kept) keeps its
    place and the places of the rows leaving are filled by the rows past len(kept).

    Example: 6 rows, rows 1 and 3 leave, kept [0, 2, 4, 5] -> [0, 4, 2, 5]: rows 4 and 5 move
    into places 1 and 3, rows 0 and 2 stay (a cache copies 2 rows, not 3).
    """
    num_kept = len(kept)
    staying = {row for row in kept if row < num_kept}
    movers = iter([row for row in kept if row >= num_kept])
    return [place if place in staying else next(movers) for place in range(num_kept)]
