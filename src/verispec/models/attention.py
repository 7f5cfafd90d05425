"""Attention in verispec's forward passes: which kernel computes it on each device.

Why: decoding feeds a new attention shape at almost every step (one more cached key; the query
length is 1 for a plain step and k + 1 for a verification pass), and on CUDA in half precision
torch's default choice, cuDNN attention, builds an execution plan the first time it sees a shape.
That first call at each new key length costs far more than the other kernels' first call, and
than many steady-state steps, so with it a fresh process would pay several steps' time per
generated token until every length had been seen once (dev/LOG.md: attention kernels).

Memory-efficient attention has no per-shape planning, and it is the one kernel used for every
pass: flash attention would take the unmasked 1-token steps of plain decoding but not the masked
(k + 1)-token verification passes, and two kernels round bf16 differently, which breaks greedy
equality between plain and speculative decoding on the GPU (tests/models/test_gpu.py). The math
kernel stays as the fallback for what the efficient kernel does not take (on some torch versions,
grouped-query heads: still exact, slower on long contexts).

On a CPU in float32, :func:`attend` computes batched passes of several queries a row (verification
passes of 8 rows or more) as two batched matmuls around a softmax, and leaves single-query steps,
small batches and prefills (fast_llama/packed.py) to scaled_dot_product_attention. torch's CPU flash
kernel splits a few-query pass into blocks that each pay a fixed cost, so on many rows a pass of two
or more queries is cheaper as matmuls, while a 1-query step is as fast or faster in the flash
kernel, and so are 1-row passes and packed prefills (dev/LOG.md: attention kernels). Neither path is
bit for bit invariant to the padded key length or to the number of queries (they differ from each
other by ~2e-7, as the flash kernel differs from itself between 1 and 2 queries); greedy equality
with plain decoding and with each request alone is what the tests check.

Rows of different lengths (a batch whose rows joined at different times, or one long prompt
among short ones) attend in contiguous ranges of rows, each over its own longest row's keys
(:func:`segments_by_length`, :func:`attend_segments`), not all over the batch's longest: one
long row among short ones would make every row of a pass read the long row's keys, and the pass
cost a multiple of the short rows' alone. Rows whose lengths differ less stay one range
(SEGMENT_CALL_BYTES).

Not here: the layers around attention (fast_llama/model.py, fast_llama/packed.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# the matmul path's fewest rows: below it, its four ops' fixed costs outweigh what it saves
# (dev/LOG.md, 2026-11-27, MATMUL_MIN_ROWS)
MATMUL_MIN_ROWS = 8

# what one more range of rows costs, as the bytes of cached keys and values a split must save
# to pay for it: a lower bar splits rows of ordinary prompts into ranges that cost more than
# they save (slicing the mask, joining the outputs, smaller calls), while at this one a single
# long row among them is still split off (dev/LOG.md, 2026-11-27, SEGMENT_CALL_BYTES)
SEGMENT_CALL_BYTES = 4 << 20

# one kernel for 1-token steps and masked verification passes alike; math as the fallback
_CUDA_KERNELS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward pass on ``device`` runs its attention in (see the module docstring).

    On CUDA it narrows torch's backend flags for the duration of the pass, then restores them
    (they are process-wide, so a forward running in another thread at the same moment sees them
    too; it still computes the same attention, possibly with another kernel)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_CUDA_KERNELS)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled dot-product attention of queries against cached keys and values.

    Shapes: query [B, H, n, D]; keys, values [B, Hkv, T, D] (H a multiple of Hkv); mask
    additive, broadcastable to [B, 1, n, T], or None -> [B, H, n, D].

    Several queries a row over at least MATMUL_MIN_ROWS rows on a CPU in float32 take the matmul
    path (module docstring), where a query group's heads share their key head by a reshape, not
    a copy. Everything else is scaled_dot_product_attention.
    """
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    if (num_queries == 1 or batch < MATMUL_MIN_ROWS or query.device.type != "cpu"
            or query.dtype != torch.float32 or (mask is not None and mask.shape[1] != 1)):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    group = num_heads // num_kv_heads
    # [B, Hkv, group * n, D]: heads h = kv * group + g, as enable_gqa pairs them
    grouped = query.reshape(batch, num_kv_heads, group * num_queries, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)  # [B, Hkv, group n, T]
    if mask is not None:
        scores = scores.view(batch, num_kv_heads, group, num_queries, -1).add_(
            mask[:, :, None]).view(batch, num_kv_heads, group * num_queries, -1)
    out = torch.matmul(scores.softmax(-1), values)  # [B, Hkv, group n, D]
    return out.view(batch, num_heads, num_queries, head_dim)


