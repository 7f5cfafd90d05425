"""What one target pass over n tokens costs, by weight type and kernel: is a file a good
speculative target on this CPU?

    .venv/bin/python benchmarks/pass_costs.py              # llama.cpp types + the demo target
    .venv/bin/python benchmarks/pass_costs.py --source model.gguf --types Q4_0 Q4_K_M

Speculative decoding pays when verifying k + 1 tokens costs little more than one token:
c(n) = cost(n tokens) / cost(1 token) is the pass-cost curve the depth policy prices. On a CPU
the weight type decides it. llama.cpp (models/llama_cpp/kernels.py) runs repacked Q4_0 and Q4_K
matrices as a GEMM over the pass's tokens, reading each weight once for all of them, while
Q4_1, Q5_K, Q6_K and Q8_0 go row by row for each token; AMX (where it runs) takes most types.
This script quantizes one source GGUF into each type with llama.cpp's own quantizer
(llama_model_quantize, requantizing where the source is quantized: the speed, not the quality,
is measured), loads each with repacking on ("auto") and off, and times passes of
n = 1, 2, 3, 4, 5, 8, 16 tokens at a fixed context (each pass is rewound), n in a shuffled order
per repetition, medians reported. The demo target on verispec's PyTorch fast path is measured
the same way (n = 1 .. 9) for comparison.

Writes a table and benchmarks/results/pass_costs.json. Run it on an idle machine: llama.cpp's
threads collapse when another process shares the cores.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec.bench.run import environment
from verispec.models.fast_llama.model import FastLlamaLM
from verispec.models.llama_cpp.model import (
    LlamaCppConfig,
    LlamaCppLM,
    LlamaCppModel,
    bindings,
)
from verispec.models.packaged import packaged_model_path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q6_K", "Q8_0")
LLAMA_NS = (1, 2, 3, 4, 5, 8, 16)
TORCH_NS = tuple(range(1, 10))
CONTEXT = 64  # prompt tokens before the timed passes


def quantized(source: Path, weight_type: str, folder: Path) -> Path:
    """``source`` requantized to ``weight_type`` by llama.cpp (cached in ``folder``)."""
    llama_cpp = bindings()
    target = folder / f"{source.stem}.{weight_type}.gguf"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{weight_type}")
    params.allow_requantize = True
    params.nthread = 0
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                      params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {weight_type}")
    return target


def time_passes(session, ns: tuple[int, ...], repetitions: int) -> dict[int, float]:
    """Median ms of one pass over n new tokens (then rewound), per n."""
    session.start([list(range(10, 10 + CONTEXT))])
    samples: dict[int, list[float]] = {n: [] for n in ns}
    order = random.Random(0)
    for repetition in range(repetitions + 2):
        shuffled = list(ns)
        order.shuffle(shuffled)
        for n in shuffled:
            tokens = torch.full((1, n), 11, dtype=torch.int64)
            start = time.perf_counter()
            session.extend(tokens)
            elapsed = time.perf_counter() - start
            session.rewind(torch.tensor([n]))
            if repetition >= 2:  # the first two rounds warm caches and thread pools
                samples[n].append(elapsed * 1e3)
    return {n: statistics.median(values) for n, values in samples.items()}


def llama_rows(source: Path, types: list[str], repetitions: int, folder: Path) -> list[dict]:
    rows = []
    for weight_type in types:
        path = quantized(source, weight_type, folder)
        for repack in ("auto", "off"):
            model = LlamaCppModel(path, config=LlamaCppConfig(repack=repack))
            costs = time_passes(LlamaCppLM(model).new_session(), LLAMA_NS, repetitions)
            rows.append({"engine": "llama.cpp", "model": source.stem, "type": weight_type,
                         "repack": repack, "buffers": model.weight_buffers, "ms": costs})
            print(_line(rows[-1]), flush=True)
    return rows


def torch_rows(repetitions: int) -> list[dict]:
    """The demo target on the fast path, float32, with each matmul kernel (matmul.py): ATen
    (MKL on x86) and packed oneDNN, whatever "auto" picks on this CPU; then the demo draft as
    "auto" loads it (its step against the target's is the cost ratio c)."""
    decoder = verispec.load()
    rows = []
    for matmul in ("aten", "onednn"):
        target = FastLlamaLM(decoder.target.model, decoder.target.vocab_size, matmul=matmul)
        costs = time_passes(target.new_session(), TORCH_NS, repetitions)
        rows.append({"engine": f"torch ({matmul})", "model": "demo target", "type": "F32",
                     "repack": "-", "buffers": {}, "ms": costs,
                     "auto": decoder.target.matmul == matmul})
        print(_line(rows[-1]), flush=True)
    costs = time_passes(decoder.draft.new_session(), TORCH_NS, repetitions)
    rows.append({"engine": f"torch ({decoder.draft.matmul})", "model": "demo draft",
                 "type": "F32", "repack": "-", "buffers": {}, "ms": costs, "auto": True})
    print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    costs = row["ms"]
    ratios = " ".join(f"c({n})={costs[n] / costs[1]:.2f}" for n in costs if n > 1)
    kernels = "+".join(sorted(set(row["buffers"]) - {"CPU_Mapped"})) or "plain"
    return (f"{row['engine']:<18} {row['type']:<7} repack={row['repack']:<4} {kernels:<11} "
            f"1 token {costs[1]:7.2f} ms  {ratios}")


def markdown(rows: list[dict], env: dict) -> str:
    ns = sorted({n for row in rows for n in row["ms"]})
    lines = [f"Pass cost by weight type, {env['processor']}, {env['date']}, torch threads "
             f"{env['threads']}: ms for one token, then c(n) = cost(n) / cost(1).", "",
             "| engine | model | type | repack | kernels | 1 token (ms) | "
             + " | ".join(f"c({n})" for n in ns if n > 1) + " |",
             "|" + "---|" * (6 + len(ns) - 1)]
    for row in rows:
        costs = row["ms"]
        kernels = "+".join(sorted(set(row["buffers"]) - {"CPU_Mapped"})) or "plain"
        cells = [f"{costs[n] / costs[1]:.2f}" if n in costs else "" for n in ns if n > 1]
        lines.append(f"| {row['engine']} | {row['model']} | {row['type']} | {row['repack']} | "
                     f"{kernels} | {costs[1]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None,
                        help="GGUF file to quantize (default: the packaged SmolLM2-135M)")
    parser.add_argument("--types", nargs="*", default=list(TYPES), choices=TYPES,
                        help="llama.cpp weight types (none: the demo target's rows only)")
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--no-torch", action="store_true", help="skip the demo target row")
    parser.add_argument("--cache", type=Path, default=ROOT / "build" / "pass-costs")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/pass_costs.json")
    parser.add_argument("--markdown", type=Path,
                        default=ROOT / "benchmarks/results/pass_costs.md")
    args = parser.parse_args(argv)
    source = args.source or packaged_model_path("smollm2-135m-instruct")
    rows = llama_rows(source, args.types, args.repetitions, args.cache) if args.types else []
    if not args.no_torch:
        rows += torch_rows(args.repetitions)
    env = environment()
    args.json.write_text(json.dumps({"environment": env, "context": CONTEXT, "rows": rows},
                                    indent=1) + "\n")
    args.markdown.write_text(markdown(rows, env))
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
