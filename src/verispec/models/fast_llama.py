"""A flat forward pass for Llama-architecture models: the fast path for small models at batch 1.

Legend: B batch, n fed tokens, T cache capacity, L layers, H query heads, Hkv kv heads,
D head dim, E hidden size, V vocabulary.

Why: for the small models speculative decoding pairs with (and for every draft), a transformers
forward at batch 1 spends most of its time in Python module dispatch, not in arithmetic; that
fixed cost is what makes a draft step expensive relative to a target step (the cost ratio c).
This module runs the same computation as ``LlamaForCausalLM`` as one function over the model's
own weight tensors (no copies), with the same preallocated per-row KV cache semantics as
transformers.py (position-indexed writes, free rewind, ragged rows).

It is a fast path with a reference: tests/test_fast_llama.py checks its logits against the
transformers forward and its greedy output against ``generate()``. ``supports()`` admits only
configurations whose math this function reproduces (default RoPE via the model's own rotary
module, SiLU MLP, no sliding window); anything else uses the transformers adapter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..errors import ConfigError, ShapeError
from .transformers import max_positions, output_width


def supports(model: PreTrainedModel) -> bool:
    """Whether :class:`FastLlamaLM` reproduces this model's forward exactly."""
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return (getattr(config, "model_type", None) == "llama"
            and getattr(rotary, "rope_type", None) == "default"
            and getattr(config, "hidden_act", None) == "silu"
            and getattr(config, "pretraining_tp", 1) == 1
            and getattr(config, "sliding_window", None) is None)


class FastLlamaLM:
    """A Llama-family ``PreTrainedModel`` as a :class:`LanguageModel` with a flat forward."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        if not supports(model):
            raise ConfigError(f"the fast Llama path does not support model_type="
                              f"{getattr(model.config, 'model_type', None)!r} with this config; "
                              "use the transformers backend.")
        width = output_width(model)
        vocab_size = width if vocab_size is None else vocab_size
        if not 1 <= vocab_size <= width:
            raise ConfigError(f"vocab_size={vocab_size} is invalid for a model with {width} "
                              "output logits.")
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.max_positions = max_positions(model)
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.dtype = model.dtype
        self._device = model.device  # cached: the model property walks every parameter
        inner = model.model
        self.embed_weight = inner.embed_tokens.weight  # [V_model, E]
        self.norm_weight = inner.norm.weight
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [D/2]
        self.rope_scaling = float(rotary.attention_scaling)
        # weights pulled out of the modules once: attribute lookups per call cost more than the
        # arithmetic at batch 1 (they reference the model's tensors; nothing is copied)
        self.layers = [_LayerWeights(layer) for layer in inner.layers]
        # the output head restricted to the vocabulary once, not per call: [V, E]
        self.head_weight = model.get_output_embeddings().weight[:vocab_size]

    @property
    def device(self) -> torch.device:
        return self._device

    def new_session(self) -> FastLlamaSession:
        return FastLlamaSession(self)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                used: int, logits_to_keep: int = 0) -> torch.Tensor:
        """tokens, positions [B, n] -> logits [B, n or logits_to_keep, V]; writes the cache."""
        dtype = self.dtype
        hidden = F.embedding(tokens, self.embed_weight)  # [B, n, E]
        cos, sin = self._rotary(positions, dtype)  # [B, 1, n, D] each
        visible = torch.arange(used, device=tokens.device)[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=tokens.device)
        mask = mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]  # [B, 1, n, used]
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]  # [B, 1]
        batch, num_new = tokens.shape
        gqa = self.num_heads != self.num_kv_heads
        for w, keys, values in zip(self.layers, cache.keys, cache.values):
            x = _rms_norm(hidden, w.input_norm, self.eps)
            query = F.linear(x, w.q, w.q_bias).view(batch, num_new, -1, self.head_dim)
            key = F.linear(x, w.k, w.k_bias).view(batch, num_new, -1, self.head_dim)
            value = F.linear(x, w.v, w.v_bias).view(batch, num_new, -1, self.head_dim)
            query = query.transpose(1, 2)  # [B, H, n, D]
            key = key.transpose(1, 2)  # [B, Hkv, n, D]
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys[rows, :, positions] = key.transpose(1, 2)  # cache [B, Hkv, T, D] at positions
            values[rows, :, positions] = value
            out = F.scaled_dot_product_attention(
                query, keys[:, :, :used], values[:, :, :used], attn_mask=mask,
                scale=self.scaling, enable_gqa=gqa)
            out = out.transpose(1, 2).reshape(batch, num_new, -1)
            hidden = hidden + F.linear(out, w.o, w.o_bias)
            x = _rms_norm(hidden, w.post_norm, self.eps)
            gate = F.silu(F.linear(x, w.gate, w.gate_bias))
            hidden = hidden + F.linear(gate * F.linear(x, w.up, w.up_bias), w.down, w.down_bias)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = _rms_norm(hidden, self.norm_weight, self.eps)
        return F.linear(hidden, self.head_weight)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """LlamaRotaryEmbedding (default rope): cos, sin [B, 1, n, D] for positions [B, n]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.rope_scaling).to(dtype)
        sin = (angles.sin() * self.rope_scaling).to(dtype)
        return cos[:, None], sin[:, None]


