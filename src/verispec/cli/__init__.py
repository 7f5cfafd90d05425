"""The ``verispec`` command line: thin argument parsing over the Python API.

    verispec generate "def fibonacci(n):" --max-new-tokens 64
    verispec generate - --json < prompt.txt
    verispec generate "x =" --frequency-penalty 0.5 --logit-bias 13:-100 --logprobs 3

Bad options or inputs print ONE line to stderr and exit with status 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..errors import VerispecError
from ..policy import named_policy
from .bench import add_bench_parser
from .options import _add_model_options, _add_sampling_options, llama_cpp_config

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (and exits 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"verispec: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _OneLineParser(prog="verispec", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"verispec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    _add_generate_parser(commands)
    _add_chat_parser(commands)
    _add_export_parser(commands)
    add_bench_parser(commands, _add_model_options)
    _add_serve_parser(commands)
    return parser


def _add_generate_parser(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="complete a prompt, streaming the text",
                                   description="Complete PROMPT, streaming text to stdout and a "
                                   "metrics summary to stderr.")
    generate.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                          help="the prompt text; '-' reads it from stdin")
    _add_model_options(generate)
    _add_sampling_options(generate)
    generate.add_argument("--json", action="store_true",
                          help="print one JSON object (text, token_ids, metrics) instead")
    generate.add_argument("--quiet", action="store_true", help="no metrics summary on stderr")
    generate.add_argument("--compare", action="store_true",
                          help=f"then time speculative and plain decoding of the same prompt "
                          f"{COMPARE_REPEATS} times each, interleaved, and report the median "
                          "speedup and its range (and, at temperature 0 or with --seed, "
                          "whether the tokens are identical)")
    generate.set_defaults(handler=_generate)


def _add_chat_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser(
        "chat", help="answer a chat message with the model's chat template",
        description="Answer MESSAGE (or each line of stdin, as one conversation) in the model's "
        "chat template (--chat-template names one for a model without), streaming the reply; "
        "the reply ends at the template's end-of-turn token.")
    chat.add_argument("message", nargs="?", default=None, metavar="MESSAGE",
                      help="the user's message; '-' reads it from stdin; none: each line of "
                      "stdin is the next user turn")
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system message first")
    _add_model_options(chat)
    _add_sampling_options(chat)
    chat.add_argument("--quiet", action="store_true", help="no metrics summary on stderr")
    chat.set_defaults(handler=_chat)


def _add_export_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export-gguf", help="write a Llama checkpoint as a .gguf file (for the llama.cpp backend)",
        description="Write the Llama-architecture transformers checkpoint in DIR (byte-level BPE "
        "tokenizer) to OUT.gguf, as llama.cpp's converter would. With no DIR: the shipped demo "
        "target; --demo-draft: the demo draft.")
    export.add_argument("source", nargs="?", default=None, metavar="DIR",
                        help="model directory (default: the demo target)")
    export.add_argument("out", metavar="OUT.gguf", help="the file to write")
    export.add_argument("--demo-draft", action="store_true",
                        help="export the shipped demo draft (instead of DIR)")
    export.add_argument("--quantization", default="F32", choices=["F32", "Q8_0"],
                        help="tensor type of the matrices (default: F32, exact)")
    export.set_defaults(handler=_export_gguf)


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    from ..server.ray.settings import add_ray_arguments  # dataclasses only; no Ray import
    from ..server.settings import add_settings_arguments  # dataclasses only; no FastAPI import

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                description="Serve the model pair over an OpenAI-compatible "
                                "HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                                "/health, /metrics). Needs the serve extra: pip install "
                                "'verispec[serve]'; with --ray, replicas of it on Ray Serve "
                                "(the ray extra).")
    add_settings_arguments(serve)
    add_ray_arguments(serve)
    serve.set_defaults(handler=_serve)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}".splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`verispec generate ... | head`): stop quietly
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _check_model_choice(args: argparse.Namespace) -> None:
    """The model flags' rules, the same as the server's (server.settings.check_model_flags)."""
    from ..server.settings import check_model_flags, paired_draft_for  # no FastAPI import

    paired = paired_draft_for(args.target, args.draft, suffix=args.suffix, no_draft=args.no_draft)
    if paired is not None:
        print(f"verispec: drafting with {paired}, the paired draft of {args.target} (--suffix "
              "or --no-draft to go without)", file=sys.stderr)
        args.draft = paired
    check_model_flags(args.target, args.draft, suffix=args.suffix, hybrid=args.hybrid,
                      no_draft=args.no_draft, hybrid_lookup=args.hybrid_lookup,
                      hybrid_chain=args.hybrid_chain, draft_p_min=args.draft_p_min)


def _read_prompt(prompt: str | None) -> str:
    from ..errors import EmptyPromptError

    if prompt == "-":
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError as exc:  # a strict locale; others hand check_text surrogates
            from ..errors import InputError

            raise InputError(f"stdin is not UTF-8 text ({exc.reason} at byte {exc.start}); pass "
                             "the prompt as UTF-8.") from None
    if not prompt:
        raise EmptyPromptError("no prompt given; pass PROMPT, or '-' to read it from stdin.")
    return prompt


def _load_decoder(args: argparse.Namespace):
    """The decoder the model flags describe."""
    from ..proposers.hybrid import lookup_named
    from ..proposers.suffix import SuffixDraft
    from ..text.load import load

    return load(args.target, SuffixDraft() if args.suffix else args.draft, device=args.device,
                dtype=args.dtype, num_draft_tokens=args.k, backend=args.backend,
                adaptive=named_policy(args.adaptive), verification=args.verification,
                hybrid=lookup_named(args.hybrid_lookup) if args.hybrid else False,
                llama_cpp_config=llama_cpp_config(args), chat_template=args.chat_template,
                cuda_graphs=args.cuda_graphs, hybrid_chain=args.hybrid_chain,
                draft_p_min=args.draft_p_min, cross_vocab=args.cross_vocab)


def _request_settings(args: argparse.Namespace) -> dict[str, object]:
    """The generation flags as Decoder.stream's arguments."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                num_draft_tokens=args.k, speculative=not args.no_draft,
                ignore_eos=args.ignore_eos, min_new_tokens=args.min_tokens, min_p=args.min_p,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, logit_bias=args.logit_bias,
                logprobs=args.logprobs)


