"""What CUDA graphs save on a pair's decoding steps: each step run through a session of the
fast backend eagerly (``load(..., cuda_graphs=False)``) against the same step replayed as a
captured graph (the default on CUDA, models/fast_llama/step_graphs.py).

    python benchmarks/cuda_graph_steps.py                       # the demo pair, bf16, CUDA
    python benchmarks/cuda_graph_steps.py --target T --draft D --dtype float32

Each case is one model, a number of rows and tokens a row (1: a decoding step or a draft
step; 2-9: a verification pass of k = 1-8), all rows at one position after a 40-token prompt:
``session.extend`` then ``session.rewind`` of what it fed, so the host's share of a step (the
graph's input copies and bucket lookup, or the eager path's op dispatch) is in the time.
Medians of --repeats timed calls, each followed by a device sync. "same argmax": every row's
greedy token agrees between the two (a graph attends over a padded key range, so in bfloat16
its logits may differ from the eager step's in the last bits; "max |diff|" says how much).
Writes cuda_graph_steps.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import verispec

CASES = ((1, 1), (1, 3), (1, 5), (1, 9), (16, 1), (16, 3), (16, 5))  # (rows, tokens a row)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target model directory (default: the demo target)")
    parser.add_argument("--draft", help="draft model directory (default: the demo draft)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    return parser.parse_args(argv)


def median_ms(step, repeats: int) -> float:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2] * 1e3


def measure(eager_lm, graphed_lm, rows: int, width: int, repeats: int) -> dict:
    """One case: the median ms of a step (extend + rewind) through an eager session and a
    graphed one, and how their logits compare."""
    tokens = torch.full((rows, width), 11, dtype=torch.int64, device=eager_lm.device)
    logits, medians = [], []
    for lm in (eager_lm, graphed_lm):
        session = lm.new_session()
        session.start([[7] * 40] * rows)

        def step(session=session) -> torch.Tensor:
            out = session.extend(tokens)
            session.rewind([width] * rows)
            return out

        medians.append(median_ms(step, repeats))
        logits.append(step().float())
    same_argmax = bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))
    return {"rows": rows, "tokens_a_row": width, "eager_ms": medians[0], "graph_ms": medians[1],
            "speedup": medians[0] / medians[1], "same_argmax": same_argmax,
            "max_abs_diff": float((logits[0] - logits[1]).abs().max())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_steps: needs a CUDA device", file=sys.stderr)
        return 2
    eager, graphed = (verispec.load(args.target, args.draft, device="cuda", dtype=args.dtype,
                                    cuda_graphs=graphs) for graphs in (False, True))
    results = []
    print("| model | rows | tokens a row | eager ms | graphed ms | speedup | same argmax | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("draft", "target"):
        for rows, width in CASES:
            row = {"model": name, **measure(getattr(eager, name), getattr(graphed, name), rows,
                                            width, args.repeats)}
            results.append(row)
            print(f"| {name} | {rows} | {width} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} "
                  f"| {row['speedup']:.1f}x | {row['same_argmax']} | {row['max_abs_diff']:.3g} |",
                  flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "dtype": args.dtype, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "models": {"target": args.target or "demo", "draft": args.draft or "demo"}}
    (out / "cuda_graph_steps.json").write_text(json.dumps({**meta, "cases": results}, indent=2)
                                               + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
