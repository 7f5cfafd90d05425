"""``verispec bench``: verispec against plain decoding and Hugging Face assisted generation.

Every method generates exactly ``max_new_tokens`` tokens for the same prompts with the same
models in one process (no EOS stop, so token counts match). After a warm-up, each repeat runs
every method back to back on each prompt (A B C, then C B A on the next prompt), so drift in
machine load hits all methods alike. A method's time is the median of its per-repeat totals;
its speedup is the median of its per-repeat ratios to the baseline (paired within a repeat).
Ratios are taken within one run of this command, never across runs. On CUDA the warm-up runs
every method on every prompt (see _warm_up).

Methods: verispec plain decoding (the baseline every speedup divides by); transformers
``generate()`` with the target alone; transformers assisted generation with the same draft at its
defaults and matched to our k (constant schedule, confidence threshold off); verispec
speculative at fixed k; verispec with each adaptive policy. Greedy runs also check that every
method produced the baseline's tokens.

The theoretical speedup uses Leviathan et al.'s (1 - a^(k+1)) / ((1 - a)(k c + 1)) with a and c
measured in this run: a is the per-token acceptance probability (accepted / tested draft tokens,
GenerationMetrics.token_acceptance; not the acceptance rate accepted / drafted, which falls with
k), c is one draft step over one plain target step, both timed here. The formula charges a
verification pass over k + 1 tokens as one target step; the column v measures what it costs
(target time per round / plain step), which on a CPU is well above 1 and is most of what
achieved / theoretical shows.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import BENCH_RULES, BatchOptions, GenerationConfig, SamplingConfig
from ..engine.engine import Engine
from ..engine.metrics import GenerationMetrics
from ..models.fast_llama.matmul import cpuinfo
from ..policy.goodput import GoodputPolicyConfig
from ..policy.threshold import ThresholdPolicyConfig
from ..proposers.draft_model import DraftModelProposer
from ..proposers.hybrid import HybridProposer
from ..proposers.ngram import NgramDraft, NgramProposer
from ..proposers.suffix import SuffixDraft, SuffixProposer
from ..sample.sampling import make_generator
from ..sample.theory import theoretical_speedup
from ..text.decoder import Decoder


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 64
    repeats: int = 5
    ks: tuple[int, ...] = (1, 2, 4, 6, 8)
    hf_ks: tuple[int, ...] = (1, 2, 4, 6, 8)  # assisted generation matched to these k
    temperatures: tuple[float, ...] = (0.0, 1.0)
    seed: int = 0
    include_hf: bool = True
    include_adaptive: bool = True
    # n-gram (prompt lookup) drafting on the same target, and HF prompt lookup matched to it
    ngram_ks: tuple[int, ...] = (1, 2, 3)
    # n-gram lookup first, the draft model where there is no match (needs a draft model)
    hybrid_ks: tuple[int, ...] = (2, 3)
    # the suffix drafter (what --suffix serves) at its own depth rule, no depth policy
    include_suffix: bool = True
    # how sampled rows of the fixed-k methods are verified (BENCH_RULES), the first unnamed:
    # "verispec k=4" is the first rule, "verispec k=4 token" another, in the same run
    rules: tuple[str, ...] = ("block",)


@dataclass
class MethodResult:
    """One method at one temperature, aggregated over repeats: times are medians of per-repeat
    totals, the speedup the median of per-repeat ratios to the baseline."""

    name: str
    kind: str  # "baseline", "hf", "verispec", "adaptive", "ngram", "hybrid"
    num_draft_tokens: int | None
    tokens_per_second: float = 0.0
    ms_per_token: float = 0.0
    speedup: float | None = None  # median over repeats of baseline seconds / method seconds
    speedup_per_repeat: list[float] = field(default_factory=list)
    acceptance_rate: float | None = None
    token_acceptance: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    mean_accepted_length: float | None = None
    cost_ratio: float | None = None
    verify_cost: float | None = None
    theoretical_speedup: float | None = None
    achieved_over_theoretical: float | None = None
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None  # CUDA runs: torch's peak allocation on the device
    matches_baseline: bool | None = None
    seconds: list[float] = field(default_factory=list)


def _peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _peak_gpu_mb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


class _Method:
    """A named generation function over one prompt's ids -> (new token ids, metrics or None).
    ``drafted`` / ``accepted``: draft counts a method without GenerationMetrics reports itself
    (llama-server's speculation)."""

    def __init__(self, name: str, kind: str, k: int | None,
                 run: Callable[[list[int], int], tuple[list[int], GenerationMetrics | None]]):
        self.name, self.kind, self.k, self.run = name, kind, k, run
        self.drafted = self.accepted = 0


def _llama_server_method(name: str, server, k: int | None, settings: BenchSettings,
                         temperature: float) -> _Method:
    """llama.cpp's own server (llama_server.py) on one prompt, over HTTP on loopback."""
    method: _Method

    def run(prompt_ids: list[int], seed: int) -> tuple[list[int], None]:
        reply = server.complete(prompt_ids, settings.max_new_tokens, temperature, seed)
        timings = reply.get("timings", {})
        method.drafted += timings.get("draft_n", 0)
        method.accepted += timings.get("draft_n_accepted", 0)
        return list(reply["tokens"]), None

    method = _Method(name, "llama-server", k, run)
    return method


def _verispec_method(decoder: Decoder, name: str, kind: str, k: int, speculative: bool,
                     settings: BenchSettings, temperature: float,
                     adaptive=None, engine: Engine | None = None,
                     rule: str = BENCH_RULES[0]) -> _Method:
    """``rule``: one of BENCH_RULES; unseeded rows draw from a generator seeded per prompt, so
    a run is reproducible under any rule."""
    engine = decoder.engine if engine is None else engine

    def run(prompt_ids: list[int], seed: int) -> tuple[list[int], GenerationMetrics]:
        keyed = rule == "seeded"
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            sampling=SamplingConfig(temperature=temperature), seed=seed if keyed else None,
            verification="token" if rule == "token" else "block")
        generator = None if keyed else make_generator(seed, decoder.target.device)
        result = engine.generate([prompt_ids], config, speculative=speculative,
                                 generator=generator,
                                 options=BatchOptions(adaptive=adaptive, num_draft_tokens=k))
        return result.token_ids[0], result.metrics

    return _Method(name, kind, k if speculative else None, run)


