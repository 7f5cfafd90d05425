"""Reproduce the README benchmark table: `verispec bench` on the shipped demo pair.

    .venv/bin/python benchmarks/run_bench.py --ks 1 2 3 4 6 8   # the README table (make bench)

writes benchmarks/results/bench_cpu.{json,png,md}.

Extra arguments are passed to `verispec bench` (e.g. --device cuda --dtype bfloat16).
"""

import sys
from pathlib import Path

from verispec.cli import main

if __name__ == "__main__":
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    tag = "bench_" + ("gpu" if "cuda" in " ".join(sys.argv[1:]) else "cpu")
    sys.exit(main(["bench", "--json", str(out / f"{tag}.json"), "--plot", str(out / f"{tag}.png"),
                   "--markdown", str(out / f"{tag}.md"), *sys.argv[1:]]))
