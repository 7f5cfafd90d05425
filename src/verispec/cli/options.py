"""Options more than one command takes: the model flags (``--target``, ``--backend``, ...) and
the llama.cpp settings they give, and the generation flags of generate and chat (sampling,
penalties, logprobs). Here, not in cli/__init__.py, so that cli/bench.py can use them without
importing the module that imports it."""

from __future__ import annotations

import argparse
import json

from ..config import (
    COST_CURVE_MODES,
    CROSS_VOCAB_MODES,
    HYBRID_LOOKUPS,
    POLICY_NAMES,
    REPACK_MODES,
    VERIFICATION_RULES,
)
from ..server.settings import add_alias_switch

COST_CURVE_HELP = ("llama.cpp backend: the target's pass costs over 1 to 9 tokens and the "
                   "draft's step, which price the depth policy from the first round. cached: "
                   "measured at the first load of each model file, thread count and kernel set, "
                   "read back after; measure: measured afresh; off: not measured (default: "
                   "$VERISPEC_COST_CURVE, else cached)")


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--target", metavar="PATH", help="target model directory or .gguf file "
                        "(default: the shipped demo target)")
    models.add_argument("--draft", metavar="PATH", help="draft model directory or .gguf file "
                        "(default: the shipped demo draft when --target is not given)")
    models.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    models.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default: float32)")
    models.add_argument("--backend", default="auto",
                        choices=["auto", "fast", "transformers", "llama.cpp"],
                        help="forward implementation: 'llama.cpp' runs .gguf files on llama.cpp "
                        "(the llamacpp extra), 'fast' is a flat Llama forward, 'transformers' "
                        "the model's own; auto = llama.cpp for .gguf files when installed, "
                        "else fast where supported")
    models.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on a CUDA device, run decoding steps eagerly instead of replaying "
                        "them as captured CUDA graphs")
    models.add_argument("--threads", type=_int, default=None, metavar="N",
                        help="llama.cpp backend: decoding threads (default: one per core)")
    models.add_argument("--context-size", type=_int, default=None, metavar="N",
                        help="llama.cpp backend: KV-cache tokens per sequence (default: the "
                        "model's trained context, at most 4096)")
    models.add_argument("--repack", default="auto", choices=REPACK_MODES,
                        help="llama.cpp backend: weight kernels. auto: repacked kernels, and "
                        "AMX only where a probe shows llama.cpp's AMX kernel runs here; on: "
                        "all llama.cpp offers, AMX unprobed; off: plain kernels (default: auto)")
    models.add_argument("--cost-curve", default=None, choices=COST_CURVE_MODES,
                        help=COST_CURVE_HELP)
    models.add_argument("--uniform-passes", action="store_true",
                        help="llama.cpp backend: decode every target token after a prompt in a "
                        "4-token pass (padded), so that greedy speculative decoding equals "
                        "plain decoding token for token on quantized files; a 1-token pass "
                        "then costs a 4-token one")
    models.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                        help="what chat renders messages with: chatml, gemma, plain or a Jinja "
                        "file (default: the model's own template)")