def _hf_method(decoder: Decoder, name: str, k: int | None, assisted: bool, matched: bool,
               settings: BenchSettings, temperature: float,
               prompt_lookup: bool = False) -> _Method:
    target = decoder.target.model
    draft = decoder.draft.model if decoder.draft is not None else None
    sampling = ({"do_sample": False} if temperature == 0 else
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0})

    generation_config = copy.deepcopy(target.generation_config)  # one object: no kwargs mix
    generation_config.update(max_new_tokens=settings.max_new_tokens,
                             min_new_tokens=settings.max_new_tokens,
                             pad_token_id=decoder.tokenizer.pad_token_id or 0, **sampling)
    # transformers samples from the global RNG (the CPU's, and the GPU's for a CUDA target):
    # seeded inside a fork of it, restored after
    rng_devices = [target.device] if target.device.type == "cuda" else []

    def run(prompt_ids: list[int], seed: int) -> tuple[list[int], None]:
        kwargs: dict[str, object] = {"generation_config": generation_config}
        if prompt_lookup:  # transformers' own n-gram drafting, k tokens a round
            kwargs["prompt_lookup_num_tokens"] = k
        if assisted:
            kwargs["assistant_model"] = draft
            config = draft.generation_config
            saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule,
                     config.assistant_confidence_threshold)
            if matched:
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
                config.assistant_confidence_threshold = 0.0
        try:
            with torch.random.fork_rng(devices=rng_devices), torch.inference_mode():
                torch.manual_seed(seed)
                out = target.generate(torch.tensor([prompt_ids], device=target.device), **kwargs)
        finally:
            if assisted:
                (config.num_assistant_tokens, config.num_assistant_tokens_schedule,
                 config.assistant_confidence_threshold) = saved
        return out[0, len(prompt_ids):].tolist(), None

    return _Method(name, "hf", k, run)


