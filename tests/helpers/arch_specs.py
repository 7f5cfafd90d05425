"""The architecture matrix: tiny random-init configs of every transformers causal LM tested.

One table drives tests/models/test_architectures.py (what is tested) and scripts/arch_table.py (the
README's list of supported and refused architectures), so the README cannot list an architecture
the tests do not run.

Every model is built from its transformers config class over a 200-token vocabulary: 32 hidden
units, 2 layers (the draft keeps the first), 4 query heads. Sliding windows and attention chunks
are WINDOW = 8 tokens, so the matrix's generations (3 x WINDOW and more) run far past them.
``eos_token_id`` is None: transformers' ``generate`` then runs the full length, as the engine does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB_SIZE = 200
WINDOW = 8
MIXED = ["sliding_attention", "full_attention"]  # layer 0 local, layer 1 global (Gemma 2/3 style)

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=None, pad_token_id=0)
GPT2_STYLE = dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=4, v_head_dim=8, head_dim=4)


@dataclass(frozen=True)
class Arch:
    """One row of the matrix: a transformers ``model_type`` and the config that exercises it."""

    name: str
    model_type: str
    feature: str  # what this row exercises (the README's column)
    overrides: dict = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # COMMON keys this config class does not take

    def config_kwargs(self, num_layers: int, vocab_size: int = VOCAB_SIZE) -> dict:
        kwargs = {key: value for key, value in COMMON.items() if key not in self.drop}
        kwargs["vocab_size"] = vocab_size
        kwargs.update(copy.deepcopy(self.overrides))
        for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
            if key in kwargs:
                kwargs[key] = num_layers
        for key in ("layer_types", "block_types"):
            if key in kwargs:
                kwargs[key] = kwargs[key][:num_layers]
        return kwargs

    def build(self, num_layers: int = 2, seed: int = 1, vocab_size: int = VOCAB_SIZE
              ) -> PreTrainedModel:
        config = AutoConfig.for_model(self.model_type, **self.config_kwargs(num_layers, vocab_size))
        torch.manual_seed(seed)  # model init only; never used by verispec itself
        return AutoModelForCausalLM.from_config(config).eval()

    def build_pair(self, vocab_size: int = VOCAB_SIZE
                   ) -> tuple[PreTrainedModel, PreTrainedModel]:
        """A 2-layer target and a 1-layer draft holding the target's first layer, embeddings and
        head (correlated with the target: drafts are often accepted and often rejected)."""
        target = self.build(2, vocab_size=vocab_size)
        draft = self.build(1, vocab_size=vocab_size)
        draft.load_state_dict(target.state_dict(), strict=False)
        return target, draft


SW = dict(sliding_window=WINDOW)

SUPPORTED = [
    Arch("Llama", "llama", "grouped-query attention, RoPE"),
    Arch("Llama 4 (text)", "llama4_text", f"chunked attention (chunk {WINDOW}), NoPE layers, MoE",
         dict(attention_chunk_size=WINDOW, num_local_experts=1, intermediate_size_mlp=64)),
    Arch("Mistral", "mistral", "no window", dict(sliding_window=None)),
    Arch("Mistral, sliding window", "mistral", f"sliding window {WINDOW} on every layer", SW),
    Arch("Mixtral", "mixtral", f"mixture of experts, sliding window {WINDOW}", dict(SW, **MOE)),
    Arch("Ministral", "ministral", f"sliding window {WINDOW} by layer types",
         dict(SW, layer_types=MIXED)),
    Arch("Qwen2", "qwen2", "QKV bias"),
    Arch("Qwen2, sliding window", "qwen2", "window on the layers past max_window_layers",
         dict(SW, use_sliding_window=True, max_window_layers=1)),
    Arch("Qwen2-MoE", "qwen2_moe", "mixture of experts with a shared expert",
         dict(MOE, shared_expert_intermediate_size=16)),
    Arch("Qwen3", "qwen3", "QK norm"),
    Arch("Qwen3-MoE", "qwen3_moe", "mixture of experts", MOE),
    Arch("Gemma", "gemma", "GeGLU, scaled embeddings"),
    Arch("Gemma 2", "gemma2", f"local (window {WINDOW}) + global layers, logit soft-capping",
         dict(SW, layer_types=MIXED)),
    Arch("Gemma 3 (text)", "gemma3_text", f"local (window {WINDOW}) + global layers",
         dict(SW, layer_types=MIXED)),
    Arch("VaultGemma", "vaultgemma", "Gemma 2 family"),
    Arch("Phi", "phi", "partial rotary (half the head)", dict(partial_rotary_factor=0.5)),
    Arch("Phi-3", "phi3", "fused QKV, no window"),
    Arch("Phi-3, sliding window", "phi3", f"sliding window {WINDOW}", SW),
    Arch("StableLM", "stablelm", "partial rotary (a quarter of the head)",
         dict(partial_rotary_factor=0.25)),
    Arch("GPT-NeoX", "gpt_neox", "partial rotary, parallel residual", dict(rotary_pct=0.25)),
    Arch("GPT-J", "gptj", "partial rotary (interleaved)", dict(GPT2_STYLE, rotary_dim=4)),
    Arch("CodeGen", "codegen", "partial rotary, fused QKV",
         dict(GPT2_STYLE, rotary_dim=4, n_ctx=256)),
    Arch("Persimmon", "persimmon", "partial rotary, QK layer norm"),
    Arch("Nemotron", "nemotron", "partial rotary, squared ReLU", dict(partial_rotary_factor=0.5)),
    Arch("GPT-2", "gpt2", "learned positions, fused QKV", GPT2_STYLE),
    Arch("GPT-BigCode", "gpt_bigcode", "multi-query attention (one KV head)",
         dict(GPT2_STYLE, multi_query=True)),
    Arch("OPT", "opt", "learned positions with an offset",
         dict(ffn_dim=64, word_embed_proj_dim=32)),
    Arch("XGLM", "xglm", "sinusoidal positions",
         dict(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4)),
    Arch("BioGPT", "biogpt", "learned positions, scaled embeddings"),
    Arch("Falcon", "falcon", "multi-query attention, parallel attention and MLP",
         drop=("head_dim",)),
    Arch("Bloom", "bloom", "ALiBi (built from the attention mask)", dict(n_layer=2, n_head=4)),
    Arch("MPT", "mpt", "ALiBi (relative to the last key)",
         dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, expansion_ratio=2)),
    Arch("OLMo", "olmo", "non-parametric layer norm"),
    Arch("OLMo 2", "olmo2", "QK norm, post-norm"),
    Arch("OLMo 3", "olmo3", f"local (window {WINDOW}) + global layers",
         dict(SW, layer_types=MIXED)),
    Arch("OLMoE", "olmoe", "mixture of experts", MOE),
    Arch("Granite", "granite", "scaled residuals and logits"),
    Arch("GraniteMoE", "granitemoe", "mixture of experts", MOE),
    Arch("Cohere", "cohere", "parallel block, logit scale"),
    Arch("Cohere 2", "cohere2", f"local (window {WINDOW}) + global layers",
         dict(SW, layer_types=MIXED)),
    Arch("Starcoder2", "starcoder2", f"sliding window {WINDOW}, biases", SW),
    Arch("GPT-OSS", "gpt_oss", f"attention sinks, local (window {WINDOW}) + global, MoE",
         dict(SW, layer_types=MIXED, **MOE)),
    Arch("EXAONE 4", "exaone4", f"local (window {WINDOW}) + global layers",
         dict(SW, layer_types=MIXED)),
    Arch("Helium", "helium", "Llama family"),
    Arch("GLM", "glm", "partial rotary (interleaved)"),
    Arch("GLM-4", "glm4", "partial rotary, extra norms"),
    Arch("SmolLM3", "smollm3", "NoPE layers"),
    Arch("Arcee", "arcee", "ReLU-squared MLP"),
    Arch("ERNIE 4.5", "ernie4_5", "Llama family"),
    Arch("Seed-OSS", "seed_oss", "attention bias"),
    Arch("Apertus", "apertus", "xIELU activation, QK norm"),
    Arch("DeepSeek-V2", "deepseek_v2", "multi-head latent attention (MLA), MoE",
         dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              first_k_dense_replace=1, n_group=1, topk_group=1)),
    Arch("DeepSeek-V3", "deepseek_v3", "multi-head latent attention (MLA), MoE",
         dict(MLA, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              first_k_dense_replace=1, n_group=1, topk_group=1)),
    Arch("MiniCPM3", "minicpm3", "multi-head latent attention (MLA)", MLA),
]


@dataclass(frozen=True)
class Refused:
    """An architecture refused at load, and the reason the error must give."""

    name: str
    arch: Arch
    reason: str  # a phrase the UnsupportedModelError's message must contain

    @property
    def why(self) -> str:
        """The README's column."""
        return WHY.get(self.reason, self.reason)


