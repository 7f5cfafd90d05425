"""Continuous batching under load: 1, 4, 8 and 16 concurrent streaming clients, speculative and
plain (``--no-draft``) servers, on loopback.

    python benchmarks/batching_load.py                        # the demo pair, greedy, 48 tokens
    python benchmarks/batching_load.py --clients 1,16 --requests-per-client 2
    python benchmarks/batching_load.py --server-arg=--max-batch-size=8 --server-args "--k 2"

A demo server is started for each mode (common.start_server; extra flags with --server-arg
or --server-args, other models with --target/--draft; with --port P, P and P + 1), warmed up
with two requests, and every prompt is sent alone to it (the reference texts). Then each client
count runs on each mode in turn (the servers are up together, the idle one waits without using
the CPU): that many clients sending --requests-per-client greedy streaming requests back to back,
more each where that sends fewer than --min-requests in all (client i sends prompts i, i + 1,
... of the first 16 held-out prompts, so the clients send different prompts at the same time).
The sweep over the levels runs --repeats times (3): a level's tok/s is the median of its passes
(their range is in the table), its other figures pool all its requests.
The clients are aiohttp's (as vLLM's serving benchmark): its C parser reads a stream for about a
third of the CPU httpx took, which on a machine the clients share with the servers came out of
the servers' share (paired 16-client runs on 2 cores: 16-23% more tok/s with aiohttp).
Per level: aggregate completion tok/s and requests/s, TTFT and latency p50/p99, the mean draft
depth the server chose (speculation.mean_num_draft_tokens, weighted by tokens), the share of
requests whose text equals the same prompt sent alone (and where the others first differ),
replies by status, and the server's RSS. Ratios (speculative/plain at each client count, each
mode at N clients over 1 client) are taken within the run. Writes batching_load.{json,md,png}
to --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    MODES,
    command_line,
    first_difference,
    machine,
    pass_rate,
    per_client,
    percentile,
    prompts_for,
    rss_bytes,
    run_level,
    start_server,
    wait_until_healthy,
)

NUM_WARMUP = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8,16", help="client counts (default 1,4,8,16)")
    parser.add_argument("--requests-per-client", type=int, default=8,
                        help="requests each client sends per level (default 8: with 4, a level "
                             "at 16 clients lasted ~3 s, and its tail, the last requests "
                             "finishing in a batch that empties, weighed on the rate)")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="requests each level sends at least: fewer clients send more each "
                             "(default 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per request (default 48)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="sweeps over every level (default 3); a level's tok/s is the median "
                             "(a 2-core VM's speed drifts by 20-30%% within minutes)")
    parser.add_argument("--modes", default="speculative,plain")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `verispec serve` flag, e.g. --server-arg=--adaptive=goodput")
    parser.add_argument("--server-args", default="",
                        help='extra `verispec serve` flags in one string, e.g. "--k 2 --threads 2"')
    parser.add_argument("--target", help="target model for the servers (default: the demo pair)")
    parser.add_argument("--draft", help="draft model for the speculative server (with --target)")
    parser.add_argument("--threads", type=int, help="torch threads of the servers")
    parser.add_argument("--port", type=int, help="the servers' port (default: a free one)")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.mode_names = args.modes.split(",")
    args.extra = args.server_arg + shlex.split(args.server_args)
    if not all(1 <= c <= 64 for c in args.client_counts) or not set(args.mode_names) <= set(MODES):
        parser.error("expected client counts in 1..64 and modes among speculative,plain")
    if args.requests_per_client < 1 or args.max_tokens < 1 or args.repeats < 1:
        parser.error("expected --requests-per-client, --max-tokens and --repeats >= 1")
    if (args.draft and not args.target) or (args.target and not args.draft
                                            and "speculative" in args.mode_names):
        parser.error("--draft needs --target, and --target needs --draft for the speculative mode")
    return args


def mean_k(results: list[dict]) -> float | None:
    """The draft depth the server chose for these requests, weighted by their tokens (None for
    a plain server)."""
    weighted = [(r["k"], r["tokens"]) for r in results
                if r["status"] == "200" and r["k"] is not None]
    if not weighted:
        return None
    return sum(k * n for k, n in weighted) / max(1, sum(n for _, n in weighted))


def summarize(results: list[dict], elapsed: float, reference: dict[str, str], rss: int | None,
              clients: int, mode: str) -> dict:
    ok = [r for r in results if r["status"] == "200"]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    differ = [{"prompt": r["prompt"][:60], "offset": first_difference(r["text"],
                                                                      reference[r["prompt"]])}
              for r in ok if r["text"] != reference[r["prompt"]]]
    return {"mode": mode, "clients": clients, "requests": len(results),
            "non_200": len(results) - len(ok),
            "statuses": dict(Counter(r["status"] for r in results)),
            "tokens_per_s": pass_rate(results, elapsed), "requests_per_s": len(ok) / elapsed,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "latency_p50": percentile([r["latency"] for r in ok], 50),
            "latency_p99": percentile([r["latency"] for r in ok], 99),
            "mean_k": mean_k(results),
            "equal_alone": 1 - len(differ) / len(ok) if ok else None, "differ": differ,
            "rss_mib": None if rss is None else rss / 2**20, "seconds": elapsed}


def reference_texts(url: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Warm the server up, then send every prompt alone: the texts each level is compared to."""
    asyncio.run(run_level(url, prompts, 1, NUM_WARMUP, max_tokens))
    alone, _ = asyncio.run(run_level(url, prompts, 1, len(prompts), max_tokens))
    failed = Counter(r["status"] for r in alone if r["status"] != "200")
    if failed:
        raise SystemExit(f"the requests sent alone failed: {dict(failed)}")
    return {r["prompt"]: r["text"] for r in alone}


