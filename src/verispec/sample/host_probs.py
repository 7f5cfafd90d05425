"""to_probs's arithmetic for logits on the CPU: numpy on the calling thread, with the numbers
the tensor path computes.

Legend: R rows (a tensor's leading dimensions, flattened), V vocabulary, C top-p candidates.

Why the CPU has a path of its own. A torch op over V floats on the CPU is split across torch's
intra-op threads, and each split waits until every thread has a core. Between a model's passes
the cores are rarely free (llama.cpp's OpenMP workers spin there, and other processes run), so a
token's handful of passes over V cost many times their arithmetic (dev/LOG.md: sampling on one
thread). A row's sampling is too little work to share; numpy's ufuncs run on the calling thread.
The softmax stays torch's: over one row it runs on the calling thread, and its exponentials and
sum are then exactly the tensor path's.

Exactness. The shift by the row's largest logit, the division by the temperature, the masks and
the comparisons are IEEE operations that round the same in numpy and torch, so the
probabilities are bit for bit the tensor path's (sampling._device_probs) wherever no
renormalising sum is involved (temperature, top-k, a grammar's mask). Top-p keeps the set a
stable sort of the whole row keeps (ties go to the lowest id), found from a candidate set
(:func:`top_p_kept`); top-p and min-p renormalise by the kept mass summed in float64 one term
after another in id order, a function of the row alone (torch's sum over one row is split
across its threads, and its last bit depends on how many there are; numpy's pairwise sum groups
terms by position, so zeros in between would change it).

Rows of a small vocabulary (at most _SMALL_VOCAB) are processed together, a large one row by
row: many rows of a few tokens (the statistical tests' fixture models, a batch on a small model)
would otherwise pay Python's overhead per row, and one row of 151,936 tokens only gains from
sorting candidates. Both give every row the same bits: a softmax row's arithmetic does not
depend on the rows beside it, the whole-row sort keeps what the candidates keep, and a
sequential sum is unchanged by the zeros of dropped tokens.

Not here: the draws (sampling.py), the race (seeded.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import SamplingConfig
from ..errors import NonFiniteError

FP32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal fp32 temperature divided by
NON_FINITE_LOGITS = (
    "logits contain NaN or +inf, or a row where every logit is -inf; expected finite logits "
    "(-inf only to mask tokens). Check the model's dtype (fp16 overflow) and its inputs."
)
# Top-p's candidates are the tokens at or above (1 - top_p - _MASS_SLACK) / V: all the others
# together hold less than 1 - top_p when the row's mass is within _MASS_SLACK of 1 (a softmax's
# rounded probabilities sum to 1 within far less). The cut is known to lie among them when their
# mass reaches top_p by _ROUNDING_MARGIN: the fp32 cumulative sums of later positions then stay
# above top_p (each is off by at most a few units in the last place of 1, about 2e-7).
_MASS_SLACK = 1e-4
_ROUNDING_MARGIN = 1e-6
# vocabularies up to this size are processed all rows at once (see the module docstring)
_SMALL_VOCAB = 8192


def host_probs(logits: torch.Tensor, sampling: SamplingConfig,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """to_probs at temperature > 0 on the CPU: logits [..., V] (float) and a grammar's mask
    allowed [..., V] bool or None -> probs [..., V] fp32.

    Raises NonFiniteError for a row whose largest (allowed) logit is not finite: NaN or +inf
    anywhere, or no finite logit, the rows to_probs refuses.
    """
    assert not sampling.is_greedy and logits.device.type == "cpu"
    rows = _host_rows(logits)  # [R, V] fp32, the logits' own memory where it can be
    if allowed is not None:
        rows = np.where(_host_rows(allowed, np.bool_), rows, np.float32(-np.inf))
    maxima = rows.max(axis=-1)  # [R]: NaN and +inf win, a row of -inf gives -inf
    if not np.isfinite(maxima).all():
        raise NonFiniteError(NON_FINITE_LOGITS)
    tempered = _tempered(rows, maxima, sampling.temperature)  # [R, V]
    if sampling.top_k is not None and sampling.top_k < rows.shape[-1]:
        tempered = _top_k(tempered if tempered is not rows else rows.copy(), sampling.top_k)
    probs = _softmax(tempered)  # [R, V]
    if sampling.top_p is not None and sampling.top_p < 1.0:
        _renormalise(probs, _top_p_mask(probs, sampling.top_p))
    if sampling.min_p:
        # min-p last (Hugging Face's warper order): the most likely token always stays
        floors = np.float32(sampling.min_p) * probs.max(axis=-1)  # [R]
        _renormalise(probs, probs >= floors[:, None])
    return torch.from_numpy(probs).reshape(logits.shape)


def host_greedy_tokens(logits: torch.Tensor, allowed: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """greedy_tokens on the CPU: the first largest (allowed) logit of each row of logits
    [..., V] -> [...] int64. Raises NonFiniteError as greedy_tokens does."""
    rows = _host_rows(logits, None)  # [R, V] in the logits' own precision
    if allowed is not None:
        rows = np.where(_host_rows(allowed, np.bool_), rows, rows.dtype.type(-np.inf))
    # argmax takes the first NaN where there is one, so one read decides both the token and,
    # through its logit, whether the row is finite
    tokens = rows.argmax(axis=-1)  # [R]
    if not np.isfinite(rows[np.arange(rows.shape[0]), tokens]).all():
        raise NonFiniteError(NON_FINITE_LOGITS)
    return torch.from_numpy(tokens).reshape(logits.shape[:-1])


def _host_rows(tensor: torch.Tensor, dtype: type | None = np.float32) -> np.ndarray:
    """tensor [..., V] on the CPU as a numpy [R, V] array of ``dtype`` (None: its own; a view
    where it can be; bfloat16, which numpy lacks, as fp32, exactly)."""
    rows = tensor.detach().cpu().reshape(-1, tensor.shape[-1])
    rows = (rows.float() if rows.dtype == torch.bfloat16 else rows).numpy()
    return rows if dtype is None or rows.dtype == dtype else rows.astype(dtype)


def _tempered(rows: np.ndarray, maxima: np.ndarray, temperature: float) -> np.ndarray:
    """rows [R, V] shifted by their maxima [R] and divided by the temperature, a new array
    (rows themselves at temperature 1, where the tensor path skips both)."""
    if temperature == 1.0:
        return rows
    # shifted first, as in the tensor path: a tiny temperature then sends every other logit to
    # -inf (the point mass the limit gives) instead of overflowing to +inf - +inf = NaN
    shifted = rows - maxima[:, None]  # [R, V] <= 0
    if temperature >= FP32_TINY:
        with np.errstate(over="ignore"):  # a logit far below the max over a tiny T: -inf
            np.divide(shifted, np.float32(temperature), out=shifted)
    else:  # the temperature is 0 in fp32: the limit directly
        shifted[shifted < 0] = -np.inf
    return shifted


def _top_k(tempered: np.ndarray, top_k: int) -> np.ndarray:
    """Each row of tempered [R, V] with its logits below its k-th largest set to -inf (in
    place): the k-th largest value, not a choice among ties, so ties at it all stay."""
    cut = tempered.shape[-1] - top_k
    kth = np.partition(tempered, cut, axis=-1)[:, cut]  # [R]
    tempered[tempered < kth[:, None]] = -np.inf
    return tempered


def _softmax(tempered: np.ndarray) -> np.ndarray:
    """torch's softmax of each row of tempered [R, V] -> a new [R, V] fp32: all rows in one
    call for a small vocabulary, else one row a call (torch splits rows among its threads)."""
    if tempered.shape[-1] <= _SMALL_VOCAB:
        return torch.softmax(torch.from_numpy(tempered), dim=-1).numpy()
    probs = np.empty(tempered.shape, dtype=np.float32)
    for row, out in zip(tempered, probs):
        torch.softmax(torch.from_numpy(row), dim=-1, out=torch.from_numpy(out))
    return probs


def _top_p_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    """What top-p keeps in each row of probs [R, V] -> bool [R, V]: a stable sort of all rows
    at once for a small vocabulary, else each row from its candidates (:func:`top_p_kept`)."""
    mask = np.zeros(probs.shape, dtype=np.bool_)
    if probs.shape[-1] > _SMALL_VOCAB:
        for row, row_mask in zip(probs, mask):
            row_mask[top_p_kept(row, top_p)] = True
        return mask
    order = np.argsort(-probs, axis=-1, kind="stable")  # [R, V] by prob, then id
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    cumulative = np.cumsum(sorted_probs, axis=-1, dtype=np.float64).astype(np.float32)
    kept = cumulative - sorted_probs < np.float32(top_p)  # [R, V] in sorted order
    kept[:, 0] = True
    np.put_along_axis(mask, order, kept, axis=-1)
    return mask


def top_p_kept(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids top-p keeps in probs [V] fp32 (a softmax's row, summing to about 1), ascending.

    The rule: sort the row by probability, descending, ties in id order (a stable sort), and
    keep the positions whose mass before them, the fp32 cumulative sum (accumulated in float64,
    as torch.cumsum does) minus their own probability, is below top_p in fp32; the first
    position always (a top_p below fp32's smallest number compares as 0).

    Only candidates are sorted: the tokens at or above a threshold that the others together
    cannot bring to top_p (_MASS_SLACK). They are exactly the head of the whole row's stable
    sort, so their cumulative sums are its own (sums of a prefix, in order) and each of their
    positions is decided as there. Later positions are all dropped once the candidates' mass
    passes top_p by more than rounding moves a sum (_ROUNDING_MARGIN); otherwise, or with no
    room for a threshold, the whole row is sorted.
    """
    limit = np.float32(top_p)
    vocab_size = probs.shape[0]
    threshold = (1.0 - float(limit) - _MASS_SLACK) / vocab_size
    if threshold > 0:
        kept = _kept_from(probs, np.flatnonzero(probs >= np.float32(threshold)), limit, False)
        if kept is not None:
            return kept
    return _kept_from(probs, np.arange(vocab_size), limit, True)


def _kept_from(probs: np.ndarray, candidates: np.ndarray, limit: np.float32,
               complete: bool) -> np.ndarray | None:
    """top_p_kept over ``candidates`` (ascending ids [C], the head of the stable sort; all V
    when ``complete``): the kept ids, ascending, or None where the cut may lie past them."""
    order = candidates[np.argsort(-probs[candidates], kind="stable")]  # [C] by prob, then id
    sorted_probs = probs[order]
    cumulative = np.cumsum(sorted_probs, dtype=np.float64).astype(np.float32)  # [C]
    if not complete and not cumulative[-1] >= limit + np.float32(_ROUNDING_MARGIN):
        return None
    kept = cumulative - sorted_probs < limit
    kept[0] = True
    return np.sort(order[kept])


def _renormalise(probs: np.ndarray, kept: np.ndarray) -> None:
    """probs [R, V] fp32, in place: zero where ``kept`` [R, V] bool is False, and the kept
    entries divided by their float64 sum, one term after another in id order, in fp32."""
    np.putmask(probs, ~kept, np.float32(0.0))
    totals = np.cumsum(probs, axis=-1, dtype=np.float64)[:, -1].astype(np.float32)  # [R]
    np.divide(probs, totals[:, None], out=probs)
