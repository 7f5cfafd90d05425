"""verispec against llama-server on the real GGUF chat models that install from PyPI.

    python benchmarks/real_models.py --llama-server /path/to/llama-server
    python benchmarks/real_models.py --llama-server BIN --models smollm2 --clients 1 \
        --temps greedy --tasks copy --requests 1          # one quick cell

Models (verispec's packaged names, the [models] extra): SmolLM2-135M-Instruct Q4_1 (its own
ChatML template) and Gemma 3 270M Q4_K_M (a base model, prompted in the gemma template).
Servers, all up together on one model, 2 threads each (an idle one waits and takes no CPU):

    llama-plain         llama-server -np 8 (continuous batching, unified KV cache)
    llama-ngram-simple  the same with --spec-type ngram-simple
    llama-ngram-mod     the same with --spec-type ngram-mod (rolling hash of the last 24 tokens,
                        up to 64 drafted, one pool shared by all requests)
    verispec-plain      verispec serve --no-draft
    verispec-ngram      verispec serve --suffix (the suffix drafter at its default depth policy)

Tasks, one chat turn each, rendered in the model's template and sent as token ids to
/v1/completions (both servers see the same tokens): ``edits`` (code edits that quote the code),
``questions`` (open questions: little to copy) and ``copy`` (the answer repeats long spans of
the prompt). Temperatures: ``greedy``, ``t0.7`` (unseeded), ``t0.7-seeded`` (verispec's keyed
sampling; llama-server always samples from a seed, so it runs t0.7 only once). At T = 0.7 both
sample the full distribution (llama-server gets top_k 0, top_p 1, min_p 0). Seeded cells run at
1 client only (at 8 they cost what t0.7 costs plus the races, measured at 1).

The prompts repeat across cells (the same 3 per task), so drafters with a pool shared across
requests (llama-server's ngram-mod, verispec's suffix drafter) find earlier answers to the same
prompt there: at temperature 0 an earlier answer is the answer. That is what such a pool is for,
but it flatters both on this benchmark against first-time prompts.

Load: 1 client sends the task's prompts one after another; 8 clients each send --requests
requests from their own starting prompt, all at once. tok/s = completion tokens / wall seconds.
Within a cell (task, temperature, clients) the servers run one after another, the order turning
each cell, so drift falls on all alike. Writes <out>.json and <out>.md (default
benchmarks/results/real_models) with ratios to verispec-plain and to llama-plain.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, TASKS, command_line, free_port, machine, wait_until_healthy

SERVERS = ("llama-plain", "llama-ngram-simple", "llama-ngram-mod", "verispec-plain",
           "verispec-ngram")
TEMPS = {"greedy": (0.0, False), "t0.7": (0.7, False), "t0.7-seeded": (0.7, True)}

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="a llama-server binary")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--temps", nargs="+", default=list(TEMPS), choices=list(TEMPS))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--requests", type=int, default=2,
                        help="requests each of the 8 clients sends in a cell (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="per request (default 128)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra flag for both verispec servers, e.g. --server-arg=--k=4")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "real_models"))
    return parser.parse_args(argv)


def start(server: str, gguf: str, args) -> tuple[object, str]:
    """(a handle with stop(), url) of one server on gguf, healthy."""
    if server.startswith("llama"):
        from verispec.bench.llama_server import start_llama_server

        spec = [] if server == "llama-plain" else ["--spec-type", server.removeprefix("llama-")]
        running = start_llama_server(args.llama_server, gguf, None, 0, args.threads, 8 * 2048,
                                     Path(tempfile.mkdtemp()), parallel=8, extra_args=spec)
        return running, f"http://127.0.0.1:{running.port}"
    port = free_port()
    command = [sys.executable, "-m", "verispec.server", "--host", "127.0.0.1", "--port",
               str(port), "--target", gguf, "--threads", str(args.threads),
               "--max-tokens-limit", "1024", "--max-batch-size", "8",
               "--no-draft" if server == "verispec-plain" else "--suffix", *args.server_arg]
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
    process.log = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, process)
    process.stop = process.terminate  # type: ignore[attr-defined]
    return process, url


def body(server: str, prompt_ids: list[int], temperature: float, seed: int | None,
         max_tokens: int) -> dict:
    request = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": temperature}
    if server.startswith("llama"):
        # the full distribution, as verispec samples it; a seed always (llama-server's own)
        request.update(top_k=0, top_p=1.0, min_p=0.0, seed=seed if seed is not None else 0,
                       cache_prompt=False)
    elif seed is not None:
        request["seed"] = seed
    return request


def complete(client: httpx.Client, url: str, request: dict) -> dict:
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=request)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}: {response.text[:300]}")
    reply = response.json()
    return {"tokens": reply["usage"]["completion_tokens"], "seconds": seconds,
            "text": reply["choices"][0]["text"], "speculation": reply.get("speculation")}


def run_cell(server: str, url: str, prompts: list[list[int]], temperature: float,
             seeded: bool, clients: int, args) -> dict:
    """One server on one cell: tok/s over the wall time of all its requests."""
    jobs = ([list(range(len(prompts)))] if clients == 1 else
            [[(c + r) % len(prompts) for r in range(args.requests)] for c in range(clients)])
    replies: list[list[dict]] = [[] for _ in jobs]

    def client_loop(index: int) -> None:
        with httpx.Client(timeout=900) as client:
            for p in jobs[index]:
                seed = args.seed + p if seeded or server.startswith("llama") else None
                request = body(server, prompts[p], temperature, seed if temperature else None,
                               args.max_tokens)
                replies[index].append(complete(client, url, request))

    started = time.perf_counter()
    if clients == 1:
        client_loop(0)
        wall = sum(r["seconds"] for r in replies[0])
    else:
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(len(jobs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    flat = [r for rs in replies for r in rs]
    tokens = sum(r["tokens"] for r in flat)
    fields = [r["speculation"] for r in flat if r["speculation"]]
    rounds = sum(f.get("num_rounds", 0) for f in fields)
    accepted = sum(f.get("accepted", 0) for f in fields)
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall,
            "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
            "texts": [r["text"] for r in replies[0]] if clients == 1 else None}


def model_prompts(name: str) -> tuple[str, dict[str, list[list[int]]]]:
    """(GGUF path, task -> token-id prompts), rendered by verispec's own chat
    templates on the model's tokenizer."""
    import verispec
    from verispec.models.packaged import packaged_model_path

    package_name, template = MODELS[name]
    gguf = str(packaged_model_path(package_name))
    decoder = verispec.load(gguf, chat_template=template)
    prompts = {task: [decoder.chat_prompt_ids([{"role": "user", "content": text}])
                      for text in texts] for task, texts in TASKS.items()}
    del decoder
    return gguf, prompts


