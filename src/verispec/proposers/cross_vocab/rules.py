"""The two cross-vocabulary rules: what a draft of another tokenizer proposes in one round.

Legend: B batch, K draft tokens, Vd the draft model's logits, Vt the target's vocabulary.

Both run on a :class:`~.session.Drafter` (the draft model's passes, its context already its
own tokens of the committed text) and return target ids.

string (Timor et al., ICML 2025: SLEM): the draft decodes greedily in its own vocabulary; the
text of its tokens is encoded by the target's tokenizer and the target ids are proposed as a
deterministic proposal (draft_probs None), which verification takes as a point mass: each is
kept with the target's probability of it (a seeded row: while it is the target's race
winner), exact at any temperature. Any pair works. Decisions:
  * boundary: the last target token of the draft's text is dropped, since more text could
    still extend it (the draft's "retu" may be the target's "return"), unless the draft ended
    its text (a special or empty-piece token: EOS, a chat marker), whose target special of the
    same text, where the target has one, is then proposed after the text;
  * steps: the draft steps until each row's text gives its k target tokens (k + 1 before the
    drop) or ends, at most MAX_STEPS_PER_TOKEN * (k + 1) steps: a round costs about as many
    draft steps as the target tokens it proposes plus one (tokenizers of similar size), more
    for a draft with shorter tokens;
  * a committed text that ends inside a character (its first bytes committed, ``pending``):
    the draft, which saw the text without them, must begin with them, and the proposal is the
    target ids after them where the target's encoding has a token boundary there; else the
    row proposes nothing this round. Bytes that are not UTF-8 end the text there.

intersection (Timor et al.: TLI): each draft step's logits are laid onto the target's ids over
the tokens both vocabularies share (vocab.SharedVocab; -inf elsewhere), then processed and
drawn exactly as a same-vocabulary draft's (draws.process_rows, draw_step, race_keyed, under
the row's grammar), so draft_probs [B, K, Vt] are the distributions drawn from, with q = 0 at
every target id outside the intersection: such a token is never proposed, and where the
target emits one it does so through the residual max(0, p - q) = p, never by an unconditional
accept. The drawn token's draft id (the same bytes) is fed to the draft for the next step.
One draft step a target token. A row whose grammar, logit bias or penalties leave no shared
token possible at a step ends its draft there (a stop decided before the step's draw, from
the context and the earlier draft tokens: exact, as the draft-p-min stop,
proposers/draft_model.py). A row whose committed text ends inside a character proposes
nothing that round (its draft's context lacks those bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from ...models.base import TokenText
from ..base import DraftPlan, Proposal, RoundConstraint
from ..draft_model import DraftRound
from ..draws import argmax_rows, draw_step, process_rows
from .context import DraftContext
from .vocab import SharedVocab, special_ids_by_text

# the string rule's draft steps a round, at most, per target token proposed (plus one)
MAX_STEPS_PER_TOKEN = 2


class Drafter(Protocol):
    """The draft model's passes in one round (session.Drafter)."""

    def first(self) -> torch.Tensor:
        """Feed each row's unfed context ids -> the logits after them [B, Vd]."""

    def step(self, draft_ids: Sequence[int]) -> torch.Tensor:
        """Feed one draft id a row [B] -> the logits after it [B, Vd]."""


class CrossRule(Protocol):
    """What a cross-vocabulary rule does in a round (module docstring)."""

    name: str

    def drafts(self, context: DraftContext) -> bool:
        """Whether a row of this context may draft this round."""

    def max_steps(self, num_draft_tokens: int) -> int:
        """The most draft steps a round for k target tokens runs."""

    def propose(self, drafter: Drafter, plan: DraftPlan, contexts: list[DraftContext | None],
                constraint: RoundConstraint | None) -> tuple[Proposal, list[list[int]]]:
        """The round's proposal (target ids) and each row's proposed ids [B][K] for the commit;
        contexts[b] None: row b drafts nothing (its count is 0)."""


