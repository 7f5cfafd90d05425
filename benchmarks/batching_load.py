"""Continuous batching under load: 1, 4, 8 and 16 concurrent streaming clients, speculative and
plain (``--no-draft``) servers, on loopback.

    python benchmarks/batching_load.py                        # the demo pair, greedy, 48 tokens
    python benchmarks/batching_load.py --clients 1,16 --requests-per-client 2

For each mode a demo server is started (load_test.serve_command; extra flags with
--server-arg), every prompt is first sent alone (the reference texts), then each client count
runs that many clients sending --requests-per-client greedy streaming requests back to back.
Per level: aggregate completion tok/s, TTFT and latency p50/p99, the mean draft depth the server
chose (speculation.mean_num_draft_tokens, weighted by tokens), the share of requests whose text
equals the same prompt sent alone, non-200 replies, and the server's RSS. Ratios are taken
within the run. Writes benchmarks/results/batching_load.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load_test import (  # noqa: E402
    percentile,
    prompts_for,
    rss_bytes,
    start_server,
    wait_until_healthy,
)

MODES = {"speculative": [], "plain": ["--no-draft"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8,16", help="client counts (default 1,4,8,16)")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", default="speculative,plain")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `verispec serve` flag, e.g. --server-arg=--adaptive=goodput")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.mode_names = args.modes.split(",")
    if not all(1 <= c <= 64 for c in args.client_counts) or not set(args.mode_names) <= set(MODES):
        parser.error("expected client counts in 1..64 and modes among speculative,plain")
    return args


async def request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One greedy streaming completion: its text, status, TTFT, latency, tokens and mean k."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    out = {"prompt": prompt, "text": "", "status": "200", "ttft": None, "tokens": 0, "k": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {**out, "status": str(response.status_code)}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return {**out, "status": "stream-error"}
                for choice in chunk.get("choices", []):
                    if choice["text"] and out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - started
                    out["text"] += choice["text"]
                if chunk.get("speculation"):
                    out["k"] = chunk["speculation"].get("mean_num_draft_tokens")
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {**out, "status": f"exception:{type(exc).__name__}"}
    return {**out, "latency": time.perf_counter() - started}


async def run_level(url: str, prompts: list[str], clients: int, per_client: int,
                    max_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        async def loop(index: int) -> list[dict]:
            return [await request(client, prompts[(index * per_client + r) % len(prompts)],
                                  max_tokens) for r in range(per_client)]

        started = time.perf_counter()
        results = await asyncio.gather(*(loop(i) for i in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - started


def summarize(results: list[dict], elapsed: float, reference: dict[str, str], rss: int | None,
              clients: int, mode: str) -> dict:
    ok = [r for r in results if r["status"] == "200"]
    tokens = sum(r["tokens"] for r in ok)
    weighted = [(r["k"], r["tokens"]) for r in ok if r["k"] is not None]
    differ = [r["prompt"][:40] for r in ok if r["text"] != reference[r["prompt"]]]
    return {"mode": mode, "clients": clients, "requests": len(results),
            "non_200": len(results) - len(ok), "tokens_per_s": tokens / elapsed,
            "ttft_p50": percentile([r["ttft"] for r in ok if r["ttft"]], 50),
            "ttft_p99": percentile([r["ttft"] for r in ok if r["ttft"]], 99),
            "latency_p50": percentile([r["latency"] for r in ok], 50),
            "latency_p99": percentile([r["latency"] for r in ok], 99),
            "mean_k": (sum(k * n for k, n in weighted) / max(1, sum(n for _, n in weighted))
                       if weighted else None),
            "equal_alone": 1 - len(differ) / max(1, len(ok)), "differ": differ,
            "rss_mib": None if rss is None else rss / 2**20, "seconds": elapsed}


def run_mode(mode: str, args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    server_args = Namespace(clients=max(args.client_counts), max_tokens=args.max_tokens, k=None,
                            target=None, draft=None, api_key=None, threads=None, url=None)
    server, url = start_server(server_args, MODES[mode] + args.server_arg)
    try:
        wait_until_healthy(url, server)
        alone, _ = asyncio.run(run_level(url, prompts, 1, len(prompts), args.max_tokens))
        reference = {r["prompt"]: r["text"] for r in alone}
        rows = []
        for clients in args.client_counts:
            results, elapsed = asyncio.run(run_level(url, prompts, clients,
                                                     args.requests_per_client, args.max_tokens))
            rows.append(summarize(results, elapsed, reference, rss_bytes(server.pid), clients,
                                  mode))
            print(f"{mode:11} {clients:2} clients: {rows[-1]['tokens_per_s']:7.1f} tok/s, TTFT "
                  f"p50 {rows[-1]['ttft_p50']:.3f} s, equal alone {rows[-1]['equal_alone']:.0%}",
                  flush=True)
        return rows
    finally:
        server.terminate()
        server.wait(30)


def markdown(rows: list[dict]) -> str:
    one = {r["mode"]: r["tokens_per_s"] for r in rows if r["clients"] == 1}
    plain = {r["clients"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    lines = ["| clients | mode | agg tok/s | x 1 client | vs plain | TTFT p50 | TTFT p99 | "
             "lat p50 | lat p99 | mean k | equal alone | non-200 | RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["clients"], r["mode"])):
        vs_plain = r["tokens_per_s"] / plain[r["clients"]] if r["clients"] in plain else None
        lines.append(
            f"| {r['clients']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / one[r['mode']]:.2f}x | "
            f"{_fmt(vs_plain, '.2f')}x | {r['ttft_p50']:.3f} | "
            f"{r['ttft_p99']:.3f} | {r['latency_p50']:.2f} | {r['latency_p99']:.2f} | "
            f"{_fmt(r['mean_k'], '.2f')} | "
            f"{r['equal_alone']:.0%} | {r['non_200']} | "
            f"{_fmt(r['rss_mib'], '.0f')} |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["clients"])
        clients = [r["clients"] for r in mine]
        left.plot(clients, [r["tokens_per_s"] for r in mine], marker="o", label=mode)
        right.plot(clients, [r["ttft_p50"] for r in mine], marker="o", label=mode)
    left.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="seconds", title="time to first token p50")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prompts_for(Namespace(url=None, target=None))[:16]
    rows = [row for mode in args.mode_names for row in run_mode(mode, args, prompts)]
    table = markdown(rows)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    import os

    import torch

    meta = {"command": " ".join(["python", "benchmarks/batching_load.py"] + (argv or sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__, "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client}
    (out / "batching_load.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (out / "batching_load.md").write_text(
        f"{meta['command']}  ({meta['date']}, {cpu}, {meta['cores']} cores)\n\n{table}\n")
    plot(rows, out / "batching_load.png")
    return 0 if all(r["non_200"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
