"""What logprobs and a frequency penalty cost, plain and speculative, on the demo pair.

    .venv/bin/python benchmarks/sampling_cost.py   # writes results/sampling_cost.{json,md}
    .venv/bin/python benchmarks/sampling_cost.py --target build/demo-gguf/target.gguf \\
        --draft build/demo-gguf/draft.gguf --backend llama.cpp \\
        --json results/sampling_cost_llama_cpp.json

The same prompts, one request at a time, greedy and sampled (T = 0.8, seeded), plain and speculative
(the decoder's default k, fixed), under four settings: nothing, logprobs=5 (each token's logprob and
its 5 most likely alternatives), frequency_penalty=0.5, and both. Reports tokens/s, the ratio of
each setting to "nothing" within the same decoding, and acceptance. Each cell is the median of
--repeats interleaved repetitions; ratios are within this run. Runs generate max_new_tokens
(ignore_eos), so every cell decodes the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import verispec

from common import command_line, machine

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):",
           "import os\nimport sys\n", "# read the config file\nwith open(",
           "def parse_args():\n    parser = ", "for i in range(10):\n    ",
           "if __name__ == '__main__':\n    ", "def merge_sort(items):\n    "]
SETTINGS = {"nothing": {}, "logprobs": {"logprobs": 5},
            "frequency penalty": {"frequency_penalty": 0.5},
            "both": {"logprobs": 5, "frequency_penalty": 0.5}}


def run_once(decoder, speculative: bool, temperature: float, settings: dict,
             max_new_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    out = [decoder.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=1, speculative=speculative, ignore_eos=True, adaptive=None,
                            **settings) for prompt in PROMPTS]  # one request at a time
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out),
            "drafted": sum(c.metrics.num_drafted for c in out),
            "accepted": sum(c.metrics.num_accepted for c in out)}


def measure(decoder, temperature: float, args) -> dict[tuple[bool, str], dict[str, float]]:
    """Median (by time) of --repeats runs per (speculative, setting), interleaved."""
    runs: dict[tuple[bool, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for speculative in (False, True):
            for name, settings in SETTINGS.items():
                runs.setdefault((speculative, name), []).append(
                    run_once(decoder, speculative, temperature, settings, args.max_new_tokens))
    return {key: sorted(values, key=lambda r: r["seconds"])[len(values) // 2]
            for key, values in runs.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" /
                                              "sampling_cost.json"))
    args = parser.parse_args(argv)
    decoder = verispec.load(args.target, args.draft, backend=args.backend)
    decoder.generate(PROMPTS[:2], max_new_tokens=8, logprobs=5, frequency_penalty=0.5)  # warm
    header = ("| T | decoding | setting | tok/s | vs nothing | acceptance |\n"
              "|---|---|---|---|---|---|")
    lines, cells = [header], []
    for temperature in (0.0, 0.8):
        measured = measure(decoder, temperature, args)
        for speculative in (False, True):
            base = measured[(speculative, "nothing")]
            base_rate = base["tokens"] / base["seconds"]
            for name in SETTINGS:
                cell = measured[(speculative, name)]
                rate = cell["tokens"] / cell["seconds"]
                acceptance = cell["accepted"] / cell["drafted"] if cell["drafted"] else None
                decoding = f"speculative k={decoder.num_draft_tokens}" if speculative else "plain"
                lines.append(f"| {temperature:g} | {decoding} | {name} | {rate:.1f} | "
                             f"{rate / base_rate:.2f}x | "
                             f"{'-' if acceptance is None else f'{acceptance:.3f}'} |")
                cells.append({"temperature": temperature, "speculative": speculative,
                              "setting": name, "tokens_per_second": rate,
                              "vs_nothing": rate / base_rate, "acceptance": acceptance, **cell})
    table = "\n".join(lines)
    print(table)
    result = {"command": command_line("sampling_cost.py", argv), "machine": machine(),
              "target": args.target or "demo", "backend": args.backend,
              "num_draft_tokens": decoder.num_draft_tokens, "prompts": len(PROMPTS),
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cells": cells}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.json).with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
