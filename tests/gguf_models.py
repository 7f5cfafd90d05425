"""Writing a transformers Llama model and its byte-level BPE tokenizer as one GGUF file.

A test helper, not a converter we ship: it writes what llama.cpp's convert_hf_to_gguf.py writes
for a Llama with a GPT-2-style tokenizer (the same metadata keys, tensor names, and the q/k row
permutation llama.cpp applies), using the ``gguf`` package's writer, so the GGUF loading path
is tested on a file whose contents are known exactly. Tensors in F32, or Q8_0 (llama.cpp's 8-bit
blocks) for the matrices with norms kept in F32, as llama.cpp's quantizer leaves them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

_TENSOR_NAMES = {  # transformers name (in a layer) -> GGUF name
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute_for_llama_cpp(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows with each head's two RoPE halves interleaved."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def save_gguf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path,
              quantization: str | None = None, architecture: str = "llama") -> Path:
    """Write ``model`` and ``tokenizer`` to ``path`` (a .gguf file); ``quantization`` "Q8_0"
    stores the matrices as 8-bit blocks (None: F32). The tokenizer needs merges (a vocabulary
    larger than its byte alphabet)."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants

    config = model.config
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("verispec-test")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL
                            for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)

    def add(name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().float().numpy().astype(np.float32)
        if quantization is None or name.endswith("norm.weight"):  # norms stay F32
            writer.add_tensor(name, data)
            return
        kind = GGMLQuantizationType[quantization]
        writer.add_tensor(name, quants.quantize(data, kind), raw_dtype=kind)  # [rows, bytes]

    state = model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in _TENSOR_NAMES.items():
            tensor = state[f"model.layers.{layer}.{hf_name}"]
            if hf_name.startswith("self_attn.q_proj"):
                tensor = _permute_for_llama_cpp(tensor, config.num_attention_heads)
            elif hf_name.startswith("self_attn.k_proj"):
                tensor = _permute_for_llama_cpp(tensor, config.num_key_value_heads)
            add(f"blk.{layer}.{gguf_name}", tensor)
    add("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