def start_mode(mode: str, args: argparse.Namespace, prompts: list[str]):
    """(server process, url, reference texts) for one mode."""
    server_args = Namespace(clients=max(args.client_counts), max_tokens=args.max_tokens, k=None,
                            target=args.target, draft=args.draft if mode == "speculative" else None,
                            api_key=None, threads=args.threads, url=None)
    port = None if args.port is None else args.port + args.mode_names.index(mode)
    server, url = start_server(server_args, MODES[mode] + args.extra, port)
    try:
        wait_until_healthy(url, server)
        return server, url, reference_texts(url, prompts, args.max_tokens)
    except BaseException:
        server.terminate()
        raise


def run_modes(args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    """Every mode's server runs at once (an idle one waits on its queue and takes no CPU); each
    client count is run on each mode back to back, so a drift of the machine's speed over the
    run falls on both sides of a ratio alike, the modes' order turning by one each repeat (in
    a fixed order, a speculative server held to plain rounds measured 1.06-1.14x the plain
    server it ran before at 16 clients; turning, 1.02x). With --repeats R the whole sweep runs
    R times: a level's tok/s is the median of its R rates, its other figures are over all its
    requests."""
    servers = {}
    try:
        for mode in args.mode_names:
            servers[mode] = start_mode(mode, args, prompts)
        passes: dict[tuple[str, int], list[tuple[list[dict], float]]] = {}
        rss: dict[tuple[str, int], int | None] = {}  # the server's RSS after the first pass
        names = list(servers)
        for repeat in range(args.repeats):
            turn = repeat % len(names)
            for clients in args.client_counts:
                for mode in names[turn:] + names[:turn]:
                    url = servers[mode][1]
                    results, elapsed = asyncio.run(run_level(
                        url, prompts, clients, per_client(args, clients), args.max_tokens))
                    passes.setdefault((mode, clients), []).append((results, elapsed))
                    if repeat == 0:  # later sweeps would show the larger levels' peak
                        rss[mode, clients] = rss_bytes(servers[mode][0].pid)
                    k = mean_k(results)
                    print(f"pass {repeat + 1}/{args.repeats} {mode:11} {clients:2} clients: "
                          f"{pass_rate(results, elapsed):7.1f} tok/s"
                          + ("" if k is None else f", mean k {k:.2f}"), flush=True)
        rows = []
        for (mode, clients), level in passes.items():
            reference = servers[mode][2]
            row = summarize([r for results, _ in level for r in results],
                            sum(elapsed for _, elapsed in level), reference,
                            rss[mode, clients], clients, mode)
            row["tokens_per_s_passes"] = [pass_rate(results, elapsed) for results, elapsed in level]
            row["mean_k_passes"] = [mean_k(results) for results, _ in level]
            row["tokens_per_s"] = statistics.median(row["tokens_per_s_passes"])
            rows.append(row)
        return rows
    finally:
        for server, _, _ in servers.values():
            server.terminate()
        for server, _, _ in servers.values():
            server.wait(30)


def ratios(rows: list[dict]) -> dict[str, dict]:
    """speculative/plain aggregate tok/s per client count; each mode's tok/s over its 1 client.
    Each is the median of the ratios within a pass (the levels of one pass ran back to back,
    on the same state of the machine), not a ratio of the medians."""
    passes = {(r["mode"], r["clients"]): r.get("tokens_per_s_passes") or [r["tokens_per_s"]]
              for r in rows}

    def over(key: tuple[str, int], base: tuple[str, int]) -> float | None:
        if base not in passes or not all(passes[base]):
            return None
        return statistics.median(a / b for a, b in zip(passes[key], passes[base]))

    return {"speculative_over_plain": {c: over((m, c), ("plain", c))
                                       for m, c in passes if m == "speculative"},
            "over_1_client": {m: {c: over((n, c), (m, 1)) for n, c in passes if n == m}
                              for m in {m for m, _ in passes}}}


def markdown(rows: list[dict], ratio: dict[str, dict]) -> str:
    lines = ["| clients | mode | agg tok/s (passes) | x 1 client | vs plain | TTFT p50 "
             "| TTFT p99 | lat p50 | lat p99 | mean k | equal alone | non-200 | RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["clients"], r["mode"])):
        vs_plain = 1.0 if r["mode"] == "plain" else ratio["speculative_over_plain"][r["clients"]]
        passes = r.get("tokens_per_s_passes") or [r["tokens_per_s"]]
        spread = f" ({min(passes):.0f}-{max(passes):.0f})" if len(passes) > 1 else ""
        cells = [str(r["clients"]), r["mode"], f"{r['tokens_per_s']:.0f}{spread}",
                 _fmt(ratio["over_1_client"][r["mode"]][r["clients"]], ".2f", "x"),
                 _fmt(vs_plain, ".2f", "x"), _fmt(r["ttft_p50"], ".3f"),
                 _fmt(r["ttft_p99"], ".3f"), _fmt(r["latency_p50"], ".2f"),
                 _fmt(r["latency_p99"], ".2f"), _fmt(r["mean_k"], ".2f"),
                 _fmt(r["equal_alone"], ".0%"), str(r["non_200"]), _fmt(r["rss_mib"], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for clients in sorted({r["clients"] for r in rows}):
        parts = [f"{m} {by[clients]:.2f}x vs 1 client"
                 for m, by in sorted(ratio["over_1_client"].items())
                 if clients > 1 and by.get(clients) is not None]
        if ratio["speculative_over_plain"].get(clients) is not None:
            parts.insert(0, f"speculative/plain {ratio['speculative_over_plain'][clients]:.2f}x")
        if parts:
            lines.append(f"- {clients} client{'s' if clients > 1 else ''}: " + "; ".join(parts))
    return "\n".join(lines)


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else format(value, spec) + suffix


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["clients"])
        clients = [r["clients"] for r in mine]
        left.plot(clients, [r["tokens_per_s"] for r in mine], marker="o", label=mode)
        right.plot(clients, [_nan(r["ttft_p50"]) for r in mine], marker="o", label=mode)
    left.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="seconds", title="time to first token p50")
    for axis in (left, right):
        axis.set_xticks(sorted({r["clients"] for r in rows}))
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prompts_for(Namespace(url=None, target=args.target))[:16]
    rows = run_modes(args, prompts)
    ratio = ratios(rows)
    table = markdown(rows, ratio)
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = command_line("batching_load.py", argv)
    meta = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), **machine(),
            "models": args.target or "demo pair", "server_args": args.extra,
            "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
            "repeats": args.repeats,
            "min_requests": args.min_requests}
    (out / "batching_load.json").write_text(
        json.dumps({**meta, "rows": rows, "ratios": ratio}, indent=2) + "\n")
    (out / "batching_load.md").write_text(
        f"{command}  ({meta['date']}, {meta['cpu']}, {meta['cores']} cores)\n\n{table}\n")
    plot(rows, out / "batching_load.png")
    print(f"wrote {out}/batching_load.{{json,md,png}}")
    return 0 if all(r["non_200"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