def build_methods(decoder: Decoder, settings: BenchSettings, temperature: float,
                  llama_servers: dict | None = None) -> list[_Method]:
    """The methods of one temperature; ``llama_servers``: running llama-server processes by k
    (None: plain decoding), each added as a method."""
    methods = [_verispec_method(decoder, "verispec plain", "baseline", 1, False, settings,
                                temperature)]
    for k, server in (llama_servers or {}).items():
        name = "llama-server plain" if k is None else f"llama-server spec k={k}"
        methods.append(_llama_server_method(name, server, k, settings, temperature))
    if settings.include_hf:
        methods += _hf_methods(decoder, settings, temperature)
    methods += _fixed_k_methods(decoder, settings, temperature)
    methods += _lookup_methods(decoder, settings, temperature)
    if settings.include_adaptive:
        methods += _adaptive_methods(decoder, settings, temperature)
    return methods


def _hf_methods(decoder: Decoder, settings: BenchSettings, temperature: float) -> list[_Method]:
    """transformers generate() with the target alone, then assisted generation at its defaults
    and matched to each of settings.hf_ks."""
    methods = [_hf_method(decoder, "hf generate (target)", None, False, False, settings,
                          temperature),
               _hf_method(decoder, "hf assisted (defaults)", None, True, False, settings,
                          temperature)]
    for k in settings.hf_ks:
        methods.append(_hf_method(decoder, f"hf assisted k={k}", k, True, True, settings,
                                  temperature))
    return methods


def _fixed_k_methods(decoder: Decoder, settings: BenchSettings, temperature: float
                     ) -> list[_Method]:
    """verispec with the draft model at each fixed k, under each verification rule."""
    methods: list[_Method] = []
    rules = settings.rules if temperature > 0 else settings.rules[:1]  # greedy: one rule
    for k in settings.ks:
        for rule in rules:
            name = f"verispec k={k}" + ("" if rule == rules[0] else f" {rule}")
            methods.append(_verispec_method(decoder, name, "verispec", k, True, settings,
                                            temperature, rule=rule))
    return methods


def _lookup_methods(decoder: Decoder, settings: BenchSettings, temperature: float
                    ) -> list[_Method]:
    """Drafting by lookup on the same target: n-gram at each k (each beside transformers'
    prompt lookup at that k), the suffix drafter, and hybrid (n-gram first, the draft model
    where there is no match)."""
    methods: list[_Method] = []
    if settings.ngram_ks:
        ngram = Engine(decoder.target,
                                   NgramProposer(decoder.target.vocab_size, NgramDraft()))
        for k in settings.ngram_ks:
            if settings.include_hf:
                methods.append(_hf_method(decoder, f"hf prompt lookup k={k}", k, False, False,
                                          settings, temperature, prompt_lookup=True))
            methods.append(_verispec_method(decoder, f"verispec ngram k={k}", "ngram", k, True,
                                            settings, temperature, engine=ngram))
    if settings.include_suffix:
        suffix = Engine(decoder.target,
                                    SuffixProposer(decoder.target.vocab_size, SuffixDraft()))
        methods.append(_verispec_method(decoder, "verispec suffix", "ngram",
                                        SuffixDraft().max_depth, True, settings, temperature,
                                        engine=suffix))
    if settings.hybrid_ks and decoder.draft is not None:
        hybrid = Engine(decoder.target,
                                    HybridProposer(DraftModelProposer(decoder.draft)))
        for k in settings.hybrid_ks:
            methods.append(_verispec_method(decoder, f"verispec hybrid k={k}", "hybrid", k, True,
                                            settings, temperature, engine=hybrid))
    return methods


