"""Fuzz ``verispec serve``: request settings at and past their bounds, many batch mates at once.

    python benchmarks/fuzz_server.py                          # 2000 requests, the demo pair
    python benchmarks/fuzz_server.py --requests 60 --clients 4
    python benchmarks/fuzz_server.py --url http://127.0.0.1:8000 --seed 7

A seeded random sweep: each request draws its settings from a fixed list per field, where the
bounds are and just past them: temperature (0, 1e-6 .. 0.01 .. 2, and out of range), top_k,
top_p, min_p, presence and frequency penalties, repetition_penalty (1e-38 .. 1e38), logit_bias
(+-100 and past it), with or without a seed, streamed or not, logprobs, n, the depth k, through
/v1/completions and /v1/chat/completions. The requests are drawn up front from --seed, so a
run sends the same requests whatever the timing; --clients of them run at once, so each is a
batch mate of others. Alongside them a control client sends two fixed requests over and over
(greedy, and seeded sampled), whose texts must equal their references, taken before the sweep:
no request may fail another. After the sweep a greedy request must still return its
reference text.

Each request ends as its HTTP status, or, for a stream that fails after its headers, as
"stream-error:<code>" ("client-error:<type>": no answer). Fails (exit 1) on any 5xx,
server_error event or unanswered request, any control text that
differs from its reference or errs, and a final greedy text that differs. Prints a table of
the outcomes by field value and writes them all to --json. Bounded, loopback only.

What it is not: a schema fuzzer (tests/server/test_server_fuzz.py), a test of outputs' laws
(tests/), or a load test (load_test.py, soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_server_options, check_loopback, served

# each field's values in range, where the arithmetic is hardest (its bounds, tiny and huge
# values); None leaves the field out
FIELDS = {
    "temperature": [0.0, 1e-6, 1e-4, 0.01, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 1.5, 2.0],
    "top_k": [None, None, 1, 2, 40, 10**6],
    "top_p": [None, None, 1e-9, 0.01, 0.5, 0.9, 1.0],
    "min_p": [None, None, 0.0, 1e-6, 0.1, 0.9, 1.0],
    "presence_penalty": [None, None, -2.0, -0.5, 0.0, 1.0, 2.0],
    "frequency_penalty": [None, None, -2.0, 0.5, 2.0],
    "repetition_penalty": [None, None, 1e-38, 1e-6, 0.1, 0.5, 1.0, 2.0, 10.0, 1e6, 1e38],
    "logit_bias": [None, None, "+100", "-100", "+-100", "+50"],
    "seed": [None, None, 0, 1, 2**63 - 1],
    "logprobs": [None, None, 0, 1, 5],
    "n": [1, 1, 1, 2, 3],
    "num_draft_tokens": [None, None, 1, 4, 8],
    "stream": [False, True],
    "endpoint": ["completions", "completions", "chat"],
}
# and past the bounds, one field of a request in INVALID_SHARE: a 4xx is the answer, never a 5xx
OUT_OF_RANGE = {
    "temperature": [-0.1, 2.5], "top_k": [0, -1], "top_p": [0.0, 1.5], "min_p": [-0.1, 1.5],
    "presence_penalty": [-2.5, 2.5], "frequency_penalty": [-2.5, 2.5],
    "repetition_penalty": [0.0, -1.0], "logit_bias": ["101", "vocab"], "seed": [2**63, -1],
    "logprobs": [21], "n": [0], "num_draft_tokens": [0, 1000],
}
INVALID_SHARE = 0.15
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n",
           "for i in range(10):\n", "x = [", "The quick brown fox"]
CONTROLS = {  # the innocent client's two requests
    "greedy": {"prompt": "def add(a, b):", "max_tokens": 48, "temperature": 0},
    "seeded": {"prompt": "class Queue:\n", "max_tokens": 48, "temperature": 0.8, "seed": 1234},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_options(parser, "unused here")
    parser.add_argument("--requests", type=int, default=2000, help="fuzzed requests (2000)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="the most per request (32)")
    parser.add_argument("--seed", type=int, default=0, help="the sweep's seed (0)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--json", default="benchmarks/results/fuzz_server.json",
                        help="where the counts and the faults go")
    args = parser.parse_args(argv)
    check_loopback(parser, args)
    return args


def draw_request(rng: random.Random, max_tokens: int) -> tuple[str, dict, dict]:
    """(endpoint, body, the drawn values by field) of one fuzzed request."""
    drawn = {name: rng.choice(values) for name, values in FIELDS.items()}
    if rng.random() < INVALID_SHARE:
        name = rng.choice(sorted(OUT_OF_RANGE))
        drawn[name] = rng.choice(OUT_OF_RANGE[name])
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "stream": drawn["stream"]}
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "num_draft_tokens"):
        if drawn[name] is not None:
            body[name] = drawn[name]
    if drawn["n"] != 1:
        body["n"] = drawn["n"]
    if drawn["logit_bias"] is not None:
        body["logit_bias"] = _logit_bias(rng, drawn["logit_bias"])
    prompt = rng.choice(PROMPTS)
    if drawn["endpoint"] == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if drawn["logprobs"] is not None:
            body |= {"logprobs": True, "top_logprobs": drawn["logprobs"]}
        return "/v1/chat/completions", body, drawn
    body["prompt"] = prompt
    if drawn["logprobs"] is not None:
        body["logprobs"] = drawn["logprobs"]
    return "/v1/completions", body, drawn


def _logit_bias(rng: random.Random, kind: str) -> dict[str, float]:
    """A few biased token ids (of a small vocabulary's range; "vocab": one past any real one)."""
    tokens = [str(rng.randrange(0, 256)) for _ in range(rng.randint(1, 3))]
    if kind == "vocab":
        return {"10000000": 5.0}
    values = {"+100": [100.0], "-100": [-100.0], "+-100": [100.0, -100.0], "+50": [50.0],
              "101": [101.0]}[kind]
    return {token: rng.choice(values) for token in tokens}


async def send(http: httpx.AsyncClient, path: str, body: dict) -> tuple[str, str, dict | None]:
    """(outcome, text, error body or None): the HTTP status, or "stream-error:<code>" for a
    stream whose error came as an event."""
    if not body.get("stream"):
        response = await http.post(path, json=body)
        payload = response.json() if response.headers.get("content-type", "").startswith(
            "application/json") else None
        if response.status_code != 200:
            return str(response.status_code), "", payload
        return "200", _text(payload), None
    text = ""
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return str(response.status_code), "", response.json()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"stream-error:{event['error'].get('code')}", text, event
            for choice in event.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return "200", text, None


def _text(payload: dict) -> str:
    choice = payload["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"] or ""


def is_fault(outcome: str, error: dict | None) -> bool:
    """A server fault: a 5xx, an error event of type server_error, or no answer at all."""
    if outcome.startswith("stream-error"):
        return (error or {}).get("error", {}).get("type") == "server_error"
    return outcome.startswith(("5", "client-error"))


async def control_loop(http: httpx.AsyncClient, references: dict[str, str],
                       stop: asyncio.Event, tally: Counter) -> None:
    """The innocent client: its two requests, streamed, until the sweep ends; each must
    return its reference text."""
    while not stop.is_set():
        for name, body in CONTROLS.items():
            outcome, text, _ = await send(http, "/v1/completions", {**body, "stream": True})
            tally[f"{name}:{'same' if outcome == '200' and text == references[name] else 'DIFF'}"
                  ] += 1


async def sweep(url: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    requests = [draw_request(rng, args.max_tokens) for _ in range(args.requests)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, headers=headers,
                                 limits=limits) as http:
        references = {name: (await send(http, "/v1/completions", body))[1]
                      for name, body in CONTROLS.items()}
        queue: asyncio.Queue = asyncio.Queue()
        for index, request in enumerate(requests):
            queue.put_nowait((index, request))
        records: list[dict] = []
        stop, control = asyncio.Event(), Counter()
        controller = asyncio.create_task(control_loop(http, references, stop, control))
        started = time.perf_counter()
        await asyncio.gather(*(client(http, queue, records) for _ in range(args.clients)))
        stop.set()
        await controller
        elapsed = time.perf_counter() - started
        final = (await send(http, "/v1/completions", CONTROLS["greedy"]))[1]
    return {"requests": args.requests, "clients": args.clients, "seed": args.seed,
            "seconds": elapsed, "records": sorted(records, key=lambda r: r["index"]),
            "control": dict(control), "final_greedy_same": final == references["greedy"]}


async def client(http: httpx.AsyncClient, queue: asyncio.Queue, records: list[dict]) -> None:
    while not queue.empty():
        index, (path, body, drawn) = queue.get_nowait()
        try:
            outcome, _, error = await send(http, path, body)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            outcome, error = f"client-error:{type(exc).__name__}", {"error": str(exc)}
        records.append({"index": index, "path": path, "body": body, "drawn": drawn,
                        "outcome": outcome, "fault": is_fault(outcome, error),
                        "error": error})


def report(result: dict[str, object]) -> list[str]:
    """The table (outcomes overall and by field value for the fields' faults) and the
    verdict lines; returns the reasons the run fails (empty: it passed)."""
    records = result["records"]
    outcomes = Counter(record["outcome"] for record in records)
    print(f"{len(records)} requests, {result['clients']} clients, seed {result['seed']}, "
          f"{result['seconds']:.0f} s")
    print("\n| outcome | requests |\n|---|---|")
    for outcome, count in sorted(outcomes.items()):
        print(f"| {outcome} | {count} |")
    faults = [record for record in records if record["fault"]]
    if faults:
        by_value: dict[str, Counter] = defaultdict(Counter)
        for record in faults:
            for name, value in record["drawn"].items():
                by_value[name][repr(value)] += 1
        print("\nfaults by field value (a value in every fault points at the cause):")
        for name, counts in by_value.items():
            print(f"  {name}: " + ", ".join(f"{value} x{n}" for value, n in counts.most_common(4)))
        print("\nfirst faults:")
        for record in faults[:5]:
            print(f"  {record['path']} {json.dumps(record['body'])[:160]} -> {record['outcome']}"
                  f" {json.dumps(record['error'])[:160]}")
    print(f"\ncontrol client: {result['control']}; final greedy text the reference: "
          f"{result['final_greedy_same']}")
    reasons = [f"{len(faults)} server faults (5xx or server_error events)"] if faults else []
    if any(key.endswith(":DIFF") for key in result["control"]):
        reasons.append("the control client's text changed or erred: a request failed another")
    if not result["final_greedy_same"]:
        reasons.append("the final greedy request did not return the reference text")
    return reasons


def summary(result: dict[str, object], reasons: list[str]) -> dict[str, object]:
    """What --json keeps: the counts, and the records of faults alone (the requests are drawn
    from --seed, so any other record is the same in a rerun)."""
    records = result.pop("records")
    return {**result, "outcomes": dict(Counter(record["outcome"] for record in records)),
            "faults": [record for record in records if record["fault"]], "failures": reasons}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with served(args) as (url, _):
        result = asyncio.run(sweep(url, args))
    reasons = report(result)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(result, reasons), indent=1))
    print(f"\nwrote {path}")
    for reason in reasons:
        print(f"FAIL: {reason}")
    return 1 if reasons else 0


if __name__ == "__main__":
    sys.exit(main())
