"""A draft language model as a proposer: k autoregressive steps over its own rewindable cache.

Legend: B batch, K draft tokens, V vocabulary, u unfed committed tokens (1 or 2 after a round
it proposed; more after rounds without its proposal: an adaptive policy's plain rounds, or a
hybrid proposer's n-gram rounds, which may leave rows of a batch with different u).

Cache bookkeeping. The draft cache lags the committed sequence by ``u`` tokens (``unfed``). A
proposal of k tokens feeds the unfed tokens plus d_1 .. d_{k-1} (d_k is sampled, never fed).
After n < k are accepted, the accepted d_1 .. d_n are already in the cache: rewinding the
k - 1 - n rejected ones leaves only the recovered token unfed. After all k are accepted, d_k
and the bonus token are unfed. A row's next round thus starts with a 1-token pass, or a 2-token
one after a fully accepted round (a 2-token pass of a small draft costs ~1.2-1.7 of a 1-token
one on a CPU: oneDNN and MKL switch kernels over 2 rows); rows of a batch with different
counts are padded for that one pass (``_feed_unfed``).

Worked example (committed "a b c", unfed [c], k = 3):
  propose: feed [c] -> d1=x, feed [x] -> d2=y, feed [y] -> d3=z     cache [a b c x y]
  n = 0, recovered w: committed "a b c w"; rewind 3 - 1 - 0 = 2     cache [a b c]   unfed [w]
  n = 1, recovered w: committed "a b c x w"; rewind 3 - 1 - 1 = 1   cache [a b c x] unfed [w]
  n = 3, bonus w:     committed "a b c x y z w"; rewind 0          cache [a b c x y] unfed [z w]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingConfig
from ..models.base import CapturesSteps, LanguageModel, LMSession, as_ints
from ..spec.sampling import draw_step_uniforms, greedy_tokens, sample_from_logits
from ..spec.seeded import race
from .base import (
    DraftPlan,
    KeyedClocks,
    LogitShaper,
    Proposal,
    RoundConstraint,
    run_isolated,
)


class DraftModelProposer:
    """Proposes tokens sampled from a draft :class:`LanguageModel`."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.device = model.device  # where draft_probs live
        self.max_positions = model.max_positions

    @property
    def num_captured(self) -> int:
        """The draft model's steps captured as CUDA graphs so far (CapturesSteps; 0 for a
        model that captures none)."""
        return self.model.num_captured if isinstance(self.model, CapturesSteps) else 0

    def start(self, prompts: Sequence[Sequence[int]]) -> DraftModelSession:
        return DraftModelSession(self.model.new_session(), prompts)