class _LayerWeights:
    """One decoder layer's tensors, looked up once."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        for name, linear in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj),
                             ("o", attn.o_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj),
                             ("down", mlp.down_proj)):
            setattr(self, name, linear.weight)
            setattr(self, f"{name}_bias", linear.bias)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm, step for step (normalise in fp32, scale in the input dtype)."""
    as_float = hidden.float()
    normed = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Per-layer keys/values [B, Hkv, T, D], grown by doubling; rows are written by position."""

    def __init__(self, lm: FastLlamaLM, num_rows: int, capacity: int) -> None:
        shape = (num_rows, lm.num_kv_heads, capacity, lm.head_dim)
        make = lambda: torch.zeros(shape, dtype=lm.dtype, device=lm.device)  # noqa: E731
        self.keys = [make() for _ in lm.layers]
        self.values = [make() for _ in lm.layers]
        self.capacity = capacity

    def ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
                new[:, :, : old.shape[2]] = old
                store[i] = new
        self.capacity = capacity


class FastLlamaSession:
    """Same protocol and cache semantics as transformers.TransformersSession."""

    def __init__(self, lm: FastLlamaLM) -> None:
        self.lm = lm
        self.cache = KVCache(lm, 0, 0)
        self.lengths = torch.zeros(0, dtype=torch.int64)  # [B]
        self.num_rows = 0

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        longest = max((len(p) for p in prompts), default=0)
        self.num_rows = len(prompts)
        self.cache = KVCache(self.lm, self.num_rows, max(128, 2 * longest))
        self.lengths = torch.zeros(self.num_rows, dtype=torch.int64, device=self.lm.device)
        if longest == 0:
            return
        padded = torch.zeros((self.num_rows, longest), dtype=torch.int64)
        for row, prompt in enumerate(prompts):  # right-padded; padding is masked, then overwritten
            padded[row, : len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.int64)
        self._forward(padded.to(self.lm.device), logits_to_keep=1)
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64,
                                    device=self.lm.device)

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V]."""
        if tokens.dim() != 2 or tokens.shape[0] != self.num_rows:
            raise ShapeError(f"extend expects tokens [B={self.num_rows}, n]; got "
                             f"{tuple(tokens.shape)}.")
        logits = self._forward(tokens.to(self.lm.device))
        self.lengths = self.lengths + tokens.shape[1]
        return logits

    def rewind(self, num_tokens: torch.Tensor) -> None:
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.int64, device=self.lengths.device)
        self.lengths = self.lengths - num_tokens

    def _forward(self, tokens: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        positions = self.lengths[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        used = int(positions.max()) + 1
        self.cache.ensure(used)
        with torch.inference_mode():
            return self.lm.forward(tokens, positions, self.cache, used, logits_to_keep)