def segments_by_length(key_lengths: Sequence[int], call_rows: float
                       ) -> list[tuple[int, int, int]]:
    """Contiguous ranges of rows [(first, stop, keys)] to attend apart, each over its longest
    row's keys: the split that reads the fewest cached key-rows (padding included), counting
    ``call_rows`` key-rows for each range's call. One range when splitting saves nothing.

    Example: key_lengths [60, 70, 900, 65], call_rows 64 -> [(0, 2, 70), (2, 3, 900),
    (3, 4, 65)]: one range reads 4 x 900 = 3,600 key-rows, these three 140 + 900 + 65 plus
    2 x 64 for their two more calls.
    """
    num_rows = len(key_lengths)
    longest = max(key_lengths)
    if num_rows * longest - sum(key_lengths) <= call_rows:  # nothing a split could save
        return [(0, num_rows, longest)]
    best = [0.0] + [math.inf] * num_rows  # best[i]: the cheapest split of rows [0, i)
    cut = [0] * (num_rows + 1)
    for stop in range(1, num_rows + 1):
        widest = 0
        for first in range(stop - 1, -1, -1):
            widest = max(widest, key_lengths[first])
            cost = best[first] + (stop - first) * widest + call_rows
            if cost < best[stop]:
                best[stop], cut[stop] = cost, first
    segments, stop = [], num_rows
    while stop:
        first = cut[stop]
        segments.append((first, stop, max(key_lengths[first:stop])))
        stop = first
    return segments[::-1]


def attend_segments(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None, scale: float,
                    segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """:func:`attend` over each range of rows (:func:`segments_by_length`) against its own
    first ``keys`` cached keys. Shapes as :func:`attend`, with keys and values [B, Hkv, T', D]
    for any T' >= every range's keys, and mask [B, 1, n, >= keys] or None -> [B, H, n, D]."""
    return torch.cat([
        attend(query[first:stop], keys[first:stop, :, :num_keys],
               values[first:stop, :, :num_keys],
               None if mask is None else mask[first:stop, :, :, :num_keys], scale)
        for first, stop, num_keys in segments])


def _attention_mask(positions: torch.Tensor | None, start: int, num_new: int, used: int,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Which cached keys each new token may attend to, as an additive mask (0 = visible, -inf =
    hidden), or None for all.

    Uniform rows: token i sits at start + i and sees keys 0 .. start + i, a causal band
    [1, 1, n, used]; a single token sees every key (None). Ragged rows: [B, 1, n, used] from the
    positions, so no row sees its stale tail or past its own position. Additive and in the
    queries' dtype because scaled_dot_product_attention turns a boolean mask into exactly this
    (where(mask, 0, -inf)) in every layer; made here, it is made once a pass, and the attention
    is bit for bit the same. Those per-layer conversions were a third of what a 2-token pass
    cost over a 1-token one.
    """
    if positions is None:
        if num_new == 1:
            return None
        hidden = torch.full((num_new, used), float("-inf"), dtype=dtype, device=device)
        return hidden.triu_(start + 1)[None, None]
    visible = torch.arange(used, device=device)[None, None, :] <= positions[:, :, None]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
        ~visible, float("-inf"))[:, None]
