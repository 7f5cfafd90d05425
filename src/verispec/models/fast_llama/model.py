"""A flat forward pass for Llama-architecture models (and Mistral and Qwen2 without a window): the
fast path for small models at batch 1.

Legend: B batch, n fed tokens, T cache capacity, L layers, H query heads, Hkv kv heads,
D head dim, E hidden size, V vocabulary.

Why: for the small models speculative decoding pairs with (and for every draft), a transformers
forward at batch 1 spends most of its time in Python module dispatch, not in arithmetic; that
fixed cost is what makes a draft step expensive relative to a target step (the cost ratio c).
This module runs the same computation as ``LlamaForCausalLM`` as one function over the model's
own weight tensors (q/k/v and gate/up fused in place, see _fuse_linears; with the oneDNN kernel
the large projections are read from packed copies, see matmul.py), with the same
preallocated per-row KV cache semantics as models/hf/adapter.py (position-indexed writes, free
rewind, ragged rows; prefills and a draft's catch-ups lay their rows end to end, unpadded:
packed.py; the session holding the rows is session.py). Per step it
issues about 20 ops a layer; at batch 1 on a CPU each costs a few microseconds whatever its
size, which is what bounds a small draft's step.
torch.compile was measured and does not pay here: a small gain a step costs a long compile per
shape, and its logits differ from the eager ones (dev/LOG.md: fast path sessions).

It is a fast path with a reference: tests/models/test_fast_llama.py checks its logits against the
transformers forward and its greedy output against ``generate()``. ``supports()`` admits only
configurations whose math this function reproduces (default RoPE via the model's own rotary
module, SiLU MLP, biases where the model has them, no sliding window); anything else uses the
transformers adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ...errors import ConfigError
from ..attention import SEGMENT_CALL_BYTES, _attention_mask, attend, attend_segments
from ..hf.adapter import max_positions, output_width
from ..hf.masks import FULL, mask_plan
from .kv_cache import KVCache
from .matmul import linear_kernel, resolve_matmul
from .packed import PackedRows, embed_packed, write_and_attend, write_packed
from .session import FastLlamaSession
from .step_graphs import StepGraphs

# Llama's forward, and the architectures whose forward is Llama's up to what this path already
# computes: Mistral (Llama + an optional sliding window) and Qwen2 (Llama + q/k/v biases + an
# optional window). A window is not computed here: a model using one takes the transformers path.
MODEL_TYPES = ("llama", "mistral", "qwen2")
STEP_GRAPHS = ("auto", "off", "static")  # FastLlamaLM's step_graphs


def supports(model: PreTrainedModel) -> bool:
    """Whether :class:`FastLlamaLM` reproduces this model's forward exactly."""
    config = model.config
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return (getattr(config, "model_type", None) in MODEL_TYPES
            and getattr(rotary, "rope_type", None) == "default"
            and getattr(config, "hidden_act", None) == "silu"
            and getattr(config, "pretraining_tp", 1) == 1
            and mask_plan(config).layer_types == (FULL,)  # causal, no window
            and _plain_float_linears(model))


def _plain_float_linears(model: PreTrainedModel) -> bool:
    """Every projection an ordinary nn.Linear with float weights (not, e.g., a module that keeps
    GGUF's quantized blocks and unpacks them in its own forward, which this path would skip)."""
    linears = [model.get_output_embeddings()] + [
        module for layer in model.model.layers
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                       layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                       layer.mlp.down_proj)]
    return all(type(linear) is torch.nn.Linear and linear.weight.is_floating_point()
               for linear in linears)


def _checked_vocab_size(model: PreTrainedModel, vocab_size: int | None,
                        step_graphs: str) -> int:
    """FastLlamaLM's arguments checked: the vocabulary it serves (default: every logit)."""
    if not supports(model):
        raise ConfigError(f"the fast Llama path does not support model_type="
                          f"{getattr(model.config, 'model_type', None)!r} with this config; "
                          "use the transformers backend.")
    if step_graphs not in STEP_GRAPHS:
        raise ConfigError(f"step_graphs={step_graphs!r} is invalid: expected one of "
                          f"{', '.join(STEP_GRAPHS)}.")
    width = output_width(model)
    vocab_size = width if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= width:
        raise ConfigError(f"vocab_size={vocab_size} is invalid for a model with {width} "
                          "output logits.")
    return vocab_size


