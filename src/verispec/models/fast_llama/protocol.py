"""FastLlama: what the fast path's KV cache, packing, step graphs and session read from their
model. FastLlamaLM (model.py) is the one implementation; it builds those pieces, so they name
this Protocol instead of importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class FastLlama(Protocol):
    vocab_size: int
    max_positions: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    segment_call_rows: float
    dtype: torch.dtype
    embed_weight: torch.Tensor  # [V_model, E]
    rotary: Any  # model.RotaryTable
    layers: Sequence[Any]  # model._LayerWeights, one per decoder layer
    step_graphs: Any  # step_graphs.StepGraphs, or None when steps run eagerly

    @property
    def device(self) -> torch.device: ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None, start: int,
                cache: Any, used: int, logits_at: int | torch.Tensor | None = None,
                segments: Sequence[tuple[int, int, int]] | None = None,
                packed: Any = None) -> torch.Tensor: ...

    def rotated_qkv(self, w: Any, hidden: torch.Tensor, cos: torch.Tensor,
                    signed_sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def finish_layer(self, w: Any, hidden: torch.Tensor, attended: torch.Tensor
                     ) -> torch.Tensor: ...
