"""``verispec bench`` on the command line: arguments, progress, the table, JSON and the plot.

The measuring lives in bench/run.py; this module only presents it (rich, matplotlib are the
``[bench]`` extra and are imported when the command runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import BENCH_RULES, MAX_NUM_DRAFT_TOKENS, SamplingConfig
from ..errors import ConfigError, UnsupportedFeatureError
from ..text.prompts import check_text
from .options import llama_cpp_config

if TYPE_CHECKING:  # the measuring side pulls in torch and transformers: imported when run
    from ..bench.run import BenchSettings, MethodResult


def add_bench_parser(commands: argparse._SubParsersAction, add_model_options) -> None:
    bench = commands.add_parser(
        "bench", help="time verispec against plain decoding and HF assisted generation",
        description="Benchmark on held-out prompts: verispec plain (baseline), transformers "
        "generate, transformers assisted generation (defaults and matched k), verispec at "
        "fixed k and with adaptive policies; greedy and temperature 1.")
    add_model_options(bench)
    bench.add_argument("--prompts", metavar="FILE", help="a JSON list of prompt strings, or a "
                       "text file with one prompt per line (default: the shipped held-out set)")
    bench.add_argument("--num-prompts", type=int, default=20, metavar="N", help="default: 20")
    bench.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default: 64")
    bench.add_argument("--repeats", type=int, default=5, metavar="N",
                       help="timed runs per method (median reported; default: 5)")
    bench.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8], metavar="K")
    bench.add_argument("--hf-ks", type=int, nargs="*", default=None, metavar="K",
                       help="k values for matched HF assisted generation (default: --ks)")
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], metavar="T")
    bench.add_argument("--llama-server", metavar="PATH", default=None,
                       help="a llama-server binary: with GGUF files on the llama.cpp backend, "
                       "also time llama.cpp's own server on them, plain and with its draft-model "
                       "speculation (over HTTP on loopback)")
    bench.add_argument("--llama-server-ks", type=int, nargs="+", default=None, metavar="K",
                       help="draft depths of llama-server's speculation (default: --ks)")
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers methods")
    bench.add_argument("--no-adaptive", action="store_true", help="skip the adaptive policies")
    bench.add_argument("--no-suffix", action="store_true",
                       help="skip the suffix drafter (what --suffix serves: no draft model)")
    bench.add_argument("--ngram-ks", type=int, nargs="*", default=[1, 2, 3], metavar="K",
                       help="k values for n-gram (prompt lookup) drafting on the same target, "
                       "and for HF prompt lookup matched to them; none to skip")
    bench.add_argument("--hybrid-ks", type=int, nargs="*", default=[2, 3], metavar="K",
                       help="k values for hybrid drafting (n-gram lookup first, the draft model "
                       "where there is no match); none to skip")
    bench.add_argument("--rules", nargs="+", choices=BENCH_RULES, default=[BENCH_RULES[0]],
                       help="how sampled rows of the fixed-k methods are verified, each a method "
                       "of its own in the same interleaved run: block or token verification "
                       "(unseeded rows), seeded (rows with a seed: races on keyed clocks) "
                       f"(default: {BENCH_RULES[0]})")
    bench.add_argument("--seed", type=int, default=0, metavar="S")
    bench.add_argument("--json", metavar="FILE", help="write all results as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="speedup versus k, with the theory")
    bench.add_argument("--markdown", metavar="FILE.md", help="the tables as Markdown (the "
                       "README's benchmark section is this file)")
    bench.set_defaults(handler=run_bench_command)


def _load_prompts(path: str | None, num_prompts: int) -> list[str]:
    if path is None:
        from ..text.demo import heldout_prompts

        prompts = heldout_prompts()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"--prompts {path!r} cannot be read ({reason}); pass a UTF-8 "
                              "text file with one prompt per line, or a JSON list of "
                              "strings.") from None
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError:
            prompts = [line for line in text.splitlines() if line.strip()]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ConfigError(f"--prompts {path!r}: expected a JSON list of strings or one "
                              "prompt per line.")
        for i, prompt in enumerate(prompts):
            if not prompt.strip():
                raise ConfigError(f"--prompts {path!r}: prompt {i} is empty; remove it.")
            check_text(prompt, f"--prompts {path!r}, prompt {i},")
    if not prompts:
        raise ConfigError("no prompts to benchmark; --prompts FILE is empty.")
    return prompts[:num_prompts]


def _check_output(flag: str, path: str | None) -> None:
    """Fail before the run, not after it: the file's folder exists and is writable, and the
    path is not a folder itself."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path!r} is a folder; pass a file path inside it.")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path!r}: the folder {str(folder)!r} does not exist; create "
                          "it first or pass a path in an existing folder.")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path!r} is not writable; pass a path you can write to.")