def print_logprobs(tokenizer, completion) -> None:
    """One line per generated token: its text, its logprob and the alternatives listed, e.g.
    ``' the'      -0.3120   ' the' -0.3120  ' a' -1.9025``; -inf for a token the processed
    distribution excludes."""
    def text(token: int) -> str:
        return repr(tokenizer.decode([token], skip_special_tokens=False))

    for lp in completion.logprobs or []:
        alternatives = "  ".join(f"{text(token)} {value:.4f}" for token, value in lp.top)
        sys.stdout.write(f"{text(lp.token_id):<16} {lp.logprob:9.4f}   {alternatives}".rstrip()
                         + "\n")


def _chat(args: argparse.Namespace) -> int:
    """One reply to MESSAGE, or a conversation: each line of stdin is a user turn, answered
    in turn with the whole conversation so far as the prompt."""
    _check_model_choice(args)
    decoder = _load_decoder(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [_read_prompt(args.message)] if args.message is not None else (
        line.rstrip("\n") for line in sys.stdin if line.strip())
    for text in turns:
        messages.append({"role": "user", "content": text})
        stream = decoder.stream_chat(messages, **_request_settings(args))
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": stream.completion.text})
        print_logprobs(decoder.tokenizer, stream.completion)
        if not args.quiet:
            print(format_metrics(stream.completion.metrics, speculative=not args.no_draft),
                  file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args.prompt)
    _check_model_choice(args)
    if args.no_draft and (args.compare or args.adaptive):
        from ..errors import ConfigError

        option = "--compare" if args.compare else "--adaptive"
        raise ConfigError(f"{option} needs a draft (it is about speculative decoding); drop "
                          "--no-draft.")
    decoder = _load_decoder(args)
    stream = decoder.stream(prompt, **_request_settings(args))
    for delta in stream:
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    completion = stream.completion
    comparison = _compare(decoder, prompt, args) if args.compare else None
    if args.json:
        print(json.dumps({**completion.to_dict(), **({"comparison": comparison}
                                                      if comparison else {})}))
        return 0
    sys.stdout.write("\n")
    print_logprobs(decoder.tokenizer, completion)
    if not args.quiet:
        print(format_metrics(completion.metrics, speculative=not args.no_draft), file=sys.stderr)
    if comparison is not None:
        same = comparison["same_tokens"]
        speedup = comparison["measured_speedup"]
        low_high = comparison["speedup_range"]
        print(f"[measured on this prompt, {COMPARE_REPEATS} interleaved runs each (medians): "
              f"speculative {comparison['speculative_tok_s']:.1f} tok/s, plain "
              f"{comparison['plain_tok_s']:.1f} tok/s, speedup "
              + ("n/a (no tokens)" if speedup is None
                 else f"{speedup:.2f}x (runs {low_high[0]:.2f}-{low_high[1]:.2f})")
              + ("" if same is None else f"; same tokens as plain decoding: "
                 f"{'yes' if same else 'NO'}") + "]", file=sys.stderr)
    return 0


COMPARE_REPEATS = 5  # interleaved speculative/plain pairs behind --compare's figures


def _compare(decoder, prompt: str, args: argparse.Namespace) -> dict[str, object]:
    """Time COMPARE_REPEATS speculative and plain generations of the prompt, interleaved (the
    order alternates pair by pair, so drift on a busy machine lands on both alike; the streamed
    run before warmed both up). Same settings and seed. The speedup is the median of the
    pairs' ratios, with their range: one pair alone moves a lot on a shared CPU. Tokens are
    compared at temperature 0 and with a seed, where they must be identical (unseeded sampled
    runs draw different, equally distributed tokens)."""
    import statistics
    import time

    def timed(speculative: bool) -> tuple[list[int], float]:
        started = time.perf_counter()
        completion = decoder.generate(prompt, **{**_request_settings(args),
                                                 "speculative": speculative, "logprobs": None})
        return completion.token_ids, time.perf_counter() - started

    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {True: [], False: []}
    for repeat in range(COMPARE_REPEATS):
        for speculative in ((True, False) if repeat % 2 == 0 else (False, True)):
            token_ids, seconds = timed(speculative)
            tokens[speculative].append(token_ids)
            rates[speculative].append(len(token_ids) / seconds)
    ratios = [fast / plain for fast, plain in zip(rates[True], rates[False]) if plain]
    return {"speculative_tok_s": statistics.median(rates[True]),
            "plain_tok_s": statistics.median(rates[False]),
            "measured_speedup": statistics.median(ratios) if ratios else None,
            "speedup_range": [min(ratios), max(ratios)] if ratios else None,
            "repeats": COMPARE_REPEATS,
            "same_tokens": (all(ids == tokens[False][0] for ids in tokens[True] + tokens[False])
                            if args.temperature == 0 or args.seed is not None else None)}


def _export_gguf(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..models.gguf_export import export_gguf

    if args.source is not None and args.demo_draft:
        raise ConfigError("--demo-draft exports the shipped demo draft; drop DIR (or the flag).")
    source = args.source
    if source is None:
        from ..text.demo import demo_pair

        pair = demo_pair()
        source = pair.draft if args.demo_draft else pair.target
    if not str(args.out).lower().endswith(".gguf"):
        raise ConfigError(f"OUT={args.out!r} is invalid: expected a file name ending in .gguf.")
    path = export_gguf(source, args.out, args.quantization)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {args.quantization})",
          file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ..server.ray.settings import ray_settings_from_args
    from ..server.settings import ServerSettings

    settings, ray_settings = ServerSettings.from_args(args), ray_settings_from_args(args)
    if ray_settings is not None:
        from ..server.ray.run import serve_on_ray

        return serve_on_ray(settings, ray_settings)
    from ..server.run import serve

    return serve(settings)


def format_metrics(metrics, speculative: bool) -> str:
    """A short human summary of a generation's metrics."""
    rate = metrics.tokens_per_second
    noun = "token" if metrics.num_emitted == 1 else "tokens"
    line = f"[{metrics.num_emitted} {noun} in {metrics.wall_time:.2f}s, {rate:.1f} tok/s"
    if not speculative:
        return line + ", plain decoding]"
    if not metrics.num_drafted:  # every round was plain (max_new_tokens=1, or no lookup match)
        return line + "; no draft tokens tested (every round was a plain step)]"
    c = metrics.cost_ratio
    return (f"{line}; acceptance rate {metrics.acceptance_rate:.2f}, mean accepted length "
            f"{metrics.mean_accepted_length:.2f} tokens/target call, c = "
            f"{'n/a' if c is None else f'{c:.3f}'}, modelled speedup "
            f"{metrics.modelled_speedup:.2f}x (formula; --compare measures it)]")