def padded_proposal(found: list[list[int]], failed: dict[int, Exception]
                    ) -> tuple[Proposal, list[list[int]]]:
    """A deterministic proposal of each row's ``found`` target ids, short rows padded with
    their last id (or 0): not verified (num_proposed)."""
    width = max(map(len, found), default=0)
    rows = [(row + row[-1:] * width)[:width] if row else [0] * width for row in found]
    draft_tokens = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width)  # [B, K]
    return Proposal(draft_tokens, None, [len(row) for row in found], failed), rows


class StringRule:
    """The string rule (module docstring)."""

    name = "string"

    def __init__(self, draft_text: TokenText, target_text: TokenText, draft_width: int,
                 target_width: int) -> None:
        self.draft_text = draft_text
        self.target_text = target_text
        self._draft_size = min(draft_text.vocab_size, draft_width)  # ids with a piece
        self._target_specials = special_ids_by_text(target_text, target_width)

    def drafts(self, context: DraftContext) -> bool:
        return True

    def max_steps(self, num_draft_tokens: int) -> int:
        return MAX_STEPS_PER_TOKEN * (num_draft_tokens + 1)

    def propose(self, drafter: Drafter, plan: DraftPlan, contexts: list[DraftContext | None],
                constraint: RoundConstraint | None) -> tuple[Proposal, list[list[int]]]:
        """Greedy draft steps until every row has its k_b target ids or its text ended (a
        deterministic proposal: the plan's samplings, processors and ``constraint`` do not
        apply; the engine cuts it where it leaves the grammar)."""
        counts = [k if context is not None else 0
                  for k, context in zip(plan.num_draft_tokens, contexts)]
        drawn: list[list[int]] = [[] for _ in counts]
        found: list[list[int]] = [[] for _ in counts]
        going = [count > 0 for count in counts]
        failed: dict[int, Exception] = {}
        logits = drafter.first()  # [B, Vd]
        for step in range(self.max_steps(max(counts))):
            tokens = argmax_rows(logits, None, failed).tolist()
            for row in range(len(counts)):
                if going[row] and row not in failed:
                    drawn[row].append(tokens[row])
                    going[row] = self._extend(row, contexts[row], drawn[row], counts[row],
                                              found, failed)
                    going[row] = going[row] and step + 1 < self.max_steps(counts[row])
            if not any(going[row] and row not in failed for row in range(len(counts))):
                break
            logits = drafter.step(tokens)
        return padded_proposal([[] if row in failed else ids[: counts[row]]
                                for row, ids in enumerate(found)], failed)

    def _extend(self, row: int, context: DraftContext, drawn: list[int], count: int,
                found: list[list[int]], failed: dict[int, Exception]) -> bool:
        """found[row] from the row's draft so far -> whether the row drafts on."""
        try:
            ids, ended = self.continuation(context.pending, drawn)
        except Exception as exc:  # the row's own fault (its tokenizer's): it fails alone
            failed.setdefault(row, exc)
            return False
        found[row] = ids
        return not ended and len(ids) < count

    def continuation(self, pending: bytes, drawn: list[int]) -> tuple[list[int], bool]:
        """The target ids of the text the draft ids ``drawn`` spell after the committed text
        (which ends with the ``pending`` bytes of an unfinished character), and whether that
        text can grow no more (module docstring: the boundary). Worked example (target
        tokens "ab" "c", draft "a" "bc"): drawn [a] -> ([], False): "a" may become "ab";
        drawn [a, bc] -> ([ab], False); drawn [a, bc, EOS] -> ([ab, c, EOS], True)."""
        pieces, end_piece = [], None
        for token_id in drawn:
            piece = self.draft_text.piece(token_id) if token_id < self._draft_size else b""
            if not piece or self.draft_text.is_special(token_id):
                end_piece = piece
                break
            pieces.append(piece)
        data = b"".join(pieces)
        if not (data.startswith(pending) or pending.startswith(data)):
            return [], True  # the draft's text leaves the committed one
        if len(data) < len(pending):
            return [], end_piece is not None
        text = _valid_prefix(data)
        ids = _ids_after(self.target_text, self.target_text.encode(text.decode()), len(pending))
        if ids is None:
            return [], True  # no target token ends where the committed text does
        if end_piece is None or len(text) < len(data):
            return ids[:-1], end_piece is not None
        special = self._target_specials.get(end_piece)
        return ids + ([] if special is None else [special]), True