def _adaptive_methods(decoder: Decoder, settings: BenchSettings, temperature: float
                      ) -> list[_Method]:
    """verispec with each depth policy, starting at k = 4."""
    return [_verispec_method(decoder, "verispec threshold", "adaptive", 4, True, settings,
                             temperature, ThresholdPolicyConfig()),
            _verispec_method(decoder, "verispec goodput", "adaptive", 4, True, settings,
                             temperature, GoodputPolicyConfig()),
            # the serving case: every prompt resumes from the estimates the previous ones left
            _verispec_method(decoder, "verispec goodput carry-over", "adaptive", 4, True,
                             settings, temperature, GoodputPolicyConfig(carry_over=True))]


def run_bench(decoder: Decoder, prompts: Sequence[list[int]], settings: BenchSettings,
              temperature: float, progress: Callable[[str], None] | None = None,
              llama_servers: dict | None = None) -> list[MethodResult]:
    """Time every method on every prompt; return per-method results.

    Interleaved at the finest grain: for each prompt every method runs back to back (the order
    reversed on alternate prompts), so a slow minute on a shared machine lands on all methods
    alike instead of on whichever method happened to be running. A method's time for a repeat
    is the sum over prompts; its reported time is the median over repeats.
    """
    methods = build_methods(decoder, settings, temperature, llama_servers)
    results = {m.name: MethodResult(m.name, m.kind, m.k) for m in methods}
    _warm_up(methods, decoder, prompts, settings, results)
    metrics, outputs = _time_methods(methods, prompts, settings, temperature, progress, results)
    num_tokens = settings.max_new_tokens * len(prompts)
    baseline = results[methods[0].name]
    plain_step = statistics.median(baseline.seconds) / num_tokens
    for method in methods:
        _summarise(results[method.name], metrics[method.name], num_tokens, plain_step,
                   baseline.seconds)
        if method.drafted:  # llama-server reports its drafts' fate itself
            results[method.name].acceptance_rate = method.accepted / method.drafted
        if temperature == 0:
            results[method.name].matches_baseline = outputs[method.name] == outputs[methods[0].name]
    return [results[m.name] for m in methods]


def _warm_up(methods: list[_Method], decoder: Decoder, prompts: Sequence[list[int]],
             settings: BenchSettings, results: dict[str, MethodResult]) -> None:
    """Run each method untimed, then record the peak memory once it has run."""
    # one prompt per method on a CPU; every prompt on CUDA, where kernels are planned
    # per input shape on first sight (transformers' bf16 attention there picks cuDNN, which
    # plans each new sequence length: models/attention.py), which must not land in one
    # method's runs
    warmup = prompts if decoder.target.device.type == "cuda" else prompts[:1]
    for method in methods:
        for i, prompt in enumerate(warmup):
            method.run(prompt, settings.seed + i)
        # the process's peak RSS once this method has run: methods share the process, so a
        # method's own footprint shows as the rise over the methods before it
        results[method.name].peak_rss_mb = _peak_rss_mb()
        results[method.name].peak_gpu_mb = _peak_gpu_mb(decoder.target.device)


def _time_methods(methods: list[_Method], prompts: Sequence[list[int]], settings: BenchSettings,
                  temperature: float, progress: Callable[[str], None] | None,
                  results: dict[str, MethodResult]
                  ) -> tuple[dict[str, GenerationMetrics], dict[str, list[list[int]]]]:
    """The timed repeats, interleaved (see run_bench): each repeat's seconds appended to the
    methods' results; returns each method's summed metrics and its first repeat's tokens."""
    metrics = {m.name: GenerationMetrics() for m in methods}
    outputs: dict[str, list[list[int]]] = {m.name: [] for m in methods}
    for repeat in range(settings.repeats):
        elapsed = dict.fromkeys(results, 0.0)
        for i, prompt in enumerate(prompts):
            if progress:
                progress(f"T={temperature} repeat {repeat + 1}/{settings.repeats}: prompt "
                         f"{i + 1}/{len(prompts)}")
            for method in methods if (repeat + i) % 2 == 0 else methods[::-1]:
                started = time.perf_counter()
                tokens, generation_metrics = method.run(prompt, settings.seed + i)
                elapsed[method.name] += time.perf_counter() - started
                if repeat == 0:
                    outputs[method.name].append(tokens)
                if generation_metrics is not None:
                    metrics[method.name] = metrics[method.name] + generation_metrics
        for method in methods:
            results[method.name].seconds.append(elapsed[method.name])
    return metrics, outputs


