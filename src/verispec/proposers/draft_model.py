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
counts are padded for that one pass (``_feed_unfed``). In general (a row that stopped early,
a chained prefix) commit keeps the longest run of the row's fed tokens that begins its
accepted ones, rewinds the rest, and leaves the accepted tokens it was not fed, then the new
token, unfed.

Worked example (committed "a b c", unfed [c], k = 3):
  propose: feed [c] -> d1=x, feed [x] -> d2=y, feed [y] -> d3=z     cache [a b c x y]
  n = 0, recovered w: committed "a b c w"; rewind 3 - 1 - 0 = 2     cache [a b c]   unfed [w]
  n = 1, recovered w: committed "a b c x w"; rewind 3 - 1 - 1 = 1   cache [a b c x] unfed [w]
  n = 3, bonus w:     committed "a b c x y z w"; rewind 0          cache [a b c x y] unfed [z w]

The confidence stop (``draft_p_min``, llama.cpp's --draft-p-min). A row's draft ends before
the first position i whose distribution q_i (the processed one its token would be drawn from;
a greedy row's logits at temperature 1) has a largest probability below the floor: the row
proposes d_1 .. d_{i-1}. The step that computed q_i has run (its token, drawn or not, is
padding), and once no row proposes a position the round stops drafting, so a batch of unsure
rows costs one step more than it proposes, not k. Exact: whether position i is proposed is a
function of q_i, that is of the context and d_1 .. d_{i-1}, decided before d_i is drawn; each
proposed d_i is then drawn from exactly the q_i it reports. A draft whose length is such a
stopping time L verifies like a full-length one whose positions after L draw from the target
itself (q_j = p_j): token-wise, those positions accept everything and the bonus after L is
p_{L+1}; in block verification (sample/block.py) they leave w_L unchanged and add no residual
mass, so P(tau = i) and every recovered or bonus distribution are those of the length-L block.
The rule "drop d_i when its own probability q_i(d_i) is below the floor" would not be exact:
the proposed d_i would then be drawn from q_i restricted to its likely tokens, not from q_i.

Chaining (``propose_after``; proposers/hybrid.py): a row's draft may begin with tokens proposed
by a lookup (deterministic) and continue with the model's after them; the first step feeds
them after the unfed tokens, and they are reported as point masses (one-hot draft_probs rows):
the token-wise rule verifies them exactly as a deterministic proposal (draft_probs None), block
verification as positions whose draft distribution is a point mass. Both are exact for any
draft distribution that is a function of the context and the draft's earlier tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import check_draft_p_min
from ..models.base import CapturesSteps, LanguageModel, LMSession, as_ints
from ..sample.sampling import draw_step_uniforms
from .base import DraftPlan, Proposal, RoundConstraint
from .draws import confidences, draw_step, process_rows, race_keyed


class DraftModelProposer:
    """Proposes tokens sampled from a draft :class:`LanguageModel`. ``draft_p_min``: the
    confidence floor (``--draft-p-min``, 0 for none; module docstring): a row's draft ends
    before the first position where the draft's most likely token is less likely than it."""

    def __init__(self, model: LanguageModel, draft_p_min: float = 0.0) -> None:
        check_draft_p_min(draft_p_min)
        self.draft_p_min = draft_p_min
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
        return DraftModelSession(self.model.new_session(), prompts, self.draft_p_min)


class DraftModelSession:
    def __init__(self, session: LMSession, prompts: Sequence[Sequence[int]],
                 draft_p_min: float = 0.0) -> None:
        self.session = session
        self.draft_p_min = draft_p_min
        session.start([list(p[:-1]) for p in prompts])
        self.unfed = [[p[-1]] for p in prompts]  # B host rows of u ids, fed by the next propose
        self._proposal: list[list[int]] | None = None  # this round's draft tokens, [B][K] ids
        self._fed: list[list[int]] = []  # the tokens each row's cache took this round

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
        with ``plan.processors``: after the row's penalties and logit bias, counting its draft
        tokens so far). A row past its k_b (or at temperature 0) takes the argmax: padding,
        never verified, and no random number; its draft_probs there are zeros. With a
        ``draft_p_min`` floor a row's draft ends before the first position whose distribution
        is below it (module docstring: the confidence stop), so rows may propose fewer than
        k_b tokens (Proposal.num_proposed) and the proposal is as wide as its longest row. A
        row whose step fails (non-finite logits, its processor's or race's fault) pads from
        there, proposes 0 tokens and is reported (Proposal.faults): its batch mates draw what
        they would have."""
        return self.propose_after(plan, None, constraint)

    def propose_after(self, plan: DraftPlan, prefixes: Sequence[Sequence[int]] | None,
                      constraint: RoundConstraint | None = None) -> Proposal:
        """:meth:`propose` with each row's draft continuing ``prefixes[b]``: tokens proposed
        before the model's (a lookup's, proposers/hybrid.py), deterministic, so their
        draft_probs are point masses (one-hot rows, verified as :mod:`..sample.rejection`
        verifies a proposal with draft_probs None). Row b proposes its prefix, then up to
        k_b - len(prefix) tokens drawn by the model after it, which the first step feeds
        (with the row's unfed tokens) where the model draws for the row; a row whose prefix
        fills its k_b draws nothing (its prefix is not fed). Not under a grammar: a
        ``constraint`` advances every row together from the round's first position."""
        assert prefixes is None or constraint is None, "a grammar's rows advance together"
        drafting = DraftRound.start(plan, prefixes, len(self.unfed))
        inputs = None
        for step in range(max(drafting.counts)):
            if step == 0:
                logits = self._feed_unfed(drafting.fed_prefixes())
            else:
                logits, drafting.num_fed = self.session.extend(inputs)[:, -1], step
            if not self._draw(drafting, plan, logits, step, constraint):
                break  # no row proposes this position: it is neither drawn nor advanced
            inputs = drafting.last_tokens[:, None]  # [B, 1]
        proposal = drafting.proposal()
        self._proposal = [row[: proposal.draft_tokens.shape[1]] for row in drafting.rows()]
        self._fed = drafting.fed()
        return proposal

    def _draw(self, drafting: DraftRound, plan: DraftPlan, logits: torch.Tensor, step: int,
              constraint: RoundConstraint | None) -> bool:
        """One draft step over every row, from its logits [B, V]: the rows' tokens (processed,
        masked, drawn, stopped by the floor, raced) join ``drafting``. -> whether any row
        proposes this position (False: nothing of the step is kept)."""
        failed = drafting.failed
        if plan.processors is not None:
            logits = process_rows(logits, plan.processors, drafting.rows(), failed)
        allowed = None if constraint is None else constraint.allowed()  # [B, V] or None
        token, probs = draw_step(logits, allowed, step, plan.samplings, drafting.sampled,
                                 drafting.uniforms, failed)
        if self.draft_p_min > 0:
            drafting.stop_unsure(step, confidences(logits, probs, allowed, drafting.live(step),
                                                   drafting.sampled, step), self.draft_p_min)
        return drafting.take_drawn(token, probs, step, plan, constraint)

    def _feed_unfed(self, extra: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed every row's unfed tokens and its ``extra`` ones (a chained draft's prefix) in
        one pass; the logits after each row's last [B, V], asked of the session at that
        column only (LMSession.extend's logits_at): after a fully accepted round most rows
        feed two tokens, and a small draft's output layer at both positions is a large share
        of its pass.

        Rows with fewer tokens are padded on the right with copies of their last one, and
        the padding is rewound at once (the cache then ends with the row's own tokens).
        Worked example: unfed [[a], [b c d]] -> feed [[a a a], [b c d]], take row 0's logits
        at position 0 and row 1's at 2, rewind [2, 0]."""
        fed = [list(row) + list(more) for row, more in zip(self.unfed, extra)]
        widths = [len(row) for row in fed]
        width = max(widths)
        inputs = torch.tensor([row + row[-1:] * (width - len(row)) for row in fed],
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
        """Each row's cache keeps the tokens it was fed this round that the row committed (a
        prefix of its accepted draft tokens) and rewinds the rest; the accepted tokens it was
        not fed and the new token are its unfed ones (module docstring, worked example)."""
        num_accepted, next_tokens = as_ints(num_accepted), as_ints(next_tokens)
        if self._proposal is None:  # a round without a proposal: the cache did not move
            self.append_committed([[token] for token in next_tokens])
            return
        proposal, fed, self._proposal, self._fed = self._proposal, self._fed, None, []
        kept = [_common_prefix(row_fed, drafted[:n])
                for row_fed, drafted, n in zip(fed, proposal, num_accepted)]
        self.session.rewind([len(row_fed) - keep for row_fed, keep in zip(fed, kept)])
        self.unfed = [drafted[keep:n] + [token] for drafted, keep, n, token
                      in zip(proposal, kept, num_accepted, next_tokens)]


class DraftRound:
    """One proposal's rows while the draft model steps (DraftModelSession.propose_after; the
    cross-vocabulary intersection rule's steps, proposers/cross_vocab/rules.py).

    prefixes: each row's tokens proposed before the model's (a lookup's; [] for none);
    counts: the model tokens each row proposes at most (k_b - its prefix, cut by the floor);
    sampled: of those, the ones drawn (0 for a greedy row, which takes the argmax; cut with
    counts); uniforms: each row's random numbers, one per drawn token; drawn: the tokens of
    every step so far for every row (host ids: past a row's count, padding); step_probs: each
    step's probs [B, V] (None where no row samples); num_fed: the drawn tokens fed (the last
    drawn is never fed); failed: rows whose drafting failed, with their errors."""

    def __init__(self, prefixes: list[list[int]], counts: list[int], sampled: list[int],
                 uniforms: list[list[float]]) -> None:
        self.prefixes, self.counts, self.sampled, self.uniforms = (prefixes, counts, sampled,
                                                                   uniforms)
        self._fed_prefixes = [prefix if count else [] for prefix, count in zip(prefixes, counts)]
        self.drawn: list[list[int]] = [[] for _ in prefixes]
        self.step_probs: list[torch.Tensor | None] = []
        self.last_tokens: torch.Tensor | None = None  # the latest step's tokens [B]
        self.num_fed = 0
        self.failed: dict[int, Exception] = {}

    @classmethod
    def start(cls, plan: DraftPlan, prefixes: Sequence[Sequence[int]] | None,
              num_rows: int) -> DraftRound:
        """The round's rows before the first step, their uniforms drawn (each generator group
        in one draw, sample.sampling.draw_step_uniforms; a keyed row races instead)."""
        assert len(plan.num_draft_tokens) == num_rows
        prefixes = [[] for _ in range(num_rows)] if prefixes is None else [
            list(prefix) for prefix in prefixes]
        counts = [max(k - len(prefix), 0) for k, prefix in zip(plan.num_draft_tokens, prefixes)]
        assert max(counts) >= 1, "a draft-model round draws at least one token"
        sampled = [0 if sampling.is_greedy else count
                   for sampling, count in zip(plan.samplings, counts)]
        keyed = plan.keyed or [None] * num_rows
        uniforms = draw_step_uniforms(
            plan.generators, [0 if clocks is not None else k for clocks, k in zip(keyed, sampled)])
        uniforms = [[0.0] * k if clocks is not None else drawn
                    for clocks, k, drawn in zip(keyed, sampled, uniforms)]
        return cls(prefixes, counts, sampled, uniforms)

    def fed_prefixes(self) -> list[list[int]]:
        """What the first step feeds after each row's unfed tokens: its prefix where the model
        draws for the row."""
        return self._fed_prefixes

    def rows(self) -> list[list[int]]:
        """Each row's tokens this round so far: its prefix, then the model's."""
        return [prefix + drawn for prefix, drawn in zip(self.prefixes, self.drawn)]

    def positions(self, step: int) -> list[int]:
        """Each row's round position at this step (after its prefix)."""
        return [len(prefix) + step for prefix in self.prefixes]

    def live(self, step: int) -> list[int]:
        """The rows that propose this step's token."""
        return [row for row, count in enumerate(self.counts)
                if count > step and row not in self.failed]

    def stop_unsure(self, step: int, confidence: dict[int, float], floor: float) -> None:
        """Rows less confident than ``floor`` at this step propose nothing from here on."""
        self.stop_at(step, [row for row, value in confidence.items() if value < floor])

    def stop_at(self, step: int, rows: Sequence[int]) -> None:
        """These rows propose nothing from this step on (their draft ends before it)."""
        for row in rows:
            self.counts[row] = step
            self.sampled[row] = min(self.sampled[row], step)

    def take_drawn(self, token: torch.Tensor, probs: torch.Tensor | None, step: int,
                   plan: DraftPlan, constraint: RoundConstraint | None) -> bool:
        """Step ``step``'s drawn tokens [B] (and probs [B, V] or None) into the round: a keyed
        row's token replaced by its race winner, the grammar advanced; False where no row
        proposes this step (the round's drafting ends)."""
        live = self.live(step)
        if not live:
            return False
        if plan.keyed is not None:
            token = race_keyed(token, probs, live, self.positions(step), plan.keyed,
                               self.failed)
        if constraint is not None:
            constraint.advance(token.tolist())
        self.take(token, probs)
        return True

    def take(self, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """A step's tokens [B] and probs [B, V] (or None) join the round."""
        for drawn, token in zip(self.drawn, tokens.tolist()):
            drawn.append(token)
        self.step_probs.append(probs)
        self.last_tokens = tokens

    def fed(self) -> list[list[int]]:
        """The tokens each row's cache took this round after its unfed ones."""
        return [prefix + drawn[: self.num_fed]
                for prefix, drawn in zip(self._fed_prefixes, self.drawn)]

    def proposal(self) -> Proposal:
        """The round's Proposal: each row's prefix and model tokens up to its count, as wide as
        the longest row (shorter rows padded with their last token, not verified)."""
        num_steps = len(self.step_probs)
        num_proposed = [0 if row in self.failed else len(prefix) + min(count, num_steps)
                        for row, (prefix, count) in enumerate(zip(self.prefixes, self.counts))]
        width = max(num_proposed)
        rows = [(row + row[-1:] * width)[:width] if row else [0] * width for row in self.rows()]
        draft_tokens = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)  # [B, K]
        return Proposal(draft_tokens, self._draft_probs(width), num_proposed,
                        self.failed)

    def _draft_probs(self, width: int) -> torch.Tensor | None:
        """[B, K, V] fp32: each row's prefix as point masses (one-hot), then the probs its
        model tokens were drawn from; None where no row drew a token (every position then a
        point mass: greedy rows, prefixes)."""
        probs = [p for p in self.step_probs if p is not None]
        if not probs or width == 0:
            return None
        if width == len(self.step_probs) == len(probs) and not any(self.prefixes):
            return torch.stack(probs, dim=1)  # [B, K, V]: one step a position
        num_rows, device = len(self.prefixes), probs[0].device
        out = torch.zeros((num_rows, width, probs[0].shape[-1]), dtype=torch.float32,
                          device=device)  # [B, K, V]
        at = [(row, position, token) for row, prefix in enumerate(self.prefixes)
              for position, token in enumerate(prefix[:width])]
        if at:
            out[tuple(torch.tensor(index, device=device) for index in zip(*at))] = 1.0
        for step, step_probs in enumerate(self.step_probs):
            rows = [row for row, position in enumerate(self.positions(step)) if position < width]
            if step_probs is not None and rows:
                index = torch.tensor(rows, device=device)
                positions = torch.tensor([len(self.prefixes[row]) + step for row in rows],
                                         device=device)
                out[index, positions] = step_probs[index]
        return out


def _common_prefix(fed: list[int], accepted: list[int]) -> int:
    """How many of a row's fed tokens begin its accepted ones (the cache keeps those)."""
    keep = 0
    while keep < min(len(fed), len(accepted)) and fed[keep] == accepted[keep]:
        keep += 1
    return keep
