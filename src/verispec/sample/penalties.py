"""Pure math: a row's logits reshaped by its history (logit bias, repetition, frequency and
presence penalties), at each position of a verified block.

Legend: P positions (a block's k + 1, or 1 for a draft step), V vocabulary, U distinct draft
tokens of the block.

A penalty defines the target law from the tokens before each position, so speculation keeps it
exactly when position j of a block counts the committed tokens and the block's first j draft
tokens (d_1 .. d_j), which is what plain decoding counts there once they are accepted. Peers
that count only committed tokens inside a block sample from a weaker penalty than asked.

The order, the same for draft and target, before the min_tokens ban, the grammar's mask and
then temperature, top-k, top-p and min-p (sample/sampling.py):
  1. logit_bias is added (OpenAI's);
  2. repetition_penalty (Hugging Face's): a token seen in prompt or output has its positive
     logit divided by it, its negative one multiplied (saturating at fp32's largest finite
     magnitude, never overflowing to inf);
  3. frequency_penalty times the token's count in the output is subtracted, then
     presence_penalty once for a token the output holds (OpenAI's).

The whole vocabulary is reshaped once from the committed history and broadcast over the P
positions; only the U tokens the block drafted differ between positions, and those columns are
recomputed from the raw logits with the same elementwise arithmetic, so position j's values are
bit for bit those of a one-position call with d_1 .. d_j committed (plain decoding's).

Worked example (frequency_penalty 1, committed output [5], drafted [7, 5, 7]; positions 0..3
count token 5: 1, 1, 2, 2 and token 7: 0, 1, 1, 2).

Not here: where the history lives (engine/rows.py), the sampling settings (sample/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import PenaltyConfig


def process_logits(logits: torch.Tensor, penalty: PenaltyConfig, prompt_seen: torch.Tensor | None,
                 output_ids: Sequence[int], drafted: Sequence[int] = ()) -> torch.Tensor:
    """Logits [P, V] -> processed logits [P, V] fp32; position j counts ``output_ids`` (the row's
    committed new tokens) followed by drafted[:j] (len(drafted) >= P - 1).

    prompt_seen [V] bool: the prompt's tokens (read only under a repetition penalty; None
    when it is off). See the module docstring for the order and the exactness argument."""
    assert logits.dim() == 2 and len(drafted) >= logits.shape[0] - 1
    logits = logits.float()
    num_positions, vocab_size = logits.shape
    bias = logit_bias_vector(penalty, vocab_size, logits.device)  # [V] or None
    if not penalty.uses_history:
        return logits if bias is None else logits + bias
    counts = output_counts(output_ids, vocab_size, logits.device)  # [V] fp32
    seen = None
    if penalty.repetition_penalty != 1.0:
        assert prompt_seen is not None and prompt_seen.shape == (vocab_size,)
        seen = prompt_seen.to(logits.device) | (counts > 0)
    processed = _penalized(logits, bias, counts, seen, penalty)  # [P, V]
    touched = sorted(set(drafted[: num_positions - 1]))
    if not touched:
        return processed
    index = torch.tensor(touched, device=logits.device)  # [U]
    extra = torch.tensor(_draft_counts(drafted, touched, num_positions),
                         dtype=torch.float32, device=logits.device)  # [P, U]
    block_counts = counts[index] + extra
    block_seen = None if seen is None else seen[index] | (extra > 0)
    processed[:, index] = _penalized(logits[:, index], None if bias is None else bias[index],
                                  block_counts, block_seen, penalty)
    return processed


def _penalized(logits: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor,
               seen: torch.Tensor | None, penalty: PenaltyConfig) -> torch.Tensor:
    """Steps 1-3 elementwise: logits [P, N], bias [N] or None, counts [N] or [P, N] fp32,
    seen like counts (bool) or None -> [P, N] fp32. Dense and gathered calls run the same
    operations on the same values, so they agree bit for bit."""
    if bias is not None:
        logits = logits + bias
    if seen is not None:
        logits = torch.where(seen, _repetition_scaled(logits, penalty.repetition_penalty), logits)
    if penalty.frequency_penalty:
        logits = logits - penalty.frequency_penalty * counts
    if penalty.presence_penalty:
        logits = logits - penalty.presence_penalty * (counts > 0).float()
    return logits


def _repetition_scaled(logits: torch.Tensor, repetition_penalty: float) -> torch.Tensor:
    """Step 2 on every entry: a positive logit divided by the penalty, a negative one
    multiplied, [P, N] -> [P, N]. A finite logit stays finite: past fp32's range the result
    saturates at its largest magnitude (within PenaltyConfig's bounds only a logit beyond 3e36
    gets there), where +inf would make the row's softmax NaN; an infinite or NaN logit stays
    what it is, for the sampler's NonFiniteError."""
    scaled = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
    return torch.where(torch.isfinite(logits), scaled.clamp(-_FP32_MAX, _FP32_MAX), logits)


_FP32_MAX = torch.finfo(torch.float32).max


def _draft_counts(drafted: Sequence[int], touched: list[int], num_positions: int
                  ) -> list[list[float]]:
    """[P][U] host counts: how often touched[u] occurs in drafted[:j] at position j."""
    column = {token: u for u, token in enumerate(touched)}
    row = [0.0] * len(touched)
    table = [list(row)]
    for token in drafted[: num_positions - 1]:
        row[column[token]] += 1.0
        table.append(list(row))
    return table


def output_counts(output_ids: Sequence[int], vocab_size: int,
                  device: torch.device | str) -> torch.Tensor:
    """How often each token occurs in ``output_ids``: [V] fp32."""
    if not output_ids:
        return torch.zeros(vocab_size, dtype=torch.float32, device=device)
    ids = torch.tensor(list(output_ids), dtype=torch.int64, device=device)
    return torch.bincount(ids, minlength=vocab_size).float()


def seen_tokens(token_ids: Sequence[int], vocab_size: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] bool: True for each token in ``token_ids`` (a prompt, for the repetition penalty)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    if token_ids:
        seen[torch.tensor(list(token_ids), dtype=torch.int64, device=device)] = True
    return seen


def logit_bias_vector(penalty: PenaltyConfig, vocab_size: int,
                      device: torch.device | str) -> torch.Tensor | None:
    """The logit_bias as a dense [V] fp32 vector (0 elsewhere), or None without one."""
    if not penalty.logit_bias:
        return None
    ids, values = zip(*penalty.logit_bias)
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    bias[torch.tensor(ids, dtype=torch.int64, device=device)] = torch.tensor(
        values, dtype=torch.float32, device=device)
    return bias
