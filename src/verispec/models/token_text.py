"""Tokenizers seen as bytes, and the vocabulary two of them share: what a draft of another
tokenizer needs (proposers/cross_vocab.py).

Legend: N shared tokens, V_d / V_t the draft's and the target's vocabulary sizes.

What this is: ``token_text`` picks the :class:`~verispec.models.base.TokenText` of a tokenizer
(transformers: models/hf/token_text.py; llama.cpp: models/llama_cpp/token_text.py);
``shared_vocabulary`` pairs the tokens of two of them that append the same bytes (the
intersection of Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies", ICML 2025, on which its TLI rule restricts the
draft); ``check_cross_pair`` refuses a pair that cannot work, with the reason.

What this is not: the proposer, nor a choice of verification rule (the caller decides from the
map's counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from ..errors import IncompatibleModelsError
from .base import TokenText, shared_token_pairs
from .hf.token_text import HfTokenText
from .llama_cpp.token_text import LlamaCppTokenText
from .llama_cpp.tokenizer import LlamaCppTokenizer

# text every useful draft and target must spell exactly: code, runs of spaces, tabs, newlines
PROBE_TEXTS = ("def add(a, b):\n\treturn a + b  # sum\n", " leading space", "x\n\n  y = [1, 2]")


def token_text(tokenizer: PreTrainedTokenizerBase | LlamaCppTokenizer,
               role: str = "draft") -> TokenText:
    """The TokenText of a loaded tokenizer: a fast transformers tokenizer (byte-level BPE or
    SentencePiece) or llama.cpp's. ``role`` ("draft", "target") names it in errors; another
    kind of tokenizer raises IncompatibleModelsError."""
    if isinstance(tokenizer, LlamaCppTokenizer):
        return LlamaCppTokenText(tokenizer, role)
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return HfTokenText(tokenizer, role)
    raise IncompatibleModelsError(
        f"the {role}'s tokenizer is a {type(tokenizer).__name__}; expected a transformers "
        "tokenizer or llama.cpp's (verispec.load loads the right one).", field=role)


@dataclass(frozen=True, eq=False)
class VocabMap:
    """The tokens a draft and a target share, one to one: draft_ids[i] and target_ids[i]
    append the same non-empty bytes (special tokens: have the same text). Sorted by draft id.

    Shapes: draft_ids, target_ids [N] int64. ``num_special``: how many of the N pairs are
    special tokens (BOS, EOS, chat markers), matched by text, never drawn from the intersection
    by a draft."""

    draft_ids: torch.Tensor  # [N] int64
    target_ids: torch.Tensor  # [N] int64
    num_special: int
    draft_vocab_size: int
    target_vocab_size: int

    def __post_init__(self) -> None:
        assert self.draft_ids.dtype == self.target_ids.dtype == torch.int64
        assert self.draft_ids.shape == self.target_ids.shape and self.draft_ids.dim() == 1
        assert 0 <= self.num_special <= self.num_shared

    @property
    def num_shared(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def draft_coverage(self) -> float:
        """The share of the draft's vocabulary that maps onto the target's."""
        return self.num_shared / self.draft_vocab_size

    @property
    def target_coverage(self) -> float:
        """The share of the target's vocabulary that the draft can reach."""
        return self.num_shared / self.target_vocab_size

    def target_of_draft(self) -> torch.Tensor:
        """[V_d] int64: the target id of each draft id, -1 where the draft's has none."""
        table = torch.full((self.draft_vocab_size,), -1, dtype=torch.int64)
        table[self.draft_ids] = self.target_ids
        return table

    def draft_of_target(self) -> torch.Tensor:
        """[V_t] int64: the draft id of each target id, -1 where the target's has none."""
        table = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        table[self.target_ids] = self.draft_ids
        return table


def shared_vocabulary(draft: TokenText, target: TokenText) -> VocabMap:
    """The intersection of two vocabularies (models.base.shared_token_pairs: non-special tokens
    with equal non-empty bytes, special tokens with equal text, the lowest id of equal pieces)."""
    pairs = shared_token_pairs(draft, target)
    num_special = sum(draft.is_special(draft_id) for draft_id, _ in pairs)
    ids = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)  # [N, 2]
    return VocabMap(ids[:, 0].contiguous(), ids[:, 1].contiguous(), num_special,
                    draft.vocab_size, target.vocab_size)


def check_decodes_text(text: TokenText, role: str,
                       probes: Sequence[str] = PROBE_TEXTS) -> None:
    """Raise IncompatibleModelsError unless ``text`` spells each probe back exactly: the
    pieces of ``encode(s)`` joined are ``s``'s UTF-8 (a tokenizer that cannot, cannot serve a
    pair of tokenizers)."""
    for probe in probes:
        spelled = b"".join(text.piece(t) for t in text.encode(probe))
        if spelled != probe.encode():
            raise IncompatibleModelsError(
                f"the {role}'s tokenizer cannot turn its tokens back into text: it encodes "
                f"{probe!r} as tokens that spell {spelled!r}; expected the same bytes. A draft "
                "of another tokenizer needs one that decodes to bytes (byte-level BPE, or "
                "SentencePiece with byte fallback).", field=role)


def check_cross_pair(draft: TokenText, target: TokenText) -> VocabMap:
    """The shared vocabulary of a draft and a target of different tokenizers, after checking
    that the pair can work: they share at least one text token, and both spell text back
    exactly (check_decodes_text). Raises IncompatibleModelsError naming why not."""
    shared = shared_vocabulary(draft, target)
    if shared.num_shared == shared.num_special:
        raise IncompatibleModelsError(
            f"the draft's and the target's vocabularies share no text token (of "
            f"{draft.vocab_size} and {target.vocab_size}); expected at least the single bytes "
            "or characters in common: pick a draft whose tokenizer spells text the same way.",
            field="draft")
    check_decodes_text(draft, "draft")
    check_decodes_text(target, "target")
    return shared
