"""llama-server's draft-model speculation on the coder pair over its two knobs, to pick the
setting benchmarks/coder_pair.py runs as llama-draft-best.

    python benchmarks/llama_draft_sweep.py --llama-server /path/to/llama-server

Each setting (--spec-draft-n-max N, --spec-draft-p-min P) serves the pair alone and runs two
cells, one client: complete greedy and edits at T = 0.7; the best is the highest mean tok/s
over those cells. Prints a table and writes <out>.json (default
benchmarks/results/llama_draft_sweep).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coder_pair import TEMPS, coder_prompts, run_cell

from common import command_line, machine

CELLS = [("complete", "greedy"), ("edits", "t0.7")]
SETTINGS = [(3, 0.0), (5, 0.0), (3, 0.75), (6, 0.75)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "llama_draft_sweep"))
    args = parser.parse_args(argv)
    from verispec.bench.llama_server import start_llama_server

    paths, prompts = coder_prompts()
    rows = []
    for n_max, p_min in SETTINGS:
        extra = ["-md", paths["draft"], "-td", str(args.threads), "--spec-draft-n-max",
                 str(n_max), "--spec-draft-p-min", str(p_min)]
        server = start_llama_server(args.llama_server, paths["target"], None, 0, args.threads,
                                    4 * 2048, Path(tempfile.mkdtemp()), parallel=4,
                                    extra_args=extra)
        url = f"http://127.0.0.1:{server.port}"
        try:
            run_cell("llama-draft", url, prompts["questions"][:1], 0.0, 1, args)  # warm-up
            rates = {f"{task} {temp}": run_cell("llama-draft", url, prompts[task], TEMPS[temp],
                                                1, args)["tok_s"]
                     for task, temp in CELLS}
        finally:
            server.stop()
        rows.append({"n_max": n_max, "p_min": p_min, "tok_s": rates,
                     "mean": sum(rates.values()) / len(rates)})
        print(f"n-max {n_max} p-min {p_min:4}: " + "  ".join(
            f"{cell} {rate:5.2f}" for cell, rate in rates.items())
              + f"  mean {rows[-1]['mean']:.2f}", flush=True)
    best = max(rows, key=lambda row: row["mean"])
    print(f"best: --spec-draft-n-max {best['n_max']} --spec-draft-p-min {best['p_min']}")
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "command": command_line("llama_draft_sweep.py", argv), "rows": rows,
         "best": best}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
