"""Why verispec's greedy text can differ from llama-server's on the same GGUF file: each
llama-server setting that changes how the logits are computed, against verispec's plain
decoding, prompt by prompt.

    python benchmarks/llama_server_agreement.py --llama-server /path/to/llama-server

For each model (the packaged SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M) and each
prompt real_models.py sends (common.TASKS; rendered in the model's chat template, sent as
token ids), greedy up to 128 tokens, ending at the model's end-of-generation tokens (no prompt
cache; ``ignore_eos`` is not used: llama-server bans those tokens under it, where verispec
generates and keeps them, so the texts would part at the first one), from:

    verispec                      verispec plain decoding in this process (llama-cpp-python;
                                  one KV stream per sequence, prompt prefilled in one pass)
    llama -np 1                   llama-server, one slot
    llama -np 8                   eight slots (the unified KV cache shared by all slots)
    llama -np 8 --no-kv-unified   eight slots, one KV stream per slot (as verispec)
    llama -np 1 -t 1              one thread instead of two
    llama -np 1 -ub 16            the prompt processed 16 tokens at a time instead of 512

and reports, per setting, on how many prompts its tokens equal verispec's, and where the first
difference is. Writes <out>.json and <out>.md (default benchmarks/results/llama_server_agreement).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, TASKS, command_line, first_difference, machine

SETTINGS = {  # (slots, threads, extra flags)
    "llama -np 1": (1, 2, []),
    "llama -np 8": (8, 2, []),
    "llama -np 8 --no-kv-unified": (8, 2, ["--no-kv-unified"]),
    "llama -np 1 -t 1": (1, 1, []),
    "llama -np 1 -ub 16": (1, 2, ["-ub", "16"]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "llama_server_agreement"))
    return parser.parse_args(argv)


def llama_tokens(binary: str, gguf: str, flags: tuple[int, int, list[str]],
                 prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """llama-server's greedy tokens for each prompt under (slots, threads, extra flags)."""
    from verispec.bench.llama_server import start_llama_server

    parallel, threads, extra = flags
    running = start_llama_server(binary, gguf, None, 0, threads, 16384,
                                 Path(tempfile.mkdtemp()), parallel=parallel, extra_args=extra)
    try:
        with httpx.Client(timeout=600) as client:
            return [client.post(f"http://127.0.0.1:{running.port}/completion", json={
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                "cache_prompt": False, "return_tokens": True}).json()["tokens"]
                for prompt in prompts]
    finally:
        running.stop()


def _without_stop(token_ids: list[int], stop_token_ids: tuple[int, ...]) -> list[int]:
    """verispec's tokens without the end-of-generation token it ended at (llama-server's
    ``tokens`` leave it out)."""
    return token_ids[:-1] if token_ids and token_ids[-1] in stop_token_ids else token_ids


def main(argv: list[str] | None = None) -> int:
    import verispec
    from verispec.models.packaged import packaged_model_path

    args = parse_args(argv)
    rows, lines = [], []
    for model in args.models:
        package_name, template = MODELS[model]
        gguf = str(packaged_model_path(package_name))
        decoder = verispec.load(gguf, chat_template=template)
        prompts = [decoder.chat_prompt_ids([{"role": "user", "content": text}])
                   for texts in TASKS.values() for text in texts]
        reference = [_without_stop(decoder.generate(p, max_new_tokens=args.max_tokens,
                                                    speculative=False).token_ids,
                                   decoder.stop_token_ids) for p in prompts]
        del decoder
        lines += [f"### {model} ({len(prompts)} prompts, {args.max_tokens} greedy tokens)", "",
                  "| setting | prompts equal to verispec's | first differences (new-token index) |",
                  "|---|---|---|"]
        for setting, flags in SETTINGS.items():
            started = time.perf_counter()
            outputs = llama_tokens(args.llama_server, gguf, flags, prompts, args.max_tokens)
            differences = [first_difference(ref, out) for ref, out in zip(reference, outputs)]
            equal = sum(d is None for d in differences)
            rows.append({"model": model, "setting": setting, "equal": equal,
                         "prompts": len(prompts), "first_differences": differences,
                         "seconds": time.perf_counter() - started})
            shown = ", ".join(str(d) for d in differences if d is not None) or "-"
            lines.append(f"| {setting} | {equal} / {len(prompts)} | {shown} |")
            print(lines[-1], flush=True)
        lines.append("")
    table = "\n".join(lines)
    out = Path(args.out)
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command_line("llama_server_agreement.py", argv)}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(f"Machine: {meta['machine']['cpu']}, "
                                      f"{meta['machine']['cores']} cores; {meta['date']}; "
                                      f"`{meta['command']}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
