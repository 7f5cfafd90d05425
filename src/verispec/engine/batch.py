"""The speculative decoding loop over a batch whose rows join and leave between rounds.

Legend: B rows, K draft tokens this round (the largest row's k), V vocabulary.

Each round (Leviathan et al. 2023, Algorithm 1, batched with ragged depths):
  1. propose: the proposer drafts k_b tokens for each row b, under the row's own sampling
              settings and from the row's own generator (proposers.base.DraftPlan);
  2. score:   the target runs ONE pass over [last committed token, d_1 .. d_K] for every row
              -> K+1 logits per row; each row's are processed by sampling.to_probs under its
              own settings (at temperature 0 only their argmax, sampling.greedy_tokens);
  3. verify:  greedy rows by verify_greedy.verify_greedy_rows (no random numbers), seeded
              sampled rows against the target's race winners on their keyed clocks
              (seeded.py), other sampled rows by block or token-wise rejection sampling
              with uniforms from their own generators, each reading only its first k_b
              draft tokens and k_b + 1 distributions (steps 2-3 row by row:
              batch_verify.py);
  4. commit:  both sides rewind each row to its accepted prefix and append the new token (a
              round that only measures drafting for the depth policy keeps the first token
              of every row: Batch._measuring);
  5. emit:    each row's new tokens, cut at its first stop token and at its max_new_tokens;
              finished rows leave the batch.
Between rounds rows join (:meth:`Batch.add`: one prefill for the joining rows, the others'
caches untouched) and leave (:meth:`Batch.remove`, or by finishing).

Exactness per row: a row's tokens are drawn from its own distributions with its own random
numbers, so its output law is the target's whatever the other rows do. A seeded row's tokens
are the target's samples at their positions on clocks keyed by its seed, so they are the same
whatever k, proposer, policy or batch mates (they could differ only where batched arithmetic
rounds its logits differently enough to flip a race).
Depth: rows follow the batch's adaptive policy (adaptive.py) or keep a fixed k (rows.Row); the
policy is one per batch-size bucket (1, 2, 3-4, 5-8, ...), since a verification pass's cost
depends on how many rows it carries, and may choose k = 0: a plain round for the whole batch.

The loop knows nothing about tokenisers, HTTP or printing; it sees token ids and the protocols
in models/base.py and proposers/base.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..policy.base import AdaptivePolicy, AdaptivePolicyConfig, RoundStats
from .verification import ban_early_stops, target_outputs, verify_batch
from .prefill import ChunkedPrefill
from ..config import GenerationConfig
from .constraints import ConstraintSet
from ..errors import EmptyPromptError, InputError, TokenOutOfRangeError
from .metrics import MetricsRecorder
from ..models.base import CapturesSteps, LanguageModel
from .target import TargetScorer
from ..proposers.base import DraftPlan, Proposer
from .rows import Row
from ..spec.checks import check_stop_token_ids


class Batch:
    """Rows decoded together, round by round; see the module docstring.

    ``policy``: the adaptive depth policy rows with an ``adaptive`` config follow (built per
    batch-size bucket, starting at ``initial_num_draft_tokens``); ``carried``: where policies
    with carry_over are kept between batches (SpeculativeDecoder.carried_policies).
    ``metrics``: the whole batch's rounds; each row has its own.
    """

    def __init__(self, target: LanguageModel, proposer: Proposer | None,
                 policy: AdaptivePolicyConfig | None = None, initial_num_draft_tokens: int = 1,
                 carried: dict[tuple[object, ...], AdaptivePolicy] | None = None,
                 cost_ratio: float | None = None) -> None:
        self.device = target.device  # where the target's logits, and verification, live
        self.vocab_size = target.vocab_size
        self._target_model = target
        self.target = TargetScorer(target.new_session(), [])
        self.proposer = None if proposer is None else proposer.start([])
        self.policy_config = policy if proposer is not None else None
        self.initial_num_draft_tokens = initial_num_draft_tokens
        self._policies: dict[int, AdaptivePolicy] = {}  # batch-size bucket -> its policy
        self._policy_k: dict[int, int] = {}  # bucket -> the k its policy returned for next round
        self._carried = carried
        self.last_policy: AdaptivePolicy | None = None  # the policy of the latest round
        self.last_num_draft_tokens = 0  # the depth of the latest round (0: plain)
        # the longest sequence every model takes (None: no limit): a round feeds each row the
        # batch's largest k + 1 tokens, so k is capped by the room of the row nearest its end
        windows = [lm.max_positions for lm in (target, proposer) if lm is not None
                   and lm.max_positions is not None]
        self.max_positions = min(windows) if windows else None
        self.rows: list[Row] = []
        self.constraints: ConstraintSet | None = None  # each row's grammar (None: free rows)
        self.recorder = MetricsRecorder(cost_ratio)
        self._draft_lags = False  # the last round was plain: the draft has tokens to catch up
        # the target's next pass also prefills rows that joined since the last round (their
        # prompts ride it: TargetScorer.add_rows), so its timing is not a round's alone
        self._joins_ride = False
        self._join_time = 0.0  # the draft's prefill of rows joining since the last round
        self._join_tokens = 0  # and those rows' max_new_tokens (RoundStats.join_time)
        # (batch-size bucket, depth) of the rounds run: the first round of each reaches the
        # policy with timed=False, and its timings weigh FIRST_USE_WEIGHT. On an H200 a server's
        # first drafting round took 44 ms against ~5.5 for the next ones at its depth; priced
        # from it, a 1-row goodput policy ran plain rounds through three levels where drafting
        # measured 1.5x them. Keyed by exact row counts and skipped outright, a 9-16-row policy
        # (rows come and go) left most of its first rounds unpriced and drafted deep on its
        # defaults
        self._shapes_run: set[tuple[int, int]] = set()
        # the models that capture steps as CUDA graphs: a round in which either captured one
        # reaches the policy as a first use. A capture costs tens of steps, and a new cache
        # layout or key bucket brings one long after a depth's first round; taken at full
        # weight, such rounds priced drafting out of reach
        self._capturers = [m for m in (target, proposer)
                           if m is not None and isinstance(m, CapturesSteps)]

    @property
    def speculative(self) -> bool:
        return self.proposer is not None

    def add(self, prompts: Sequence[Sequence[int]], configs: Sequence[GenerationConfig],
            generators: Sequence[torch.Generator],
            constraints: ConstraintSet | None = None,
            prefilled: Sequence[ChunkedPrefill] | None = None,
            lanes: Sequence[int] | None = None) -> list[Row]:
        """Rows joining between rounds: one prompt (token ids), config and generator each;
        ``constraints``: their grammars (a ConstraintSet over these rows) or None. The joining
        rows are prefilled in one pass, or with ``prefilled`` (one finished chunked prefill of
        each prompt, :meth:`start_prefill`) their target caches are copied in; the rows already
        here are not touched. ``lanes``: with a seed shared by several rows, what tells their
        clocks apart (rows.Row; default 0 each: rows seeded one by one)."""
        prompts = check_prompts(prompts, self.vocab_size)
        assert len(configs) == len(prompts) == len(generators)
        for config in configs:
            check_stop_token_ids(config.stop_token_ids, self.vocab_size)
        lanes = [0] * len(prompts) if lanes is None else list(lanes)
        rows = [Row(prompt, config, generator,
                    follows_policy=self.policy_config is not None and config.adaptive is not None,
                    lane=lane)
                for prompt, config, generator, lane in zip(prompts, configs, generators, lanes)]
        if prefilled is None:
            self._joins_ride |= self.target.add_rows(prompts)
        else:
            assert len(prefilled) == len(prompts) and all(
                p.done and p.prompt_ids == list(prompt) for p, prompt in zip(prefilled, prompts))
            self.target.adopt_rows([p.session for p in prefilled], prompts)
        if self.proposer is not None:
            # rows joining a batch that runs plain rounds leave their draft work for the next
            # proposal (proposers.base.ProposerSession.add_rows); a row with a fixed k drafts
            # in the next round anyway
            defer = self._draft_lags and all(row.follows_policy for row in rows)
            started = time.perf_counter()
            self.proposer.add_rows(prompts, defer=defer)
            if not defer:  # the policy prices it as a cost of drafting
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self._join_time += time.perf_counter() - started
                self._join_tokens += sum(config.max_new_tokens for config in configs)
        joining = constraints if constraints is not None and constraints.active else None
        if self.constraints is None and joining is not None:
            self.constraints = ConstraintSet(joining.index, [None] * len(self.rows))
        if self.constraints is not None:
            self.constraints.add_rows(joining, len(rows))
        self.rows += rows
        return rows

    def start_prefill(self, prompt: Sequence[int]) -> ChunkedPrefill | None:
        """A long prompt's target prefill to run apart, a chunk between rounds, before it joins
        with :meth:`add`'s ``prefilled``; None where the target's backend cannot take a row
        prefilled apart. The batch's own session is asked: a backend that holds one live
        session a model (llama.cpp) must not be asked for another."""
        if not callable(getattr(self.target.session, "adopt_rows", None)):
            return None
        return ChunkedPrefill(self._target_model, check_prompts([prompt], self.vocab_size)[0])

    def remove(self, rows: Sequence[Row]) -> None:
        """Rows leaving between rounds (a cancelled request): they end as "cancelled"."""
        leaving = {row.id for row in rows}
        for row in rows:
            row.cancel()
        self._keep([i for i, row in enumerate(self.rows) if row.id not in leaving])

    def step(self) -> list[tuple[Row, list[int]]]:
        """One round over every row: [(row, its new tokens)]; rows that finish leave."""
        assert self.rows, "a round needs at least one row"
        policy = self._policy()
        # the k the policy returned last (a probe of a neighbouring depth included), else its own
        policy_k = None if policy is None else self._policy_k.get(self._bucket(),
                                                                  policy.num_draft_tokens)
        wanted = [row.num_draft_tokens(policy_k) if self.speculative else 0 for row in self.rows]
        if self.max_positions is not None and max(wanted) > 0:
            room = min(self.max_positions - len(row.prompt) - row.num_generated
                       for row in self.rows)
            wanted = [min(k, max(room, 0)) for k in wanted]
        if self._draft_lags and max(wanted) > 0:
            # the work plain rounds left the proposer is done before the clock starts, so
            # that this round's draft time prices its steps. Timed with them, such rounds
            # went unpriced (RoundStats.draft_timed), and a draft step priced high by a cold
            # start (5.8 ms against ~0.6 at one row) stayed so and held k at 0 for good
            self.proposer.catch_up()
            self._draft_lags = False
        captures = self._num_captured()
        started = time.perf_counter()
        # 1. propose (under a grammar: each draft token drawn from its masked distribution)
        draft_tokens, draft_probs, num_draft = self._propose(wanted)
        allowed = None  # the grammar's masks for the target's K + 1 positions [B, K+1, V]
        constraints = self._active_constraints()
        if constraints is not None:  # a deterministic proposal is cut where it leaves it
            kept = constraints.cover(draft_tokens)
            draft_tokens = draft_tokens[:, :kept]
            draft_probs = None if draft_probs is None else draft_probs[:, :kept]
            num_draft = [min(k, kept) for k in num_draft]
            allowed = constraints.round_masks()
        draft_time = _synced_elapsed(started, draft_tokens)
        # 2. score: one target pass over each row's pending token and the K draft tokens
        target_started = time.perf_counter()
        # [B, K+1, V]; row b's columns past k_b are not read (verify_batch)
        target_logits = ban_early_stops(self.rows, self.target.score(draft_tokens, num_draft))
        target_out = target_outputs(self.rows, target_logits, allowed)
        target_time = _synced_elapsed(target_started, target_logits)
        # 3. verify each row on its first k_b tokens
        verify_started = time.perf_counter()
        num_accepted, output_tokens = verify_batch(self.rows, draft_tokens, draft_probs,
                                                   num_draft, target_out, self.vocab_size)
        measured = num_accepted  # what verification found: the policy's evidence
        measuring = self._measuring(policy, policy_k)
        if measuring:  # each row keeps its first token only: rows in step stay in step
            num_accepted = [0] * len(self.rows)
        next_tokens = [row[n] for row, n in zip(output_tokens, num_accepted)]  # recovered/bonus
        # 4. commit / rewind both sides (and the grammar) to the accepted prefix + the new token
        self.target.commit(num_accepted, next_tokens)
        if self.proposer is not None:
            self.proposer.commit(num_accepted, next_tokens)
        if self.constraints is not None:
            self.constraints.commit(num_accepted, next_tokens)
        # 5. emit
        emitted = [(row, row.emit(tokens[: n + 1]))
                   for row, tokens, n in zip(self.rows, output_tokens, num_accepted)]
        times = {"draft_time": draft_time, "target_time": target_time,
                 "verify_time": time.perf_counter() - verify_started,
                 "wall_time": time.perf_counter() - started}
        self._record(draft_tokens.shape[1], num_draft, measured, emitted, times, policy,
                     self._overhead(times), measuring, self._num_captured() > captures, wanted)
        self._keep([i for i, row in enumerate(self.rows) if not row.finished])
        return emitted

    def _num_captured(self) -> int:
        return sum(model.num_captured for model in self._capturers)

    def _measuring(self, policy: AdaptivePolicy | None, policy_k: int | None) -> bool:
        """Whether this round only measures drafting for the policy (AdaptivePolicy.measuring:
        a probe while its choice is plain rounds) over more than one row.
        Such a round commits one token a row: its accepted draft tokens are dropped (exact: a
        round's first token alone has the target's law, and at temperature 0 it is the
        target's argmax), so that rows which advanced together still do. Kept, a probe's
        accepted tokens moved most rows one token ahead of the others; the rows then finished
        in different rounds and rejoined in small groups, each a prefill pass of its own
        (in-process, 16 clients, nine passes each: 19-27 joins a pass with measuring probes,
        31-39 without, 8 for the plain batch)."""
        return (policy is not None and policy_k is not None and len(self.rows) > 1
                and policy.measuring(policy_k))

    @staticmethod
    def _overhead(times: dict[str, float]) -> float:
        """Seconds of this round outside drafting and scoring (verification, bookkeeping). The
        caller's time between rounds is left out: under a server's load it is mostly waiting
        for the GIL and the CPU, noise that pushed the policy to depths that measured slower."""
        return times["wall_time"] - times["draft_time"] - times["target_time"]

    def _policy(self) -> AdaptivePolicy | None:
        """The policy of the current batch size's bucket, built on first use; None below the
        config's min_rows (the rows' own k then)."""
        if self.policy_config is None or len(self.rows) < self.policy_config.min_rows or not any(
                row.follows_policy for row in self.rows):
            return None
        bucket = self._bucket()
        if bucket not in self._policies:
            previous = None if not self.policy_config.carry_over or self._carried is None else (
                self._carried.get(self._carry_key(bucket)))
            self._policies[bucket] = self.policy_config.build(self.initial_num_draft_tokens,
                                                              previous)
        return self._policies[bucket]

    def _bucket(self) -> int:
        return 1 << (len(self.rows) - 1).bit_length()  # 1, 2, 4, 8, ...

    def _carry_key(self, bucket: int) -> tuple[object, ...]:
        return (self.policy_config, bucket)

    def _active_constraints(self) -> ConstraintSet | None:
        return self.constraints if self.constraints is not None and (
            self.constraints.active) else None

    def _propose(self, num_draft: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """-> draft_tokens [B, K], draft_probs [B, K, V] or None, each row's k_b <= K (a
        proposer may find fewer than asked: an n-gram lookup)."""
        constraints = self._active_constraints()
        if constraints is not None:
            constraints.start_round()
        if self.proposer is None or max(num_draft) == 0:
            return (torch.empty((len(self.rows), 0), dtype=torch.int64, device=self.device),
                    None, [0] * len(self.rows))
        keyed = [row if row.keyed else None for row in self.rows]
        plan = DraftPlan(num_draft, [row.config.sampling for row in self.rows],
                         [row.generator for row in self.rows],
                         keyed if any(row is not None for row in keyed) else None)
        proposal = self.proposer.propose(plan, constraints)
        width = proposal.draft_tokens.shape[1]
        found = proposal.num_proposed or [width] * len(num_draft)
        num_draft = [min(k, width, n) for k, n in zip(num_draft, found)]
        # tokens meet the target's probs on its device (an n-gram lookup proposes host tensors;
        # the draft's probs are on the draft's device, which load() makes the target's)
        return proposal.draft_tokens.to(self.device), proposal.draft_probs, num_draft

    def _record(self, width: int, num_draft: list[int], num_accepted: list[int],
                emitted: list[tuple[Row, list[int]]], times: dict[str, float],
                policy: AdaptivePolicy | None, other_time: float, measuring: bool,
                captured: bool, asked: list[int]) -> None:
        """Add the round to the batch's and each row's metrics; give the policy its stats.
        num_accepted: what verification found. In a measuring round (_measuring) each row's
        metrics count a plain round (it kept no draft token); the batch's and the policy's
        count what was verified. ``captured``: a model captured a step graph this round (its
        timings then weigh like a first use). ``asked``: the depth each row was asked to draft
        (num_draft: what its proposer found, no more)."""
        reached, accepted_at = [0] * width, [0] * width
        for (row, new), k, n in zip(emitted, num_draft, num_accepted):
            row_reached = [1 if n >= j else 0 for j in range(k)]  # position j tested
            row_accepted = [1 if n > j else 0 for j in range(k)]
            if measuring:
                row.recorder.record_round(0, 1, 0, len(new), [], [], times)
            else:
                row.recorder.record_round(k, 1, n, len(new), row_reached, row_accepted, times)
            for j in range(k):
                reached[j] += row_reached[j]
                accepted_at[j] += row_accepted[j]
        self.recorder.record_round(width, len(emitted), sum(num_accepted),
                                   sum(len(new) for _, new in emitted), reached, accepted_at,
                                   times, num_drafted=sum(num_draft))
        self.last_policy = policy
        self.last_num_draft_tokens = width
        draft_timed = not self._draft_lags  # this round's draft fed only its own k steps
        self._draft_lags = width == 0 and self.proposer is not None
        depth, reached, accepted_at = _policy_evidence(asked, num_draft, num_accepted)
        bucket = self._bucket()
        shape = (bucket, depth)  # per bucket: rows come and go within one
        # a round whose target pass also prefilled joining rows weighs like a first use: a
        # 16-prompt join charged to its depth drove a 16-row policy to k = 8 (0.76x plain)
        timed = shape in self._shapes_run and not self._joins_ride and not captured
        self._shapes_run.add(shape)
        self._joins_ride = False
        if policy is not None:  # k = 0 rounds too: a policy may choose plain rounds
            stats = RoundStats(depth, tuple(reached), tuple(accepted_at), times["draft_time"],
                               times["target_time"], other_time, draft_timed, len(emitted),
                               self._join_time, self._join_tokens, timed)
            self._policy_k[bucket] = policy.next_num_draft_tokens(stats)
            if self.policy_config is not None and self.policy_config.carry_over and (
                    self._carried is not None):
                self._carried[self._carry_key(bucket)] = policy
        self._join_time, self._join_tokens = 0.0, 0

    def _keep(self, indices: list[int]) -> None:
        """Keep these rows on every side; the others leave. The rows that stay keep their places
        where they can: the last ones fill the places of those leaving (a cache moves only
        them), so the batch's order is not kept."""
        if len(indices) == len(self.rows):
            return
        indices = fill_from_the_end(indices)
        self.target.keep_rows(indices)
        if self.proposer is not None:
            self.proposer.keep_rows(indices)
        if self.constraints is not None:
            self.constraints.keep_rows(indices)
        self.rows = [self.rows[i] for i in indices]


