"""The coder pair against llama-server: Qwen2.5-Coder-1.5B-Instruct drafted by its 0.5B sibling.

    python benchmarks/coder_pair.py --llama-server /path/to/llama-server
    python benchmarks/coder_pair.py --llama-server BIN --servers llama-plain verispec-plain \
        --tasks complete --temps greedy --clients 1          # one quick cell

Models: verispec's packaged names (the [coder] extra), the same GGUF files for every server.
Servers, all up together, 2 threads each (an idle one waits and takes no CPU):

    llama-plain        llama-server -m target -np 4
    llama-draft        the same with -md draft at llama-server's own defaults
    llama-draft-best   the same with --llama-best (default: the best setting of a sweep, see
                       benchmarks/results/coder_pair.md)
    llama-ngram-mod    llama-server --spec-type ngram-mod (no draft model)
    verispec-plain     verispec serve --no-draft
    verispec-draft     verispec serve --target ... --draft ... (the defaults)
    verispec-draft-carry  verispec-draft with --carry-over (the depth policy's estimates
                       carried from one request to the next)
    verispec-hybrid    the same with --hybrid (the suffix drafter where it matches, else the draft)
    verispec-chain     --hybrid --hybrid-lookup suffix --hybrid-chain: the suffix drafter's span,
                       continued by the draft model in the same round
    verispec-ngram     verispec serve --suffix (the suffix drafter, no draft model)
    verispec-uniform   verispec-draft with --uniform-passes (docs/exactness.md): every target
                       pass in one kernel family, greedy speculative == plain by construction

Tasks, one chat turn each, rendered in the target's ChatML template and sent as token ids to
/v1/completions: ``complete`` (write a function), ``edits`` (code edits that quote the code: the
reply copies long spans) and ``questions`` (open questions). Temperatures ``greedy`` and
``t0.7`` (seeded; llama-server samples from a seed too; both sample the full distribution).

Load: 1 client sends the task's prompts one after another; 4 clients send one prompt each, all
at once. tok/s = completion tokens / wall seconds. Within a cell the servers run one after
another, the order turning each cell. Acceptance and tokens per target pass come from each
server's own counters (verispec's ``speculation`` field, llama-server's ``timings``). Writes
<out>.json and <out>.md (default benchmarks/results/coder_pair).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    CODE_COUNT,
    CODE_SQUARES,
    TASKS,
    command_line,
    free_port,
    machine,
    wait_until_healthy,
)

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
LLAMA = {"llama-plain": [], "llama-draft": ["-md", "{draft}"],
         "llama-draft-best": ["-md", "{draft}"], "llama-ngram-mod": ["--spec-type", "ngram-mod"]}
VERISPEC = {"verispec-plain": ["--no-draft"], "verispec-draft": ["--draft", "{draft}"],
            "verispec-draft-carry": ["--draft", "{draft}", "--carry-over"],
            "verispec-hybrid": ["--draft", "{draft}", "--hybrid"],
            "verispec-chain": ["--draft", "{draft}", "--hybrid", "--hybrid-lookup", "suffix",
                               "--hybrid-chain"],
            "verispec-ngram": ["--suffix"],
            "verispec-uniform": ["--draft", "{draft}", "--uniform-passes"]}
SERVERS = (*LLAMA, *VERISPEC)
CODER_TASKS = {
    "complete": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        ("Write a Python function merge_sorted(a, b) that merges two sorted lists into one "
         "sorted list without using sort()."),
    ],
    "edits": [
        (f"Rename the variable `lst` to `numbers` and use a list comprehension in this "
         f"code:\n\n```python\n{CODE_SQUARES}```"),
        (f"This function reads a file but never closes it. Rewrite it with a `with` "
         f"statement:\n\n```python\n{CODE_COUNT}```"),
    ],
    "questions": TASKS["questions"][:2],
}
TEMPS = {"greedy": 0.0, "t0.7": 0.7}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", help="a llama-server binary (without it: verispec's "
                        "servers only)")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--tasks", nargs="+", default=list(CODER_TASKS),
                        choices=list(CODER_TASKS))
    parser.add_argument("--temps", nargs="+", default=list(TEMPS), choices=list(TEMPS))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--cells", nargs="+", metavar="TASK:TEMP:CLIENTS",
                        help="exactly these cells (e.g. edits:greedy:4) instead of every "
                        "combination of --tasks, --temps and --clients")
    parser.add_argument("--max-tokens", type=int, default=96, help="per request (default 96)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every request runs to --max-tokens (llama-server and verispec "
                             "both take ignore_eos): equal lengths, so a sampled cell compares "
                             "the same amount of work although the servers' texts differ")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--llama-best", default="--spec-draft-n-max 3 --spec-draft-p-min 0",
                        help="llama-draft-best's flags (a sweep's best)")
    parser.add_argument("--verispec-arg", action="append", default=[],
                        help="an extra flag for every verispec server, e.g. --verispec-arg=--k=3")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "coder_pair"))
    args = parser.parse_args(argv)
    if args.llama_server is None:
        args.servers = [s for s in args.servers if s in VERISPEC]
    return args


def start(server: str, paths: dict[str, str], args) -> tuple[object, str]:
    """(a handle with stop(), url) of one server, healthy."""
    if server in LLAMA:
        from verispec.bench.llama_server import start_llama_server

        extra = [a.format(**paths) for a in LLAMA[server]]
        if "-md" in extra:
            extra += ["-td", str(args.threads)]
        if server == "llama-draft-best":
            extra += shlex.split(args.llama_best)
        running = start_llama_server(args.llama_server, paths["target"], None, 0, args.threads,
                                     4 * 2048, Path(tempfile.mkdtemp()), parallel=4,
                                     extra_args=extra)
        return running, f"http://127.0.0.1:{running.port}"
    port = free_port()
    command = [sys.executable, "-m", "verispec.server", "--host", "127.0.0.1", "--port",
               str(port), "--target", paths["target"], "--threads", str(args.threads),
               "--max-tokens-limit", "1024", "--max-batch-size", "4",
               *[a.format(**paths) for a in VERISPEC[server]], *args.verispec_arg]
    # open for the server's life: the log stays on disk for a failed run's reading
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{server}-", suffix=".log",
                                      delete=False)
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, process)
    process.stop = process.terminate  # type: ignore[attr-defined]
    process.log_path = log.name  # type: ignore[attr-defined]
    return process, url


def body(server: str, prompt_ids: list[int], temperature: float, seed: int,
         max_tokens: int, ignore_eos: bool = False) -> dict:
    request = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
               "seed": seed}
    if ignore_eos:  # every server emits max_tokens: sampled texts differ in length otherwise
        request["ignore_eos"] = True
    if server in LLAMA:  # the full distribution, as verispec samples it
        request.update(top_k=0, top_p=1.0, min_p=0.0, cache_prompt=False)
    return request


def complete(client: httpx.Client, url: str, request: dict) -> dict:
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=request)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    return {"tokens": reply["usage"]["completion_tokens"], "seconds": seconds,
            "text": reply["choices"][0]["text"], "speculation": reply.get("speculation"),
            "timings": reply.get("timings")}


def counters(replies: list[dict]) -> dict:
    """Drafted and accepted tokens over a cell's replies (verispec's speculation field or
    llama-server's timings) and, for verispec, tokens per target pass (its
    mean_accepted_length, weighted by the tokens of each reply)."""
    drafted = accepted = tokens = 0
    passes = 0.0
    for reply in replies:
        if reply["speculation"]:
            spec = reply["speculation"]
            drafted += spec.get("drafted", 0)
            accepted += spec.get("accepted", 0)
            if spec.get("mean_accepted_length"):
                tokens += reply["tokens"]
                passes += reply["tokens"] / spec["mean_accepted_length"]
        elif reply["timings"]:
            drafted += reply["timings"].get("draft_n", 0)
            accepted += reply["timings"].get("draft_n_accepted", 0)
    return {"drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_pass": tokens / passes if passes else None}


def run_cell(server: str, url: str, prompts: list[list[int]], temperature: float,
             clients: int, args) -> dict:
    """One server on one cell: tok/s over the wall time of all its requests."""
    jobs = [list(range(len(prompts)))] if clients == 1 else [[c % len(prompts)]
                                                             for c in range(clients)]
    replies: list[list[dict]] = [[] for _ in jobs]

    def client_loop(index: int) -> None:
        with httpx.Client(timeout=900) as client:
            for p in jobs[index]:
                request = body(server, prompts[p], temperature, args.seed + p, args.max_tokens,
                               args.ignore_eos)
                replies[index].append(complete(client, url, request))

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    flat = [r for rs in replies for r in rs]
    tokens = sum(r["tokens"] for r in flat)
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall, **counters(flat),
            "texts": [r["text"] for r in replies[0]] if clients == 1 else None}


def coder_prompts() -> tuple[dict[str, str], dict[str, list[list[int]]]]:
    """(GGUF paths, task -> token-id prompts in the target's own chat template)."""
    import verispec
    from verispec.models.packaged import packaged_model_path

    paths = {"target": str(packaged_model_path(TARGET)), "draft": str(packaged_model_path(DRAFT))}
    decoder = verispec.load(paths["target"], None)
    prompts = {task: [decoder.chat_prompt_ids([{"role": "user", "content": text}])
                      for text in texts] for task, texts in CODER_TASKS.items()}
    del decoder
    return paths, prompts


def run(args) -> list[dict]:
    paths, prompts = coder_prompts()
    servers: dict[str, tuple[object, str]] = {}
    rows = []
    try:
        for server in args.servers:
            servers[server] = start(server, paths, args)
        with httpx.Client(timeout=900) as client:  # warm-up, out of the times
            for server, (_, url) in servers.items():
                complete(client, url, body(server, prompts["questions"][0], 0.0, 0, 16))
        cells = ([(task, temp, int(clients)) for task, temp, clients
                  in (cell.split(":") for cell in args.cells)] if args.cells else
                 [(task, temp, clients) for clients in args.clients for task in args.tasks
                  for temp in args.temps])
        for index, (task, temp, clients) in enumerate(cells):
            order = list(servers)
            order = order[index % len(order):] + order[: index % len(order)]
            for server in order:
                result = run_cell(server, servers[server][1], prompts[task], TEMPS[temp],
                                  clients, args)
                rows.append({"server": server, "task": task, "temp": temp, "clients": clients,
                             **result})
                print(f"{task:9} {temp:6} {clients} {server:17} {result['tok_s']:6.2f} tok/s"
                      + (f"  acc {result['acceptance']:.2f}" if result["acceptance"] else "")
                      + (f"  tok/pass {result['tokens_per_pass']:.2f}"
                         if result["tokens_per_pass"] else ""), flush=True)
    finally:
        for handle, _ in servers.values():
            handle.stop()
    return rows


def markdown(rows: list[dict]) -> str:
    """A row per server, a column per cell: tok/s and the ratio to llama-plain."""
    cells = list(dict.fromkeys((r["task"], r["temp"], r["clients"]) for r in rows))
    servers = list(dict.fromkeys(r["server"] for r in rows))
    got = {(r["server"], r["task"], r["temp"], r["clients"]): r for r in rows}
    lines = ["| server | " + " | ".join(f"{t} {temp} c{c}" for t, temp, c in cells) + " |",
             "|---|" + "---|" * len(cells)]
    for server in servers:
        entries = []
        for cell in cells:
            row, base = got.get((server, *cell)), got.get(("llama-plain", *cell))
            if row is None:
                entries.append("-")
                continue
            ratio = f" ({row['tok_s'] / base['tok_s']:.2f}x)" if base else ""
            accepted = (f", {row['acceptance']:.2f} acc" if row["acceptance"] is not None
                        else "")
            entries.append(f"{row['tok_s']:.2f}{ratio}{accepted}")
        lines.append(f"| {server} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n\nRatios to llama-plain in the same cell; acc: accepted / " \
        "drafted tokens.\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    table = markdown(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command_line("coder_pair.py", argv), "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "llama_best": args.llama_best}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; {meta['date']}; "
        f"`{meta['command']}`\n\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
