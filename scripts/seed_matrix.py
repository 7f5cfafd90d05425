"""The whole seed-invariance product, once: seeds x proposers x k x modes x backends.

tests/engine/test_seed_invariance.py covers every setting on a rotation of 100 seeds (the suite's
time budget); this script runs the full product on the demo pair and reports, for each (backend,
proposer, k, mode), how many seeded texts equal seeded plain decoding token for token:
  alone     one request at a time, fixed k;
  batch     at most 4 rows decoded together, a row joining as soon as another leaves (rows
            end at different lengths), fixed k;
  adaptive  the same batches under a depth policy (goodput, threshold and goodput-plain in turn
            by seed, a batch of each), k its starting depth.
Seeds take T 0.7 or 1.0, top-p 0.9 on half of them and a JSON schema on one in five.

    python scripts/seed_matrix.py [--seeds 100] [--json benchmarks/results/seed_matrix.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import replace

import verispec
from verispec.bench.run import environment
from verispec.policy import named_policy
from verispec.text.demo import heldout_prompts

SCHEMA = {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"], "additionalProperties": False}}}
PROPOSERS = {"draft": {}, "ngram": {"draft": verispec.NgramDraft()}, "hybrid": {"hybrid": True}}
POLICIES = [named_policy(name) for name in ("goodput", "threshold", "goodput-plain")]
K_VALUES = (1, 2, 4, 8)
WIDTH = 4


def cases(num_seeds: int) -> list[dict]:
    """Each seed's request: prompt and settings."""
    prompts = [p for p in heldout_prompts() if len(p) <= 160]
    return [dict(prompt=prompts[i % len(prompts)], seed=10_000 + 7_919 * i,
                 temperature=(0.7, 1.0)[i % 2], top_p=(None, 0.9)[(i // 2) % 2],
                 response_format=SCHEMA if i % 5 == 3 else None, max_new_tokens=10 + i % 11)
            for i in range(num_seeds)]


def settings(case: dict) -> dict:
    return {key: value for key, value in case.items() if key != "prompt"}


def run_batches(decoder, requests: list[dict], k: int, policies=(None,)) -> list[list[int]]:
    """Token ids of every request through open batches of at most WIDTH rows at depth k, one
    per depth policy of ``policies`` (None: fixed k), request i in batch i % len(policies)."""
    out = [None] * len(requests)
    for which, policy in enumerate(policies):
        batch = decoder.open_batch(options=replace(decoder.batch_options, adaptive=policy,
                                                   num_draft_tokens=k))
        pending = deque((index, case) for index, case in enumerate(requests)
                        if index % len(policies) == which)
        while pending or len(batch):
            while pending and len(batch) < WIDTH:
                index, case = pending.popleft()
                batch.add(case["prompt"], index, **settings(case))
            for text_row, _ in batch.step():
                if text_row.completion is not None:
                    out[text_row.tag] = text_row.completion.token_ids
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    requests = cases(args.seeds)
    rows, started = [], time.time()
    for backend in ("fast", "transformers"):
        plain = verispec.load(backend=backend)
        reference = [plain.generate(case["prompt"], speculative=False, **settings(case)).token_ids
                     for case in requests]
        for proposer, extra in PROPOSERS.items():
            decoder = verispec.load(backend=backend, **extra)
            for k in K_VALUES:
                outputs = {
                    "alone": [decoder.generate(case["prompt"], num_draft_tokens=k, adaptive=None,
                                               **settings(case)).token_ids for case in requests],
                    "batch": run_batches(decoder, requests, k),
                    "adaptive": run_batches(decoder, requests, k, POLICIES)}
                for mode, tokens in outputs.items():
                    equal = sum(a == b for a, b in zip(tokens, reference))
                    rows.append(dict(backend=backend, proposer=proposer, k=k, mode=mode,
                                     equal=equal, seeds=len(requests)))
                    print(f"{backend:12} {proposer:6} k={k} {mode:8} {equal}/{len(requests)}",
                          flush=True)
    total = sum(row["equal"] for row in rows), sum(row["seeds"] for row in rows)
    print(f"all: {total[0]}/{total[1]} equal, {time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": environment(), "rows": rows}, handle,
                      indent=2)
    return 0 if total[0] == total[1] else 1


if __name__ == "__main__":
    raise SystemExit(main())