def _policy_evidence(asked: list[int], num_draft: list[int], num_accepted: list[int]
                     ) -> tuple[int, list[int], list[int]]:
    """(depth, reached [depth], accepted_at [depth]): what a round tells the depth policy,
    priced at the depth it asked for. A row asked for k_b tokens whose proposer found fewer
    (a lookup without a long enough match) counts its first missing position as tested and
    rejected: it yields no token there. So the rates are tokens gained per position asked, and
    T(k) the mean cost of rounds run at depth k, whatever the proposer found; counting only
    the positions drafted, a batch where one row of eight drafted, nearly always kept, looked
    as if every row would, and the policy drafted deep for a fraction of the gain it priced.

    Example: asked [4, 4], found [2, 0], accepted [2, 0] -> depth 4, reached [2, 1, 1, 0],
    accepted_at [1, 1, 0, 0]."""
    depth = max(asked, default=0)
    reached, accepted_at = [0] * depth, [0] * depth
    for k, found, n in zip(asked, num_draft, num_accepted):
        assert n <= found <= k
        for j in range(k):
            reached[j] += n >= j
            accepted_at[j] += n > j
    return depth, reached, accepted_at


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


def _synced_elapsed(started: float, tensor: torch.Tensor) -> float:
    """Seconds since ``started``, after the device that produced ``tensor`` has finished."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - started


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate a batch of token-id prompts; return them as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError(f"prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]]; "
                         f"got {prompts!r:.80}.")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, int) or not isinstance(prompt, Sequence):
            raise InputError(f"prompts[{row}]={prompt!r:.40} is not a list of token ids; pass a "
                             "batch, e.g. [[1, 2, 3]] for one prompt.")
        if len(prompt) == 0:
            raise EmptyPromptError(f"prompts[{row}] is empty; a prompt needs at least one token "
                                   "(for example the BOS token).")
        ids = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InputError(f"prompts[{row}] holds {token!r}; token ids must be ints.")
            if not 0 <= token < vocab_size:
                raise TokenOutOfRangeError(f"prompts[{row}] holds token id {token}, outside the "
                                           f"vocabulary [0, {vocab_size}).")
            ids.append(token)
        checked.append(ids)
    return checked