def _summarise(result: MethodResult, metrics: GenerationMetrics, num_tokens: int,
               plain_step: float, baseline_seconds: list[float]) -> None:
    seconds = statistics.median(result.seconds)
    result.tokens_per_second = num_tokens / seconds
    result.ms_per_token = 1000 * seconds / num_tokens
    # paired: a repeat's methods ran interleaved prompt by prompt, so the ratio within a repeat
    # cancels the machine's drift between repeats; a ratio of the two medians would not (the
    # medians can come from different repeats)
    result.speedup_per_repeat = [b / s for b, s in zip(baseline_seconds, result.seconds)]
    result.speedup = statistics.median(result.speedup_per_repeat)
    if metrics.num_drafted:
        result.acceptance_rate = metrics.acceptance_rate
        result.token_acceptance = metrics.token_acceptance
        result.per_position_acceptance = [round(x, 4) for x in metrics.per_position_acceptance]
        result.mean_accepted_length = metrics.mean_accepted_length
        # c: one draft step over one plain target step (the formula's unit), both measured here
        result.cost_ratio = (metrics.draft_time / metrics.num_draft_steps) / plain_step
        # v: one verification pass over k + 1 tokens, in plain target steps (the formula takes 1)
        result.verify_cost = (metrics.target_time / metrics.num_target_calls) / plain_step
        # lookup proposals vary in length by round (none without a match): no fixed-k theory
        if result.kind in ("ngram", "hybrid"):
            return
        k = result.num_draft_tokens if result.kind == "verispec" else round(
            metrics.mean_num_draft_tokens)
        result.theoretical_speedup = theoretical_speedup(
            min(metrics.token_acceptance, 1.0), max(k, 1), result.cost_ratio)
        result.achieved_over_theoretical = result.speedup / result.theoretical_speedup


def environment(device: torch.device | None = None) -> dict[str, object]:
    """Where a run happened; ``accelerator`` names the GPU of a CUDA run."""
    env: dict[str, object] = {
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "processor": cpu_label(),
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    if device is not None and device.type == "cuda":
        env["accelerator"] = torch.cuda.get_device_name(device)
    return env


def cpu_label() -> str:
    """The CPU as a benchmark records it: its name and, where /proc/cpuinfo has them, its family,
    model and widest vector instructions, e.g. "<model name> (family 25 model 1, AVX2)". A VM
    often gives every generation of a vendor's server CPUs one name, and two generations gave
    the demo pair's load benchmark different verdicts (dev/LOG.md)."""
    name = cpuinfo("model name") or platform.processor() or "unknown"
    family, model, flags = cpuinfo("cpu family"), cpuinfo("model"), cpuinfo("flags").split()
    details = [f"family {family} model {model}"] if family and model else []
    details += ["AVX-512"] if "avx512f" in flags else ["AVX2"] if "avx2" in flags else []
    return f"{name} ({', '.join(details)})" if details else name


def to_json(results: dict[float, list[MethodResult]], settings: BenchSettings,
            extra: dict[str, object], device: torch.device | None = None) -> str:
    return json.dumps({"settings": asdict(settings), "environment": environment(device), **extra,
                       "results": {str(t): [asdict(r) for r in rs] for t, rs in results.items()}},
                      indent=2)
