"""Block verification: the draft block is judged as a whole, not token by token.

Reference: Sun, Mendlovic, Leviathan, Aharoni, Ro, Beirami, Suresh, "Block Verification
Accelerates Speculative Decoding" (ICLR 2025), Algorithm 2. Token-wise verification (rejection.py)
stops at the first draft token that fails its own test. Block verification carries a weight, the
running target/draft ratio of the prefix clamped at 1, so a token the target under-weights can be
kept when later tokens make up for it. The output has exactly the target's law (checked by exact
enumeration in tests/sample/test_verify_block.py, from the tensor form of these formulas in
tests/helpers/rule_references.py), and for the same draft it keeps at least as many
tokens in expectation as token-wise verification. With X_1..X_k the draft tokens, q_i =
draft_probs[:, i-1] and p_i = target_probs[:, i-1] (the paper's M_s and M_b after X_<i):

  weights     w_0 = 1,  w_i = min(1, w_{i-1} p_i(X_i) / q_i(X_i))
  masses      r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x))                      (i < k)
  stop_probs  h_0 = 1,  h_i = r_i / (r_i + 1 - w_i) for 0 < i < k (0 when r_i = 0),  h_k = w_k
  tau         the largest i in 0..k with eta_i < h_i, eta_i ~ U[0, 1)  -> num_accepted
  next token  bonus ~ p_{k+1} if tau = k, else recovered ~ norm(max(0, w_tau p_{tau+1} - q_{tau+1}))

Vocabulary as in rejection.py: accepted (X_1..X_tau), recovered, bonus. Every eta is read: tau is
the last position that passes, not the one before the first failure. At tau = 0 the recovered
token comes from rejection.py's residual norm(max(0, p_1 - q_1)). So P(tau = i | X) = h_i
prod_{j > i} (1 - h_j), which the tests use to compute the exact law.

Arithmetic: the paper's rule, evaluated so that it never divides by 0 or leaves [0, 1] when
draft and target are both near-certain (a low temperature, a logit_bias of +-100: r_i far
below 2^-53, fp32 subnormals, zeros). h_i is r_i / (r_i + (1 - w_i)), the complement first
(_stop_prob): at w_i = 1 it is r_i / r_i = 1, the limit, where (r_i + 1) - w_i would round a
small r_i away and divide by 0. w_i is (w_{i-1} p_i(X_i)) / q_i(X_i), clamped at 1: a near-0
q_i overflows p_i / q_i to inf in fp32, and w_{i-1} = 0 times inf would be NaN.

Legend: B batch, K draft tokens (max over rows), V vocabulary. Probabilities are fp32 (float64
works too).

Worked example (k = 2, V = 3; tokens 0, 1, 2):
  draft X = [0, 1], q_1 = [.5, .5, 0], q_2 = [.5, .4, .1]
  target p_1 = [.25, .75, 0], p_2 = [0, .6, .4], p_3 = [1, 0, 0]
  w_1 = min(1, .25/.5) = .5;  r_1 = sum max(0, .5 p_2 - q_2) = 0 + 0 + .1 = .1
  h_1 = .1 / (.1 + 1 - .5) = 1/6;  w_2 = min(1, .5 * .6/.4) = .75 = h_2
  eta = [.1, .9]: position 1 passes (.1 < 1/6), position 2 fails (.9 >= .75) -> tau = 1;
  recovered ~ norm(max(0, .5 p_2 - q_2)) = [0, 0, 1] -> output [0, 2, PAD]. The unweighted
  residual norm(max(0, p_2 - q_2)) = [0, .4, .6] would emit 1 too: a wrong law.
  eta = [.9, .5]: position 2 passes -> tau = 2, bonus ~ p_3 -> output [0, 1, 0].

Edge cases, as in rejection.py: q(x) = 0 for a proposed token -> DraftContractError; NaN or inf ->
NonFiniteError; a recovered residual with no mass (rounding) is drawn from p_{tau+1} instead.

Not here: point-mass proposals (draft_probs None, greedy and n-gram drafts) stay on
rejection.verify_rows and raise UnsupportedFeatureError here; the token-wise rule (rejection.py);
the temperature-0 forms (greedy.py); the input checks (checks.py); choosing between
rules (the engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import DraftContractError, UnsupportedFeatureError
from .checks import check_draft_tokens
from .rejection import checked_draft_rows, draw_rows_randomness, plain_rows, rows_at
from .result import assemble_rows
from .sampling import sample_with_host_uniforms

_NEEDS_DRAFT_PROBS = (
    "block verification needs draft_probs [B, K, V], the distributions the draft tokens were "
    "drawn from; got None (a deterministic proposal). Verify point-mass drafts with the "
    "token-wise rule, verispec.sample.rejection.verify_rows.")
_DRAFT_GAVE_ZERO = (
    "the draft proposed a token to which its own reported distribution gives probability 0; "
    "draft_probs must be exactly the distributions the draft tokens were sampled from.")


def verify_block_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                      target_probs: torch.Tensor,
                      generator: torch.Generator | Sequence[torch.Generator],
                      num_draft_tokens: Sequence[int] | None = None
                      ) -> tuple[list[int], list[list[int]]]:
    """Block verification with host lists out: rejection.verify_rows's contract, the block rule.

    Shapes: draft_tokens [B, K] int64; draft_probs [B, K, V], exactly the distributions the
    draft tokens were drawn from (None raises UnsupportedFeatureError: use verify_rows);
    target_probs [B, K+1, V]; num_draft_tokens B host ints in [0, K] (ragged rows: row b reads
    its first k_b tokens and k_b + 1 target distributions), None for K each.
    ``generator``: one for the batch, or one per row. Rows sharing a generator draw together,
    each group its etas [rows, its largest k] fp32 then its next_uniforms [rows] fp64, the
    numbers verify_rows would draw, so a row with a generator of its own draws the same
    numbers whatever else is in the batch. Returns (num_accepted, B ints; output_tokens, B rows
    of K+1 ints: accepted tokens, the recovered or bonus token, then PAD_TOKEN).
    """
    check_draft_tokens(draft_tokens)
    if draft_probs is None:
        raise UnsupportedFeatureError(_NEEDS_DRAFT_PROBS)
    etas, next_uniforms, num_draft = draw_rows_randomness(
        draft_tokens, draft_probs, target_probs, generator, num_draft_tokens)
    return verify_block_rows_with_randomness(draft_tokens, draft_probs, target_probs, etas,
                                             next_uniforms, num_draft)


def verify_block_rows_with_randomness(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                                      target_probs: torch.Tensor, etas: torch.Tensor,
                                      next_uniforms: torch.Tensor, num_draft: list[int]
                                      ) -> tuple[list[int], list[list[int]]]:
    """The block rule on checked inputs with its random numbers given (verify_block_rows draws
    them; tests replay them): etas [B, K] and next_uniforms [B] in [0, 1), num_draft B host
    ints. Draft position i (1-based) passes iff etas[b, i-1] < h_i; the recovered or bonus
    token is the inverse-CDF draw of next_uniforms[b]. -> (num_accepted, B ints;
    output_tokens, B rows of K+1 ints). Tensor work is two gathers and one [B, K, V] pass;
    decisions are host floats."""
    max_k = draft_tokens.shape[1]
    draft_rows = checked_draft_rows(draft_tokens, num_draft, target_probs.shape[-1])
    if max_k == 0:  # nothing drafted (plain decoding): the next token is an ordinary sample
        return plain_rows(target_probs, next_uniforms)
    # 1. Weights w_0..w_K on the host, from the ratios at the proposed tokens.
    weights = _weights_rows(draft_tokens, draft_probs, target_probs, num_draft)
    # 2. Residual masses r_i: one pass over [B, K, V] (w_0..w_{K-1} against p_1..p_K, q_1..q_K).
    weight_tensor = torch.tensor([row[:max_k] for row in weights], dtype=target_probs.dtype,
                                 device=target_probs.device)  # [B, K]
    excess = _weighted_excess(weight_tensor, draft_probs, target_probs)  # [B, K, V]
    masses = excess.sum(-1).tolist()
    # 3. tau: the last position whose eta falls below its stop probability.
    num_accepted = [_last_pass(_stop_probs(w, r, n), eta_row)
                    for w, r, n, eta_row in zip(weights, masses, num_draft, etas.tolist())]
    # 4. The recovered token (weighted residual at tau) or the bonus token (p_{k+1}).
    next_target = rows_at(target_probs, num_accepted)  # [B, V]
    next_probs = torch.stack([excess[b, n] if n < k else next_target[b]
                              for b, (n, k) in enumerate(zip(num_accepted, num_draft))])
    next_tokens = sample_with_host_uniforms(next_probs, next_uniforms.tolist(),
                                            fallback=next_target).tolist()
    # 5. Assemble: accepted prefix, then the next token, then padding.
    return num_accepted, assemble_rows(draft_rows, num_accepted, next_tokens)


def _weights_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor, num_draft: list[int]) -> list[list[float]]:
    """w_0..w_K per row (B lists of K+1 host floats; 0 past the row's k), from the ratios
    p_i(X_i) / q_i(X_i) read in one transfer. Raises DraftContractError for q_i(X_i) = 0."""
    max_k, vocab_size = draft_tokens.shape[1], target_probs.shape[-1]
    safe_tokens = draft_tokens.clamp(0, vocab_size - 1)[..., None]  # ragged tails: any id
    at_draft = torch.stack([target_probs[:, :max_k].gather(-1, safe_tokens).squeeze(-1),
                            draft_probs.gather(-1, safe_tokens).squeeze(-1).to(
                                target_probs.dtype)], dim=1).tolist()  # [B, 2, K]
    weights = []
    for (target_row, draft_row), n in zip(at_draft, num_draft):
        if any(value <= 0 for value in draft_row[:n]):
            raise DraftContractError(_DRAFT_GAVE_ZERO)
        row = [1.0]
        for target_value, draft_value in zip(target_row[:n], draft_row[:n]):
            row.append(min(row[-1] * target_value / draft_value, 1.0))
        weights.append(row + [0.0] * (max_k - n))
    return weights


def _weighted_excess(weights: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor) -> torch.Tensor:
    """max(0, w_i p_{i+1} - q_{i+1}) for i = 0..K-1: the unnormalised recovered distribution
    after i accepted tokens; its sum is r_i. weights [B, K] -> [B, K, V]."""
    max_k = weights.shape[1]
    excess = target_probs[:, :max_k].mul(weights[..., None])  # the pass's one allocation
    return excess.sub_(draft_probs.to(excess.dtype)).clamp_min_(0.0)


def _stop_probs(weights: list[float], masses: list[float], k: int) -> list[float]:
    """h_0..h_k of one row from its w_0..w_k and r_0..r_{k-1} (host floats)."""
    if k == 0:
        return [1.0]
    stop_probs = [1.0]  # tau = 0 needs no test
    for w, r in zip(weights[1:k], masses[1:k]):
        stop_probs.append(_stop_prob(w, r))
    return stop_probs + [weights[k]]


def _stop_prob(weight: float, mass: float) -> float:
    """h = r / (r + (1 - w)) for 0 < i < k, in the order that is exact in the limit.

    The complement 1 - w is taken first: w is in [0, 1], so 1 - w is exact for w >= 1/2
    (Sterbenz) and 0 at w = 1, where h = r / r = 1 for any r > 0. Evaluated as (r + 1) - w,
    a mass r below 2^-53 (draft and target both near-certain: low temperature, a large
    logit_bias) is rounded away against 1 and h becomes r / 0; a larger r loses bits and h
    can exceed 1. With the complement, r + (1 - w) >= r (rounding is monotone), so h lies in
    (0, 1] with no clamp. r = 0: nothing to recover, never stop here (h = 0, also when w = 1,
    where the formula is 0 / 0).
    """
    return mass / (mass + (1.0 - weight)) if mass > 0 else 0.0


def _last_pass(stop_probs: list[float], etas: list[float]) -> int:
    """tau: the largest i in 1..k with etas[i-1] < h_i, else 0. Every eta is read."""
    for i in range(len(stop_probs) - 1, 0, -1):
        if etas[i - 1] < stop_probs[i]:
            return i
    return 0
