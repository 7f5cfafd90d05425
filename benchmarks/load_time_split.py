"""Where a loaded server's time goes: its forward passes by model and kind, and the rest.

    python benchmarks/load_time_split.py                     # demo servers, 1 and 16 clients
    python benchmarks/load_time_split.py --clients 16 --modes speculative

For each mode (speculative, plain) a demo server is started with a timer around every forward
pass of the fast path (``FastLlamaLM.forward`` and the packed feed, ``feed_packed``, installed
by a ``sitecustomize`` module on the server's PYTHONPATH: the library itself is not changed),
warmed up, and run at each client
count as a level of batching_load.py (the same greedy streaming clients and prompts). Per level
it prints the wall time, the tok/s, and per model (target, draft) and kind of pass:

    prefill       a packed feed, computing no logits (models/fast_llama/packed.py): the draft's
                  joining prompts, or its catching up on plain rounds' tokens and deferred
                  prompts (LMSession.feed)
    1 token       a plain decoding step (target), a draft step (draft)
    2+ tokens     a verification pass over k + 1 tokens a row (target), the draft's feed of
                  the tokens a round committed (draft)
    ... + joins   either of those carrying joining rows' prompts (the target's joins ride the
                  next round's pass: FastLlamaSession.add_rows)

with calls, seconds, share of the wall time, ms per call and tokens fed a call (rows x width,
padding included; a packed feed has none);
"outside" is the wall time no forward pass took (the engine's Python, detokenising, the event
loop and HTTP, and the level's ramp-up and tail). Writes load_time_split.json to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    MODES,
    machine,
    pass_rate,
    per_client,
    prompts_for,
    run_level,
    start_server,
    wait_until_healthy,
)

# written into the server's sitecustomize.py: times every FastLlamaLM.forward and packed feed
# by (model, kind) and dumps the totals to $VERISPEC_TIME_SPLIT every 0.2 s
HOOK = '''
import json, os, threading, time
import verispec.models.fast_llama.model as fast_llama
import verispec.models.fast_llama.session as fast_llama_session

_totals = {}
_forward = fast_llama.FastLlamaLM.forward

_feed_packed = fast_llama_session.feed_packed

def _add(lm, kind, seconds, num_tokens):
    model = getattr(lm.model.config, "_name_or_path", "") or "model"
    entry = _totals.setdefault(f"{model}|{kind}", [0, 0.0, 0])
    entry[0] += 1
    entry[1] += seconds
    entry[2] += num_tokens

def _timed(self, tokens, positions, start, cache, used, *args, **kwargs):
    began = time.perf_counter()
    logits = _forward(self, tokens, positions, start, cache, used, *args, **kwargs)
    width = tokens.shape[1]
    kind = "1 token" if width == 1 else "2+ tokens"  # the draft's prefills: packed feeds
    packed = kwargs.get("packed")  # joining prompts riding this pass
    num_tokens = tokens.numel() + (0 if packed is None else packed.tokens.shape[1])
    _add(self, kind if packed is None else kind + " + joins", time.perf_counter() - began,
         num_tokens)
    return logits

def _timed_feed(lm, cache, starts, rows):
    began = time.perf_counter()
    _feed_packed(lm, cache, starts, rows)
    _add(lm, "prefill", time.perf_counter() - began, sum(len(row) for row in rows))

def _dump():
    while True:
        time.sleep(0.2)
        path = os.environ["VERISPEC_TIME_SPLIT"]
        with open(path + ".tmp", "w") as out:
            json.dump(_totals, out)
        os.replace(path + ".tmp", path)

fast_llama.FastLlamaLM.forward = _timed
fast_llama_session.feed_packed = _timed_feed
threading.Thread(target=_dump, daemon=True).start()
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,16", help="client counts (default 1,16)")
    parser.add_argument("--requests-per-client", type=int, default=8)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", default="speculative,plain")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.mode_names = args.modes.split(",")
    unknown = [m for m in args.mode_names if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    return args


def totals(path: Path) -> dict[str, list]:
    time.sleep(0.5)  # the hook dumps every 0.2 s
    return json.loads(path.read_text()) if path.exists() else {}


def split(before: dict[str, list], after: dict[str, list], wall: float) -> list[dict]:
    rows = []
    for key, (calls, seconds, tokens) in after.items():
        old_calls, old_seconds, old_tokens = before.get(key, (0, 0.0, 0))
        if calls > old_calls:
            model, kind = key.split("|")
            rows.append({"model": Path(model).name or model, "kind": kind,
                         "calls": calls - old_calls, "seconds": seconds - old_seconds,
                         "tokens": tokens - old_tokens})
    rows.sort(key=lambda row: -row["seconds"])
    rows.append({"model": "", "kind": "outside", "calls": None, "tokens": None,
                 "seconds": wall - sum(row["seconds"] for row in rows)})
    for row in rows:
        row["share"] = row["seconds"] / wall
    return rows


def run_mode(mode: str, args: argparse.Namespace, prompts: list[str], hook_dir: Path) -> list:
    dump = hook_dir / f"{mode}.json"
    os.environ["VERISPEC_TIME_SPLIT"] = str(dump)
    server_args = Namespace(clients=max(args.client_counts), max_tokens=args.max_tokens, k=None,
                            target=None, draft=None, api_key=None, threads=None, url=None)
    server, url = start_server(server_args, MODES[mode])
    levels = []
    try:
        wait_until_healthy(url, server)
        for clients in (1, max(args.client_counts)):  # warm-up: both ends of the range
            asyncio.run(run_level(url, prompts, clients, 2, args.max_tokens))
        for clients in args.client_counts:
            before = totals(dump)
            results, wall = asyncio.run(run_level(url, prompts, clients,
                                                  per_client(args, clients), args.max_tokens))
            levels.append({"mode": mode, "clients": clients, "wall_s": wall,
                           "tokens_per_s": pass_rate(results, wall),
                           "passes": split(before, totals(dump), wall)})
            print_level(levels[-1])
    finally:  # gone before the hook's directory is removed (it writes there as it exits)
        server.terminate()
        server.wait(30)
    return levels


def print_level(level: dict) -> None:
    print(f"\n{level['mode']}, {level['clients']} clients: {level['wall_s']:.2f} s, "
          f"{level['tokens_per_s']:.0f} tok/s")
    print(f"  {'model':8} {'pass':10} {'calls':>6} {'s':>7} {'share':>6} {'ms/call':>8} "
          f"{'tok/call':>8}")
    for row in level["passes"]:
        calls = "" if row["calls"] is None else row["calls"]
        per_call = "" if not row["calls"] else f"{1e3 * row['seconds'] / row['calls']:.2f}"
        width = "" if not row["calls"] else f"{row['tokens'] / row['calls']:.1f}"
        print(f"  {row['model']:8} {row['kind']:10} {calls:>6} {row['seconds']:7.3f} "
              f"{100 * row['share']:5.1f}% {per_call:>8} {width:>8}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prompts_for(Namespace(url=None, target=None))
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "VERISPEC_TIME_SPLIT")}
    with tempfile.TemporaryDirectory() as tmp:
        hook_dir = Path(tmp)
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(hook_dir), saved["PYTHONPATH"]]))
        try:  # the servers inherit the hook through the environment
            levels = [level for mode in args.mode_names
                      for level in run_mode(mode, args, prompts, hook_dir)]
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_time_split.json").write_text(json.dumps(
        {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
         "levels": levels},
        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