def run_model(name: str, args) -> list[dict]:
    gguf, prompts = model_prompts(name)
    servers: dict[str, tuple[object, str]] = {}
    rows = []
    try:
        for server in args.servers:
            servers[server] = start(server, gguf, args)
        with httpx.Client(timeout=900) as client:  # warm-up, out of the times
            for server, (_, url) in servers.items():
                complete(client, url, body(server, prompts["questions"][0], 0.0, None, 16))
        cells = [(task, temp, clients) for clients in args.clients for task in args.tasks
                 for temp in args.temps if clients == 1 or not TEMPS[temp][1]]
        for index, (task, temp, clients) in enumerate(cells):
            temperature, seeded = TEMPS[temp]
            order = list(servers)
            order = order[index % len(order):] + order[: index % len(order)]
            for server in order:
                if server.startswith("llama") and seeded:
                    continue  # llama-server samples from a seed either way: the t0.7 cell
                result = run_cell(server, servers[server][1], prompts[task], temperature,
                                  seeded, clients, args)
                rows.append({"model": name, "server": server, "task": task, "temp": temp,
                             "clients": clients, **result})
                print(f"{name:8} {task:9} {temp:11} {clients} {server:19} "
                      f"{result['tok_s']:7.1f} tok/s"
                      + (f"  mal {result['mean_accepted_length']:.2f}"
                         if result["mean_accepted_length"] else ""), flush=True)
    finally:
        for handle, _ in servers.values():
            handle.stop()
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per model: a row per (task, temperature, clients), tok/s per server and the
    ratios the issue names."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = dict.fromkeys((r["task"], r["temp"], r["clients"]) for r in rows
                              if r["model"] == model)
        servers = list(dict.fromkeys(r["server"] for r in rows if r["model"] == model))
        lines += [f"### {model}", "",
                  "| task | temp | clients | " + " | ".join(servers)
                  + " | ngram / plain | v-plain / l-plain | v-ngram / best l-ngram |",
                  "|---|---|---|" + "---|" * (len(servers) + 3)]
        for task, temp, clients in cells:
            got = {r["server"]: r for r in rows if r["model"] == model and r["task"] == task
                   and r["clients"] == clients and (r["temp"] == temp or (
                       r["server"].startswith("llama") and temp == "t0.7-seeded"
                       and r["temp"] == "t0.7"))}

            def rate(server: str, got: dict = got) -> float | None:
                return got[server]["tok_s"] if server in got else None

            def ratio(a: float | None, b: float | None) -> str:
                return f"{a / b:.2f}x" if a and b else "-"

            best_llama = max((rate(s) or 0 for s in ("llama-ngram-simple", "llama-ngram-mod")),
                             default=0) or None
            lines.append(f"| {task} | {temp} | {clients} | " + " | ".join(
                f"{rate(s):.1f}" if rate(s) else "-" for s in servers) + " | "
                + " | ".join([ratio(rate("verispec-ngram"), rate("verispec-plain")),
                              ratio(rate("verispec-plain"), rate("llama-plain")),
                              ratio(rate("verispec-ngram"), best_llama)]) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for model in args.models:
        rows += run_model(model, args)
    table = markdown(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command_line("real_models.py", argv),
            "max_tokens": args.max_tokens, "requests_per_client": args.requests}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; {meta['date']}; "
        f"`{meta['command']}`\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
