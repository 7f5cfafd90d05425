"""What CUDA graphs would save on a pair's forward steps: each step run eagerly (the fast
backend's forward, as decoding runs it today) against the same step captured once in a CUDA
graph and replayed. A measurement for the GPU work ahead, not a feature: verispec does not
capture graphs yet.

    python benchmarks/cuda_graph_steps.py                       # the demo pair, bf16, CUDA
    python benchmarks/cuda_graph_steps.py --target T --draft D --dtype float32

Each case is one model, a number of rows and tokens a row (1: a decoding step or a draft
step; 2-5: a verification pass), all rows at one position after a 40-token prompt, so that
the step's shapes are fixed while it replays. Medians of --repeats timed calls, each followed
by a device sync. "same logits": the replay's logits equal the eager step's bit for bit (a
graph replays the same kernels). Writes cuda_graph_steps.json to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec.models.attention import attention_kernels

CASES = ((1, 1), (1, 5), (16, 1), (16, 2))  # (rows, tokens a row)


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


def measure(lm, rows: int, width: int, repeats: int) -> dict:
    """One case: eager and graph-replayed medians (ms) of ``lm``'s step."""
    device = lm.device
    session = lm.new_session()
    session.start([[7] * 40] * rows)
    start = session.lengths[0]
    used = start + width
    session.cache.ensure(used)
    tokens = torch.full((rows, width), 11, dtype=torch.int64, device=device)

    def eager() -> torch.Tensor:
        with torch.inference_mode(), attention_kernels(device):
            return lm.forward(tokens, None, start, session.cache, used, width - 1)

    eager_ms = median_ms(eager, repeats)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's docs ask
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = eager()
    graph_ms = median_ms(graph.replay, repeats)
    return {"rows": rows, "tokens_a_row": width, "eager_ms": eager_ms, "graph_ms": graph_ms,
            "speedup": eager_ms / graph_ms, "same_logits": bool(torch.equal(captured, eager()))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graph_steps: needs a CUDA device", file=sys.stderr)
        return 2
    decoder = verispec.load(args.target, args.draft, device="cuda", dtype=args.dtype)
    results = []
    print("| model | rows | tokens a row | eager ms | graph replay ms | speedup | same logits |")
    print("|---|---|---|---|---|---|---|")
    for name, lm in (("draft", decoder.draft), ("target", decoder.target)):
        for rows, width in CASES:
            row = {"model": name, **measure(lm, rows, width, args.repeats)}
            results.append(row)
            print(f"| {name} | {rows} | {width} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} "
                  f"| {row['speedup']:.1f}x | {row['same_logits']} |", flush=True)
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
