"""Pure verification math for speculative sampling: acceptance, residual, bonus; batched.

Reference: Leviathan, Kalman, Matias 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative
Sampling", Algorithm 2). With p the target and q the draft distribution, draft token x_i is
accepted with probability min(1, p(x_i) / q(x_i)); at the first rejection a token is drawn from
the residual norm(max(0, p - q)); if all k are accepted an extra token is drawn from the target's
(k+1)-th distribution. Every emitted token then has exactly the target's distribution.

Vocabulary (used throughout verispec):
  accepted   draft tokens kept by the acceptance test (a prefix of the proposal);
  recovered  the token drawn from the residual at the first rejected position;
  bonus      the token drawn from the target's distribution after all k draft tokens were accepted.
Each row of a round emits num_accepted + 1 tokens: the accepted ones, then recovered or bonus.

Legend: B batch, K draft tokens (max over rows), V vocabulary. Probabilities are fp32.

A deterministic proposal (greedy draft, n-gram) has draft_probs None: it is verified as a point
mass q = one_hot(x), so it is accepted with probability p(x) and the residual is p with x removed.

Edge cases, made explicit:
  * q(x) = 0 for a proposed token: the proposer broke its contract -> DraftContractError.
  * a residual that sums to 0 (p == q numerically): rejection there has probability 0, so the row
    is never resampled in exact arithmetic; if rounding rejects anyway we draw from p.
  * NaN or inf in any probability -> NonFiniteError; never a silent sample.

Not here: models, caches, sampling settings (see sampling.py), the decoding loop (engine/batch.py;
its verification step over a batch's rows is engine/verification.py), the temperature-0 forms that
need no random numbers (greedy.py), the input checks (checks.py), VerifyResult and the output's
assembly (result.py), and the formulas for expected acceptance and speedup (theory.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import DraftContractError, ShapeError
from .checks import (
    check_draft_tokens,
    check_generator,
    check_token_range,
    check_verify_inputs,
    proposed_mask,
    raise_out_of_range,
)
from .result import VerifyResult, assemble_output, assemble_rows, result_from_rows
from .sampling import generator_groups, sample_with_host_uniforms, sample_with_uniform

_DRAFT_GAVE_ZERO = (
    "the draft proposed a token to which its own reported distribution gives probability 0; "
    "draft_probs must be exactly the distributions the draft tokens were sampled from (or None "
    "for a deterministic proposal).")


def point_mass(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One-hot fp32 distributions for deterministic tokens. [...] int64 -> [..., V] fp32."""
    return torch.nn.functional.one_hot(tokens, vocab_size).to(torch.float32)


def residual_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_target - p_draft)): where the recovered token is drawn from after a rejection.

    Shapes: [..., V] each -> [..., V] fp32. A row whose residual sums to 0 (equal distributions)
    returns the target row: rejection there has probability 0, see the module docstring.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(torch.float32).tiny),
                       target_probs)


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, generator: torch.Generator,
           num_draft_tokens: torch.Tensor | None = None) -> VerifyResult:
    """Batched modified rejection sampling: which draft tokens to keep, and the next token.

    Shapes:
      draft_tokens     [B, K] int64; entries at positions >= num_draft_tokens[b] are ignored.
      draft_probs      [B, K, V] fp32, exactly the distributions the draft tokens were drawn
                       from; None for a deterministic proposal (verified as a point mass).
      target_probs     [B, K+1, V] fp32, processed with the same sampling settings; row b's
                       bonus distribution is target_probs[b, num_draft_tokens[b]].
      num_draft_tokens [B] int64 in [0, K] (ragged rows); None means K for every row.
    Random numbers come from ``generator`` in a fixed order: uniforms [B, K] fp32 for the
    acceptance tests, then next_uniforms [B] float64 for the recovered/bonus draw;
    :func:`verify_with_randomness` takes them explicitly. One uniform per row replaces V
    exponentials: at batch 1 over a large vocabulary that saves time every round (dev/LOG.md:
    host checks).
    """
    uniforms, next_uniforms = _draw_uniforms(draft_tokens, generator, target_probs.device)
    return verify_with_randomness(draft_tokens, draft_probs, target_probs, uniforms,
                                  next_uniforms, num_draft_tokens)


