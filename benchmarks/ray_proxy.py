"""The cost of Ray Serve's proxy: `verispec serve --ray --replicas 1` against a direct `verispec
serve` with the same flags and threads, greedy streaming clients, 1 and 8 of them.

    python benchmarks/ray_proxy.py                     # both servers started here, the demo pair
    python benchmarks/ray_proxy.py --clients 1,8,16 --repeats 5 --threads 2
    python benchmarks/ray_proxy.py --direct-url URL --ray-url URL   # servers already running

The Ray server is the command on a local Ray it starts itself (one replica reserving --threads
CPUs and running that many torch threads; the direct server runs the same threads). Both servers
run at once, so Ray's own idle processes (its control store, raylet, Serve's controller) weigh on
both sides alike and the difference is the proxy's path: the proxy process, its routing and the
hop to the replica. Each client count runs on each server in turn, the order turning each repeat;
a level's tok/s is the median of its passes and the ratio the median of its per-pass ratios (a
shared machine's speed drifts within minutes). Time to first token is pooled over the passes (p50,
p99). Every reply is compared with the direct server's text for its prompt sent alone (greedy:
they must be equal). Prints a table; writes ray_proxy.json to --out-dir (default
benchmarks/results). The clients are common.py's aiohttp clients (batching_load.py's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from argparse import Namespace
from collections import Counter
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    command_line,
    machine,
    pass_rate,
    per_client,
    percentile,
    prompts_for,
    run_level,
    served,
    start_server,
)

MODES = ("direct", "ray")
NUM_WARMUP = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8", help="client counts (default 1,8)")
    parser.add_argument("--requests-per-client", type=int, default=8,
                        help="requests each client sends per level (default 8)")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="requests each level sends at least (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per request (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps over the levels (3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of each server, and the CPUs the replica reserves "
                             "(default: the machine's cores)")
    parser.add_argument("--target", help="target model (default: the demo pair)")
    parser.add_argument("--draft", help="draft model (with --target)")
    parser.add_argument("--direct-url", help="a running `verispec serve` instead of one started")
    parser.add_argument("--ray-url", help="a running `verispec serve --ray` (its proxy)")
    parser.add_argument("--ray-ingress", default="proxy", choices=("proxy", "haproxy"),
                        help="the started command's --ray-ingress (default proxy); haproxy "
                        "writes ray_proxy_haproxy.json")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    if not all(1 <= c <= 64 for c in args.client_counts):
        parser.error("expected client counts in 1..64")
    if min(args.requests_per_client, args.max_tokens, args.repeats, args.threads) < 1:
        parser.error("expected --requests-per-client, --max-tokens, --repeats, --threads >= 1")
    if bool(args.target) != bool(args.draft):
        parser.error("--target and --draft go together")
    return args


@contextmanager
def servers(args: argparse.Namespace):
    """{mode: url}, each server healthy: the URLs given, or servers started and stopped here."""
    given = {"direct": args.direct_url, "ray": args.ray_url}
    extra = {"direct": [], "ray": ["--ray", "--replicas", "1", "--replica-cpus",
                                   str(args.threads), "--ray-ingress", args.ray_ingress]}
    with ExitStack() as stack:
        urls = {}
        for mode in MODES:
            server_args = Namespace(clients=max(args.client_counts), max_tokens=args.max_tokens,
                                    target=args.target, draft=args.draft, api_key=None,
                                    threads=args.threads, url=given[mode], server_pid=None)
            start = partial(start_server, extra=extra[mode])
            urls[mode] = stack.enter_context(served(server_args, start))[0]
        yield urls


def sweep(args: argparse.Namespace, urls: dict[str, str], prompts: list[str]) -> dict:
    """Every level on every server, --repeats times: {(mode, clients): [(results, seconds)]}."""
    passes: dict[tuple[str, int], list[tuple[list[dict], float]]] = {}
    for repeat in range(args.repeats):
        order = MODES[repeat % 2:] + MODES[:repeat % 2]
        for clients in args.client_counts:
            for mode in order:
                results, elapsed = asyncio.run(run_level(
                    urls[mode], prompts, clients, per_client(args, clients), args.max_tokens))
                passes.setdefault((mode, clients), []).append((results, elapsed))
                print(f"pass {repeat + 1}/{args.repeats} {mode:6} {clients:2} clients: "
                      f"{pass_rate(results, elapsed):7.1f} tok/s", flush=True)
    return passes


def reference_texts(urls: dict[str, str], prompts: list[str], max_tokens: int) -> dict:
    """Warm both servers up; then every prompt sent alone to the direct server."""
    for url in urls.values():
        asyncio.run(run_level(url, prompts, 1, NUM_WARMUP, max_tokens))
    alone, _ = asyncio.run(run_level(urls["direct"], prompts, 1, len(prompts), max_tokens))
    failed = Counter(r["status"] for r in alone if r["status"] != "200")
    if failed:
        raise SystemExit(f"the requests sent alone failed: {dict(failed)}")
    return {r["prompt"]: r["text"] for r in alone}


def summarize(passes: dict, reference: dict[str, str]) -> list[dict]:
    rows = []
    for (mode, clients), level in passes.items():
        results = [r for pass_results, _ in level for r in pass_results]
        ok = [r for r in results if r["status"] == "200"]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        rates = [pass_rate(pass_results, elapsed) for pass_results, elapsed in level]
        rows.append({"mode": mode, "clients": clients, "requests": len(results),
                     "statuses": dict(Counter(r["status"] for r in results)),
                     "tokens_per_s": statistics.median(rates), "tokens_per_s_passes": rates,
                     "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
                     "equal_to_direct_alone": (sum(r["text"] == reference[r["prompt"]]
                                                   for r in ok) / len(ok)) if ok else None})
    return rows


def proxy_cost(rows: list[dict]) -> dict[int, dict]:
    """Per client count: ray/direct tok/s (the median of the per-pass ratios) and the time to
    first token the proxy adds (p50 against p50)."""
    by = {(r["mode"], r["clients"]): r for r in rows}
    cost = {}
    for clients in sorted({r["clients"] for r in rows}):
        direct, ray = by["direct", clients], by["ray", clients]
        pairs = zip(ray["tokens_per_s_passes"], direct["tokens_per_s_passes"])
        ttfts = (ray["ttft_p50"], direct["ttft_p50"])
        cost[clients] = {"tokens_per_s_ratio": statistics.median(a / b for a, b in pairs if b),
                         "ttft_p50_added_s": None if None in ttfts else ttfts[0] - ttfts[1]}
    return cost


def table(rows: list[dict], cost: dict[int, dict]) -> str:
    by = {(r["mode"], r["clients"]): r for r in rows}
    lines = [("| clients | direct tok/s | ray tok/s | ray / direct | direct TTFT p50 / p99 (s) | "
              "ray TTFT p50 / p99 (s) | TTFT added p50 (ms) | texts equal (direct, ray) |"),
             "|---|---|---|---|---|---|---|---|"]
    for clients, added in cost.items():
        direct, ray = by["direct", clients], by["ray", clients]
        lines.append(
            f"| {clients} | {direct['tokens_per_s']:.0f} | {ray['tokens_per_s']:.0f} | "
            f"{added['tokens_per_s_ratio']:.2f}x | {_ttft(direct)} | {_ttft(ray)} | "
            f"{_ms(added['ttft_p50_added_s'])} | {_share(direct)}, {_share(ray)} |")
    return "\n".join(lines)


def _ttft(row: dict) -> str:
    if row["ttft_p50"] is None:
        return ""
    return f"{row['ttft_p50']:.3f} / {row['ttft_p99']:.3f}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:+.0f}"


def _share(row: dict) -> str:
    share = row["equal_to_direct_alone"]
    return "" if share is None else f"{share:.0%}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prompts_for(Namespace(url=None, target=args.target))[:16]
    with servers(args) as urls:
        reference = reference_texts(urls, prompts, args.max_tokens)
        rows = summarize(sweep(args, urls, prompts), reference)
    cost = proxy_cost(rows)
    print(table(rows, cost))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("ray_proxy.py", argv),
            "date": time.strftime("%Y-%m-%d %H:%M"), **machine(),
            "models": args.target or "demo pair", "threads": args.threads,
            "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
            "min_requests": args.min_requests, "repeats": args.repeats,
            "ray_ingress": args.ray_ingress}
    name = "ray_proxy.json" if args.ray_ingress == "proxy" else "ray_proxy_haproxy.json"
    (out / name).write_text(json.dumps(
        {**meta, "rows": rows, "proxy_cost": cost}, indent=2) + "\n")
    print(f"wrote {out}/{name}")
    return 0 if all(set(r["statuses"]) == {"200"} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