class DraftModelSession:
    def __init__(self, session: LMSession, prompts: Sequence[Sequence[int]]) -> None:
        self.session = session
        session.start([list(p[:-1]) for p in prompts])
        self.unfed = [[p[-1]] for p in prompts]  # B host rows of u ids, fed by the next propose
        self._proposal: torch.Tensor | None = None  # draft tokens [B, K] of this round

    def add_rows(self, prompts: Sequence[Sequence[int]], defer: bool = False) -> None:
        """Rows join: their prompts are prefilled now, or with ``defer`` held as unfed tokens
        for the next propose. A batch that runs plain rounds (under load, where verifying
        draft tokens costs more than it gains) may not propose for hundreds of rounds, and a
        row that leaves before then never costs the draft anything, while eager prefills and
        catch-ups leave a loaded speculative server behind the plain one."""
        assert self._proposal is None, "rows join between rounds"
        if defer:
            self.session.add_rows([[] for _ in prompts])
            self.unfed += [list(p) for p in prompts]
            return
        self.session.add_rows([list(p[:-1]) for p in prompts])
        self.unfed += [[p[-1]] for p in prompts]

    def keep_rows(self, rows: Sequence[int]) -> None:
        assert self._proposal is None, "rows leave between rounds"
        self.session.keep_rows(rows)
        self.unfed = [self.unfed[row] for row in rows]

    def catch_up(self) -> None:
        """Feed every row's unfed tokens but its last (plain rounds' tokens, deferred prompts),
        with no logits (LMSession.feed: the fast backend groups rows of near widths instead
        of padding all to the widest); the next propose then feeds one token a row, as after
        a rejection. Worked example: unfed [[a], [b c d]] -> feed [[], [b c]]; unfed
        [[a], [d]], the cache of row 1 holding b c more."""
        assert self._proposal is None, "the draft catches up between rounds"
        backlog = [row[:-1] for row in self.unfed]
        if any(backlog):
            self.session.feed(backlog)
            self.unfed = [row[-1:] for row in self.unfed]

    def propose(self, plan: DraftPlan, constraint: RoundConstraint | None = None) -> Proposal:
        """Draft plan.num_draft_tokens[b] tokens for row b, each sampled under the row's own
        settings; draft_probs are exactly the distributions sampled from (with a
        ``constraint``: masked by the grammar state each token extends, engine/constraints.py;
        with ``plan.shapers``: after the row's penalties and logit bias, counting its draft
        tokens so far). A row past its k_b (or at temperature 0) takes the argmax: padding,
        never verified, and no random number; its draft_probs there are zeros. A row whose
        step fails (non-finite logits, its shaper's or race's fault) pads from there, proposes
        0 tokens and is reported (Proposal.faults): its batch mates draw what they would
        have."""
        num_steps = plan.num_steps
        assert num_steps >= 1 and len(plan.num_draft_tokens) == len(self.unfed)
        # the round's uniforms, each generator group in one draw (spec.sampling.draw_step_uniforms)
        sampled = [0 if sampling.is_greedy else k
                   for sampling, k in zip(plan.samplings, plan.num_draft_tokens)]
        keyed = plan.keyed or [None] * len(sampled)
        uniforms = draw_step_uniforms(
            plan.generators, [0 if clocks is not None else k for clocks, k in zip(keyed, sampled)])
        uniforms = [[0.0] * k if clocks is not None else drawn  # a keyed row races instead
                    for clocks, k, drawn in zip(keyed, sampled, uniforms)]
        draft_tokens, draft_probs = [], []
        failed: dict[int, Exception] = {}  # rows whose drafting failed: padding from then on
        for step in range(num_steps):
            logits = self._feed_unfed() if step == 0 else self.session.extend(inputs)[:, -1]
            if plan.shapers is not None:
                logits = _shaped(logits, plan.shapers, draft_tokens, failed)
            allowed = None if constraint is None else constraint.allowed()  # [B, V] or None
            token, probs = _draw_step(logits, allowed, step, plan.samplings, sampled, uniforms,
                                      failed)
            if plan.keyed is not None:
                token = _race_keyed(token, probs, step, keyed, sampled, failed)
            if constraint is not None:
                constraint.advance(token.tolist())
            draft_tokens.append(token)
            if probs is not None:
                draft_probs.append(probs)
            inputs = token[:, None]
        self._proposal = torch.stack(draft_tokens, dim=1)  # [B, K]
        stacked_probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, K, V]
        return Proposal(self._proposal, stacked_probs,
                        [0 if row in failed else k for row, k in enumerate(plan.num_draft_tokens)],
                        failed)

    def _feed_unfed(self) -> torch.Tensor:
        """Feed every row's unfed tokens in one pass; the logits after each row's last [B, V],
        asked of the session at that column only (LMSession.extend's logits_at): after a
        fully accepted round most rows feed two tokens, and a small draft's output layer at
        both positions is a large share of its pass.

        Rows with fewer unfed tokens are padded on the right with copies of their last one, and
        the padding is rewound at once (the cache is then exactly the committed sequence).
        Worked example: unfed [[a], [b c d]] -> feed [[a a a], [b c d]], take row 0's logits
        at position 0 and row 1's at 2, rewind [2, 0]."""
        widths = [len(row) for row in self.unfed]
        width = max(widths)
        inputs = torch.tensor([row + row[-1:] * (width - len(row)) for row in self.unfed],
                              dtype=torch.int64)  # [B, u]
        logits = self.session.extend(inputs, [w - 1 for w in widths])  # [B, V]
        if min(widths) < width:
            self.session.rewind([width - w for w in widths])
        return logits

    def append_committed(self, committed: Sequence[Sequence[int]]) -> None:
        """Tokens committed in a round this session did not propose ([B][*] host ids): they
        join the unfed tokens, fed by the next propose."""
        assert self._proposal is None
        self.unfed = [row + list(tokens) for row, tokens in zip(self.unfed, committed)]

    def commit(self, num_accepted: Sequence[int], next_tokens: Sequence[int]) -> None:
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        if self._proposal is None:  # a round without a proposal: the cache did not move
            self.append_committed([[token] for token in next_tokens])
        else:
            proposal, self._proposal = self._proposal.tolist(), None
            num_draft_tokens = len(proposal[0])
            # the cache holds the unfed tokens and d_1 .. d_{k-1}: keep the accepted ones
            self.session.rewind([max(num_draft_tokens - 1 - n, 0) for n in num_accepted])
            self.unfed = [[token] if n < num_draft_tokens else [drafted[-1], token]
                          for drafted, n, token in zip(proposal, num_accepted, next_tokens)]


def _shaped(logits: torch.Tensor, shapers: Sequence[LogitShaper | None],
            draft_tokens: list[torch.Tensor], failed: dict[int, Exception]) -> torch.Tensor:
    """One step's logits [B, V] with each row that has a shaper reshaped by it after the row's
    draft tokens so far (draft_tokens: one [B] tensor per earlier step) -> [B, V] fp32. A row
    whose shaper raises joins ``failed`` with its error."""
    drafted = torch.stack(draft_tokens, dim=1).tolist() if draft_tokens else [[]] * len(shapers)
    shaped = logits.float().clone()
    for b, shaper in enumerate(shapers):
        if shaper is not None and b not in failed:
            try:
                shaped[b] = shaper.shape_draft(logits[b], drafted[b])
            except Exception as exc:  # the row's own fault: it drafts nothing, and fails
                failed.setdefault(b, exc)
    return shaped


