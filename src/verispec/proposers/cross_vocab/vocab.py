"""The tokens two vocabularies share, and the text-level matching of special tokens.

Legend: B batch, S shared tokens, Vd the draft model's logits, Vt the target's vocabulary.

Two tokens are shared when their pieces (TokenText.piece: the bytes each appends to the text)
are identical and non-empty: a non-special token with a non-special one, a special token
(BOS, EOS, chat markers) with a special one of the same text, never a special with a plain
token. Where one vocabulary has several tokens of the same bytes (a byte-fallback token and a
plain one), the lowest id stands for them: models.base.shared_token_pairs, which
models/token_text.py's ``shared_vocabulary`` reports too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import IncompatibleModelsError
from ...models.base import TokenText, shared_token_pairs


def shared_pairs(draft_text: TokenText, target_text: TokenText, draft_width: int,
                 target_width: int, pairs: Sequence[tuple[int, int]] | None = None
                 ) -> list[tuple[int, int]]:
    """(draft id, target id) of every token both vocabularies have (models.base.
    shared_token_pairs: ``pairs`` where the caller has them already), the draft's ids below
    ``draft_width`` (its model's logits) and the target's below ``target_width``; sorted by
    target id."""
    if pairs is None:
        pairs = shared_token_pairs(draft_text, target_text, draft_width, target_width)
    return sorted(((d, t) for d, t in pairs if d < draft_width and t < target_width),
                  key=lambda pair: pair[1])


class SharedVocab:
    """The shared tokens of a draft and a target as index maps on the draft's device.

    ``to_target`` lays a draft step's logits [B, Vd] onto the target's ids [B, Vt], -inf at
    every target id outside the intersection, so a distribution computed from them gives
    those ids probability 0; ``draft_ids`` maps target ids back to the draft's (a shared
    token's draft id, ``pad`` for any other: a padding position, never proposed)."""

    def __init__(self, pairs: list[tuple[int, int]], target_width: int,
                 device: torch.device) -> None:
        self.num_shared = len(pairs)
        self.target_width = target_width
        draft_ids, target_ids = zip(*pairs) if pairs else ((), ())
        self._draft_index = torch.tensor(draft_ids, dtype=torch.int64, device=device)  # [S]
        self._target_index = torch.tensor(target_ids, dtype=torch.int64, device=device)  # [S]
        self._outside = torch.ones(target_width, dtype=torch.bool, device=device)  # [Vt]
        self._outside[self._target_index] = False
        self._to_draft = [-1] * target_width  # target id -> draft id, -1 off the intersection
        for draft_id, target_id in pairs:
            self._to_draft[target_id] = draft_id

    @classmethod
    def build(cls, draft_text: TokenText, target_text: TokenText, draft_width: int,
              target_width: int, device: torch.device,
              pairs: Sequence[tuple[int, int]] | None = None) -> SharedVocab:
        """The intersection of the two vocabularies; IncompatibleModelsError when empty."""
        pairs = shared_pairs(draft_text, target_text, draft_width, target_width, pairs)
        if not pairs:
            raise IncompatibleModelsError(
                f"rule='intersection' is invalid for this pair: the draft's {draft_text.vocab_size}"
                f" tokens and the target's {target_text.vocab_size} share none (no token of "
                "identical bytes); use rule='string', which works for any pair.", field="rule")
        return cls(pairs, target_width, device)

    def is_shared(self, target_id: int) -> bool:
        return 0 <= target_id < self.target_width and self._to_draft[target_id] >= 0

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """draft_logits [B, Vd] -> [B, Vt] fp32: a shared token's draft logit at its target id,
        -inf at every other."""
        out = torch.full((draft_logits.shape[0], self.target_width), float("-inf"),
                         dtype=torch.float32, device=draft_logits.device)  # [B, Vt]
        out[:, self._target_index] = draft_logits[:, self._draft_index].float()
        return out

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, Vt] with -inf at every target id outside the intersection (in place)."""
        return logits.masked_fill_(self._outside.to(logits.device), float("-inf"))

    def draft_ids(self, target_ids: list[int], pad: int = 0) -> list[int]:
        """Each target id's draft id (host ints), ``pad`` off the intersection."""
        return [self._to_draft[t] if self.is_shared(t) else pad for t in target_ids]


def special_ids_by_text(text: TokenText, limit: int) -> dict[bytes, int]:
    """A vocabulary's special tokens by their text: piece -> lowest id below ``limit``."""
    special: dict[bytes, int] = {}
    for token_id in range(min(text.vocab_size, limit)):
        if text.is_special(token_id) and (piece := text.piece(token_id)):
            special.setdefault(piece, token_id)
    return special
