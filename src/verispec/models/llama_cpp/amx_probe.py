"""Whether llama.cpp's AMX kernels run on this machine: a probe run in a throwaway process.

What this is: ``python amx_probe.py DIR`` (this file as a script) writes a tiny Llama GGUF
with Q8_0 matrices (a weight type ggml's AMX buffer type takes) into DIR, loads it with
llama.cpp's extra buffer types on, checks that the AMX buffer type holds its weights, and
decodes prompt- and verify-sized batches. It prints ``amx-ok`` and exits 0 when that works,
``amx-unused`` when llama.cpp did not give the weights to AMX (no AMX build, no tile
permission: nothing to route around). A machine whose tiles fault kills it with SIGILL or
SIGSEGV. kernels.py runs it once per process before the first GGUF model loads.

Why llama.cpp's own kernel rather than a few tile instructions: on a KVM guest that grants the
tile permission, a hand-written ``ldtilecfg``/``tilezero``/``tdpbssd`` sequence ran cleanly
(one thread and several, across sleeps and yields) while ggml's AMX matmul faulted on its
second call in a thread (dev/LOG.md, 2026-11-28). Only the real kernel, called as a model
calls it, answers the question.

What this is not: a benchmark. Its weights are random; nothing it computes is kept.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

_EMBED, _FFN, _LAYERS, _HEADS = 256, 512, 2, 4
_SPECIALS = ("<unk>", "<s>", "</s>")
_NUM_WORDS = 29  # with the specials and 256 byte tokens: a vocabulary of 288 = 9 * 32 rows


def write_probe_model(path: Path, weight_type: str = "Q8_0") -> None:
    """A random two-layer Llama whose matrices are ``weight_type`` (Q8_0 or Q4_0: types the
    gguf package can quantize), with a SentencePiece-style vocabulary of byte tokens (every
    dimension a multiple of what AMX's tiles and the repacked kernels' 8-row blocks need)."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    tokens = list(_SPECIALS) + [f"<0x{byte:02X}>" for byte in range(256)]
    tokens += [f"w{index}" for index in range(_NUM_WORDS)]
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_header(writer, gguf, tokens)

    def matrix(name: str, rows: int, cols: int) -> None:
        weight = rng.normal(0.0, 0.05, size=(rows, cols)).astype(np.float32)
        quantization = gguf.GGMLQuantizationType[weight_type]
        data = quantize(weight, quantization)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=quantization)

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    writer.add_tensor("token_embd.weight",
                      rng.normal(0.0, 0.05, size=(len(tokens), _EMBED)).astype(np.float32))
    for layer in range(_LAYERS):
        prefix = f"blk.{layer}."
        vector(prefix + "attn_norm.weight", _EMBED)
        vector(prefix + "ffn_norm.weight", _EMBED)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrix(prefix + name + ".weight", _EMBED, _EMBED)
        matrix(prefix + "ffn_gate.weight", _FFN, _EMBED)
        matrix(prefix + "ffn_up.weight", _FFN, _EMBED)
        matrix(prefix + "ffn_down.weight", _EMBED, _FFN)
    vector("output_norm.weight", _EMBED)
    matrix("output.weight", len(tokens), _EMBED)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_header(writer, gguf, tokens: list[str]) -> None:
    """The probe model's hyperparameters and its vocabulary (3 control, 256 byte tokens, then
    words)."""
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(types))
    writer.add_context_length(256)
    writer.add_embedding_length(_EMBED)
    writer.add_block_count(_LAYERS)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_HEADS)
    writer.add_rope_dimension_count(_EMBED // _HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def run_probe(folder: Path) -> str:
    """Load the probe model on llama.cpp with every extra buffer type and decode with it; the
    answer main() prints. Plain llama-cpp-python calls: this file runs as a script, without
    importing verispec (and torch), so the probe costs well under a second."""
    import llama_cpp

    path = folder / "amx-probe.gguf"
    write_probe_model(path)
    buffers: list[str] = []

    def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        buffers.append(text.decode("utf-8", errors="replace"))

    callback = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError("llama.cpp could not load the probe model")
    if not any(" AMX model buffer size" in line for line in buffers):
        return "amx-unused"
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = 256
    context = llama_cpp.llama_init_from_model(model, context_params)
    # a prompt-sized pass, then verify-sized ones: ggml's AMX matmul has faulted on a thread's
    # second call, not its first
    _decode(llama_cpp, context, list(range(3, 43)), 0)
    for round_index in range(8):
        _decode(llama_cpp, context, [5, 6, 7, 8], 40 + 4 * round_index)
    return "amx-ok"


def _decode(llama_cpp, context, tokens: list[int], start: int) -> None:
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    for index, token in enumerate(tokens):
        batch.token[index] = token
        batch.pos[index] = start + index
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = 0
        batch.logits[index] = True
    batch.n_tokens = len(tokens)
    status = llama_cpp.llama_decode(context, batch)
    llama_cpp.llama_batch_free(batch)
    if status != 0:
        raise RuntimeError(f"llama_decode failed with status {status}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python amx_probe.py DIR", file=sys.stderr)
        return 2
    print(run_probe(Path(argv[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