class FastLlamaLM:
    """A Llama-family ``PreTrainedModel`` as a :class:`LanguageModel` with a flat forward.

    ``matmul`` picks the kernel of every projection (matmul.py): "aten" (F.linear),
    "onednn", or "auto" (oneDNN for float32 on x86 CPUs not made by Intel, where MKL is slow);
    the resolved name is ``self.matmul``. ``draft``: the model only drafts, so its numbers may
    differ between batch sizes, and under "onednn" each projection picks its kernel by the rows
    of the call (matmul.linear_kernel's ``by_rows``); a target's kernel is fixed per weight.
    ``step_graphs``: how decoding steps run (step_graphs.py): "auto" captures them as
    CUDA graphs on a CUDA device and runs them eagerly elsewhere, "off" always eagerly, and
    "static" at the graphs' static shapes without capturing them (what a graph replays, on any
    device: for tests).
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None,
                 matmul: str = "auto", draft: bool = False, step_graphs: str = "auto") -> None:
        vocab_size = _checked_vocab_size(model, vocab_size, step_graphs)
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.max_positions = max_positions(model)
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        # what one more range of rows must save to pay (models.attention.SEGMENT_CALL_BYTES), in
        # cached key-rows: a key and a value of every kv head, for one row
        self.segment_call_rows = SEGMENT_CALL_BYTES / (
            2 * self.num_kv_heads * self.head_dim * model.dtype.itemsize)
        self.eps = config.rms_norm_eps
        self.dtype = model.dtype
        self._device = model.device  # cached: the model property walks every parameter
        self.matmul = resolve_matmul(matmul, self._device, self.dtype)
        # on packed oneDNN weights a pass over a few tokens costs about one token's: the deeper
        # default depth (policy.default_num_draft_tokens)
        self.flat_verify = self.matmul == "onednn"
        kernel = linear_kernel(self.matmul, by_rows=draft)
        self.linear = kernel.linear  # x [.., E], weight [O, E] as prepared, bias -> [.., O]
        inner = model.model
        self.embed_weight = inner.embed_tokens.weight  # [V_model, E]
        self.norm_weight = inner.norm.weight
        rotary = inner.rotary_emb
        self.rotary = RotaryTable(rotary.inv_freq, float(rotary.attention_scaling), self.dtype,
                                  self._device)
        # exact for float32 (F.rms_norm computes what LlamaRMSNorm does); half precisions
        # follow LlamaRMSNorm's casts step for step
        self.rms_norm = _fused_rms_norm if self.dtype == torch.float32 else _rms_norm
        # weights pulled out of the modules once: attribute lookups per call cost more than the
        # arithmetic at batch 1; q/k/v and gate/up are fused in place (see _fuse_linears)
        self.layers = [_LayerWeights(layer, kernel.prepare) for layer in inner.layers]
        # the output head restricted to the vocabulary once, not per call: [V, E]
        self.head_weight = kernel.prepare(model.get_output_embeddings().weight[:vocab_size])
        capture = self._device.type == "cuda" and step_graphs == "auto"
        self.step_graphs = StepGraphs(self, capture) if capture or step_graphs == "static" else (
            None)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_captured(self) -> int:
        """Steps captured as CUDA graphs so far (models.base.CapturesSteps)."""
        return 0 if self.step_graphs is None else self.step_graphs.num_captured

    def new_session(self) -> FastLlamaSession:
        return FastLlamaSession(self)

    def scoring_session(self) -> FastLlamaSession:
        """A session that runs eagerly (models.base.ScoresApart): a prompt scored once must
        not capture a step graph for its length, evicting the decoding steps'."""
        return FastLlamaSession(self, eager=True)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None, start: int,
                cache: KVCache, used: int, logits_at: int | torch.Tensor | None = None,
                segments: Sequence[tuple[int, int, int]] | None = None,
                packed: PackedRows | None = None) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, V], or [B, 1, V] at column logits_at[b] of each row
        b (logits_at [B] int64, or one int for every row: the output layer runs at those
        positions only); writes the cache.

        Two ways to place the tokens. Uniform rows (batch 1, or every row holding ``start``
        tokens): ``positions`` is None and row b's tokens go to start .. start + n - 1, so cache
        writes are slices and a single new token needs no mask. Ragged rows: ``positions`` [B, n]
        gives each token's position; writes are indexed and a [B, 1, n, used] mask hides what a
        row must not see (its stale tail, other rows' padding). ``segments``: ragged rows
        attend in these ranges, each over its own keys (models.attention.segments_by_length).

        ``packed``: more tokens for this pass (packed.py: joining rows' prompts), laid after the
        B n rows' tokens in every projection, with no logits of their own (see attend_packed).
        """
        batch, num_new = tokens.shape
        hidden, cos, signed_sin = self.embed(tokens, positions, start, used, packed)
        mask = _attention_mask(positions, start, num_new, used, self.dtype, tokens.device)
        rows = None if positions is None else torch.arange(batch, device=tokens.device)[:, None]
        last = len(self.layers) - 1
        for layer, (w, keys, values) in enumerate(zip(self.layers, cache.keys, cache.values)):
            query, key, value = self.rotated_qkv(w, hidden, cos, signed_sin)
            if packed is not None:  # packed keys first: a joining row's tokens attend to them
                query, key, value, joined = self.attend_packed(
                    packed, query, key, value, keys, values, batch, num_new, layer == last)
            _write_cache(keys, values, key, value, start, positions, rows)
            out = self.attend_cache(query, keys, values, mask, used, segments)  # [B, H, n, D]
            out = out.transpose(1, 2).reshape(batch, num_new, -1)  # [B, n, H D]
            if packed is not None:
                hidden, out = _rejoin_packed(hidden, out, joined)
            hidden = self.finish_layer(w, hidden, out)
        return self.compute_logits(hidden, batch, num_new, logits_at, packed)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None, start: int, used: int,
              packed: PackedRows | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, n] -> hidden [B, n, E] and cos, signed_sin [B|1, n, 1, D] (as
        RotaryTable.lookup). With ``packed``, one token axis: the rows' B n tokens, then the N
        packed ones: hidden [1, Bn+N, E], cos and signed_sin [1, Bn+N, 1, D]."""
        batch, num_new = tokens.shape
        hidden = F.embedding(tokens, self.embed_weight)  # [B, n, E]
        cos, signed_sin = self.rotary.lookup(positions, start, num_new, used)  # [B|1, n, 1, D]
        if packed is None:
            return hidden, cos, signed_sin
        width = batch * num_new  # the rows' own tokens on the joint token axis
        extra, extra_cos, extra_sin = embed_packed(self, packed)  # [1, N, E], [1, N, 1, D]
        hidden = torch.cat([hidden.reshape(1, width, -1), extra], dim=1)  # [1, Bn+N, E]
        cos, signed_sin = (torch.cat([table.expand(batch, num_new, -1, -1).reshape(
            1, width, 1, -1), extra_table], dim=1)
            for table, extra_table in ((cos, extra_cos), (signed_sin, extra_sin)))
        return hidden, cos, signed_sin

    def attend_packed(self, packed: PackedRows, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int,
                      num_new: int, last: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One layer's packed tokens, before the rows' own attention: their keys and values
        written and their attention run, so that a joining row's tokens see its prompt.
        query [1, Bn+N, H, D], key and value [1, Bn+N, Hkv, D]; keys, values [B, Hkv, T, D]
        (one layer's cache) -> the rows' query, key, value [B, n, H|Hkv, D] and the packed
        tokens' attention output [1, N, H D]. In the ``last`` layer nothing reads the packed
        tokens' output (they have no logits): their keys and values are written, no more, and
        the output is None.

        Worked example: rows [x], [y] and a joining row's prompt [a b c] -> the projections
        see [x y a b c] ([1, 5, E]); attention runs for [a b c] against that row's keys (a
        causal band), then for [x], [y] and the joining row's token as usual.
        """
        width = batch * num_new  # the rows' own tokens on the joint token axis
        if last:
            write_packed(packed, key[0, width:], value[0, width:], keys, values)
            joined = None
        else:
            joined = write_and_attend(self, packed, query[0, width:], key[0, width:],
                                      value[0, width:], keys, values)  # [1, N, H D]
        query, key, value = (x[0, :width].view(batch, num_new, *x.shape[2:])
                             for x in (query, key, value))  # [B, n, H|Hkv, D]
        return query, key, value, joined

    def attend_cache(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, used: int,
                     segments: Sequence[tuple[int, int, int]] | None) -> torch.Tensor:
        """query [B, n, H, D] against one layer's cache (keys, values [B, Hkv, T, D]): its first
        ``used`` positions, or each segment's own range -> [B, H, n, D]."""
        if segments is None:
            return attend(query.transpose(1, 2), keys[:, :, :used], values[:, :, :used], mask,
                          self.scaling)
        return attend_segments(query.transpose(1, 2), keys, values, mask, self.scaling, segments)

    def compute_logits(self, hidden: torch.Tensor, batch: int, num_new: int,
                       logits_at: int | torch.Tensor | None, packed: PackedRows | None
                       ) -> torch.Tensor:
        """The last layer's hidden [B, n, E] ([1, Bn, E] with ``packed``) -> logits [B, n, V],
        or [B, 1, V] at ``logits_at`` (as forward)."""
        if packed is not None:
            hidden = hidden[0, :batch * num_new].view(batch, num_new, -1)  # [B, n, E]
        if isinstance(logits_at, int):  # [B, 1, E]
            hidden = hidden[:, logits_at : logits_at + 1]
        elif logits_at is not None:
            hidden = hidden[torch.arange(batch, device=hidden.device), logits_at][:, None]
        hidden = self.rms_norm(hidden, self.norm_weight, self.eps)
        return self.linear(hidden, self.head_weight)

    def rotated_qkv(self, w: _LayerWeights, hidden: torch.Tensor, cos: torch.Tensor,
                    signed_sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's first half up to attention: hidden [B, n, E] -> query [B, n, H, D], key and
        value [B, n, Hkv, D], query and key rotated (cos, signed_sin as RotaryTable.lookup)."""
        batch, num_new = hidden.shape[:2]
        num_qk_heads = self.num_heads + self.num_kv_heads
        x = self.rms_norm(hidden, w.input_norm, self.eps)
        qkv = self.linear(x, w.qkv, w.qkv_bias)  # [B, n, (H + 2 Hkv) D], one matmul
        qkv = qkv.view(batch, num_new, -1, self.head_dim)  # [B, n, H+2Hkv, D]
        # rotate queries and keys together: one pass over [B, n, H+Hkv, D]. HF's
        # rotate_half(x) * sin is [-x2 * s1, x1 * s2]; roll(x) * signed_sin is
        # [x2 * -s1, x1 * s2], the same numbers bit for bit (negation is exact), in 2 ops
        # instead of 4
        qk = qkv[:, :, :num_qk_heads]
        qk = qk * cos + qk.roll(self.head_dim // 2, -1) * signed_sin
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads:], qkv[:, :, num_qk_heads:]

    def finish_layer(self, w: _LayerWeights, hidden: torch.Tensor, attended: torch.Tensor
                     ) -> torch.Tensor:
        """A layer's second half: attended [B, n, H D] -> the next hidden [B, n, E] (output
        projection and MLP, each added to the residual)."""
        hidden = hidden + self.linear(attended, w.o, w.o_bias)
        x = self.rms_norm(hidden, w.post_norm, self.eps)
        gate_up = self.linear(x, w.gate_up, w.gate_up_bias)  # [B, n, 2 I], one matmul
        gate, up = gate_up[..., : w.gate_width], gate_up[..., w.gate_width :]
        return hidden + self.linear(F.silu(gate) * up, w.down, w.down_bias)


def _write_cache(keys: torch.Tensor, values: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, start: int, positions: torch.Tensor | None,
                 rows: torch.Tensor | None) -> None:
    """The rows' key, value [B, n, Hkv, D] written to one layer's cache (keys, values
    [B, Hkv, T, D]): slices from ``start`` for uniform rows (positions None), indexed writes at
    positions [B, n] (rows [B, 1]) for ragged ones."""
    if positions is None:
        num_new = key.shape[1]
        keys[:, :, start : start + num_new] = key.transpose(1, 2)
        values[:, :, start : start + num_new] = value.transpose(1, 2)
    else:  # advanced indices around a slice: the indexed view is [B, n, Hkv, D]
        keys[rows, :, positions] = key
        values[rows, :, positions] = value


def _rejoin_packed(hidden: torch.Tensor, out: torch.Tensor, joined: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' attention output out [B, n, H D] back on the joint token axis of hidden
    [1, Bn+N, E], followed by the packed tokens' output joined [1, N, H D] -> out
    [1, Bn+N, H D]. In the last layer (joined None) the packed tokens drop out: hidden
    [1, Bn, E], out [1, Bn, H D]."""
    width = out.shape[0] * out.shape[1]  # B n
    if joined is None:
        return hidden[:, :width], out.reshape(1, width, -1)
    return hidden, torch.cat([out.reshape(1, width, -1), joined], dim=1)


class _LayerWeights:
    """One decoder layer's tensors, looked up once; q/k/v and gate/up fused, projection weights
    in the layout the kernel reads (``prepare``: the same tensors for ATen, packed copies for
    oneDNN, matmul.py)."""

    def __init__(self, layer: torch.nn.Module,
                 prepare: Callable[[torch.Tensor], torch.Tensor]) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        qkv, self.qkv_bias = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, self.gate_up_bias = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.gate_width = mlp.gate_proj.weight.shape[0]
        self.qkv, self.gate_up = prepare(qkv), prepare(gate_up)
        self.o, self.o_bias = prepare(attn.o_proj.weight), attn.o_proj.bias
        self.down, self.down_bias = prepare(mlp.down_proj.weight), mlp.down_proj.bias


def _fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of outputs, in] (and bias) for linears that read the same input.

    One matmul instead of several saves a dispatch per linear, which is most of a small model's
    step at batch 1. The modules' own weights are re-pointed at views of the fused tensor (the
    same values), so fusing costs no memory and the transformers forward still runs on them.
    Wrap a model after moving it (``.to(...)`` gives the modules new tensors).
    """
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        offset = 0
        for linear in linears:
            width = linear.weight.shape[0]
            linear.weight.data = weight[offset : offset + width]
            offset += width
        if all(linear.bias is None for linear in linears):
            return weight, None
        return weight, torch.cat([
            linear.bias if linear.bias is not None else weight.new_zeros(linear.weight.shape[0])
            for linear in linears])


def _fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(hidden, weight.shape, weight, eps)


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm, step for step (normalise in fp32, scale in the input dtype)."""
    as_float = hidden.float()
    normed = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


class RotaryTable:
    """cos and signed sin of default RoPE for positions 0 .. T-1 [T, D], computed once, grown by
    doubling. signed sin is sin with its first half negated (see FastLlamaLM.forward).

    The same arithmetic as LlamaRotaryEmbedding (fp32 angles position * inv_freq, cos/sin
    times attention_scaling, cast to the model dtype), so the values are identical; looking
    them up per step replaces a dozen small ops.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.inv_freq = inv_freq.float().to(device)  # [D/2]
        self.scaling, self.dtype = scaling, dtype
        self.cos = self.sin = torch.empty((0, 2 * self.inv_freq.shape[0]), dtype=dtype,
                                          device=device)

    def lookup(self, positions: torch.Tensor | None, start: int, num_new: int, used: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [B, n, 1, D] for positions [B, n]; [1, n, 1, D] for start ..
        start + n - 1 when positions is None (uniform rows). ``used`` bounds every position
        (grows the table)."""
        self.ensure(used)
        if positions is None:
            window = slice(start, start + num_new)
            return self.cos[window][None, :, None], self.sin[window][None, :, None]
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]

    def ensure(self, size: int) -> None:
        """Rows for positions 0 .. size - 1, doubling so that growth is amortized."""
        if size > self.cos.shape[0]:
            self._grow(max(size, 2 * self.cos.shape[0], 256))

    @property
    def layout(self) -> tuple[int, int]:
        """Where the tables live (a captured step reads them: step_graphs.py)."""
        return self.cos.data_ptr(), self.sin.data_ptr()

    def _grow(self, size: int) -> None:
        positions = torch.arange(size, device=self.inv_freq.device).float()
        freqs = positions[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        self.cos = (angles.cos() * self.scaling).to(self.dtype)
        sin = (angles.sin() * self.scaling).to(self.dtype)
        half = sin.shape[-1] // 2
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # signed sin
