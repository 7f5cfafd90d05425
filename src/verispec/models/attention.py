"""Which kernels ``scaled_dot_product_attention`` may pick in verispec's forward passes.

Why: decoding feeds a new attention shape at almost every step (one more cached key; the query
length is 1 for a plain step and k + 1 for a verification pass), and on CUDA in half precision
torch's default choice, cuDNN attention, builds an execution plan the first time it sees a shape.
Measured on an H100 with torch 2.11 (bf16, 8 heads of 64, 300-360 keys), the first call at each
new key length cost:

    cuDNN (the default)   51-450 ms     flash or memory-efficient   2.7-3.8 ms
    steady state          0.03-0.04 ms  flash or memory-efficient   0.03-0.05 ms

so a fresh process paid ~8 ms per generated token on top of a ~2 ms step until every length had
been seen once (a cold 64-token generation of the demo pair: 16 ms per token instead of 2).

Memory-efficient attention has no per-shape planning, and it is the one kernel used for every
pass: flash attention would take the unmasked 1-token steps of plain decoding but not the masked
(k + 1)-token verification passes, and two kernels round bf16 differently, which broke greedy
equality between plain and speculative decoding on the GPU (tests/test_gpu.py). The math kernel
stays as the fallback for what the efficient kernel does not take (on some torch versions,
grouped-query heads: still exact, slower on long contexts). CPUs are left to torch.

Not here: the attention math itself (the adapters call scaled_dot_product_attention).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