def _valid_prefix(data: bytes) -> bytes:
    """The longest prefix of ``data`` that is UTF-8 text (an unfinished or invalid sequence
    ends it)."""
    try:
        data.decode()
    except UnicodeDecodeError as error:
        return data[: error.start]
    return data


def _ids_after(text: TokenText, ids: list[int], offset: int) -> list[int] | None:
    """The ids after the first ``offset`` bytes of their text; None where no id ends there."""
    end = 0
    for index, token_id in enumerate(ids):
        if end == offset:
            return ids[index:]
        end += len(text.piece(token_id))
    return [] if end == offset else None


class IntersectionRule:
    """The intersection rule (module docstring) over ``shared``."""

    name = "intersection"

    def __init__(self, shared: SharedVocab) -> None:
        self.shared = shared

    def drafts(self, context: DraftContext) -> bool:
        return not context.pending

    def max_steps(self, num_draft_tokens: int) -> int:
        return num_draft_tokens

    def propose(self, drafter: Drafter, plan: DraftPlan, contexts: list[DraftContext | None],
                constraint: RoundConstraint | None) -> tuple[Proposal, list[list[int]]]:
        """k_b draft steps for row b, each token drawn from the row's processed distribution
        over the shared tokens (under ``constraint`` where given) and reported with it."""
        counts = [k if context is not None else 0
                  for k, context in zip(plan.num_draft_tokens, contexts)]
        drafting = DraftRound.start(replace(plan, num_draft_tokens=counts), None, len(counts))
        logits = drafter.first()  # [B, Vd]
        for step in range(max(counts)):
            if step:
                logits = drafter.step(self.shared.draft_ids(drafting.last_tokens.tolist()))
            if not self.draw(drafting, plan, logits, step, constraint):
                break  # no row proposes this position: it is neither drawn nor advanced
        proposal = drafting.proposal()
        return proposal, [row[: proposal.draft_tokens.shape[1]] for row in drafting.rows()]

    def draw(self, drafting: DraftRound, plan: DraftPlan, draft_logits: torch.Tensor,
             step: int, constraint: RoundConstraint | None) -> bool:
        """One step from the draft's logits [B, Vd]: each row's target token, drawn from its
        processed distribution over the shared tokens, joins ``drafting`` -> whether any row
        proposes this position."""
        failed = drafting.failed
        logits = self.shared.to_target(draft_logits)  # [B, Vt], -inf off the intersection
        if plan.processors is not None:  # then off the intersection again, whatever they did
            logits = self.shared.restrict(process_rows(logits, plan.processors,
                                                       drafting.rows(), failed))
        allowed = None if constraint is None else constraint.allowed()  # [B, Vt] or None
        logits = _stop_stuck(drafting, logits, allowed, step)
        token, probs = draw_step(logits, allowed, step, plan.samplings, drafting.sampled,
                                 drafting.uniforms, failed)
        return drafting.take_drawn(token, probs, step, plan, constraint)


def _stop_stuck(drafting: DraftRound, logits: torch.Tensor, allowed: torch.Tensor | None,
                step: int) -> torch.Tensor:
    """logits [B, Vt] where the rows that have no possible shared token (every allowed logit
    -inf, none NaN: a grammar, a ban or a bias excludes the intersection) take 0 at the
    allowed ids, so that their padding token (the argmax) is one the grammar takes; those
    still drafting stop at this step."""
    possible = logits > float("-inf")  # [B, Vt]; False at NaN
    if allowed is not None:
        possible &= allowed.to(logits.device)
    stuck_rows = (~possible.any(dim=-1) & ~logits.isnan().any(dim=-1)).tolist()
    stuck = [row for row, is_stuck in enumerate(stuck_rows)
             if is_stuck and row not in drafting.failed]
    if not stuck:
        return logits
    live = set(drafting.live(step))
    drafting.stop_at(step, [row for row in stuck if row in live])
    logits = logits.clone()
    for row in stuck:
        logits[row] = 0.0 if allowed is None else torch.where(
            allowed[row].to(logits.device), 0.0, float("-inf"))
    return logits
