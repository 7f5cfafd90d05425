"""Top-p written as a sort of the whole row: the reference for sample/host_probs.py, which sorts
only candidates (test-only math).

The rule: sort by probability, descending, ties in id order (a stable sort); a position is
kept while the mass before it (the fp32 cumulative sum minus its own probability) is below
top_p in fp32; the first position always. The kept entries are divided by their float64 sum,
added one term after another in id order, rounded to fp32.
"""

from __future__ import annotations

import numpy as np
import torch


def reference_top_p_kept(probs: torch.Tensor, top_p: float) -> list[int]:
    """The ids top-p keeps in probs [V] fp32, ascending."""
    sorted_probs, sorted_ids = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [V] fp32
    kept = mass_before < top_p  # a Python float against fp32: compared in fp32
    kept[0] = True
    return sorted(sorted_ids[kept].tolist())


def reference_renormalised(probs: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """probs [V] fp32 kept at ``kept`` (ascending ids) and renormalised; zero elsewhere."""
    values = probs[kept]
    total = np.float64(0.0)
    for value in values.numpy():  # the kept mass, one term after another in id order
        total += np.float64(value)
    total = np.float32(total)
    out = torch.zeros_like(probs)
    out[kept] = torch.from_numpy(values.numpy() / total)
    return out