def llama_cpp_config(args: argparse.Namespace):
    """The LlamaCppConfig of --threads, --context-size, --repack, --cost-curve and
    --uniform-passes."""
    from ..models.llama_cpp.model import LlamaCppConfig

    return LlamaCppConfig(num_threads=args.threads, context_size=args.context_size,
                          repack=args.repack, cost_curve=args.cost_curve,
                          uniform_passes=args.uniform_passes)


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    sampling = parser.add_argument_group("generation")
    sampling.add_argument("--k", type=_int, default=None, metavar="N",
                          help="draft tokens per round, 1 to 32 (default: on llama.cpp the depth "
                          "its measured cost curve prices best, see --cost-curve; else 4 on a "
                          "GPU and on CPUs where the target runs on packed oneDNN weights, e.g. "
                          "AMD; 2 on other CPUs, where verifying more costs more than it saves)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0 = greedy, at most 10000 (default: 0)")
    sampling.add_argument("--top-k", type=_int, default=None, metavar="K")
    sampling.add_argument("--top-p", type=float, default=None, metavar="P")
    sampling.add_argument("--max-new-tokens", type=_int, default=64, metavar="N",
                          help="default: 64")
    sampling.add_argument("--seed", type=_int, default=None, metavar="S")
    sampling.add_argument("--stop", nargs="+", default=None, metavar="STR",
                          help="stop strings (excluded from the output)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="do not stop at end-of-generation tokens (fixed-length output)")
    sampling.add_argument("--min-tokens", type=_int, default=0, metavar="N",
                          help="no end-of-generation token before N new tokens (default: 0)")
    sampling.add_argument("--min-p", type=float, default=None, metavar="P",
                          help="keep tokens at least P times as likely as the most likely one")
    _add_penalty_options(parser)
    _add_drafting_options(sampling)
    sampling.add_argument("--no-draft", action="store_true",
                          help="plain target decoding through the same code path")
    sampling.add_argument("--adaptive", choices=POLICY_NAMES, default=None,
                          help="adapt k between rounds, starting at --k: 'goodput' measures "
                          "which depth is fastest here, 'goodput-plain' may also choose plain "
                          "rounds (k = 0), 'threshold' follows acceptance")
    sampling.add_argument("--verification", choices=VERIFICATION_RULES,
                          default=VERIFICATION_RULES[0],
                          help="how an unseeded sampled request tests a draft model's tokens: "
                          "'block' (block verification: exact, keeps at least as many tokens a "
                          "round on average) or 'token' (token-wise rejection sampling); a seeded "
                          "request keeps draft tokens while they are the target's own samples "
                          "(default: "
                          f"{VERIFICATION_RULES[0]})")


def _add_drafting_options(group: argparse._ArgumentGroup) -> None:
    """How a model-free or hybrid draft looks up, and the draft model's confidence floor."""
    group.add_argument("--suffix", action="store_true",
                       help="draft without a model, by the suffix-decoding rule: where the "
                       "last tokens repeat a span of the prompt, the output or an earlier "
                       "request, draft its most frequent continuation, deeper the longer "
                       "the match; nothing elsewhere")
    add_alias_switch(group, "--ngram", "--suffix", "suffix")
    group.add_argument("--hybrid", action="store_true",
                       help="draft by prompt lookup in rounds where it finds a match, by the "
                       "draft model otherwise (needs a draft model: the demo pair's, or "
                       "--draft)")
    group.add_argument("--hybrid-lookup", choices=HYBRID_LOOKUPS, default=HYBRID_LOOKUPS[0],
                       help="with --hybrid, what is looked up before the draft model: ngram "
                       "(the last 2-3 tokens) or suffix (the suffix drafter: the longest "
                       f"repeated span) (default: {HYBRID_LOOKUPS[0]})")
    group.add_argument("--hybrid-chain", action="store_true",
                       help="with --hybrid, a row whose lookup finds fewer than k tokens goes "
                       "on with the draft model's after them in the same round")
    group.add_argument("--cross-vocab", choices=CROSS_VOCAB_MODES, default=CROSS_VOCAB_MODES[0],
                       help="how a draft of another tokenizer than the target's proposes: "
                       "string (its text re-tokenized into target tokens, kept where they "
                       "match the target's own), intersection (drawn over the tokens both "
                       "vocabularies share, ratio-tested) or auto (by how much of the two "
                       f"vocabularies is shared) (default: {CROSS_VOCAB_MODES[0]})")
    group.add_argument("--draft-p-min", type=float, default=0.0, metavar="P",
                       help="the draft model's confidence floor, 0 to 1: a draft ends before "
                       "the first position where its most likely token is less likely than "
                       "P (a greedy draft's at temperature 1); exact, it changes only how "
                       "many tokens are drafted (default: 0, none)")


def _add_penalty_options(parser: argparse.ArgumentParser) -> None:
    penalties = parser.add_argument_group(
        "penalties and logprobs", "applied to the target's distribution, which speculation "
        "keeps exactly (docs/exactness.md gives the order)")
    penalties.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                           help="subtracted once from each token already generated, -2 to 2 "
                           "(OpenAI's; default: 0)")
    penalties.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                           help="subtracted per earlier occurrence in the output, -2 to 2 "
                           "(OpenAI's; default: 0)")
    penalties.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                           help="Hugging Face's, over prompt and output, 0.01 to 100: > 1 "
                           "discourages repeats (default: 1, off)")
    penalties.add_argument("--logit-bias", type=_logit_bias, default=None, metavar="ID:BIAS,...",
                           help="add BIAS (-100 to 100) to token ID's logit: ID:BIAS pairs "
                           "separated by commas, or a JSON object {\"ID\": BIAS}; each ID once")
    penalties.add_argument("--logprobs", type=_int, default=None, metavar="N",
                           help="after the text, each token's logprob and its N (0 to 20) most "
                           "likely alternatives (with --json: in the JSON)")


def _logit_bias(text: str) -> dict[int, float]:
    """--logit-bias: '13:-100,42:5' or '{"13": -100}' -> {13: -100.0, ...}; a token id given
    twice (5:1,5:2, or 5 and 05) is refused, as the server refuses it, rather than one value
    silently kept (the ranges are the library's to check)."""
    expected = (f"expected ID:BIAS pairs separated by commas (e.g. 13:-100,42:5) or a JSON "
                f"object (e.g. '{{\"13\": -100}}'), got {text!r}")
    if text.lstrip().startswith("{"):
        try:  # the object as its (key, value) pairs: a key it repeats must not vanish
            items = json.loads(text, object_pairs_hook=list)
        except ValueError:
            raise argparse.ArgumentTypeError(expected) from None
    else:
        items = [tuple(part.split(":")) for part in text.split(",")]
    bias: dict[int, float] = {}
    for item in items:
        try:
            key, value = item
            if isinstance(value, bool) or not str(key).strip().lstrip("-").isdigit():
                raise ValueError
            token, value = int(key), float(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(expected) from None
        if token in bias:
            raise argparse.ArgumentTypeError(f"token id {token} is given twice in {text!r}; "
                                             "give each token id once")
        bias[token] = value
    return bias
