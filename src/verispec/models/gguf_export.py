"""Export a Llama-architecture transformers checkpoint and its byte-level BPE tokenizer to GGUF.

What this is: ``verispec export-gguf DIR OUT.gguf`` and :func:`export_gguf`, which write what
llama.cpp's ``convert_hf_to_gguf.py`` writes for a Llama with a GPT-2-style tokenizer (the same
metadata keys, tensor names, and the q/k row permutation llama.cpp applies), with the ``gguf``
package's writer. Tensors in F32 (bit-identical to the checkpoint's float32 weights), or Q8_0
(llama.cpp's 8-bit blocks) for the matrices, with norms kept in F32 as llama.cpp's quantizer
leaves them. It exists so the shipped demo pair (and the tests' tiny models) run on the
llama.cpp backend without llama.cpp's source tree.

What this is not: a general converter. Other architectures, SentencePiece tokenizers, rope
scaling and the other quantization types are refused with UnsupportedFeatureError naming
llama.cpp's converter, which handles them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from ..errors import UnsupportedFeatureError

if TYPE_CHECKING:  # gguf is imported when a file is written
    from gguf import GGUFWriter
    from transformers import PretrainedConfig

QUANTIZATIONS = ("F32", "Q8_0")

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


def check_exportable(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Raise UnsupportedFeatureError unless this module writes ``model`` and ``tokenizer``
    faithfully: a plain Llama (default RoPE, SiLU, no biases or window) and a byte-level BPE
    tokenizer with merges."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    problems = []
    if getattr(config, "model_type", None) != "llama":
        problems.append(f"architecture {getattr(config, 'model_type', None)!r} (expected llama)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"activation {config.hidden_act!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("projection biases")
    if getattr(config, "sliding_window", None) is not None:
        problems.append("a sliding window")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    if (spec.get("model", {}).get("type") != "BPE" or not spec["model"].get("merges")
            or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel"):
        problems.append("a tokenizer that is not byte-level BPE with merges")
    if problems:
        raise UnsupportedFeatureError(
            "verispec export-gguf writes plain Llama models with byte-level BPE tokenizers; this "
            f"checkpoint has {', '.join(problems)}. Use llama.cpp's convert_hf_to_gguf.py.")


def export_gguf(source: str | Path, out: str | Path, quantization: str = "F32") -> Path:
    """Write the transformers checkpoint in directory ``source`` to the GGUF file ``out``."""
    from .loading import load_model, load_tokenizer

    if quantization not in QUANTIZATIONS:
        raise UnsupportedFeatureError(f"quantization={quantization!r} is not written here: "
                                      f"expected one of {', '.join(QUANTIZATIONS)}; llama.cpp's "
                                      "llama-quantize makes the others from an F32 file.")
    model = load_model(str(source), device=torch.device("cpu"), dtype=torch.float32,
                       role="source")
    tokenizer = load_tokenizer(str(source), "source", model_dir=True)
    check_exportable(model, tokenizer)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    name = Path(source).expanduser().resolve().name
    return save_gguf(model, tokenizer, out, None if quantization == "F32" else quantization,
                     name=name)


def save_gguf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path,
              quantization: str | None = None, architecture: str = "llama",
              name: str = "verispec-export") -> Path:
    """Write ``model`` and ``tokenizer`` to ``path`` (a .gguf file); ``quantization`` "Q8_0"
    stores the matrices as 8-bit blocks (None: F32). The tokenizer needs merges (a vocabulary
    larger than its byte alphabet). No checks: :func:`export_gguf` makes them."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_name(name)
    _add_hyperparameters(writer, model.config)
    _add_tokenizer(writer, tokenizer)
    _add_tensors(writer, model, quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hyperparameters(writer: GGUFWriter, config: PretrainedConfig) -> None:
    """The model's shape as llama.cpp's llama architecture keys."""
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


def _add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    """The byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens in id order, their
    types, merges, special ids and the chat template."""
    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex of ByteLevel(use_regex)
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL
                            for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    for token_id, add_id in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                             (tokenizer.eos_token_id, writer.add_eos_token_id),
                             (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add_id(token_id)
    writer.add_add_bos_token(False)
    if getattr(tokenizer, "chat_template", None):  # as llama.cpp's converter writes it
        writer.add_chat_template(tokenizer.chat_template)


def _add_tensors(writer: GGUFWriter, model: LlamaForCausalLM, quantization: str | None) -> None:
    """Every weight under its GGUF name, in llama.cpp's order, q/k rows permuted; the matrices
    quantized when ``quantization`` names a type, the norms always F32."""
    from gguf import GGMLQuantizationType, quants

    def add(name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().float().numpy().astype(np.float32)
        if quantization is None or name.endswith("norm.weight"):  # norms stay F32
            writer.add_tensor(name, data)
            return
        kind = GGMLQuantizationType[quantization]
        writer.add_tensor(name, quants.quantize(data, kind), raw_dtype=kind)  # [rows, bytes]

    config = model.config
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
