"""Speculative decoding under a JSON schema against unconstrained, on the demo pair.

    .venv/bin/python benchmarks/structured_output.py   # writes results/structured_output.json

The same prompts, greedy and sampled (T = 0.8), four ways: plain and speculative (the
decoder's default k), each unconstrained and under a JSON schema (response_format). Reports
tokens/s, the speculative speedup within each condition, acceptance, and the grammar's cost:
the time llguidance takes per token mask (one mask per draft step plus one per round), and its
share of the constrained run's time. Each cell is the median of 3 interleaved repetitions;
ratios are within this run. Unconstrained runs generate max_new_tokens (the demo models rarely
stop); constrained runs stop where the JSON ends.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import verispec
from verispec.bench.run import environment

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "id", "tags", "active"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["core", "io", "math", "net"]}},
                         "active": {"type": "boolean"}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
PROMPTS = ["# the package record as JSON\nrecord = ", "def load_record():\n    return ",
           "RECORD = ", "# metadata\nmeta = ", "config = json.loads('", "item = dict(",
           "# a user row\nuser = ", "payload = "]


def run_once(decoder, prompt: str, constrained: bool, speculative: bool, temperature: float,
             max_new_tokens: int) -> dict[str, float]:
    stream = decoder.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                            seed=1, speculative=speculative,
                            response_format=RESPONSE_FORMAT if constrained else None)
    started = time.perf_counter()
    for _ in stream:
        pass
    seconds = time.perf_counter() - started
    constraints = stream.run.constraints
    metrics = stream.completion.metrics
    return {"seconds": seconds, "tokens": len(stream.completion.token_ids),
            "drafted": metrics.num_drafted, "accepted": metrics.num_accepted,
            "mask_seconds": constraints.mask_seconds if constraints else 0.0,
            "masks": constraints.num_masks if constraints else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" /
                                              "structured_output.json"))
    args = parser.parse_args()
    decoder = verispec.load()
    decoder.generate("x = ", max_new_tokens=8, response_format=RESPONSE_FORMAT)  # warm-up
    rows = []
    print(f"| T | condition | plain tok/s | speculative tok/s (k = {decoder.num_draft_tokens}) "
          "| speedup | acceptance | mask ms/token | mask share |")
    print("|---|---|---|---|---|---|---|---|")
    for temperature in (0.0, 0.8):
        for constrained in (False, True):
            totals: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(args.repeats):  # plain and speculative interleaved
                for speculative in (False, True):
                    runs = [run_once(decoder, p, constrained, speculative, temperature,
                                     args.max_new_tokens) for p in PROMPTS]
                    totals[speculative].append({key: sum(r[key] for r in runs)
                                                for key in runs[0]})
            cells = {speculative: sorted(values, key=lambda t: t["seconds"])[len(values) // 2]
                     for speculative, values in totals.items()}
            plain, spec = cells[False], cells[True]
            plain_rate = plain["tokens"] / plain["seconds"]
            spec_rate = spec["tokens"] / spec["seconds"]
            row = {"temperature": temperature, "constrained": constrained,
                   "plain_tok_s": round(plain_rate, 1), "spec_tok_s": round(spec_rate, 1),
                   "speedup": round(spec_rate / plain_rate, 2),
                   "acceptance": round(spec["accepted"] / max(spec["drafted"], 1), 3),
                   "tokens_plain": plain["tokens"], "tokens_spec": spec["tokens"],
                   "mask_ms": round(1e3 * spec["mask_seconds"] / max(spec["masks"], 1), 4),
                   "mask_share": round(spec["mask_seconds"] / spec["seconds"], 4),
                   "masks_per_token": round(spec["masks"] / max(spec["tokens"], 1), 2)}
            rows.append(row)
            label = "JSON schema" if constrained else "unconstrained"
            mask = (f"{row['mask_ms']:.3f} | {100 * row['mask_share']:.1f}%" if constrained
                    else "- | -")
            print(f"| {temperature:g} | {label} | {row['plain_tok_s']:.0f} | "
                  f"{row['spec_tok_s']:.0f} | {row['speedup']:.2f}x | {row['acceptance']:.2f} | "
                  f"{mask} |")
    Path(args.json).write_text(json.dumps({"environment": environment(), "settings": {
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "prompts": PROMPTS,
        "num_draft_tokens": decoder.num_draft_tokens, "schema": SCHEMA}, "rows": rows},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