def verify_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, generator: torch.Generator | Sequence[torch.Generator],
                num_draft_tokens: Sequence[int] | None = None
                ) -> tuple[list[int], list[list[int]]]:
    """:func:`verify` with its result as host lists: what the decoding loop uses at temperature > 0.

    Shapes as in :func:`verify`; num_draft_tokens: B host ints (ragged rows), None for K each.
    ``generator``: one for the batch, or one per row; rows sharing a generator draw together
    (sampling.generator_groups), each group its uniforms [rows, its largest k] then its
    next_uniforms [rows], so a row with a generator of its own draws the same numbers whatever
    else is in the batch, and one generator for all rows draws exactly what :func:`verify`
    draws. Returns (num_accepted, B ints; output_tokens, B rows of K+1 ints as in
    VerifyResult.output_tokens), equal to ``verify(...).num_accepted.tolist()`` and
    ``.output_tokens.tolist()`` for the same generator state. Batches of up to
    HOST_ROWS_MAX_BATCH rows never build the result tensors only to read them back.
    """
    uniforms, next_uniforms, num_draft = draw_rows_randomness(
        draft_tokens, draft_probs, target_probs, generator, num_draft_tokens)
    if draft_tokens.shape[0] <= HOST_ROWS_MAX_BATCH:
        return _verify_rows(draft_tokens, draft_probs, target_probs, uniforms, next_uniforms,
                            num_draft)
    result = _verify_batched(draft_tokens, draft_probs, target_probs, uniforms, next_uniforms,
                             num_draft)
    return result.num_accepted.tolist(), result.output_tokens.tolist()


