"""Drafts of other tokenizers on the coder target, in one process, one client, one run.

    python benchmarks/cross_vocab.py                      # every method, every cell
    python benchmarks/cross_vocab.py --methods plain smollm2-string --tasks complete

Target: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, the packaged name) on llama.cpp, 2 threads. The
methods, each a decoder of its own over the same file:

    plain              the target alone (speculative=False)
    qwen-0.5b          its same-vocabulary sibling, Qwen2.5-Coder-0.5B-Instruct (llama.cpp)
    smollm2-string     SmolLM2-135M-Instruct (llama.cpp, 49,152 tokens) by the string rule
    smollm2-inter      the same draft by the intersection rule
    demo-string        the shipped demo draft (transformers, 8,192 tokens) by the string rule
    suffix             the suffix drafter (no draft model)

Tasks: coder_pair.py's ``complete`` and ``edits`` chat turns, greedy and T = 0.7 (seeded), each
reply run to --max-tokens with ignore_eos so that every method does the same work. Within a
repetition the methods run one after another on each prompt, the order turning from prompt to
prompt. Per method and cell: tokens per second (completion tokens / wall seconds), the ratio
to plain measured in the same run, acceptance (accepted / drafted), target tokens per target
pass (emitted / target calls) and c, the draft's cost per step over a one-token target pass
(the draft's seconds per step, re-tokenization included, over plain's target seconds per call).
Writes <out>.json and <out>.md (default benchmarks/results/cross_vocab).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine

TARGET = "qwen2.5-coder-1.5b-instruct"
# method -> (draft, cross_vocab rule); the draft "demo" is the shipped demo pair's draft
METHODS = {
    "plain": (None, None),
    "qwen-0.5b": ("qwen2.5-coder-0.5b-instruct", None),
    "smollm2-string": ("smollm2-135m-instruct", "string"),
    "smollm2-inter": ("smollm2-135m-instruct", "intersection"),
    "demo-string": ("demo", "string"),
    "suffix": ("suffix", None),
}
TEMPS = {"greedy": 0.0, "t0.7": 0.7}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--tasks", nargs="+", default=["complete", "edits"],
                        choices=["complete", "edits", "questions"])
    parser.add_argument("--temps", nargs="+", default=list(TEMPS), choices=list(TEMPS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="passes over every prompt")
    parser.add_argument("--k", type=int, default=None, help="a fixed depth (default: goodput)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cross_vocab"))
    return parser.parse_args(argv)


def load_method(name: str, args: argparse.Namespace):
    """The decoder of one method."""
    import verispec
    from verispec.models.llama_cpp.model import LlamaCppConfig
    from verispec.proposers.suffix import SuffixDraft
    from verispec.text.demo import demo_pair

    draft, rule = METHODS[name]
    if draft == "demo":
        draft = demo_pair().draft
    elif draft == "suffix":
        draft = SuffixDraft()
    options = {"cross_vocab": rule} if rule else {}
    if args.k is not None:
        options |= {"num_draft_tokens": args.k, "adaptive": None}
    return verispec.load(TARGET, draft, llama_cpp_config=LlamaCppConfig(num_threads=args.threads),
                         **options)


def run_one(decoder, name: str, prompt: str, temperature: float, args) -> dict:
    speculative = name != "plain"
    start = time.perf_counter()
    reply = decoder.chat([{"role": "user", "content": prompt}], max_new_tokens=args.max_tokens,
                         ignore_eos=True, temperature=temperature, seed=args.seed,
                         speculative=speculative)
    seconds = time.perf_counter() - start
    metrics = reply.metrics
    return {"tokens": len(reply.token_ids), "seconds": seconds,
            "drafted": metrics.num_drafted, "accepted": metrics.num_accepted,
            "emitted": metrics.num_emitted, "target_calls": metrics.num_target_calls,
            "target_time": metrics.target_time, "draft_time": metrics.draft_time,
            "draft_steps": metrics.num_draft_steps}


def summarize(runs: list[dict]) -> dict:
    total = {key: sum(run[key] for run in runs) for key in runs[0]}
    return {"tok_s": total["tokens"] / total["seconds"],
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else None,
            "tokens_per_pass": total["emitted"] / total["target_calls"],
            "draft_step_s": (total["draft_time"] / total["draft_steps"]
                             if total["draft_steps"] else None),
            "target_call_s": total["target_time"] / total["target_calls"],
            "requests": len(runs)}


def main(argv: list[str] | None = None) -> int:
    from coder_pair import CODER_TASKS  # the same chat turns as the coder-pair benchmark

    args = parse_args(argv)
    decoders = {name: load_method(name, args) for name in args.methods}
    cells = [(task, temp) for task in args.tasks for temp in args.temps]
    runs: dict[tuple[str, str, str], list[dict]] = {}
    turn = 0
    for _ in range(args.repeats):
        for task, temp in cells:
            for prompt in CODER_TASKS[task]:
                order = args.methods[turn % len(args.methods):] + args.methods[
                    :turn % len(args.methods)]
                turn += 1
                for name in order:
                    run = run_one(decoders[name], name, prompt, TEMPS[temp], args)
                    runs.setdefault((task, temp, name), []).append(run)
                    print(f"{task} {temp} {name}: {run['tokens'] / run['seconds']:.2f} tok/s",
                          file=sys.stderr, flush=True)
    results = report(runs, decoders, cells, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(results, indent=2))
    Path(args.out + ".md").write_text(markdown(results))
    print(markdown(results))
    return 0


def report(runs, decoders, cells, args) -> dict:
    rows = []
    for task, temp in cells:
        plain = summarize(runs[(task, temp, "plain")]) if "plain" in args.methods else None
        for name in args.methods:
            summary = summarize(runs[(task, temp, name)])
            summary |= {"task": task, "temp": temp, "method": name,
                        "rule": decoders[name].cross_vocab,
                        "vs_plain": summary["tok_s"] / plain["tok_s"] if plain else None}
            rows.append(with_cost_ratio(summary, plain))
    return {"command": command_line("cross_vocab.py", sys.argv[1:]),
            "machine": machine(), "target": TARGET, "max_tokens": args.max_tokens,
            "threads": args.threads, "rows": rows,
            "mean_vs_plain": {name: statistics.mean(r["vs_plain"] for r in rows
                                                    if r["method"] == name and r["vs_plain"])
                              for name in args.methods if name != "plain"}}


def with_cost_ratio(row: dict, plain: dict | None) -> dict:
    """``row`` with c: its draft's seconds per step over its cell's plain one-token pass."""
    drafts = row["draft_step_s"] and plain is not None
    return row | {"c": row["draft_step_s"] / plain["target_call_s"] if drafts else None}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    lines = [f"# Drafts of other tokenizers on {results['target']}", "",
             f"`{results['command']}`", "", f"Machine: {results['machine']}", "",
             "| task | temp | method | rule | tok/s | vs plain | acceptance | tokens/pass | c |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['task']} | {row['temp']} | {row['method']} | "
                     f"{row['rule'] or '-'} | {row['tok_s']:.2f} | "
                     f"{_fmt(row['vs_plain'], '.2f')} | {_fmt(row['acceptance'], '.2f')} | "
                     f"{row['tokens_per_pass']:.2f} | {_fmt(row['c'], '.3f')} |")
    lines += ["", "Mean ratio to plain over the cells: " + ", ".join(
        f"{name} {value:.2f}x" for name, value in results["mean_vs_plain"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
