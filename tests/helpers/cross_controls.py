"""Negative controls of the cross-vocabulary rules: out-of-intersection tokens accepted
unconditionally, the mistake the law tests must catch.

A target token with no token of the same bytes in the draft's vocabulary is outside the
intersection: the intersection rule gives it q = 0, so the draft never proposes it and the
target emits it through the residual. A common mistake maps draft tokens onto such targets
anyway (by their first byte, or by re-tokenising) and, having no draft probability for them,
accepts them as if q were 0 in p / q: always. These rules do that, with q = 1e-30 (a q of
exactly 0 for a proposed token is a DraftContractError), so min(1, p / q) = 1 wherever the
target allows the token.

Legend: B batch, Vt the target's vocabulary.
"""

from __future__ import annotations

import torch

from verispec.proposers.cross_vocab import CrossVocabProposer
from verispec.proposers.cross_vocab.rules import IntersectionRule, StringRule
from verispec.proposers.cross_vocab.vocab import SharedVocab

ALMOST_ZERO = 1e-30


class LeakyShared:
    """A SharedVocab that also lays each ``leak`` target id onto a draft id's logit."""

    def __init__(self, shared: SharedVocab, leak: dict[int, int]) -> None:
        self.shared = shared
        self.leak = leak

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        out = self.shared.to_target(draft_logits)  # [B, Vt]
        for target_id, draft_id in self.leak.items():
            out[:, target_id] = draft_logits[:, draft_id].float()
        return out

    def draft_ids(self, target_ids: list[int], pad: int = 0) -> list[int]:
        return [self.leak.get(t, d) for t, d in zip(target_ids,
                                                    self.shared.draft_ids(target_ids, pad))]


class LeakyIntersection(IntersectionRule):
    """Draws the leaked target ids too, and reports them with q = ALMOST_ZERO."""

    def __init__(self, shared: SharedVocab, leak: dict[int, int]) -> None:
        super().__init__(LeakyShared(shared, leak))
        self.leak = leak

    def draw(self, drafting, plan, draft_logits, step, constraint) -> bool:
        if not super().draw(drafting, plan, draft_logits, step, constraint):
            return False
        probs = drafting.step_probs[-1]  # [B, Vt] or None (greedy rows)
        if probs is not None:
            for row, token in enumerate(drafting.last_tokens.tolist()):
                if token in self.leak:
                    probs[row, token] = ALMOST_ZERO
        return True


class LeakyString(StringRule):
    """Reports each proposed target id outside the intersection with q = ALMOST_ZERO (the
    others as point masses)."""

    def __init__(self, rule: StringRule, shared: SharedVocab) -> None:
        super().__init__(rule.draft_text, rule.target_text, rule._draft_size,
                         shared.target_width)
        self.shared = shared

    def propose(self, drafter, plan, contexts, constraint):
        proposal, rows = super().propose(drafter, plan, contexts, constraint)
        tokens = proposal.draft_tokens  # [B, K]
        probs = torch.nn.functional.one_hot(tokens, self.shared.target_width).float()
        for (row, position), token in zip(torch.cartesian_prod(
                torch.arange(tokens.shape[0]), torch.arange(tokens.shape[1])).tolist(),
                tokens.reshape(-1).tolist()):
            if not self.shared.is_shared(token):
                probs[row, position, token] = ALMOST_ZERO
        return type(proposal)(tokens, probs, proposal.num_proposed, proposal.faults), rows


def leaky_proposer(model, draft_text, target_text, rule: str) -> CrossVocabProposer:
    """A CrossVocabProposer whose ``rule`` accepts out-of-intersection tokens unconditionally:
    the intersection rule leaks each target id outside it onto the draft token of its first
    byte; the string rule reports such ids with q ~ 0."""
    proposer = CrossVocabProposer(model, draft_text, target_text, rule)
    shared = SharedVocab.build(draft_text, target_text, model.vocab_size,
                               target_text.vocab_size, model.device)
    if rule == "intersection":
        leak = {t: draft_text.encode(target_text.piece(t)[:1].decode())[0]
                for t in range(target_text.vocab_size) if not shared.is_shared(t)}
        proposer.rule = LeakyIntersection(shared, leak)
    else:
        proposer.rule = LeakyString(proposer.rule, shared)
    return proposer