STATEFUL = "recurrent or state-space layers"
WHY = {
    STATEFUL: "recurrent or state-space layers: their state cannot drop rejected draft tokens",
    "'conv' layers": "short-convolution layers keep a state that cannot drop rejected tokens",
    "fixed causal buffer": "local attention from a fixed buffer that assumes unragged rows",
    "forward failed on a ragged cached batch": "ALiBi built from a 2D padding mask inside the "
                                                "forward (refused by the load-time check)",
}
REFUSED = [
    Refused("Mamba", Arch("Mamba", "mamba", "", dict(state_size=4)), STATEFUL),
    Refused("Mamba-2", Arch("Mamba-2", "mamba2", "", dict(num_heads=4, head_dim=16, state_size=4,
                                                          n_groups=1, expand=2)), STATEFUL),
    Refused("Falcon-Mamba", Arch("Falcon-Mamba", "falcon_mamba", "", dict(state_size=4)),
            STATEFUL),
    Refused("RWKV", Arch("RWKV", "rwkv", "", dict(attention_hidden_size=32, context_length=256)),
            STATEFUL),
    Refused("xLSTM", Arch("xLSTM", "xlstm", ""), STATEFUL),
    Refused("Jamba (hybrid)", Arch("Jamba", "jamba", "", dict(
        num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1)), STATEFUL),
    Refused("Qwen3-Next (hybrid)", Arch("Qwen3-Next", "qwen3_next", "", dict(
        MOE, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, shared_expert_intermediate_size=16)), STATEFUL),
    Refused("RecurrentGemma (hybrid)", Arch("RecurrentGemma", "recurrent_gemma", "", dict(
        lru_width=32, attention_window_size=WINDOW, block_types=["recurrent", "attention"])),
            STATEFUL),
    Refused("Falcon-H1 (hybrid)", Arch("Falcon-H1", "falcon_h1", ""), STATEFUL),
    Refused("Nemotron-H (hybrid)", Arch("Nemotron-H", "nemotron_h", ""), STATEFUL),
    Refused("LFM2 (convolution + attention)", Arch("LFM2", "lfm2", "", dict(
        layer_types=["conv", "full_attention"])), "'conv' layers"),
    Refused("GPT-Neo", Arch("GPT-Neo", "gpt_neo", "", dict(
        num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=WINDOW)), "fixed causal buffer"),
    Refused("Falcon with ALiBi (Falcon-RW)", Arch("Falcon-RW", "falcon", "", dict(alibi=True),
                                                  drop=("head_dim",)),
            "forward failed on a ragged cached batch"),
]
