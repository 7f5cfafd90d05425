"""Which llama.cpp pass widths give bit-identical logits per position: the measurement behind
``LlamaCppConfig(uniform_passes=True)`` (docs/exactness.md).

    .venv/bin/python benchmarks/pass_width_bits.py                    # the packaged models
    .venv/bin/python benchmarks/pass_width_bits.py --models qwen2.5-coder-1.5b-instruct \
        --repack auto off --flash on off --threads 2 1

For each model and setting, a prompt is prefilled once; then the same continuation of 8
tokens is fed in passes of several shapes (widths, padding), from that same cache (each shape
is rewound away before the next), and each position's logits are compared bit for bit with
those of one-token passes ("w1"), of padded passes ("w1+pad": every pass padded to 4 tokens
with logits at every token, as uniform passes do) and of one 8-token pass ("w8"). A position
counts as equal when all its logits are; an earlier position's cache entries differing makes
the later ones differ too. Two prompt lengths are measured: a short one (llama.cpp's KV view
under 512 cells) and a long one (a view of 512 cells or more, where a one-token pass's flash
attention splits the cache across threads).

Not timing: nothing here measures speed. Writes a table and, with --json, the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from verispec.models.llama_cpp.model import LlamaCppConfig, LlamaCppModel, bindings
from verispec.models.packaged import packaged_model_path

MODELS = ("qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m")
TEXT = ("def merge_sorted(left, right):\n    \"\"\"Merge two sorted lists into one sorted list."
        "\"\"\"\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
        "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1"
        "\n        else:\n            result.append(right[j])\n            j += 1\n"
        "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n")
NUM_FED = 8  # continuation tokens compared per shape
GROUP = 4  # the repacked kernels' GEMM takes rows in groups of 4
# shape name -> pass widths over the fed tokens; "+pad" pads each pass to a multiple of 4
# (of 8: "+pad8"), with logits at the padding too unless "-nologits"
SHAPES = {
    "w1": [1] * 8, "w2": [2] * 4, "w3": [3, 3, 2], "w4": [4, 4], "w8": [8],
    "w1+pad": [1] * 8, "w3+pad": [3, 3, 2], "w1+pad-nologits": [1] * 8, "w3+pad8": [3, 3, 2],
}
REFERENCES = ("w1", "w1+pad", "w8")  # each shape is compared with these


@dataclass(frozen=True)
class Setting:
    repack: str
    flash: bool
    threads: int


class RawContext:
    """A one-sequence llama_context with flash attention and threads chosen."""

    def __init__(self, model: LlamaCppModel, setting: Setting, n_ctx: int) -> None:
        llama_cpp = bindings()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = setting.threads
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if setting.flash
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        self.llama_cpp = llama_cpp
        self.handle = llama_cpp.llama_init_from_model(model.handle, params)
        assert self.handle, "llama.cpp could not create the context"
        self.memory = llama_cpp.llama_get_memory(self.handle)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.num_logits = model.num_logits

    def close(self) -> None:
        self.llama_cpp.llama_batch_free(self.batch)
        self.llama_cpp.llama_free(self.handle)

    def decode(self, tokens: list[int], start: int, logits: list[bool]) -> torch.Tensor:
        """tokens at positions start.. of sequence 0 -> logits [sum(logits), V] (a copy)."""
        for slot, (token, wants) in enumerate(zip(tokens, logits)):
            self.batch.token[slot] = token
            self.batch.pos[slot] = start + slot
            self.batch.n_seq_id[slot] = 1
            self.batch.seq_id[slot][0] = 0
            self.batch.logits[slot] = wants
        self.batch.n_tokens = len(tokens)
        assert self.llama_cpp.llama_decode(self.handle, self.batch) == 0
        count = sum(logits)
        pointer = self.llama_cpp.llama_get_logits(self.handle)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(count, self.num_logits))
                                .copy()) if count else torch.empty(0, self.num_logits)

    def remove(self, start: int) -> None:
        assert self.llama_cpp.llama_memory_seq_rm(self.memory, 0, start, -1)


def tokenize(model: LlamaCppModel, text: str) -> list[int]:
    llama_cpp = bindings()
    raw = text.encode()
    buffer = (llama_cpp.llama_token * (len(raw) + 8))()
    count = llama_cpp.llama_tokenize(model.vocab, raw, len(raw), buffer, len(buffer), True, False)
    assert count > 0
    return list(buffer[:count])


def feed(context: RawContext, fed: list[int], start: int, shape: str) -> torch.Tensor:
    """``fed`` from position ``start`` in the passes of ``shape`` -> logits [len(fed), V];
    the cache is rewound to ``start`` afterwards."""
    rows, position = [], start
    padded = "+pad" in shape
    multiple = 2 * GROUP if "pad8" in shape else GROUP
    for width in SHAPES[shape]:
        real = fed[position - start: position - start + width]
        padding = (-width) % multiple if padded else 0
        tokens = real + [real[-1]] * padding
        wants = [True] * width + [not shape.endswith("nologits")] * padding
        rows.append(context.decode(tokens, position, wants)[:width])
        if padding:
            context.remove(position + width)
        position += width
    context.remove(start)
    return torch.cat(rows)


def measure(model: LlamaCppModel, setting: Setting, prompt: list[int], fed: list[int]
            ) -> dict[str, dict[str, int]]:
    """Per shape: positions bit-equal to one-token passes ("vs_w1") and to padded one-token
    passes ("vs_pad")."""
    context = RawContext(model, setting, n_ctx=len(prompt) + 64)
    try:
        for begin in range(0, len(prompt), 512):
            chunk = prompt[begin:begin + 512]
            context.decode(chunk, begin, [False] * len(chunk))
        logits = {shape: feed(context, fed, len(prompt), shape) for shape in SHAPES}
    finally:
        context.close()
    counts = {}
    for shape, rows in logits.items():
        counts[shape] = {reference: sum(torch.equal(a, b) for a, b in zip(rows, logits[reference]))
                         for reference in REFERENCES}
        counts[shape]["max_abs_vs_w1"] = float((rows - logits["w1"]).abs().max())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--repack", nargs="+", default=["auto", "off"])
    parser.add_argument("--flash", nargs="+", default=["on", "off"])
    parser.add_argument("--threads", nargs="+", type=int, default=[2])
    parser.add_argument("--prompts", nargs="+", type=int, default=[48, 600],
                        help="prompt lengths (tokens) before the compared positions")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args()
    results = []
    for name in args.models:
        for repack in args.repack:
            model = LlamaCppModel(packaged_model_path(name), config=LlamaCppConfig(repack=repack))
            tokens = tokenize(model, TEXT * 12)
            for length in args.prompts:
                prompt, fed = tokens[:length], tokens[length:length + NUM_FED]
                for flash in args.flash:
                    for threads in args.threads:
                        setting = Setting(repack, flash == "on", threads)
                        counts = measure(model, setting, prompt, fed)
                        results.append({"model": name, "repack": repack,
                                        "kernels": model.kernels.reason,
                                        "buffers": model.weight_buffers, "flash": flash,
                                        "threads": threads, "prompt": length,
                                        "tiled_mm": os.environ.get("GGML_CPU_TILED_MM", "on"),
                                        "counts": counts})
                        report(results[-1])
            del model
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


def report(result: dict) -> None:
    print(f"\n{result['model']} repack={result['repack']} flash={result['flash']} "
          f"tiled_mm={result['tiled_mm']} "
          f"threads={result['threads']} prompt={result['prompt']} "
          f"({', '.join(f'{k} {v:.0f}' for k, v in result['buffers'].items())} MiB)")
    print(f"  {'shape':<16} " + " ".join(f"{'=' + r:>9}" for r in REFERENCES)
          + f" {'max|d| vs w1':>13}")
    for shape, count in result["counts"].items():
        print(f"  {shape:<16} " + " ".join(f"{count[r]:>9}" for r in REFERENCES)
              + f" {count['max_abs_vs_w1']:>13.3g}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
