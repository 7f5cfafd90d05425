"""The server's batching loop without the server: what continuous batching gives in-process, the
ceiling the HTTP server's figures sit under (benchmarks/batching_load.py).

    python benchmarks/batching_ceiling.py                  # demo pair, 1 and 16 clients, 3 repeats
    python benchmarks/batching_ceiling.py --clients 1,4,8,16 --repeats 5

The decoder is the server's (load_decoder with the default settings: the demo pair and the
server's depth policy); each mode keeps one batch for the whole run, as a server does. Each
client count runs the loop of server/worker.py in one thread with no HTTP, no event loop and no
client process: N clients send their requests back to back (client i sends held-out
prompts i, i + 1, ..., as batching_load.py's clients do), a finished request's client joins its
next one before the next round, joining prompts share a prefill up to the server's default
prefill budget, and rows step together (TextBatch, as the worker; unlike the server's, the
batch is not capped at --max-batch-size, 16: above 16 clients every client holds a row).
Speculative (the decoder's goodput policy), plain (speculative=False) and any --fixed-k depths
take turns, the order turning each repeat; a level's tok/s is the median of its passes, ratios
are medians of per-pass ratios.

Why: the aim "16 clients make >= 4x one client's tok/s" is spec(16)/spec(1) =
plain(16)/plain(1) x [spec(16)/plain(16)] / [spec(1)/plain(1)]; this script measures each factor
without the server's own costs, which are a larger share at 16 clients than at 1 (the event
loop's CPU time preempts one of the two compute threads, and the other waits at the barrier).
Then, per client count, the bound the model passes alone set (``passes_bound``): the clients'
prompts prefilled and --max-tokens steps over all rows with nothing between the passes, plain, and
speculative at the best per-round gain the measured acceptance, target passes and draft step
allow; a server of this pair on this machine cannot beat it.
Writes batching_ceiling.json to --out-dir (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from verispec.server.run import load_decoder
from verispec.server.settings import ServerSettings
from verispec.text.batch import TextBatch
from verispec.text.demo import heldout_prompts
from verispec.text.inputs import RequestSettings

from common import client_prompt, command_line, machine

MODES = ("speculative", "plain")  # the server's default and --no-draft; --fixed-k adds k=N


def open_mode(decoder, mode: str) -> tuple[TextBatch, dict[str, object]]:
    """The batch of a mode and the settings its rows join with: "speculative" (the decoder's
    depth policy), "plain", or "k=N" (speculative at a fixed depth N, no policy)."""
    if mode == "plain":
        return decoder.open_batch(False), {}
    if mode == "speculative":
        return decoder.open_batch(True), {}
    return decoder.open_batch(True, replace(decoder.batch_options, adaptive=None,
                                            num_draft_tokens=int(mode.removeprefix("k=")))), {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,16", help="client counts (default 1,16)")
    parser.add_argument("--requests", type=int, default=128,
                        help="requests per level, split among the clients (default 128)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per request (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per level (default 3)")
    parser.add_argument("--fixed-k", default="",
                        help="also run speculative modes at these fixed depths, e.g. 1,2")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.modes = list(MODES) + [f"k={int(k)}" for k in filter(None, args.fixed_k.split(","))]
    if not all(1 <= c <= 64 for c in args.client_counts) or min(
            args.requests, args.max_tokens, args.repeats) < 1:
        parser.error("expected client counts in 1..64 and --requests, --max-tokens, --repeats >= 1")
    return args


def run_level(batch: TextBatch, row_settings: dict[str, object], prompts: list[str],
              clients: int, num_requests: int, max_tokens: int, prefill_budget: int) -> dict:
    """One pass: ``clients`` clients sending ``num_requests`` greedy requests in all through
    ``batch`` (empty; it stays open between passes, as the server's worker keeps one for its
    life, so its depth policies keep what they measured), the way the worker runs it. Returns
    tok/s and the mean k chosen (weighted by rounds)."""
    per_client = -(-num_requests // clients)
    sent = [0] * clients
    idle = list(range(clients))  # clients with no request in the batch
    owner: dict[int, int] = {}  # row id -> client
    num_tokens = num_drafted = num_row_rounds = num_tested = num_accepted = 0
    started = time.perf_counter()
    while True:
        # 1. join: idle clients' next requests, up to the prefill budget (at least one)
        joining, who, budget = [], [], 0
        for client in list(idle):
            if sent[client] == per_client or (joining and budget >= prefill_budget):
                continue
            prompt = prompts[client_prompt(client, sent[client], len(prompts))]
            joining.append(batch.prepare(prompt, max_new_tokens=max_tokens, temperature=0.0,
                                         **row_settings))
            budget += len(joining[-1].prepared.prompt_ids)
            sent[client] += 1
            who.append(client)
            idle.remove(client)
        for row, client in zip(batch.add_rows(joining), who):
            owner[row.row.id] = client
        if not len(batch):
            break
        # 2. one round for every row; finished rows free their client
        for row, _ in batch.step():
            if row.completion is not None:
                metrics = row.completion.metrics
                num_tokens += len(row.completion.token_ids)
                num_drafted += metrics.num_drafted
                num_row_rounds += metrics.num_row_rounds
                num_tested += sum(metrics.num_reached)
                num_accepted += sum(metrics.num_accepted_at)
                idle.append(owner.pop(row.row.id))
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": num_tokens / elapsed, "mean_k": num_drafted / max(num_row_rounds, 1),
            "token_acceptance": num_accepted / num_tested if num_tested else None}


def median_ms(run, repeats: int = 9) -> float:
    """Median wall time of ``run()`` in ms, after one untimed call."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def passes_bound(decoder, prompts: list[str], clients: int, max_tokens: int, budget: int,
                 acceptance: float, max_k: int = 6) -> dict:
    """What the model passes alone allow ``clients`` rows: no Python between passes, no joins
    but one per request, every row in step. Plain: the clients' prompts prefilled as the worker
    joins them (up to ``budget`` prompt tokens a pass group, shortest first), then max_tokens
    1-token steps over all rows; tok/s = clients x max_tokens / that time. Speculative: the
    same prefill, the steps divided by the best per-round gain any depth k <= max_k offers at
    this many rows, E(k) T(1) / (T(k + 1) + k D), with E(k) = 1 + a + ... + a^k for the
    greedy token acceptance a measured in the speculative passes, T(n) the target's pass over
    n tokens a row and D the draft's 1-token step, both halfway through the decode (the
    draft's 2-token steps after a fully accepted round, and its prefills, left out): an upper
    bound for any server of this pair here."""
    plain = RequestSettings()
    ids = sorted((decoder.prepare(prompts[client_prompt(c, 0, len(prompts))], plain, 0).prompt_ids
                  for c in range(clients)), key=len)
    chunks, chunk = [], []
    for prompt in ids:  # run_level's admission: prompts until the budget is reached
        if chunk and sum(map(len, chunk)) >= budget:
            chunks.append(chunk)
            chunk = []
        chunk.append(prompt)
    chunks.append(chunk)
    target = decoder.target.new_session()
    target.start([])

    def prefill() -> None:  # into the cache's slots of the last run, as the server's batch
        target.keep_rows([])
        for group in chunks:
            target.add_rows(group)

    def prefill_and_decode() -> None:
        prefill()
        for _ in range(max_tokens):
            target.extend(torch.ones((clients, 1), dtype=torch.int64))

    plain_ms = median_ms(prefill_and_decode, 5)
    prefill_ms = median_ms(prefill, 5)
    decode_ms = plain_ms - prefill_ms
    # T(n) and D below halfway through the decode (its mean context: attention grows with it)
    prefill()
    halfway = torch.ones((clients, max_tokens // 2), dtype=torch.int64)
    target.extend(halfway)
    draft = decoder.draft.new_session()
    draft.start(ids)
    draft.extend(halfway)
    step = torch.ones((clients, 1), dtype=torch.int64)
    draft_ms = median_ms(lambda: (draft.extend(step), draft.rewind([1] * clients)))
    target_ms = [median_ms(lambda n=n: (target.extend(torch.ones((clients, n), dtype=torch.int64)),
                                        target.rewind([n] * clients)))
                 for n in range(1, max_k + 2)]  # T(1) .. T(max_k + 1), after the decode above
    gains = [sum(acceptance ** i for i in range(k + 1)) * target_ms[0]
             / (target_ms[k] + k * draft_ms) for k in range(1, max_k + 1)]
    best_k = max(range(len(gains)), key=gains.__getitem__) + 1
    speculative_ms = prefill_ms + decode_ms / max(1.0, gains[best_k - 1])
    return {"clients": clients, "prefill_ms": prefill_ms, "decode_ms": decode_ms,
            "target_pass_ms": target_ms, "draft_step_ms": draft_ms, "acceptance": acceptance,
            "best_k": best_k, "best_round_gain": gains[best_k - 1],
            "plain_tokens_per_s": 1e3 * clients * max_tokens / plain_ms,
            "speculative_tokens_per_s": 1e3 * clients * max_tokens / speculative_ms}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = ServerSettings()  # the server's defaults: the demo pair, its depth policy, budget
    decoder = load_decoder(settings)
    prompts = heldout_prompts()[:16]
    budget = settings.prefill_budget
    batches = {mode: open_mode(decoder, mode) for mode in args.modes}
    for batch, row_settings in batches.values():  # warm-up, as the servers' and references
        run_level(batch, row_settings, prompts, 1, 16, args.max_tokens, budget)
    passes: dict[tuple[str, int], list[dict]] = {}
    names = args.modes
    for repeat in range(args.repeats):
        for clients in args.client_counts:
            turn = (repeat + clients) % len(names)
            for mode in names[turn:] + names[:turn]:
                result = run_level(*batches[mode], prompts, clients, args.requests,
                                   args.max_tokens, budget)
                passes.setdefault((mode, clients), []).append(result)
                print(f"pass {repeat + 1}/{args.repeats} {mode:11} {clients:2} clients: "
                      f"{result['tokens_per_s']:7.1f} tok/s, mean k {result['mean_k']:.2f}",
                      flush=True)

    def ratio(num: tuple[str, int], den: tuple[str, int]) -> float:
        return statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                 for a, b in zip(passes[num], passes[den]))

    low, high = min(args.client_counts), max(args.client_counts)
    rows = [{"mode": mode, "clients": clients,
             "tokens_per_s": statistics.median(p["tokens_per_s"] for p in level),
             "tokens_per_s_passes": [round(p["tokens_per_s"], 1) for p in level],
             "mean_k": statistics.mean(p["mean_k"] for p in level),
             "vs_plain": ratio((mode, clients), ("plain", clients)),
             f"vs_{low}_clients": ratio((mode, clients), (mode, low))}
            for (mode, clients), level in passes.items()]
    print(f"\n| clients | mode | tok/s (passes) | vs plain | vs {low} client(s) | mean k |")
    print("|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["clients"], r["mode"])):
        passes_text = ", ".join(f"{x:.0f}" for x in row["tokens_per_s_passes"])
        print(f"| {row['clients']} | {row['mode']} | {row['tokens_per_s']:.0f} ({passes_text}) | "
              f"{row['vs_plain']:.2f}x | {row[f'vs_{low}_clients']:.2f}x | {row['mean_k']:.2f} |")
    bounds = []
    for clients in args.client_counts:
        rates = [p["token_acceptance"] for p in passes["speculative", clients]
                 if p["token_acceptance"] is not None]
        bounds.append(passes_bound(decoder, prompts, clients, args.max_tokens, budget,
                                   statistics.median(rates) if rates else 0.0))
    print("\nThe passes alone (no Python between them, one join a request, rows in step):")
    print("| clients | plain bound tok/s | speculative bound tok/s | best k | round gain | "
          "acceptance | speculative measured / bound |")
    print("|---|---|---|---|---|---|---|")
    for bound in bounds:
        measured = statistics.median(
            p["tokens_per_s"] for p in passes["speculative", bound["clients"]])
        bound["speculative_measured_share"] = measured / bound["speculative_tokens_per_s"]
        print(f"| {bound['clients']} | {bound['plain_tokens_per_s']:.0f} | "
              f"{bound['speculative_tokens_per_s']:.0f} | {bound['best_k']} | "
              f"{bound['best_round_gain']:.2f}x | {bound['acceptance']:.2f} | "
              f"{bound['speculative_measured_share']:.2f} |")
    spec_scaling = ratio(("speculative", high), ("speculative", low))
    print(f"\nspeculative {high} vs {low}: {spec_scaling:.2f}x"
          f" = plain {ratio(('plain', high), ('plain', low)):.2f}x"
          f" x {ratio(('speculative', high), ('plain', high)):.2f}"
          f" / {ratio(('speculative', low), ('plain', low)):.2f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("batching_ceiling.py", argv),
            "date": time.strftime("%Y-%m-%d %H:%M"), **machine(), "max_tokens": args.max_tokens,
            "requests": args.requests}
    report = {**meta, "rows": rows, "bounds": bounds}
    (out / "batching_ceiling.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
