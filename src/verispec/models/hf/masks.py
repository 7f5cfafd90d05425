"""Attention masks for ragged rows, one per layer kind, from transformers' own mask rules.

Legend: B batch, n new tokens, T keys attended (cache slots in use).

The transformers adapter keeps row b's token at position p in cache slot p, and the rows of a
batch hold different lengths (ragged acceptance). transformers' mask builders
(``create_causal_mask`` and friends) place every row's queries at one shared offset, so they
cannot express such rows. This module evaluates transformers' own mask *rules*
(``causal_mask_function``, ``sliding_window_causal_mask_function``,
``chunked_causal_mask_function``) at each row's own positions, and hands the model what
``transformers.masking_utils.create_masks_for_generate`` would: one 4D mask, or a dict keyed by
layer type for models that mix kinds (Gemma 2 and 3, Cohere 2, GPT-OSS, OLMo 3, ...).

Which rule a layer gets follows ``create_masks_for_generate`` (transformers' own dispatch):
``config.layer_types`` when the config has it; otherwise every layer sliding when
``config.sliding_window`` is set, chunked when ``config.attention_chunk_size`` is set, and plain
causal else. Any other layer type (linear attention, Mamba or convolution blocks) keeps a state
that cannot drop rejected tokens and is refused at load (:func:`mask_plan`).

Not here: the cache (adapter.py keeps every key, so a sliding-window layer rewinds
exactly: the window is a mask over a full history, never a ring buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.masking_utils import (
    causal_mask_function,
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)

from ...errors import UnsupportedModelError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
MASKED_LAYER_TYPES = (FULL, SLIDING, CHUNKED)

# config attributes that list each layer's block kind, and the kinds that are attention
_BLOCK_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
_ATTENTION_BLOCKS = {FULL, SLIDING, CHUNKED, "attention", "global", "local", "*", "-"}


@dataclass(frozen=True)
class MaskPlan:
    """How to mask one model's layers: the kinds in use and their sizes.

    ``per_layer_type``: the model takes a dict {layer type: mask} (its config lists
    ``layer_types``); otherwise one mask serves every layer, of kind ``layer_types[0]``.
    """

    layer_types: tuple[str, ...]
    per_layer_type: bool
    sliding_window: int | None = None
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        assert self.layer_types and set(self.layer_types) <= set(MASKED_LAYER_TYPES)
        assert self.per_layer_type or len(self.layer_types) == 1
        assert SLIDING not in self.layer_types or (self.sliding_window or 0) > 0
        assert CHUNKED not in self.layer_types or (self.chunk_size or 0) > 0


def recurrent_blocks(config: object) -> list[str]:
    """The non-attention block kinds a config lists (Mamba, linear attention, ...), if any."""
    kinds: list[str] = []
    for name in _BLOCK_LISTS:
        blocks = getattr(config, name, None)
        if isinstance(blocks, str):
            blocks = list(blocks)  # hybrid_override_pattern: one character per layer
        for kind in blocks or ():
            if isinstance(kind, str) and kind not in _ATTENTION_BLOCKS and kind not in kinds:
                kinds.append(kind)
    return kinds


def mask_plan(config: object, role: str = "model") -> MaskPlan:
    """The masks ``config``'s layers need; UnsupportedModelError for layers that are not masked
    attention. ``config`` is the model's text config."""
    architecture = getattr(config, "model_type", "unknown")
    recurrent = recurrent_blocks(config)
    if recurrent:
        raise UnsupportedModelError(
            f"the {role} ({architecture}) has {', '.join(map(repr, recurrent))} layers: a "
            "recurrent or state-space state cannot drop rejected draft tokens exactly, so "
            "verispec cannot verify it; use a transformer (attention-only) model.")
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = tuple(dict.fromkeys(layer_types))
        return MaskPlan(kinds, per_layer_type=True, sliding_window=window, chunk_size=chunk)
    if window is not None:
        return MaskPlan((SLIDING,), per_layer_type=False, sliding_window=window)
    if chunk is not None:
        return MaskPlan((CHUNKED,), per_layer_type=False, chunk_size=chunk)
    return MaskPlan((FULL,), per_layer_type=False)


def _rule(plan: MaskPlan, kind: str, batch_size: int, device: torch.device) -> Callable:
    if kind == SLIDING:
        return sliding_window_causal_mask_function(plan.sliding_window)
    if kind == CHUNKED:  # positions start at 0 in every row: no left padding
        return chunked_causal_mask_function(plan.chunk_size,
                                            torch.zeros(batch_size, dtype=torch.int64,
                                                        device=device))
    return causal_mask_function


def build_masks(plan: MaskPlan, positions: torch.Tensor, num_keys: int, dtype: torch.dtype
                ) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive masks (0 visible, dtype's min hidden) for queries at ``positions``.

    Shapes: positions [B, n] (row b's i-th new token sits at slot positions[b, i]) ->
    mask [B, 1, n, T=num_keys], or a dict of them keyed by layer type.

    Worked example (window 3, rows of 5 and 2 tokens, one new token each: positions [[5], [2]]):
      row 0 sees slots 3 4 5 (the window), row 1 sees 0 1 2; slots past a row's length are stale
      keys of rejected drafts (or the other row's padding) and stay hidden.
    """
    batch_size = positions.shape[0]
    query = positions[:, None, :, None]  # [B, 1, n, 1]
    key = torch.arange(num_keys, device=positions.device)[None, None, None, :]  # [1, 1, 1, T]
    batch = torch.arange(batch_size, device=positions.device)[:, None, None, None]  # [B, 1, 1, 1]
    masks = {}
    for kind in plan.layer_types:
        visible = _rule(plan, kind, batch_size, positions.device)(batch, 0, query, key)
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
        masks[kind] = mask.masked_fill_(~visible, torch.finfo(dtype).min)  # [B, 1, n, T]
    return masks if plan.per_layer_type else masks[plan.layer_types[0]]
