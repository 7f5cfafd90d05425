"""One step of a draft model's proposal over a batch's rows: the logits processed by each row's
penalties, the tokens drawn (greedy, sampled, or raced on a seeded row's keyed clocks), and each
row's confidence for the draft-p-min stop. What DraftModelSession.propose_after (draft_model.py)
runs each step; it keeps the rows' state.

Legend: B batch, V vocabulary. Faults per row: a row whose own work raises (non-finite
logits, its processor's or race's error) joins the step's ``failed`` and pads from there; its
batch mates draw what they would have (proposers.base.run_isolated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingConfig
from ..sample.sampling import greedy_tokens, sample_from_logits, to_probs
from ..sample.seeded import race
from .base import KeyedClocks, LogitProcessor, run_isolated

# a greedy row's confidence is read at temperature 1 (confidences)
_UNTEMPERED = SamplingConfig(temperature=1.0)


def process_rows(logits: torch.Tensor, processors: Sequence[LogitProcessor | None],
           drafted: Sequence[Sequence[int]], failed: dict[int, Exception]) -> torch.Tensor:
    """One step's logits [B, V] with each row that has a processor reshaped by it after the row's
    draft tokens so far (``drafted``: host ids per row) -> [B, V] fp32. A row whose processor
    raises joins ``failed`` with its error."""
    out = logits.float().clone()
    for b, processor in enumerate(processors):
        if processor is not None and b not in failed:
            try:
                out[b] = processor.process_draft(logits[b], drafted[b])
            except Exception as exc:  # the row's own fault: it drafts nothing, and fails
                failed.setdefault(b, exc)
    return out


def race_keyed(tokens: torch.Tensor, probs: torch.Tensor | None, live: Sequence[int],
               positions: Sequence[int], keyed: Sequence[KeyedClocks | None],
               failed: dict[int, Exception]) -> torch.Tensor:
    """tokens [B] with each keyed row among the ``live`` ones (which sample at this step)
    redrawn by a race of its probs [B, V] on the clocks of its round position
    ``positions[row]`` (sample.seeded.race): the draft's token is then coupled to the target's
    race winner there, which verification compares it with. A row whose race raises joins
    ``failed``."""
    rows = [row for row in live if keyed[row] is not None]
    if not rows:
        return tokens
    assert probs is not None
    tokens = tokens.clone()
    host_probs = probs[rows].cpu()  # [R, V]: one copy from an accelerator, not one a race
    for row, row_probs in zip(rows, host_probs):
        try:
            tokens[row] = race(row_probs, keyed[row].clocks(positions[row], probs.shape[-1]))
        except Exception as exc:  # the row's own fault: it drafts nothing, and fails
            failed.setdefault(row, exc)
    return tokens


def confidences(logits: torch.Tensor, probs: torch.Tensor | None, allowed: torch.Tensor | None,
                rows: Sequence[int], sampled: Sequence[int], step: int) -> dict[int, float]:
    """Each of ``rows``' confidence at this step: the largest probability of the distribution
    its token is drawn from (probs [B, V], the processed one) where the row samples at this
    step (sampled[row] > step), else (a greedy row) of its logits [B, V] at temperature 1
    under the grammar's mask ``allowed`` [B, V]: the probability of its argmax token, which
    llama.cpp's --draft-p-min reads of its greedy draft."""
    drawn = [row for row in rows if sampled[row] > step]
    greedy = [row for row in rows if sampled[row] <= step]
    out: dict[int, float] = {}
    if drawn:
        assert probs is not None
        out.update(zip(drawn, probs[drawn].amax(dim=-1).tolist()))
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        untempered = to_probs(logits[index], _UNTEMPERED, rows_of(allowed, index))  # [G, V]
        out.update(zip(greedy, untempered.amax(dim=-1).tolist()))
    return out


def draw_step(logits: torch.Tensor, allowed: torch.Tensor | None, step: int,
              samplings: Sequence[SamplingConfig], sampled: Sequence[int],
              uniforms: list[list[float]], failed: dict[int, Exception]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft step's tokens [B] and, when any row samples at this step, probs [B, V] fp32.

    Rows that sample at this step (sampled[b] > step) are drawn by
    sample.sampling.sample_from_logits, each group of rows with equal settings in one call, their
    probs exactly what they were drawn from; the others take the argmax (greedy drafts: point
    masses; rows past their k: padding) with zero probs. One group covering every row (a batch
    under one setting) indexes nothing. A row whose draw raises (its logits are not finite) joins
    ``failed`` and pads; the others are drawn with the uniforms they had (run_isolated): what they
    would have drawn anyway."""
    groups: dict[SamplingConfig, list[int]] = {}
    for row, (sampling, count) in enumerate(zip(samplings, sampled)):
        if count > step and row not in failed:
            groups.setdefault(sampling, []).append(row)
    num_rows = logits.shape[0]
    if len(groups) == 1 and len(next(iter(groups.values()))) == num_rows:
        (sampling, _), = groups.items()
        try:
            probs, tokens = sample_from_logits(logits, sampling, [u[step] for u in uniforms],
                                               allowed)
        except Exception:  # some row's fault: drawn in parts below, with the same uniforms
            probs = None
        if probs is not None:
            return tokens, probs
    tokens = argmax_rows(logits, allowed, failed)  # [B]
    if not groups:  # no row draws at this step
        return tokens, None
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V]
    for sampling, group in groups.items():
        rows = [row for row in group if row not in failed]  # the argmax may have found some

        def draw(part: list[int], sampling: SamplingConfig = sampling
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            index = torch.tensor(part, device=logits.device)
            return sample_from_logits(logits[index], sampling,
                                      [uniforms[row][step] for row in part],
                                      rows_of(allowed, index))

        for part, (part_probs, part_tokens) in run_isolated(rows, draw,
                                                            failed.setdefault):
            index = torch.tensor(part, device=logits.device)
            probs[index], tokens[index] = part_probs, part_tokens
    return tokens, probs


def argmax_rows(logits: torch.Tensor, allowed: torch.Tensor | None,
                failed: dict[int, Exception]) -> torch.Tensor:
    """sample.sampling.greedy_tokens of each row [B] (one call while no row fails); a row whose
    logits have no finite maximum joins ``failed`` and pads with the first token its grammar
    allows (its grammar state advances with it), else 0."""
    num_rows = logits.shape[0]
    live = [row for row in range(num_rows) if row not in failed]

    def argmax(part: list[int]) -> torch.Tensor:
        if len(part) == num_rows:
            return greedy_tokens(logits, allowed)
        index = torch.tensor(part, device=logits.device)
        return greedy_tokens(logits[index], rows_of(allowed, index))

    parts = run_isolated(live, argmax, failed.setdefault)
    if len(parts) == 1 and len(parts[0][0]) == num_rows:
        return parts[0][1]
    tokens = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    for part, part_tokens in parts:
        tokens[torch.tensor(part, device=logits.device)] = part_tokens
    if allowed is not None:
        for row in failed:
            tokens[row] = int(allowed[row].to(torch.uint8).argmax())  # 0 when none is allowed
    return tokens


def rows_of(allowed: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """A grammar's masks [B, V] at the rows ``index`` (on the masks' device), or None."""
    return None if allowed is None else allowed[index.to(allowed.device)]