def draw_rows_randomness(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor,
                         generator: torch.Generator | Sequence[torch.Generator],
                         num_draft_tokens: Sequence[int] | None
                         ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The random numbers of a rows-form rule (verify_rows, block.verify_block_rows),
    drawn per generator group (:func:`_draw_grouped_uniforms`), and the inputs checked:
    -> (uniforms [B, K] fp32, next_uniforms [B] fp64, each row's k as host ints)."""
    batch_size, max_k = check_draft_tokens(draft_tokens)
    counts = [max_k] * batch_size if num_draft_tokens is None else list(num_draft_tokens)
    generators = (list(generator) if isinstance(generator, (list, tuple))
                  else [generator] * batch_size)  # a non-generator fails check_generator
    if len(counts) != batch_size or len(generators) != batch_size:
        raise ShapeError(f"num_draft_tokens and generators need one entry per row (B = "
                         f"{batch_size}); got {len(counts)} and {len(generators)}.")
    uniforms, next_uniforms = _draw_grouped_uniforms(generators, counts, max_k,
                                                     target_probs.device)
    num_draft = check_verify_inputs(
        draft_tokens, draft_probs, target_probs, uniforms, next_uniforms,
        None if num_draft_tokens is None else torch.tensor(counts, device=draft_tokens.device))
    return uniforms, next_uniforms, num_draft


def _draw_uniforms(draft_tokens: torch.Tensor, generator: torch.Generator,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """verify's random numbers, in its fixed order: uniforms [B, K] fp32, next_uniforms [B] fp64.
    Drawn where the generator lives, then moved (a no-op when both are on one device)."""
    check_generator(generator)
    batch_size, max_k = check_draft_tokens(draft_tokens)
    uniforms = torch.rand((batch_size, max_k), generator=generator, device=generator.device)
    next_uniforms = torch.rand((batch_size,), generator=generator, dtype=torch.float64,
                               device=generator.device)
    return uniforms.to(device), next_uniforms.to(device)


def _draw_grouped_uniforms(generators: list[torch.Generator], counts: list[int], max_k: int,
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_draw_uniforms` per generator group (see :func:`verify_rows`): uniforms [B, K]
    fp32 (zeros past a group's largest k, never read) and next_uniforms [B] fp64."""
    groups = generator_groups(generators)
    if len(groups) == 1:  # one generator: exactly verify's draws
        generator = groups[0][0]
        width = max(counts, default=0)
        uniforms = torch.rand((len(counts), width), generator=generator, device=generator.device)
        next_uniforms = torch.rand((len(counts),), generator=generator, dtype=torch.float64,
                                   device=generator.device)
        return (torch.nn.functional.pad(uniforms, (0, max_k - width)).to(device),
                next_uniforms.to(device))
    uniforms = torch.zeros((len(counts), max_k), device=device)
    next_uniforms = torch.zeros((len(counts),), dtype=torch.float64, device=device)
    for generator, rows in groups:
        width = max(counts[row] for row in rows)
        drawn = torch.rand((len(rows), width), generator=generator, device=generator.device)
        drawn_next = torch.rand((len(rows),), generator=generator, dtype=torch.float64,
                                device=generator.device)
        index = torch.tensor(rows, device=device)
        uniforms[index, :width] = drawn.to(device)
        next_uniforms[index] = drawn_next.to(device)
    return uniforms, next_uniforms


def verify_with_randomness(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                           target_probs: torch.Tensor, uniforms: torch.Tensor,
                           next_uniforms: torch.Tensor,
                           num_draft_tokens: torch.Tensor | None = None) -> VerifyResult:
    """:func:`verify` with its random numbers given: uniforms [B, K] and next_uniforms [B], all
    in [0, 1).

    Draft token i of row b is accepted iff uniforms[b, i] < min(1, p_target / p_draft); the
    recovered/bonus token is the inverse-CDF draw of next_uniforms[b] from that row's final
    distribution (sampling.sample_with_uniform: exact, never a zero-probability token).
    Batches of up to HOST_ROWS_MAX_BATCH rows decide on host ints, larger ones with tensor ops
    over the batch; both give the same result.
    """
    num_draft = check_verify_inputs(draft_tokens, draft_probs, target_probs, uniforms,
                                     next_uniforms, num_draft_tokens)
    if draft_tokens.shape[0] <= HOST_ROWS_MAX_BATCH:
        num_accepted, output_tokens = _verify_rows(draft_tokens, draft_probs, target_probs,
                                                   uniforms, next_uniforms, num_draft)
        return result_from_rows(num_accepted, output_tokens, num_draft, draft_tokens.device)
    return _verify_batched(draft_tokens, draft_probs, target_probs, uniforms, next_uniforms,
                           num_draft)


# At most this many rows, verify_with_randomness decides on the host (_verify_rows): at batch 1
# its ~65 tiny tensor ops, each run cold right after a target pass, cost more than the math.
# Larger batches take the tensor path (_verify_batched), whose op count does not grow with B.
# Both give the same tokens for the same random numbers (tests/sample/test_verify.py checks both
# against a per-row reference).
HOST_ROWS_MAX_BATCH = 8


def _verify_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, uniforms: torch.Tensor, next_uniforms: torch.Tensor,
                 num_draft: list[int]) -> tuple[list[int], list[list[int]]]:
    """verify_with_randomness for small batches, on host ints: -> (num_accepted, B ints;
    output_tokens, B rows of K+1 ints, padded with PAD_TOKEN)."""
    max_k = draft_tokens.shape[1]
    draft_rows = checked_draft_rows(draft_tokens, num_draft, target_probs.shape[-1])
    if max_k == 0:  # nothing drafted (plain decoding): the next token is an ordinary sample
        return plain_rows(target_probs, next_uniforms)
    # 1. acceptance test, 2. the recovered or bonus token
    num_accepted = _accept_rows(draft_tokens, draft_probs, target_probs, uniforms, num_draft)
    next_tokens = _next_tokens_rows(draft_rows, draft_probs, target_probs, next_uniforms,
                                    num_accepted, num_draft)
    # 3. Assemble: accepted prefix, then the next token, then padding.
    return num_accepted, assemble_rows(draft_rows, num_accepted, next_tokens)


def checked_draft_rows(draft_tokens: torch.Tensor, num_draft: list[int],
                       vocab_size: int) -> list[list[int]]:
    """draft_tokens [B, K] as host rows, every proposed token (row b's first num_draft[b])
    checked to be an id in [0, V) (TokenOutOfRangeError)."""
    draft_rows = draft_tokens.tolist()
    for row, n in zip(draft_rows, num_draft):
        if not all(0 <= token < vocab_size for token in row[:n]):
            raise_out_of_range(row[:n], vocab_size)
    return draft_rows


def plain_rows(target_probs: torch.Tensor, next_uniforms: torch.Tensor
               ) -> tuple[list[int], list[list[int]]]:
    """A round with nothing drafted (K = 0): each row's next token is an ordinary sample of
    target_probs [B, 1, V] with its next_uniforms [B]. -> (num_accepted, output_tokens)."""
    next_tokens = sample_with_host_uniforms(target_probs[:, 0], next_uniforms.tolist())
    return [0] * len(next_tokens), [[token] for token in next_tokens.tolist()]


def _accept_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor, uniforms: torch.Tensor, num_draft: list[int]
                 ) -> list[int]:
    """The accepted prefix's length per row (B host ints), for drafts of K >= 1 tokens.

    The ratios p_target / p_draft at the proposed tokens are fp32 tensor ops; the comparisons
    with the uniforms and the accepted prefix are host ints and floats (comparing two floats is
    exact in any precision). Positions past a ragged row's num_draft_tokens may hold any id:
    clamped into range, their ratios are never looked at.
    """
    max_k, vocab_size = draft_tokens.shape[1], target_probs.shape[-1]
    ragged = any(n < max_k for n in num_draft)
    safe_tokens = (draft_tokens.clamp(0, vocab_size - 1) if ragged else draft_tokens)[..., None]
    target_at_draft = target_probs[:, :max_k].gather(-1, safe_tokens).squeeze(-1)  # [B, K]
    if draft_probs is None:  # point mass: q(x) = 1
        ratios = target_at_draft.tolist()
    else:
        draft_at_draft = draft_probs.gather(-1, safe_tokens).squeeze(-1)  # [B, K]
        draft_values = draft_at_draft.tolist()
        if any(value <= 0 for row, n in zip(draft_values, num_draft) for value in row[:n]):
            raise DraftContractError(_DRAFT_GAVE_ZERO)
        ratios = (target_at_draft / draft_at_draft).tolist()
    num_accepted = []
    for ratio_row, uniform_row, n in zip(ratios, uniforms.tolist(), num_draft):
        accepted = 0
        while accepted < n and uniform_row[accepted] < min(ratio_row[accepted], 1.0):
            accepted += 1
        num_accepted.append(accepted)
    return num_accepted


def _next_tokens_rows(draft_rows: list[list[int]], draft_probs: torch.Tensor | None,
                      target_probs: torch.Tensor, next_uniforms: torch.Tensor,
                      num_accepted: list[int], num_draft: list[int]) -> list[int]:
    """Each row's recovered token (residual at the first rejection) or bonus token (the target
    after the accepted prefix), as B host ints.

    Rows are picked by host index; the residual is only built if some row was rejected, and
    left unnormalised (the inverse-CDF draw scales by each row's total; a row whose residual is
    all zero, p == q, is drawn from the target, see the module docstring).
    """
    max_k = len(draft_rows[0])
    next_target = rows_at(target_probs, num_accepted)  # [B, V]
    rejected = [n < k for n, k in zip(num_accepted, num_draft)]
    if any(rejected):
        if draft_probs is None:  # max(0, p - one_hot(x)) is p with x zeroed
            residual = next_target.clone()
            for b, (row, n) in enumerate(zip(draft_rows, num_accepted)):
                if rejected[b]:
                    residual[b, row[n]] = 0.0
        else:
            next_draft = rows_at(draft_probs, [min(n, max_k - 1) for n in num_accepted])
            residual = (next_target - next_draft).clamp_min_(0.0)  # [B, V]
        next_probs = residual if all(rejected) else torch.where(
            torch.tensor(rejected, device=target_probs.device)[:, None], residual, next_target)
    else:
        next_probs = next_target
    return sample_with_host_uniforms(next_probs, next_uniforms.tolist(),
                                     fallback=next_target).tolist()


def _verify_batched(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    target_probs: torch.Tensor, uniforms: torch.Tensor,
                    next_uniforms: torch.Tensor, num_draft_list: list[int]) -> VerifyResult:
    """verify_with_randomness as tensor ops over the whole batch: the path for large batches."""
    max_k = draft_tokens.shape[1]
    vocab_size = target_probs.shape[-1]
    num_draft, valid = proposed_mask(num_draft_list, max_k, draft_tokens.device)
    check_token_range(draft_tokens, valid, vocab_size)
    if max_k == 0:  # nothing drafted (plain decoding): the next token is an ordinary sample
        next_tokens = sample_with_uniform(target_probs[:, 0], next_uniforms)  # [B]
        return assemble_output(draft_tokens, torch.zeros_like(num_draft), next_tokens, num_draft)

    # 1. Acceptance test at every proposed position (positions past a row's length count as
    # rejected: valid [B, K] is False there).
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))
    target_at_draft = target_probs[:, :max_k].gather(-1, safe_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)  # point mass: q(x) = 1
    else:
        draft_at_draft = draft_probs.gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, K]
        if bool((valid & (draft_at_draft <= 0)).any()):
            raise DraftContractError(_DRAFT_GAVE_ZERO)
    draft_at_draft = torch.where(valid, draft_at_draft, torch.ones_like(draft_at_draft))
    accepted = valid & (uniforms < (target_at_draft / draft_at_draft).clamp(max=1.0))
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # length of the accepted prefix [B]
    all_accepted = num_accepted == num_draft

    # 2. The next token: residual at the first rejection, or the bonus distribution after
    # position n.
    next_target = _row_at(target_probs, num_accepted)  # [B, V]
    first_rejected = num_accepted.clamp(max=max_k - 1)
    if draft_probs is None:
        next_draft = point_mass(safe_tokens.gather(1, first_rejected[:, None]).squeeze(1),
                                vocab_size)
    else:
        next_draft = _row_at(draft_probs, first_rejected)  # [B, V]
    residual = residual_probs(next_draft, next_target)
    next_probs = torch.where(all_accepted[:, None], next_target, residual)
    next_tokens = sample_with_uniform(next_probs, next_uniforms)  # [B]

    # 3. Assemble: accepted prefix, then the next token, then padding.
    return assemble_output(draft_tokens, num_accepted, next_tokens, num_draft)


def _row_at(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs[b, positions[b]] for each row: [B, K, V], [B] -> [B, V] (a gather: cheaper than
    advanced indexing at batch 1)."""
    index = positions[:, None, None].expand(-1, 1, probs.shape[-1])  # [B, 1, V]
    return probs.gather(1, index).squeeze(1)


def rows_at(probs: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """probs[b, positions[b]] for each row: [B, K, V] and B host ints -> [B, V]. Views and one
    stack (a single view at batch 1): no index tensors."""
    if len(positions) == 1:
        return probs[0, positions[0]][None]
    return torch.stack([probs[b, n] for b, n in enumerate(positions)])