def _check_args(args: argparse.Namespace) -> None:
    """Every argument checked before the models load (a bad one costs a second, not a load)."""
    if args.repeats < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ConfigError("--repeats, --num-prompts and --max-new-tokens must be >= 1.")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads} is invalid: expected an integer >= 1, or no "
                          "--threads for the default (one per core).")
    if args.llama_server is not None and not Path(args.llama_server).is_file():
        raise ConfigError(f"--llama-server {args.llama_server!r} is not a file; pass the path of "
                          "a llama-server binary built from llama.cpp's source.")
    for flag, ks in (("--ks", args.ks), ("--hf-ks", args.hf_ks or []),
                     ("--llama-server-ks", args.llama_server_ks or []),
                     ("--ngram-ks", args.ngram_ks), ("--hybrid-ks", args.hybrid_ks)):
        bad = [k for k in ks if not 1 <= k <= MAX_NUM_DRAFT_TOKENS]
        if bad:
            raise ConfigError(f"{flag} {bad[0]} is invalid: expected k from 1 to "
                              f"{MAX_NUM_DRAFT_TOKENS}.")
        _check_distinct(flag, ks)
    for temperature in args.temperatures:
        SamplingConfig(temperature=temperature)  # ConfigError names the bad value
    _check_distinct("--temperatures", args.temperatures)
    for flag, path in (("--json", args.json), ("--plot", args.plot),
                       ("--markdown", args.markdown)):
        _check_output(flag, path)
    _require_extra("rich")
    if args.plot:
        _require_extra("matplotlib")


def _check_distinct(flag: str, values: list) -> None:
    """Each method's row is named by its k (each table by its temperature): no repeats."""
    repeated = [v for i, v in enumerate(values) if v in values[:i]]
    if repeated:
        raise ConfigError(f"{flag} lists {repeated[0]:g} twice; list each value once.")


