"""Pure sampling math: logits -> the distribution actually sampled from, and draws from it.

Legend: B batch, K draft tokens, V vocabulary; ``...`` is any leading shape.

:func:`to_probs` is the single place where temperature, top-k, top-p and min-p are applied. The
draft samples from its output and reports exactly that tensor as its probabilities, and the target's
scores go through the same function, so the acceptance test compares the two distributions that were
really in play (the exactness requirement of Leviathan et al. 2023, Chen et al. 2023).

One exact draw, batched, free of normalisation, never selecting a zero-probability entry, fed
by an explicit ``torch.Generator`` (the global RNG is never touched): inverse CDF with one
uniform per row and float64 cumulative sums (:func:`sample`, and :func:`sample_with_uniform`
when the uniforms are given, as verification does so that tests can replay them).
:func:`sample_from_logits` is to_probs and that draw in one call, for a sampling draft's step.

Not here: models, caches, acceptance tests (see rejection.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import SamplingConfig, check_seed
from ..errors import NonFiniteError, ShapeError
from .checks import check_generator
from .host_probs import FP32_TINY, NON_FINITE_LOGITS, host_greedy_tokens, host_probs


def _check_floating(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() < 1:
        got = f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}" if isinstance(
            tensor, torch.Tensor) else type(tensor).__name__
        raise ShapeError(f"{name} must be a floating-point tensor [..., V]; got {got}.")


def to_probs(logits: torch.Tensor, sampling: SamplingConfig,
             allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Turn logits into the fp32 distribution a token is sampled from.

    Shapes: logits [..., V] (any float dtype; -inf marks an impossible token) -> probs [..., V]
    fp32.
    allowed [..., V] bool (a grammar's mask, engine/constraints.py): tokens it excludes get
    probability 0 and the rest are renormalised, before temperature, top-k and top-p.
    temperature 0 gives a point mass on the argmax (ties go to the lowest id).
    Raises NonFiniteError for NaN or +inf logits or a row with no finite (allowed) logit.
    """
    _check_floating("logits", logits)
    if sampling.is_greedy:
        tokens = greedy_tokens(logits, allowed)[..., None]
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            -1, tokens, 1.0)
    return _checked_probs(logits, sampling, allowed)


