"""Does the flat fast path pay for the Llama-compatible architectures it now takes?

    .venv/bin/python benchmarks/fast_path_archs.py   # writes results/fast_path_archs.json

One step (a 1-token extend at batch 1 after a 64-token prompt) of random-init Llama, Mistral and
Qwen2 models of two sizes (the demo draft's and a 6-layer 512-wide one), on the transformers
adapter and on the fast path (models/fast_llama.py), one thread, float32. Blocks of 64 steps,
the two backends' blocks interleaved, the median block reported; ratios are within this run.
The models are random: step time does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from verispec.bench.run import environment  # noqa: E402
from verispec.models.fast_llama.model import FastLlamaLM  # noqa: E402
from verispec.models.hf.adapter import TransformersLM  # noqa: E402

from arch_specs import Arch  # noqa: E402

SIZES = [(256, 2), (512, 6)]  # (hidden, layers)
STEPS, BLOCKS, PROMPT = 64, 7, list(range(1, 65))


def step_ms(lm) -> float:
    session = lm.new_session()
    session.start([PROMPT])
    begin = time.perf_counter()
    for i in range(STEPS):
        session.extend(torch.tensor([[i + 3]]))
    return (time.perf_counter() - begin) / STEPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks/results/fast_path_archs.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| model | hidden x layers | transformers ms/step | fast ms/step | speedup |")
    print("|---|---|---|---|---|")
    for model_type in ("llama", "mistral", "qwen2"):
        for hidden, layers in SIZES:
            arch = Arch(model_type, model_type, "", dict(
                hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=8,
                num_key_value_heads=4, head_dim=hidden // 8, sliding_window=None))
            model = arch.build(layers, vocab_size=8192)
            backends = {"transformers": TransformersLM(model), "fast": FastLlamaLM(model)}
            times = {name: [] for name in backends}
            for _ in range(BLOCKS):
                for name, lm in backends.items():
                    times[name].append(step_ms(lm))
            median = {name: statistics.median(values) for name, values in times.items()}
            row = dict(model_type=model_type, hidden=hidden, layers=layers,
                       transformers_ms=round(median["transformers"], 3),
                       fast_ms=round(median["fast"], 3),
                       speedup=round(median["transformers"] / median["fast"], 2))
            rows.append(row)
            print(f"| {model_type} | {hidden} x {layers} | {row['transformers_ms']:.2f} | "
                  f"{row['fast_ms']:.2f} | {row['speedup']:.2f}x |")
    Path(args.json).write_text(json.dumps({"environment": environment(), "rows": rows},
                                          indent=2) + "\n")


if __name__ == "__main__":
    main()