def _require_extra(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UnsupportedFeatureError(f"verispec bench needs the bench extra ({module} is not "
                                      "installed): pip install 'verispec[bench]'.")


def run_bench_command(args: argparse.Namespace) -> int:
    """Check the flags, load the pair, time every method at each temperature, report."""
    _check_args(args)
    texts = _load_prompts(args.prompts, args.num_prompts)

    from rich.console import Console

    decoder = _load_bench_decoder(args)
    prompts = [decoder.tokenizer.encode(p) for p in texts]
    settings = _bench_settings(args, on_llama_cpp=decoder.target.matmul == "llama.cpp")
    console = Console(stderr=True)
    _print_header(console, args, decoder, len(prompts), settings)
    all_results = _run_temperatures(args, decoder, prompts, settings, console)
    _report_results(args, decoder, all_results, settings, len(prompts))
    return 0


def _load_bench_decoder(args: argparse.Namespace):
    """The decoder the model flags describe, on --threads threads; --llama-server needs it to
    be a GGUF pair on the llama.cpp backend."""
    import torch

    from ..text.load import load

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    decoder = load(args.target, args.draft, device=args.device, dtype=args.dtype,
                   backend=args.backend, llama_cpp_config=llama_cpp_config(args))
    on_llama_cpp = decoder.target.matmul == "llama.cpp"
    if args.llama_server is not None and not (on_llama_cpp and decoder.draft is not None):
        raise ConfigError("--llama-server compares llama.cpp's server with verispec on the same "
                          "GGUF pair: pass --target and --draft .gguf files on the llama.cpp "
                          "backend.")
    return decoder


def _bench_settings(args: argparse.Namespace, on_llama_cpp: bool) -> BenchSettings:
    """The flags as the run's settings."""
    from ..bench.run import BenchSettings

    return BenchSettings(max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                         ks=tuple(args.ks),
                         hf_ks=tuple(args.ks if args.hf_ks is None else args.hf_ks),
                         temperatures=tuple(args.temperatures),
                         seed=args.seed,
                         # transformers' generate() needs a transformers model
                         include_hf=not args.no_hf and not on_llama_cpp,
                         include_adaptive=not args.no_adaptive,
                         include_suffix=not args.no_suffix,
                         ngram_ks=tuple(args.ngram_ks), hybrid_ks=tuple(args.hybrid_ks),
                         rules=tuple(dict.fromkeys(args.rules)))


def _print_header(console, args: argparse.Namespace, decoder, num_prompts: int,
                  settings: BenchSettings) -> None:
    """On stderr: the run's size and where it runs, then the pair's measured cost curve
    (policy/costs.py), where the llama.cpp backend measured one."""
    from ..bench.run import environment

    env = environment(decoder.target.device)
    # the projections' kernel of verispec's target (models/fast_llama/matmul.py); transformers' own
    # forward (generate(), assisted generation) always runs ATen's
    matmul = decoder.target.matmul
    device = args.device + (f" ({env['accelerator']})" if "accelerator" in env else "")
    console.print(f"[bold]verispec bench[/]: {num_prompts} prompts x {settings.max_new_tokens} "
                  f"tokens, {settings.repeats} repeats, {env['threads']} threads, "
                  f"{env['processor']}, torch {env['torch']}, {device} {args.dtype}, "
                  f"matmul {matmul}")
    if decoder.cost_curve is not None:
        console.print(f"cost curve: {decoder.cost_curve.describe()}", highlight=False)


def _run_temperatures(args: argparse.Namespace, decoder, prompts: list[list[int]],
                      settings: BenchSettings, console) -> dict[float, list[MethodResult]]:
    """The bench at each temperature, with a progress bar on ``console`` and, with
    --llama-server, llama-server processes started for the run and stopped after it."""
    import torch
    from rich.progress import Progress

    from ..bench.run import run_bench

    all_results: dict[float, list[MethodResult]] = {}
    servers = _start_llama_servers(args, decoder) if args.llama_server else {}
    try:
        with Progress(console=console, transient=True) as progress, torch.inference_mode():
            task = progress.add_task("bench", total=len(settings.temperatures))
            for temperature in settings.temperatures:
                all_results[temperature] = run_bench(
                    decoder, prompts, settings, temperature,
                    progress=lambda text: progress.update(task, description=text),
                    llama_servers=servers)
                progress.advance(task)
    finally:
        for server in servers.values():
            server.stop()
    return all_results


def _report_results(args: argparse.Namespace, decoder,
                    all_results: dict[float, list[MethodResult]], settings: BenchSettings,
                    num_prompts: int) -> None:
    """The tables on stdout, then the --json, --plot and --markdown files asked for."""
    from rich.console import Console

    from ..bench.run import to_json

    out = Console(width=200)  # the table is wide; do not wrap it in pipes and logs
    for temperature, results in all_results.items():
        out.print(results_table(results, temperature))
    curve = decoder.cost_curve
    extra = {"device": args.device, "dtype": args.dtype, "backend": args.backend,
             "matmul": decoder.target.matmul, "num_prompts": num_prompts,
             "cost_curve": None if curve is None else asdict(curve)}
    if args.json:
        Path(args.json).write_text(to_json(all_results, settings, extra, decoder.target.device))
    if args.plot:
        plot_speedups(all_results, Path(args.plot))
    if args.markdown:
        Path(args.markdown).write_text(markdown_tables(all_results))


def _start_llama_servers(args: argparse.Namespace, decoder) -> dict:
    """llama-server processes on the bench's GGUF pair: plain (key None) and speculative at
    each of --llama-server-ks, all with the threads and context of verispec's models."""
    import tempfile

    from ..bench.llama_server import start_llama_server

    threads = decoder.target.config.threads()
    context = decoder.target.max_positions
    log_dir = Path(tempfile.mkdtemp(prefix="verispec-llama-server-"))
    servers = {}
    try:
        servers[None] = start_llama_server(args.llama_server, args.target, None, 0, threads,
                                           context, log_dir)
        for k in args.llama_server_ks or args.ks:
            servers[k] = start_llama_server(args.llama_server, args.target, args.draft, k,
                                            threads, context, log_dir)
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _matches_column(r: MethodResult) -> str:
    """The '= base' column: whether greedy output equals the baseline's ('-' when sampled)."""
    return "-" if r.matches_baseline is None else ("yes" if r.matches_baseline else "NO")


def results_table(results: list[MethodResult], temperature: float):
    from rich.table import Table

    table = Table(title=f"temperature {temperature:g} (speedup over verispec plain)")
    for column in ("method", "tok/s", "ms/tok", "speedup", "accept", "a", "per-position",
                   "tok/call", "c", "v", "theory", "ach/theory", "peak MB", "= base"):
        # peak MB: the process's peak RSS on a CPU run, torch's peak GPU allocation on CUDA
        table.add_column(column, justify="left" if column in ("method", "per-position")
                         else "right")
    for r in results:
        per_position = "/".join(f"{x:.2f}"[1:] if x < 1 else "1" for x in
                                r.per_position_acceptance[:8])
        same = _matches_column(r)
        table.add_row(r.name, _fmt(r.tokens_per_second, ".1f"), _fmt(r.ms_per_token),
                      _fmt(r.speedup), _fmt(r.acceptance_rate), _fmt(r.token_acceptance),
                      per_position or "-",
                      _fmt(r.mean_accepted_length), _fmt(r.cost_ratio, ".3f"),
                      _fmt(r.verify_cost),
                      _fmt(r.theoretical_speedup), _fmt(r.achieved_over_theoretical),
                      _fmt(r.peak_rss_mb if r.peak_gpu_mb is None else r.peak_gpu_mb, ".0f"),
                      same)
    return table


def markdown_tables(all_results: dict[float, list[MethodResult]]) -> str:
    """One Markdown table per temperature: the columns of the terminal table that matter."""
    lines = []
    for temperature, results in all_results.items():
        title = "greedy" if temperature == 0 else "sampling"
        lines += [f"**Temperature {temperature:g} ({title})**", "",
                  "| method | tok/s | speedup | repeats | accepted / drafted | a | "
                  "tokens / target call | c | v | theory | achieved / theory | = plain |",
                  "|---" * 12 + "|"]
        for r in results:
            same = _matches_column(r)
            spread = (f"{min(r.speedup_per_repeat):.2f}-{max(r.speedup_per_repeat):.2f}"
                      if r.speedup_per_repeat else "-")
            lines.append(f"| {r.name} | {r.tokens_per_second:.0f} | {_fmt(r.speedup)} | {spread} | "
                         f"{_fmt(r.acceptance_rate)} | "
                         f"{_fmt(r.token_acceptance)} | {_fmt(r.mean_accepted_length)} | "
                         f"{_fmt(r.cost_ratio)} | {_fmt(r.verify_cost)} | "
                         f"{_fmt(r.theoretical_speedup)} | {_fmt(r.achieved_over_theoretical)} | "
                         f"{same} |")
        lines.append("")
    return "\n".join(lines)


def plot_speedups(all_results: dict[float, list[MethodResult]], path: Path) -> None:
    import matplotlib

    from ..sample.theory import theoretical_speedup

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(8 * len(all_results), 4.5),
                             squeeze=False)
    for ax, (temperature, results) in zip(axes[0], all_results.items()):
        fixed = [r for r in results if r.kind == "verispec"]
        ks = [r.num_draft_tokens for r in fixed]
        ax.plot(ks, [r.speedup for r in fixed], "o-", label="verispec (measured)")
        for kind, marker, label in (("ngram", "^-", "verispec n-gram (measured)"),
                                    ("hybrid", "D-", "verispec hybrid (measured)")):
            rows = [r for r in results if r.kind == kind]
            if rows:
                ax.plot([r.num_draft_tokens for r in rows], [r.speedup for r in rows], marker,
                        label=label)
        drafted = [r for r in fixed if r.token_acceptance is not None]
        if drafted:
            a = sum(r.token_acceptance for r in drafted) / len(drafted)
            c = sum(r.cost_ratio for r in drafted) / len(drafted)
            grid = list(range(1, max(ks) + 1))
            ax.plot(grid, [theoretical_speedup(a, k, c) for k in grid], "--",
                    label=f"theory (a={a:.2f}, c={c:.3f})")
        for r in results:
            if r.kind == "hf" and r.num_draft_tokens is not None:
                ax.plot([r.num_draft_tokens], [r.speedup], "s", label=f"{r.name}")
            elif r.name == "hf assisted (defaults)":
                ax.axhline(r.speedup, color="gray", linestyle=":", label=r.name)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xlabel("k (draft tokens per round)")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"temperature {temperature:g}")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the data
    fig.tight_layout()
    fig.savefig(path, dpi=110)
