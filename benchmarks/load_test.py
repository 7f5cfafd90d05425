"""Load test of ``verispec serve``: N concurrent streaming clients for M seconds, on loopback.

    python benchmarks/load_test.py --clients 16 --duration 60             # starts a demo server
    python benchmarks/load_test.py --target T --draft D --clients 4        # other models
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --server-pid 1234

Reports requests/s, completion tokens/s, p50/p99 latency and time to first token, responses by
status (and client-side exceptions), the server's acceptance rate, and the server's resident
memory (RSS) after a warm-up request and after the load; prints a table and writes JSON.
Bounded: no new request after --duration seconds or --max-requests requests, and only loopback
addresses are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    add_server_options,
    check_loopback,
    percentile,
    prompts_for,
    rss_bytes,
    served,
)


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    started: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_options(parser, "for its RSS")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (default: 4)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (default: 60)")
    parser.add_argument("--max-requests", type=int, default=10_000, help="request cap")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (default: 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--json-out", default="load_test.json", help="default: load_test.json")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 256 or not 0 < args.duration <= 3600 or args.max_requests < 1:
        parser.error("expected 1 <= --clients <= 256, 0 < --duration <= 3600, --max-requests >= 1")
    check_loopback(parser, args)
    return args


async def one_request(client: httpx.AsyncClient, body: dict, tally: Tally) -> None:
    started = time.perf_counter()
    first_token = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                tally.statuses[str(response.status_code)] += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    tally.statuses["stream-error"] += 1
                    return
                if chunk["choices"][0]["text"] and first_token is None:
                    first_token = time.perf_counter() - started
                if "usage" in chunk:
                    tally.completion_tokens += chunk["usage"]["completion_tokens"]
                    tally.drafted += chunk["speculation"]["drafted"]
                    tally.accepted += chunk["speculation"]["accepted"]
    except httpx.HTTPError as exc:
        tally.statuses[f"exception:{type(exc).__name__}"] += 1
        return
    tally.statuses["200"] += 1
    tally.latencies.append(time.perf_counter() - started)
    if first_token is not None:
        tally.first_token.append(first_token)


async def run_clients(url: str, args: argparse.Namespace, prompts: list[str], clients: int,
                      max_requests: int, duration: float) -> tuple[Tally, float]:
    """``clients`` loops, each sending one streaming request after another until ``duration``
    seconds have passed or ``max_requests`` have been sent."""
    tally = Tally()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as client:
        started = time.perf_counter()
        deadline = started + duration

        async def client_loop(index: int) -> None:
            while time.perf_counter() < deadline and tally.started < max_requests:
                prompt = prompts[(tally.started + index) % len(prompts)]
                tally.started += 1
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
                        "temperature": args.temperature, "seed": tally.started}
                await one_request(client, body, tally)

        await asyncio.gather(*(client_loop(i) for i in range(clients)))
        return tally, time.perf_counter() - started


def summarize(tally: Tally, elapsed: float, rss_before: int | None, rss_after: int | None,
              args: argparse.Namespace, url: str) -> dict[str, object]:
    ok = len(tally.latencies)
    growth = None if not rss_before or rss_after is None else (rss_after / rss_before - 1) * 100
    return {
        "url": url, "models": args.target or ("demo pair" if args.url is None else "server's"),
        "clients": args.clients, "duration_s": round(elapsed, 2), "max_tokens": args.max_tokens,
        "temperature": args.temperature, "server_threads": args.threads,
        "requests": tally.started, "ok": ok,
        "requests_per_s": ok / elapsed,
        "completion_tokens_per_s": tally.completion_tokens / elapsed,
        "latency_p50_s": percentile(tally.latencies, 50),
        "latency_p99_s": percentile(tally.latencies, 99),
        "ttft_p50_s": percentile(tally.first_token, 50),
        "ttft_p99_s": percentile(tally.first_token, 99),
        "responses_by_status": dict(tally.statuses),
        "num_5xx": sum(n for s, n in tally.statuses.items() if s.startswith("5")),
        "acceptance_rate": tally.accepted / tally.drafted if tally.drafted else None,
        "rss_before_mb": None if rss_before is None else rss_before / 2**20,
        "rss_after_mb": None if rss_after is None else rss_after / 2**20,
        "rss_growth_pct": growth,
    }


def print_table(report: dict[str, object]) -> None:
    width = max(map(len, report))
    for key, value in report.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with served(args) as (url, pid):
        prompts = prompts_for(args)
        rss_start = rss_bytes(pid)
        warmup, _ = asyncio.run(run_clients(url, args, prompts, 1, 1, args.request_timeout))
        assert warmup.latencies, f"the warm-up request failed: {dict(warmup.statuses)}"
        rss_before = rss_bytes(pid)
        tally, elapsed = asyncio.run(run_clients(url, args, prompts, args.clients,
                                                 args.max_requests, args.duration))
        rss_after = rss_bytes(pid)
    report = summarize(tally, elapsed, rss_before, rss_after, args, url)
    report["rss_at_start_mb"] = None if rss_start is None else rss_start / 2**20
    print_table(report)
    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    return 1 if report["num_5xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