def sample_from_logits(logits: torch.Tensor, sampling: SamplingConfig, uniforms: list[float],
                       allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """to_probs and an inverse-CDF draw in one: what a sampling draft does at every step.

    Shapes: logits [B, V], uniforms B host floats in [0, 1) -> (probs [B, V] fp32, tokens [B]).
    probs is exactly to_probs(logits, sampling) and tokens is sample_with_uniform(probs,
    uniforms): the distribution reported is the one drawn from. Off the CPU the finiteness
    check rides on the draw's cumulative sum (NaN anywhere reaches a row's total), one
    reduction fewer than to_probs then sample. Temperature > 0 only (a greedy draft calls
    greedy_tokens). Raises NonFiniteError like to_probs.
    """
    _check_floating("logits", logits)
    assert not sampling.is_greedy and logits.dim() == 2 and len(uniforms) == logits.shape[0]
    probs = _sampled_probs(logits, sampling, allowed)  # [B, V] fp32
    return probs, _inverse_cdf(probs, uniforms, NON_FINITE_LOGITS)


def _checked_probs(logits: torch.Tensor, sampling: SamplingConfig,
                   allowed: torch.Tensor | None) -> torch.Tensor:
    """_sampled_probs, with rows that are not finite refused (NonFiniteError) on every device."""
    probs = _sampled_probs(logits, sampling, allowed)
    # off the CPU: softmax turns NaN, +inf and all -inf rows into NaN, and any NaN makes the sum
    # NaN, so one reduction covers all three (cheaper than an elementwise isfinite pass)
    if probs.device.type != "cpu" and not math.isfinite(float(probs.sum())):
        raise NonFiniteError(NON_FINITE_LOGITS)
    return probs


def _sampled_probs(logits: torch.Tensor, sampling: SamplingConfig,
                   allowed: torch.Tensor | None) -> torch.Tensor:
    """Mask, temperature, top-k, softmax, top-p, min-p: [..., V] -> [..., V] fp32. On the CPU
    row by row on the calling thread (host_probs.py, which refuses rows that are not
    finite); elsewhere as batched tensor ops, not checked for NaN."""
    if logits.device.type == "cpu":
        return host_probs(logits, sampling, allowed)
    return _device_probs(_masked(logits.float(), allowed), sampling)


def _device_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """_sampled_probs as batched tensor ops, on fp32 logits [..., V] already masked."""
    if sampling.temperature != 1.0:  # dividing by 1.0 is the identity: skip the pass over V
        # shifted by the row's max first: softmax does not change, and a tiny temperature
        # (1e-40) sends every other logit to -inf instead of overflowing to +inf - +inf = NaN,
        # which is the limit the math gives (a point mass on the argmax, shared by ties).
        # NaN, +inf and all -inf rows still come out NaN (max - max), for to_probs' check.
        logits = logits - logits.amax(dim=-1, keepdim=True)  # [..., V], <= 0 (or NaN)
        if sampling.temperature >= FP32_TINY:
            logits = logits / sampling.temperature
        else:  # the temperature is 0 in fp32: the limit directly (0 stays 0, NaN stays NaN)
            logits = logits.masked_fill(logits < 0, float("-inf"))
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1.0:
        probs = _truncate_top_p(probs, sampling.top_p)
    if sampling.min_p:
        # min-p last (Hugging Face's warper order): the most likely token always stays
        kept = probs >= sampling.min_p * probs.amax(dim=-1, keepdim=True)
        probs = _renormalised(probs.masked_fill(~kept, 0.0))
    return probs


def to_logprobs(logits: torch.Tensor, sampling: SamplingConfig,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The log-probabilities of the distribution a token is drawn from: [..., V] -> [..., V]
    fp32, -inf for tokens it excludes (a grammar's mask, top-k, top-p, min-p).

    At temperature > 0 this is log(to_probs(logits, sampling, allowed)), computed as a
    log-softmax of the tempered logits over the tokens to_probs keeps (no log of a rounded
    probability). At temperature 0 the point mass would give 0 and -inf only: the
    log-probabilities are those of the masked logits at temperature 1, the distribution whose
    argmax greedy decoding takes (OpenAI's logprobs at temperature 0 are the model's too).
    At temperature > 0 raises NonFiniteError like to_probs.
    """
    _check_floating("logits", logits)
    logits = _masked(logits.float(), allowed)
    if sampling.is_greedy:
        return torch.log_softmax(logits, dim=-1)
    kept = _checked_probs(logits, sampling, None) > 0  # [..., V]
    tempered = logits - logits.amax(dim=-1, keepdim=True)
    if sampling.temperature >= FP32_TINY:
        tempered = tempered / sampling.temperature
    return torch.log_softmax(tempered.masked_fill(~kept, float("-inf")), dim=-1)


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [..., V] with -inf where allowed [..., V] (bool) is False; unchanged for None."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def greedy_tokens(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The temperature-0 choice: the argmax of logits [..., V] (among the ``allowed`` tokens
    when a grammar's mask [..., V] is given), ties to the lowest id. -> [...].

    to_probs at temperature 0 is the point mass on exactly this token; a greedy draft calls
    this directly because it reports no distribution (it is verified as a point mass).
    Raises NonFiniteError for NaN or +inf logits or a row with no finite logit.
    """
    _check_floating("logits", logits)
    if logits.device.type == "cpu":  # one pass on the calling thread (host_probs.py)
        return host_greedy_tokens(logits, allowed)
    logits = _masked(logits, allowed)
    # one reduction gives both: max propagates NaN and +inf, is -inf only for a row with no
    # finite logit, and its index is the first maximal one (the lowest id), as argmax's is
    best_logits, tokens = logits.max(dim=-1)
    # checked on the host: one read of B floats costs less than isfinite + all + a sync, right
    # after a model's pass (measured in place, dev/LOG.md: host checks)
    if not all(map(math.isfinite, best_logits.reshape(-1).tolist())):
        raise NonFiniteError(NON_FINITE_LOGITS)
    return tokens


def _truncate_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p; renormalise. [..., V] -> same.
    Ties go to the lowest id (a stable sort), as host_probs.top_p_kept keeps them."""
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    # the top token is always kept (its mass_before is 0, but a top_p below fp32's smallest
    # number, e.g. 1e-300, compares as 0 and would drop it too, leaving nothing)
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, sorted_ids, drop_sorted)
    return _renormalised(probs.masked_fill(drop, 0.0))


def _renormalised(kept: torch.Tensor) -> torch.Tensor:
    """kept [..., V] divided by its row sums, summed in float64 (as host_probs does)."""
    return kept / kept.sum(dim=-1, keepdim=True, dtype=torch.float64).float()


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of ``probs`` [..., V] using ``generator``. -> tokens [...] int64.

    Inverse-CDF sampling with one uniform per row (a float64 cumulative sum, so rounding is far
    below any probability that matters): at batch 1 with a large vocabulary this is far cheaper
    than drawing V exponentials, and it is the draw a draft makes at every step.
    """
    _check_floating("probs", probs)
    uniforms = torch.rand(probs.shape[:-1], generator=generator, dtype=torch.float64,
                          device=generator.device).to(probs.device)
    return sample_with_uniform(probs, uniforms)


def sample_with_uniform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Deterministic inverse-CDF draw: the first token whose cumulative mass exceeds u * total.

    Shapes: probs [..., V] (need not be normalised), uniforms [...] in [0, 1) -> tokens [...].
    Zero-probability tokens are never returned: their CDF step has zero width, and the
    threshold is kept strictly below the total mass.
    """
    if not isinstance(uniforms, torch.Tensor) or uniforms.shape != probs.shape[:-1]:
        got = tuple(uniforms.shape) if isinstance(uniforms, torch.Tensor) else type(uniforms)
        raise ShapeError(f"uniforms must be a tensor of shape {tuple(probs.shape[:-1])} (one per "
                         f"row of probs {tuple(probs.shape)}); got {got}.")
    return _inverse_cdf(probs, uniforms.reshape(-1).tolist(), _BAD_TOTAL_MASS)


def sample_with_host_uniforms(probs: torch.Tensor, uniforms: list[float],
                              fallback: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sample_with_uniform` with the uniforms as host floats, one per row (row-major).

    Shapes: probs [..., V], fallback None or [..., V] -> tokens [...]. A row of probs with zero
    total mass is drawn from the same row of ``fallback`` when one is given (verification's
    residual of two equal distributions), else raises NonFiniteError.
    """
    assert len(uniforms) == probs[..., 0].numel()
    return _inverse_cdf(probs, uniforms, _BAD_TOTAL_MASS, fallback)


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float], bad_total: str,
                 fallback: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse-CDF draw behind every sampler here; a bad row raises NonFiniteError(bad_total)
    (see sample_with_host_uniforms for fallback)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [..., V]
    # the per-row threshold is computed on the host: Python floats are IEEE float64, so u * total
    # and nextafter round exactly as the tensor ops would, and one transfer replaces ~8 tiny ops
    totals = cdf[..., -1].reshape(-1).tolist()
    if fallback is not None and 0.0 in totals:
        empty = torch.tensor([total == 0.0 for total in totals], device=probs.device)
        return _inverse_cdf(torch.where(empty.reshape(*probs.shape[:-1], 1), fallback, probs),
                            uniforms, bad_total)
    thresholds = []
    for u, total in zip(uniforms, totals):
        if not 0.0 < total < math.inf:  # NaN fails both comparisons
            raise NonFiniteError(bad_total)
        thresholds.append(min(float(u) * total, math.nextafter(total, 0.0)))
    if len(thresholds) == 1:  # one row: a Python float is searched for as is, no tensor built
        # (a scalar search returns a host tensor even for a CUDA cdf: moved back, a no-op on CPU)
        return torch.searchsorted(cdf.reshape(-1), thresholds[0], right=True).reshape(
            cdf.shape[:-1]).to(cdf.device)
    threshold = torch.tensor(thresholds, dtype=torch.float64, device=cdf.device)
    return torch.searchsorted(cdf, threshold.reshape(*cdf.shape[:-1], 1), right=True).squeeze(-1)


_BAD_TOTAL_MASS = ("probs has a row with zero, NaN or infinite total mass; expected non-negative "
                   "finite probabilities with a positive sum per row.")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh torch.Generator; ``seed=None`` seeds it from the OS, never from the global RNG."""
    check_seed(seed)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def generator_groups(generators: Sequence[torch.Generator]
                     ) -> list[tuple[torch.Generator, list[int]]]:
    """Rows grouped by the generator they share (the same object), in order of first
    appearance: [(generator, rows)]. A group draws its random numbers in one call, so a row
    with a generator of its own draws the same numbers whatever else is in the batch.
    Example: [g, h, g] -> [(g, [0, 2]), (h, [1])]."""
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for row, generator in enumerate(generators):
        check_generator(generator)
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    return list(groups.values())


def draw_step_uniforms(generators: Sequence[torch.Generator], counts: Sequence[int]
                       ) -> list[list[float]]:
    """Per row b, counts[b] float64 uniforms (host floats): a draft's draws for one round.
    Each generator group draws [max count, rows] at once, step-major (the numbers one
    sampling.sample call per step would take), and row b keeps its column's first counts[b].
    A group whose counts are all 0 draws nothing."""
    drawn: list[list[float]] = [[] for _ in counts]
    for generator, rows in generator_groups(generators):
        steps = max(counts[row] for row in rows)
        if steps == 0:
            continue
        table = torch.rand((steps, len(rows)), generator=generator, dtype=torch.float64,
                           device=generator.device).tolist()  # [steps, rows]
        for column, row in enumerate(rows):
            drawn[row] = [table[step][column] for step in range(counts[row])]
    return drawn
