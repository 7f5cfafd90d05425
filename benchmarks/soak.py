"""Soak test of ``verispec serve``: N concurrent clients for a long while, watching for leaks.

    python benchmarks/soak.py                                  # 10 minutes, demo pair, 16 clients
    python benchmarks/soak.py --duration 60 --sample-every 15  # a short check
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Each client sends well-formed requests one after another, cycling through /v1/completions and
/v1/chat/completions, streamed and whole, greedy and sampled (seeded), over varied prompts:
--warmup seconds, then --duration seconds more. The server process's resident memory (VmRSS)
and open file descriptors are sampled at the end of the warm-up (the baseline: the server's
memory settles in the first seconds of load), every --sample-every seconds after it, and when
the load ends; descriptors also before the clients connect and after they close. Prints a
markdown table and a summary, writes JSON, and exits 1 when any request did not end in a
complete 200 response, RSS grew by --rss-growth-limit percent or more over the baseline, or the
descriptor count moved by more than --fd-slack (under load, or from before the load to after
it). Bounded, loopback only.

What it is not: a throughput benchmark (load_test.py), or a test of outputs (tests/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    add_server_options,
    check_loopback,
    launch,
    percentile,
    prompts_for,
    rss_bytes,
    serve_command,
    served,
)

SERVING_LINE = re.compile(r"^verispec: serving .* on (http://\S+) ")
SYSTEM = "You complete Python code."


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # "200", "503", "stream-error", ...
    latencies: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    sent: int = 0

    @property
    def done(self) -> int:
        return sum(self.statuses.values())


@dataclass
class Sample:
    label: str  # "baseline", "t+60s", "end"
    elapsed_s: float
    requests_done: int
    rss_bytes: int | None
    open_fds: int | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_options(parser, "RSS, fds")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--duration", type=float, default=600.0,
                        help="seconds of load after the warm-up (default: 600)")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds of the same load before the baseline sample (default: 30; "
                        "RSS settles in about 15 s on the demo pair)")
    parser.add_argument("--sample-every", type=float, default=60.0,
                        help="seconds between RSS / fd samples (default: 60)")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (default: 32)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--rss-growth-limit", type=float, default=10.0,
                        help="fail at this RSS growth over the baseline, in %% (default: 10)")
    parser.add_argument("--fd-slack", type=int, default=8,
                        help="fail when open fds move by more than this (default: 8)")
    parser.add_argument("--json", default="benchmarks/results/soak.json",
                        help="default: benchmarks/results/soak.json")
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 256 or not 0 < args.duration <= 6 * 3600:
        parser.error("expected 1 <= --clients <= 256 and 0 < --duration <= 21600")
    if not 1 <= args.sample_every <= args.duration or args.max_tokens < 1 or args.warmup < 0:
        parser.error("expected 1 <= --sample-every <= --duration, --max-tokens >= 1 and "
                     "--warmup >= 0")
    check_loopback(parser, args)
    if args.server_pid and not args.url:
        parser.error("--server-pid goes with --url")
    return args


def open_fds(pid: int | None) -> int | None:
    if pid is None:
        return None
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``verispec serve`` on a port the OS picks (--port 0); its URL from the startup line.
    stdout and stderr go to files, not pipes: a full pipe (uvicorn's access log) would stall it."""
    stdout = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".out")
    server = launch(serve_command(args, 0), stdout=stdout)
    server.stdout_file = stdout  # type: ignore[attr-defined]  (kept open while it runs)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        for line in Path(stdout.name).read_text().splitlines():
            match = SERVING_LINE.match(line)
            if match:
                return server, match.group(1)
        time.sleep(0.2)
    server.kill()
    server.wait(30)
    log = server.log  # type: ignore[attr-defined]
    log.seek(0)
    sys.exit(f"the server printed no 'verispec: serving' line (exit {server.returncode}):\n"
             f"{log.read()}")


