"""Greedy suffix-drafted replies equal plain replies when the pool matches at the first round.

    .venv/bin/python benchmarks/ngram_first_round.py           # 30 chats, SmolLM2-135M Q4_1
    .venv/bin/python benchmarks/ngram_first_round.py --chats 5 --target gemma-3-270m \
        --chat-template gemma

Each copy-heavy chat (edit, repeat or reformat a given text) is sent twice to one decoder with
the suffix drafter: the second time its pool holds the first reply, so drafting starts at the
first round, while the prompt is still being decoded. Both replies are compared with plain
greedy decoding of the same chat (no draft), token for token; where they differ, the logprob
margin at the first difference is reported (docs/exactness.md states the bound). Writes
benchmarks/results/ngram_first_round.json. Not timed: an agreement check, runnable beside
other work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import verispec
from verispec.bench.run import environment
from verispec.models.llama_cpp.model import LlamaCppConfig
from verispec.proposers.suffix import SuffixDraft

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import first_difference

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "def add(a, b):\n    return a + b",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "import os\nprint(os.getcwd())",
    "The meeting is moved from Monday at 10 am to Tuesday at 2 pm.",
    "x = [1, 2, 3]\ny = [v * 2 for v in x]",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y",
]
TASKS = [
    "Repeat the following text exactly, with nothing else:\n\n{text}",
    "Fix any mistakes in this text and return all of it:\n\n{text}",
    "Rewrite this text in upper case:\n\n{text}",
]


def chats(count: int) -> list[list[dict[str, str]]]:
    prompts = [task.format(text=text) for task in TASKS for text in TEXTS]
    return [[{"role": "user", "content": prompt}] for prompt in prompts[:count]]


def margin_at(reply, other) -> dict | None:
    """Where two replies' tokens first differ, and the first reply's logprob margin there
    (None where one reply only stops sooner)."""
    position = first_difference(reply.token_ids, other.token_ids)
    if position is None:
        return None
    if position == min(len(reply.token_ids), len(other.token_ids)):
        return {"position": position, "margin": None}
    step, token = reply.logprobs[position], other.token_ids[position]
    alternatives = dict(step.top)
    return {"position": position,
            "margin": step.logprob - alternatives[token] if token in alternatives else None}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--chat-template", default=None)
    parser.add_argument("--chats", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repack", default="auto")
    parser.add_argument("--json", type=Path,
                        default=ROOT / "benchmarks/results/ngram_first_round.json")
    args = parser.parse_args(argv)
    config = LlamaCppConfig(repack=args.repack)
    drafted = verispec.load(args.target, SuffixDraft(), chat_template=args.chat_template,
                            llama_cpp_config=config)
    plain = verispec.load(args.target, None, chat_template=args.chat_template,
                          llama_cpp_config=config)
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "logprobs": 5}
    rows = []
    for index, messages in enumerate(chats(args.chats)):
        reference = plain.chat(messages, speculative=False, **settings)
        first = drafted.chat(messages, **settings)
        second = drafted.chat(messages, **settings)  # the pool holds `first`: drafts at round 1
        row = {"chat": index, "tokens": len(reference.token_ids),
               "first_equal": first.token_ids == reference.token_ids,
               "second_equal": second.token_ids == reference.token_ids,
               "second_drafted": second.metrics.num_drafted,
               "first_difference": margin_at(reference, first) or margin_at(reference, second)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"chats": len(rows), "first_equal": sum(r["first_equal"] for r in rows),
               "second_equal": sum(r["second_equal"] for r in rows)}
    print(summary)
    args.json.write_text(json.dumps({"environment": environment(), "target": args.target,
                                     "repack": args.repack, "summary": summary, "rows": rows},
                                    indent=1) + "\n")
    return 0 if summary["second_equal"] == summary["first_equal"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
