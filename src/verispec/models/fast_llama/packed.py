"""A packed feed for the flat Llama forward (model.py): ragged rows' new tokens in one pass,
laid end to end, with no padding and no logits.

Legend: S segments (rows fed), N tokens fed in all (the sum of their widths), E hidden size,
H query heads, Hkv kv heads, D head dim.

Why: a feed (a join's prompts prefilled into free cache slots, a draft catching up on plain
rounds' tokens) carries rows of very different widths. Laid out as [B, u] they are right-padded,
and padding costs what real tokens cost in every projection; split into groups of near widths,
each group pays a pass's fixed cost (reading every weight once more). Packed, the projections
run once over the N real tokens ([1, N, E], one matmul each), and only attention, which is per
row anyway, runs row by row: each segment's queries against its own row's cached keys.

Packed tokens also ride a decoding pass (FastLlamaLM.forward's ``packed``): the prompts of a
target's rows that joined since the last round go through that round's pass, so a join pays
no pass of its own (in which every weight would be read once more).

What it is not: a pass that returns logits for packed tokens (nothing fed here needs them: a
joining row's last prompt token and a draft's last unfed token are fed by the next round), or
another model: the layer's halves around attention are FastLlamaLM's own (rotated_qkv,
finish_layer), so a packed feed writes the keys and values a padded one would, up to the
summation order of the matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..attention import _attention_mask, attention_kernels
from .kv_cache import KVCache
from .protocol import FastLlama


class PackedRows(NamedTuple):
    """Ragged rows' new tokens laid end to end (:func:`pack_rows`), ready for a pass.

    Shapes: tokens [1, N]; positions, cache_rows [N] (each token's position and cache row);
    segments: (cache row, start, width) per row fed; masks: each segment's causal band
    [1, 1, w, start + w], or None for one token; used: the keys the widest reach needs.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cache_rows: torch.Tensor
    segments: list[tuple[int, int, int]]
    masks: list[torch.Tensor | None]
    used: int


def pack_rows(lm: FastLlama, starts: Sequence[int], rows: Sequence[Sequence[int]]
              ) -> PackedRows | None:
    """rows[b] to go to cache row b at positions starts[b] .., laid end to end; rows with
    nothing to feed are left out (None when no row has anything).

    Worked example: starts [5, 0, 9], rows [[a, b], [], [c]] -> tokens [a b c] (N = 3),
    positions [5 6 9], cache rows [0 0 2]; attention then runs twice: row 0's two queries
    against its keys 0 .. 6 (a causal band from position 5), row 2's one query against keys
    0 .. 9.
    """

    segments = [(row, start, len(ids)) for row, (start, ids) in enumerate(zip(starts, rows))
                if ids]
    if not segments:
        return None
    device = lm.device
    tokens = torch.tensor([t for ids in rows for t in ids], dtype=torch.int64,
                          device=device)[None]  # [1, N]
    positions = torch.cat([torch.arange(start, start + width) for _, start, width in segments]
                          ).to(device)  # [N]
    cache_rows = torch.tensor([row for row, _, width in segments for _ in range(width)],
                              device=device)  # [N]
    masks = [_attention_mask(None, start, width, start + width, lm.dtype, device)
             for _, start, width in segments]  # [1, 1, w, start + w] or None (one token)
    used = max(start + width for _, start, width in segments)
    return PackedRows(tokens, positions, cache_rows, segments, masks, used)


def embed_packed(lm: FastLlama, packed: PackedRows
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed tokens' hidden states [1, N, E] and their cos, signed sin [1, N, 1, D]."""
    hidden = F.embedding(packed.tokens, lm.embed_weight)
    cos, signed_sin = lm.rotary.lookup(packed.positions[None], 0, packed.tokens.shape[1],
                                       packed.used)
    return hidden, cos, signed_sin


def write_packed(packed: PackedRows, key: torch.Tensor, value: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
    """The packed tokens' keys and values written to their rows' caches. key, value
    [N, Hkv, D]; keys, values [B, Hkv, T, D] (one layer's cache)."""
    keys[packed.cache_rows, :, packed.positions] = key
    values[packed.cache_rows, :, packed.positions] = value


def write_and_attend(lm: FastLlama, packed: PackedRows, query: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """One layer's attention for the packed tokens: their keys and values written to their
    rows' caches, then each segment's queries against its own row. query [N, H, D]; key,
    value [N, Hkv, D]; keys, values [B, Hkv, T, D] (one layer's cache) -> [1, N, H D]."""
    write_packed(packed, key, value, keys, values)
    return _attend_by_row(lm, query.transpose(0, 1), keys, values, packed.segments,
                          packed.masks)


def feed_packed(lm: FastLlama, cache: KVCache, starts: Sequence[int],
                rows: Sequence[Sequence[int]]) -> None:
    """Append rows[b] to cache row b at positions starts[b] .., all rows in one pass, no logits
    (:func:`pack_rows`' worked example); rows with nothing to feed are skipped. The cache must
    already hold room for every row's end.

    The last layer only writes keys and values: with no logits, nothing reads its output
    (attention, output projection and MLP: ~19% of a feed's projections on the demo target,
    and half of the demo draft's layers)."""
    packed = pack_rows(lm, starts, rows)
    if packed is None:
        return
    hidden, cos, signed_sin = embed_packed(lm, packed)  # [1, N, E], [1, N, 1, D]
    last = len(lm.layers) - 1
    with torch.inference_mode(), attention_kernels(lm.device):
        for layer, (w, keys, values) in enumerate(zip(lm.layers, cache.keys, cache.values)):
            query, key, value = lm.rotated_qkv(w, hidden, cos, signed_sin)  # [1, N, H|Hkv, D]
            if layer == last:
                write_packed(packed, key[0], value[0], keys, values)
                break
            out = write_and_attend(lm, packed, query[0], key[0], value[0], keys, values)
            hidden = lm.finish_layer(w, hidden, out)  # out [1, N, H D]


def _attend_by_row(lm: FastLlama, query: torch.Tensor, keys: torch.Tensor,
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
