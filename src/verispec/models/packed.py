"""A packed feed for the flat Llama forward (fast_llama.py): ragged rows' new tokens in one pass,
laid end to end, with no padding and no logits.

Legend: S segments (rows fed), N tokens fed in all (the sum of their widths), E hidden size,
H query heads, Hkv kv heads, D head dim.

Why: a feed (a join's prompts prefilled into free cache slots, a draft catching up on plain
rounds' tokens) carries rows of very different widths. Laid out as [B, u] they are right-padded,
and padding costs what real tokens cost in every projection; split into groups of near widths,
each group pays a pass's fixed cost (reading every weight once more). Packed, the projections
run once over the N real tokens ([1, N, E], one matmul each), and only attention, which is per
row anyway, runs row by row: each segment's queries against its own row's cached keys.

What it is not: a pass that returns logits (nothing fed here needs them: a joining row's last
prompt token and a draft's last unfed token are fed by the next round), or another model: the
layer's halves around attention are FastLlamaLM's own (rotated_qkv, finish_layer), so a packed
feed writes the keys and values a padded one would, up to the summation order of the matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .attention import attention_kernels

if TYPE_CHECKING:
    from .fast_llama import FastLlamaLM, KVCache


def feed_packed(lm: FastLlamaLM, cache: KVCache, starts: Sequence[int],
                rows: Sequence[Sequence[int]]) -> None:
    """Append rows[b] to cache row b at positions starts[b] .., all rows in one pass; rows with
    nothing to feed are skipped. The cache must already hold room for every row's end.

    Worked example: starts [5, 0, 9], rows [[a, b], [], [c]] -> tokens [a b c] (N = 3),
    positions [5 6 9], cache rows [0 0 2]; attention runs twice: row 0's two queries against
    its keys 0 .. 6 (a causal band from position 5), row 2's one query against keys 0 .. 9.
    """
    from .fast_llama import _attention_mask  # the padded forward's causal band, reused

    segments = [(row, start, len(ids)) for row, (start, ids) in enumerate(zip(starts, rows))
                if ids]
    if not segments:
        return
    device = lm.device
    tokens = torch.tensor([t for ids in rows for t in ids], dtype=torch.int64,
                          device=device)[None]  # [1, N]
    num_tokens = tokens.shape[1]
    positions = torch.cat([torch.arange(start, start + width) for _, start, width in segments]
                          ).to(device)  # [N]
    cache_rows = torch.tensor([row for row, _, width in segments for _ in range(width)],
                              device=device)  # [N]
    used = max(start + width for _, start, width in segments)
    hidden = F.embedding(tokens, lm.embed_weight)  # [1, N, E]
    cos, signed_sin = lm.rotary.lookup(positions[None], 0, num_tokens, used)  # [1, N, 1, D]
    masks = [_attention_mask(None, start, width, start + width, lm.dtype, device)
             for _, start, width in segments]  # [1, 1, w, start + w] or None (one token)
    with torch.inference_mode(), attention_kernels(device):
        for w, keys, values in zip(lm.layers, cache.keys, cache.values):
            query, key, value = lm.rotated_qkv(w, hidden, cos, signed_sin)  # [1, N, H|Hkv, D]
            keys[cache_rows, :, positions] = key[0]  # [N, Hkv, D]
            values[cache_rows, :, positions] = value[0]
            out = _attend_by_row(lm, query[0].transpose(0, 1), keys, values, segments, masks)
            hidden = lm.finish_layer(w, hidden, out)  # out [1, N, H D]


def _attend_by_row(lm: FastLlamaLM, query: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, segments: list[tuple[int, int, int]],
                   masks: list[torch.Tensor | None]) -> torch.Tensor:
    """Each segment's queries against its own cache row. query [H, N, D]; keys, values
    [B, Hkv, T, D] -> [1, N, H D]."""
    outputs, offset = [], 0
    for (row, start, width), mask in zip(segments, masks):
        out = F.scaled_dot_product_attention(
            query[None, :, offset : offset + width], keys[row : row + 1, :, : start + width],
            values[row : row + 1, :, : start + width], attn_mask=mask, scale=lm.scaling,
            enable_gqa=lm.num_heads != lm.num_kv_heads)  # [1, H, w, D]
        outputs.append(out[0].transpose(0, 1).reshape(width, -1))
        offset += width
    return torch.cat(outputs)[None]
