"""A draft model of another tokenizer as a proposer: exact speculative decoding across
vocabularies.

Legend: B batch, K draft tokens, Vt the target's vocabulary.

What it is: :class:`CrossVocabProposer` drafts target token ids with a draft model whose
vocabulary differs from the target's, by one of CROSS_VOCAB_RULES (Timor et al., "Accelerating
LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies",
ICML 2025; rules.py says what each proposes and decides):

  string        the draft's greedy text, encoded by the target's tokenizer, proposed as a
                deterministic proposal (SLEM). Works for every pair whose tokenizers write
                text; exact at any temperature, seeded rows included.
  intersection  the draft's distribution restricted to the tokens both vocabularies share
                (identical bytes), drawn and reported over the target's ids with q = 0
                outside the intersection, then the ordinary ratio or block test (TLI). Needs
                a shared vocabulary (an empty one is an IncompatibleModelsError); pays where
                the pair shares most of the tokens its text uses (byte-level BPE families).

Both keep the draft's context in its own tokens (context.py) and its cache rewound to what
the target committed (session.py). Each proposal meets base.Proposal's contract over the
target's vocabulary: the string rule's is deterministic (draft_probs None), the
intersection rule's draft_probs [B, K, Vt] are exactly the distributions its tokens were
drawn from.

What it is not: a tokenizer adapter (models/token_text.py implements TokenText for real
tokenizers), or the choice of rule for a pair (the caller's, e.g. load()).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ...config import CROSS_VOCAB_RULES, check_int, is_int, require
from ...errors import IncompatibleModelsError
from ...models.base import CapturesSteps, LanguageModel, TokenText
from .rules import CrossRule, IntersectionRule, StringRule
from .session import CrossVocabSession
from .vocab import SharedVocab


class DraftPrompts:
    """Target prompts whose draft context starts with the draft's own prompt (a chat the text
    layer rendered with each model's template): target prompt ids -> draft ids. A row whose
    prompt is here feeds the draft those ids instead of its own tokens of the target prompt's
    text; any other row, the target prompt's text. The most recent ``capacity`` entries are
    kept (a server's conversations come and go). Only the draft's context changes: never the
    target's law."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._prompts: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def register(self, target_ids: Sequence[int], draft_ids: Sequence[int]) -> None:
        key = tuple(int(token_id) for token_id in target_ids)
        self._prompts[key] = [int(token_id) for token_id in draft_ids]
        self._prompts.move_to_end(key)
        while len(self._prompts) > self.capacity:
            self._prompts.popitem(last=False)

    def get(self, target_ids: Sequence[int]) -> list[int] | None:
        return self._prompts.get(tuple(int(token_id) for token_id in target_ids))


class CrossVocabProposer:
    """Proposes target ids drafted by ``model``, whose tokenizer is ``draft_text``, for a
    target whose tokenizer is ``target_text``, by ``rule`` (CROSS_VOCAB_RULES).

    ``draft_prefix``: draft ids each row's draft context starts with (the draft's BOS where
    it expects one; the target's own BOS, a control token with no text, does not reach it).
    ``target_vocab_size``: the width of the target's logits, where it exceeds its tokenizer's
    (padded embeddings; default target_text.vocab_size): the ids past the tokenizer are never
    proposed. ``max_positions`` is None: the draft's window counts its own tokens, so a row
    whose draft context outgrows it stops drafting (session.py), and only the target's window
    bounds a row. ``draft_prompts``: the target prompts that come with the draft's own
    rendering of them (DraftPrompts; default: none). ``shared_pairs``: the intersection's
    (draft id, target id) pairs where the caller computed them (models.base.shared_token_pairs
    over the whole vocabularies); None: the intersection rule computes them."""

    def __init__(self, model: LanguageModel, draft_text: TokenText, target_text: TokenText,
                 rule: str, draft_prefix: Sequence[int] = (),
                 target_vocab_size: int | None = None,
                 draft_prompts: DraftPrompts | None = None,
                 shared_pairs: Sequence[tuple[int, int]] | None = None) -> None:
        require(rule in CROSS_VOCAB_RULES, "rule", rule,
                " or ".join(map(repr, CROSS_VOCAB_RULES)) + " ('string' works for any pair)")
        if target_vocab_size is not None:
            check_int("target_vocab_size", target_vocab_size, 1, note=", or None")
        target_width = target_text.vocab_size if target_vocab_size is None else (
            target_vocab_size)
        _check_widths(model, draft_text, target_text, target_width, draft_prefix)
        self.model = model
        self.draft_text = draft_text
        self.target_text = target_text
        self.draft_prefix = list(draft_prefix)
        self.draft_prompts = DraftPrompts() if draft_prompts is None else draft_prompts
        self.vocab_size = target_width
        self.device = model.device  # where draft_probs live
        self.max_positions = None
        self.rule = _build_rule(rule, model, draft_text, target_text, target_width, shared_pairs)

    @property
    def rule_name(self) -> str:
        """The rule this proposer drafts by (one of CROSS_VOCAB_RULES)."""
        return self.rule.name

    @property
    def num_captured(self) -> int:
        """The draft model's steps captured as CUDA graphs so far (CapturesSteps)."""
        return self.model.num_captured if isinstance(self.model, CapturesSteps) else 0

    def target_bytes(self, target_ids: Sequence[int]) -> bytes:
        """The text of target ids (an id past the target's tokenizer has none)."""
        text = self.target_text
        return b"".join(text.piece(token_id) for token_id in target_ids
                        if token_id < text.vocab_size)

    def start(self, prompts: Sequence[Sequence[int]]) -> CrossVocabSession:
        return CrossVocabSession(self.model.new_session(), self.rule, self.draft_text,
                                 self.target_bytes, self.draft_prefix, self.model.max_positions,
                                 prompts, self.draft_prompts.get)


def _build_rule(rule: str, model: LanguageModel, draft_text: TokenText,
                target_text: TokenText, target_width: int,
                pairs: Sequence[tuple[int, int]] | None) -> CrossRule:
    if rule == "string":
        return StringRule(draft_text, target_text, model.vocab_size, target_width)
    return IntersectionRule(SharedVocab.build(draft_text, target_text, model.vocab_size,
                                              target_width, model.device, pairs))


def _check_widths(model: LanguageModel, draft_text: TokenText, target_text: TokenText,
                  target_width: int, draft_prefix: Sequence[int]) -> None:
    """Each tokenizer's ids fit its model's logits (IncompatibleModelsError); the prefix is
    draft ids (ConfigError)."""
    if draft_text.vocab_size > model.vocab_size:
        raise IncompatibleModelsError(
            f"draft_text has {draft_text.vocab_size} ids but the draft model's logits only "
            f"{model.vocab_size}: its tokenizer is not the draft model's. Load the draft "
            "model's own tokenizer.", field="draft")
    if target_text.vocab_size > target_width:
        raise IncompatibleModelsError(
            f"target_vocab_size={target_width} is invalid: the target's tokenizer has "
            f"{target_text.vocab_size} ids; pass the width of the target model's logits.",
            field="target_vocab_size")
    require(all(is_int(token_id) and 0 <= token_id < model.vocab_size
                for token_id in draft_prefix), "draft_prefix", list(draft_prefix),
            f"draft ids in [0, {model.vocab_size}), e.g. [the draft tokenizer's BOS id], or ()")


__all__ = ["CROSS_VOCAB_RULES", "CrossVocabProposer", "DraftPrompts"]
