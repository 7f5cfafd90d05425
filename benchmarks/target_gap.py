"""What a target pass costs when other work runs between passes: the v column, taken apart.

    .venv/bin/python benchmarks/target_gap.py            # demo pair, writes results/target_gap.json
    .venv/bin/python benchmarks/target_gap.py --threads 1 --blocks 4 \
        --json benchmarks/results/target_gap_1thread.json
    OMP_WAIT_POLICY=ACTIVE .venv/bin/python benchmarks/target_gap.py \
        --json benchmarks/results/target_gap_omp_active.json   # OpenMP threads never sleep
    .venv/bin/python benchmarks/target_gap.py \
        --json benchmarks/results/target_gap_loaded.json       # the 05:10 run, a busier hour

The speedup formula charges one verification pass over k + 1 tokens as one plain step. This
script measures the target's pass alone (the demo pair's target through verispec's fast path,
batch 1, greedy) in sustained patterns, so the cost can be split into its two parts:

  * rows: a pass over 1, 2, 3 or 4 tokens, back to back (nothing else runs between passes);
  * gap:  a pass over 3 tokens (k = 2) with something run before every pass, as in speculative
    decoding: the draft's two steps of a round, an idle pause as long as those steps, a
    read of 24 MB (about twice the draft's weights), or a busy wait on the clock of 0.3 ms,
    as long as the draft's steps, 3 ms and 6 ms (nothing but time passes).

Each pattern runs in blocks of consecutive passes (the first passes of a block are dropped),
the blocks of all patterns interleaved, medians reported. Ratios are within this run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import verispec
from verispec.bench.run import environment
from verispec.models.base import LMSession

CONTEXT = list(range(2, 66))  # a 64-token context; the positions used by one pass are reused


def _pass(session: LMSession, num_tokens: int) -> None:
    """One target pass over num_tokens new tokens, then rewind them (the cache is unchanged)."""
    session.extend(torch.full((1, num_tokens), 5, dtype=torch.int64))
    session.rewind(torch.tensor([num_tokens]))


def _busy_wait(seconds: float) -> Callable[[], None]:
    """Spin on the clock for ``seconds``: one core busy, no tensor op, no memory traffic, so
    only the time since the previous pass changes."""
    def wait() -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
    return wait


def time_patterns(patterns: dict[str, tuple[int, Callable[[], object] | None]],
                  target: LMSession, blocks: int, passes: int) -> dict[str, list[float]]:
    """Seconds of each timed target pass per pattern (num_tokens, what runs before each pass).

    Blocks of consecutive passes, the blocks of all patterns interleaved; the first 5 passes of
    a block still see the previous pattern and are not timed.
    """
    times: dict[str, list[float]] = {name: [] for name in patterns}
    for _ in range(blocks):
        for name, (num_tokens, between) in patterns.items():
            for i in range(passes + 5):
                if between is not None:
                    between()
                started = time.perf_counter()
                _pass(target, num_tokens)
                if i >= 5:
                    times[name].append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8, help="blocks per pattern")
    parser.add_argument("--passes", type=int, default=100, help="timed passes per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path,
                        default=Path(__file__).parent / "results" / "target_gap.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    decoder = verispec.load()  # the demo pair, float32 on CPU
    target, draft = decoder.target.new_session(), decoder.draft.new_session()
    target.start([CONTEXT])
    draft.start([CONTEXT])
    scratch = torch.ones(6 * 1024 * 1024)  # 24 MB of float32

    def draft_round() -> None:  # what a k = 2 round runs before its target pass
        _pass(draft, 2)
        _pass(draft, 1)

    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(50):
            draft_round()
        draft_round_s = (time.perf_counter() - started) / 50
        times = time_patterns({
            "1 token, back to back": (1, None),
            "2 tokens, back to back": (2, None),
            "3 tokens, back to back": (3, None),
            "4 tokens, back to back": (4, None),
            "3 tokens after the draft's 2 steps": (3, draft_round),
            "3 tokens after an idle pause as long": (3, lambda: time.sleep(draft_round_s)),
            "3 tokens after reading 24 MB": (3, lambda: float(scratch.sum())),
            "3 tokens after busy-waiting 0.3 ms": (3, _busy_wait(0.0003)),
            "3 tokens after busy-waiting as long": (3, _busy_wait(draft_round_s)),
            "3 tokens after busy-waiting 3 ms": (3, _busy_wait(0.003)),
            "3 tokens after busy-waiting 6 ms": (3, _busy_wait(0.006)),
        }, target, args.blocks, args.passes)
    base = statistics.median(times["1 token, back to back"])
    rows = [{"pattern": name, "ms": 1000 * statistics.median(t),
             "vs_one_token": statistics.median(t) / base} for name, t in times.items()]
    print(f"draft round (2 steps): {1000 * draft_round_s:.2f} ms; target pass, median of "
          f"{args.blocks * args.passes} per pattern ({args.threads} threads):")
    print(f"{'pattern':42s} {'ms':>6s} {'x 1 token':>10s}")
    for row in rows:
        print(f"{row['pattern']:42s} {row['ms']:6.2f} {row['vs_one_token']:10.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    openmp = {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    args.json.write_text(json.dumps({"environment": environment(), "threads": args.threads,
                                     "openmp_env": openmp, "draft_round_ms": 1000 * draft_round_s,
                                     "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