def _race_keyed(tokens: torch.Tensor, probs: torch.Tensor | None, step: int,
                keyed: Sequence[KeyedClocks | None], sampled: Sequence[int],
                failed: dict[int, Exception]) -> torch.Tensor:
    """tokens [B] with each keyed row that samples at this step redrawn by a race of its
    probs [B, V] on its position's clocks (spec.seeded.race): the draft's token is then coupled to
    the target's race winner there, which verification compares it with. A row whose race
    raises joins ``failed``."""
    rows = [row for row, (clocks, count) in enumerate(zip(keyed, sampled))
            if clocks is not None and count > step and row not in failed]
    if not rows:
        return tokens
    assert probs is not None
    tokens = tokens.clone()
    host_probs = probs[rows].cpu()  # [R, V]: one copy from an accelerator, not one a race
    for row, row_probs in zip(rows, host_probs):
        try:
            tokens[row] = race(row_probs, keyed[row].clocks(step, probs.shape[-1]))
        except Exception as exc:  # the row's own fault: it drafts nothing, and fails
            failed.setdefault(row, exc)
    return tokens


def _draw_step(logits: torch.Tensor, allowed: torch.Tensor | None, step: int,
               samplings: Sequence[SamplingConfig], sampled: Sequence[int],
               uniforms: list[list[float]], failed: dict[int, Exception]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft step's tokens [B] and, when any row samples in this round, probs [B, V] fp32.

    Rows that sample at this step (sampled[b] > step) are drawn by spec.sampling.sample_from_logits,
    each group of rows with equal settings in one call, their probs exactly what they were drawn
    from; the others take the argmax (greedy drafts: point masses; rows past their k: padding)
    with zero probs. One group covering every row (a batch under one setting) indexes nothing.
    A row whose draw raises (its logits are not finite) joins ``failed`` and pads; the others
    are drawn with the uniforms they had (run_isolated): what they would have drawn anyway."""
    groups: dict[SamplingConfig, list[int]] = {}
    for row, (sampling, count) in enumerate(zip(samplings, sampled)):
        if count > step and row not in failed:
            groups.setdefault(sampling, []).append(row)
    num_rows = logits.shape[0]
    if len(groups) == 1 and len(next(iter(groups.values()))) == num_rows:
        (sampling, _), = groups.items()
        try:
            probs, tokens = sample_from_logits(logits, sampling, [u[step] for u in uniforms],
                                               allowed)
        except Exception:  # some row's fault: drawn in parts below, with the same uniforms
            probs = None
        if probs is not None:
            return tokens, probs
    tokens = _argmax_rows(logits, allowed, failed)  # [B]
    if not any(sampled):
        return tokens, None
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V]
    for sampling, group in groups.items():
        rows = [row for row in group if row not in failed]  # the argmax may have found some

        def draw(part: list[int], sampling: SamplingConfig = sampling
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            index = torch.tensor(part, device=logits.device)
            return sample_from_logits(logits[index], sampling,
                                      [uniforms[row][step] for row in part],
                                      _rows_of(allowed, index))

        for part, (part_probs, part_tokens) in run_isolated(rows, draw,
                                                            failed.setdefault):
            index = torch.tensor(part, device=logits.device)
            probs[index], tokens[index] = part_probs, part_tokens
    return tokens, probs


def _argmax_rows(logits: torch.Tensor, allowed: torch.Tensor | None,
                 failed: dict[int, Exception]) -> torch.Tensor:
    """spec.sampling.greedy_tokens of each row [B] (one call while no row fails); a row whose
    logits have no finite maximum joins ``failed`` and pads with the first token its grammar
    allows (its grammar state advances with it), else 0."""
    num_rows = logits.shape[0]
    live = [row for row in range(num_rows) if row not in failed]

    def argmax(part: list[int]) -> torch.Tensor:
        if len(part) == num_rows:
            return greedy_tokens(logits, allowed)
        index = torch.tensor(part, device=logits.device)
        return greedy_tokens(logits[index], _rows_of(allowed, index))

    parts = run_isolated(live, argmax, failed.setdefault)
    if len(parts) == 1 and len(parts[0][0]) == num_rows:
        return parts[0][1]
    tokens = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    for part, part_tokens in parts:
        tokens[torch.tensor(part, device=logits.device)] = part_tokens
    if allowed is not None:
        for row in failed:
            tokens[row] = int(allowed[row].to(torch.uint8).argmax())  # 0 when none is allowed
    return tokens


def _rows_of(allowed: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """A grammar's masks [B, V] at the rows ``index`` (on the masks' device), or None."""
    return None if allowed is None else allowed[index.to(allowed.device)]
