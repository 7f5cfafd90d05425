"""Batched generation through the library: `Decoder.generate(list_of_prompts)` by batch size,
speculative against plain, and whether each row's greedy text equals the same prompt alone.

    python benchmarks/batching_library.py                                   # CPU, float32
    python benchmarks/batching_library.py --device cuda --dtype bfloat16    # a GPU

One call of `generate` per batch (no server, no joins: every row starts together), the demo pair,
greedy, held-out prompts (row i of a batch of B takes prompt i mod 16). Modes: plain
(`speculative=False`), speculative under the decoder's goodput policy, and any --fixed-k depths.
Modes take turns inside each repeat, the order turning each repeat; a batch size's tok/s is the
median of its repeats (after one untimed warm-up call per mode and size), ratios are medians of
per-repeat ratios against plain. "= alone" is the share of rows whose text equals the same
prompt generated alone in the same mode; on a GPU in bfloat16, kernels chosen by batch size
can round a row's logits differently, so this is a measurement there, not a guarantee.
Writes batching_library.json (batching_library_cuda.json on a GPU) to --out-dir (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import verispec
from verispec.text.demo import heldout_prompts

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="default 1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=48, help="per row (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per size and mode")
    parser.add_argument("--fixed-k", default="", help="also speculative at these depths, e.g. 2,4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.batch_sizes.split(",")]
    args.modes = ["plain", "speculative"] + [f"k={int(k)}" for k in filter(None,
                                                                          args.fixed_k.split(","))]
    if min(args.sizes + [args.max_tokens, args.repeats]) < 1:
        parser.error("expected batch sizes, --max-tokens and --repeats >= 1")
    return args


def mode_settings(mode: str) -> dict[str, object]:
    if mode == "plain":
        return {"speculative": False}
    if mode == "speculative":
        return {}
    return {"num_draft_tokens": int(mode.removeprefix("k=")), "adaptive": None}


def timed_call(decoder, prompts: list[str], max_tokens: int, mode: str) -> tuple[float, list]:
    """Seconds of one batched greedy call and its completions."""
    if decoder.target.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    completions = decoder.generate(prompts, max_new_tokens=max_tokens, **mode_settings(mode))
    return time.perf_counter() - started, completions


def run(args: argparse.Namespace) -> list[dict]:
    decoder = verispec.load(device=args.device, dtype=args.dtype)
    prompts = heldout_prompts()[:16]
    alone = {mode: [decoder.generate(prompt, max_new_tokens=args.max_tokens,
                                     **mode_settings(mode)).text for prompt in prompts]
             for mode in args.modes}
    rows = []
    for size in args.sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        for mode in args.modes:  # warm-up: kernels and the policy's first timings at this size
            timed_call(decoder, batch, args.max_tokens, mode)
        rates: dict[str, list[float]] = {mode: [] for mode in args.modes}
        equal: dict[str, list[bool]] = {mode: [] for mode in args.modes}
        mean_k: dict[str, list[float]] = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            turn = repeat % len(args.modes)
            for mode in args.modes[turn:] + args.modes[:turn]:
                seconds, completions = timed_call(decoder, batch, args.max_tokens, mode)
                rates[mode].append(sum(len(c.token_ids) for c in completions) / seconds)
                equal[mode] += [c.text == alone[mode][i % len(prompts)]
                                for i, c in enumerate(completions)]
                mean_k[mode].append(sum(c.metrics.num_drafted for c in completions)
                                    / max(1, sum(c.metrics.num_row_rounds for c in completions)))
        for mode in args.modes:
            ratios = [rate / plain for rate, plain in zip(rates[mode], rates["plain"])]
            rows.append({"batch_size": size, "mode": mode,
                         "tokens_per_s": statistics.median(rates[mode]),
                         "repeats_tokens_per_s": rates[mode],
                         "vs_plain": statistics.median(ratios),
                         "mean_k": statistics.mean(mean_k[mode]),
                         "equal_alone": sum(equal[mode]) / len(equal[mode])})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | mode | tok/s | vs plain | mean k | = alone |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch_size']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
              f"{r['vs_plain']:.2f}x | {r['mean_k']:.2f} | {100 * r['equal_alone']:.0f}% |"
              for r in rows]
    return "\n".join(lines)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return str(machine()["cpu"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    table = markdown(rows)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
              "command": command_line("batching_library.py", argv),
              "device": device_name(args.device), "dtype": args.dtype,
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
              "table": table}
    cuda = args.device.startswith("cuda")
    name = "batching_library_cuda.json" if cuda else "batching_library.json"
    (out / name).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