def request_for(n: int, prompts: list[str], max_tokens: int) -> tuple[str, dict]:
    """The n-th request: chat or completion, streamed or whole, greedy or sampled (alternating
    in that order of periods 2, 4, 8), prompt n mod len(prompts); half the streams ask for
    usage."""
    prompt = prompts[n % len(prompts)]
    stream, greedy = (n // 2) % 2 == 0, (n // 4) % 2 == 0
    body: dict[str, object] = {"max_tokens": max_tokens, "stream": stream}
    body |= {"temperature": 0} if greedy else {"temperature": 0.8, "top_p": 0.95, "seed": n}
    if stream and n % 16 < 8:
        body["stream_options"] = {"include_usage": True}
    if n % 2:
        body["messages"] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> None:
    """Send one request; count its outcome: the status, or what went wrong in a 200 stream
    (an error event, no [DONE]), or the client-side exception."""
    started = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                tally.statuses[str(response.status_code)] += 1
                return
            if body["stream"]:
                outcome, tokens = await read_stream(response)
            else:
                payload = json.loads(await response.aread())
                outcome, tokens = "200", payload["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        tally.statuses[f"exception:{type(exc).__name__}"] += 1
        return
    tally.statuses[outcome] += 1
    if outcome == "200":
        tally.latencies.append(time.perf_counter() - started)
        tally.completion_tokens += tokens


async def read_stream(response: httpx.Response) -> tuple[str, int]:
    """("200", completion tokens if usage was sent) for a stream ending in [DONE] without an
    error event; ("stream-error" | "stream-truncated", 0) otherwise."""
    tokens, done = 0, False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            return "stream-error", 0
        tokens += chunk.get("usage", {}).get("completion_tokens", 0)
    return ("200", tokens) if done else ("stream-truncated", 0)


async def soak(url: str, pid: int | None, args: argparse.Namespace,
               prompts: list[str]) -> tuple[Tally, list[Sample], dict[str, int | None]]:
    """--warmup seconds of load, the baseline sample, --duration seconds of load sampled every
    --sample-every seconds, a last sample; fds also before the clients connect and after."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    fds = {"before_clients": open_fds(pid)}
    tally, samples = Tally(), []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.request_timeout,
                                 limits=httpx.Limits(max_connections=args.clients + 4)) as client:
        baseline_at = time.perf_counter() + args.warmup
        deadline = baseline_at + args.duration

        def sample(label: str) -> None:
            samples.append(Sample(label, time.perf_counter() - baseline_at, tally.done,
                                  rss_bytes(pid), open_fds(pid)))
            print(f"  {label:>9}: {tally.done} requests, {dict(tally.statuses)}", file=sys.stderr)

        async def sampler() -> None:
            await asyncio.sleep(baseline_at - time.perf_counter())
            sample("baseline")
            ticks = 1
            while baseline_at + ticks * args.sample_every < deadline:
                await asyncio.sleep(baseline_at + ticks * args.sample_every - time.perf_counter())
                sample(f"t+{ticks * args.sample_every:g}s")
                ticks += 1

        async def client_loop() -> None:
            while time.perf_counter() < deadline:
                n = tally.sent
                tally.sent += 1
                await one_request(client, *request_for(n, prompts, args.max_tokens), tally)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(client_loop() for _ in range(args.clients)))
        await sampling  # done: its last tick was before the deadline
        sample("end")
    await asyncio.sleep(2)  # the server closes its side of the connections
    fds["after_clients"] = open_fds(pid)
    return tally, samples, fds


def summarize(tally: Tally, samples: list[Sample], fds: dict[str, int | None],
              args: argparse.Namespace, url: str) -> dict[str, object]:
    baseline, end = samples[0], samples[-1]
    rss_growth = (None if baseline.rss_bytes is None or end.rss_bytes is None
                  else (end.rss_bytes / baseline.rss_bytes - 1) * 100)
    load_fds = [s.open_fds for s in samples if s.open_fds is not None]
    failures = {status: n for status, n in tally.statuses.items() if status != "200"}
    checks = {
        "all_200": not failures,
        "rss_flat": None if rss_growth is None else rss_growth < args.rss_growth_limit,
        "fds_flat": None if not load_fds else (
            max(load_fds) - min(load_fds) <= args.fd_slack
            and fds["after_clients"] <= fds["before_clients"] + args.fd_slack),
    }
    return {
        "url": url, "models": args.target or ("demo pair" if args.url is None else "server's"),
        "clients": args.clients, "duration_s": round(end.elapsed_s, 1),
        "sample_every_s": args.sample_every, "max_tokens": args.max_tokens,
        "warmup_s": args.warmup, "warmup_requests": baseline.requests_done,
        "requests": tally.done, "ok": tally.statuses["200"], "not_ok": sum(failures.values()),
        "responses_by_status": dict(tally.statuses),
        "completion_tokens_in_usage": tally.completion_tokens,  # streams: those that asked
        "latency_p50_s": percentile(tally.latencies, 50),
        "latency_p99_s": percentile(tally.latencies, 99),
        "rss_baseline_mb": mb(baseline.rss_bytes), "rss_end_mb": mb(end.rss_bytes),
        "rss_max_mb": mb(max((s.rss_bytes for s in samples if s.rss_bytes), default=None)),
        "rss_growth_pct": rss_growth,
        "fds_before_clients": fds["before_clients"], "fds_after_clients": fds["after_clients"],
        "fds_min": min(load_fds, default=None), "fds_max": max(load_fds, default=None),
        "checks": checks, "passed": all(ok is not False for ok in checks.values()),
        "samples": [vars(s) for s in samples],
    }


def mb(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / 2**20


def print_report(report: dict[str, object]) -> None:
    print("| sample | minute | requests done | RSS MB | open fds |")
    print("|---|---:|---:|---:|---:|")
    for s in report["samples"]:
        rss = "n/a" if s["rss_bytes"] is None else f"{s['rss_bytes'] / 2**20:.1f}"
        fds = "n/a" if s["open_fds"] is None else s["open_fds"]
        print(f"| {s['label']} | {s['elapsed_s'] / 60:.2f} | {s['requests_done']} | {rss} | "
              f"{fds} |")
    growth = report["rss_growth_pct"]
    print(f"\n{report['requests']} requests ({report['warmup_requests']} in the "
          f"{report['warmup_s']:g} s warm-up, then {report['duration_s']} s) from "
          f"{report['clients']} clients ({report['models']}): {report['ok']} complete 200s, "
          f"{report['not_ok']} not ({report['responses_by_status']})")
    print("RSS growth after warm-up: " + ("not measured (no --server-pid)" if growth is None else
          f"{growth:+.2f}% ({report['rss_baseline_mb']:.1f} -> {report['rss_end_mb']:.1f} MB, "
          f"max {report['rss_max_mb']:.1f})"))
    print(f"open fds under load: min {report['fds_min']}, max {report['fds_max']}; before the "
          f"clients {report['fds_before_clients']}, after {report['fds_after_clients']}")
    verdicts = {True: "ok", False: "FAILED", None: "not measured"}
    print("checks: " + ", ".join(f"{name} {verdicts[ok]}" for name, ok in report["checks"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with served(args, start=start_server) as (url, pid):
        tally, samples, fds = asyncio.run(soak(url, pid, args, prompts_for(args)))
    report = summarize(tally, samples, fds, args, url)
    print_report(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
