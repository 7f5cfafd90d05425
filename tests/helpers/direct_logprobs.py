"""The demo target's own transformers forward, the reference that logprobs are checked against.

load_demo_target: the shipped target in fp32 (its checkpoint is bf16, whose logits differ from
the library's fp32 load by ~5e-2); direct_logprobs: one forward's log_softmax over token ids.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from verispec.text.demo import demo_pair


def load_demo_target():
    """The demo target as transformers loads it, in fp32, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(demo_pair().target, dtype=torch.float32).eval()


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward over ids [T] -> [T, V] fp32: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
