"""Reference forms of the verification rules, and test-only helpers (test-only math).

src/verispec/sample holds one implementation of each rule, the one the engine runs; the tests
check it against these:
  block_weights                 the block rule's weights w_i and stop_probs h_i as tensors
                                (sample/block.py's formulas, a loop over K of [B] ops), from which
                                the tests compute the exact law P(tau = i | X);
  verify_block_with_randomness  sample/block.py's rule with its random numbers given, as a
                                VerifyResult: replays what verify_block_rows drew;
  acceptance_probs              min(1, p / q) over the whole vocabulary (rejection.py's test at
                                every token, not only the proposed ones);
  sample_from_logprobs          one draw per row of log-probabilities (sample.sampling.sample).

Legend: B batch, K draft tokens (max over rows), V vocabulary.
"""

from __future__ import annotations

import torch

from verispec.errors import DraftContractError, UnsupportedFeatureError
from verispec.sample.block import verify_block_rows_with_randomness
from verispec.sample.checks import (
    check_draft_tokens,
    check_inputs,
    check_token_range,
    check_verify_inputs,
    proposed_mask,
)
from verispec.sample.result import VerifyResult, result_from_rows
from verispec.sample.sampling import sample


def block_weights(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  target_probs: torch.Tensor, num_draft_tokens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The block rule's weights w_0..w_K and stop_probs h_0..h_K, as tensors.

    Shapes: draft_tokens [B, K] int64, draft_probs [B, K, V], target_probs [B, K+1, V] (float64
    for exact-law computations), num_draft_tokens [B] in [0, K] or None (K for every row).
    Returns (weights [B, K+1], stop_probs [B, K+1]) in target_probs' dtype; w_0 = h_0 = 1, and
    entries past a row's k are 0. P(tau = i | X) = h_i prod_{j > i} (1 - h_j). The formulas
    and their order of evaluation are sample/block.py's module docstring.
    """
    batch_size, max_k = check_draft_tokens(draft_tokens)
    if draft_probs is None:
        raise UnsupportedFeatureError("block_weights needs draft_probs [B, K, V]; got None.")
    num_draft, valid = proposed_mask(check_inputs(draft_tokens, draft_probs, target_probs,
                                                  num_draft_tokens), max_k, draft_tokens.device)
    check_token_range(draft_tokens, valid, target_probs.shape[-1])
    dtype = target_probs.dtype
    safe_tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens))[..., None]
    target_at_draft = target_probs[:, :max_k].gather(-1, safe_tokens).squeeze(-1)  # [B, K]
    draft_at_draft = draft_probs.gather(-1, safe_tokens).squeeze(-1).to(dtype)  # [B, K]
    if bool((valid & (draft_at_draft <= 0)).any()):
        raise DraftContractError("the draft proposed a token its draft_probs give 0.")
    weights = torch.zeros((batch_size, max_k + 1), dtype=dtype, device=target_probs.device)
    weights[:, 0] = 1.0
    for i in range(max_k):  # w_{i+1} = min(1, (w_i p_{i+1}(X_{i+1})) / q_{i+1}(X_{i+1}))
        weighted = weights[:, i] * target_at_draft[:, i]
        ratio = weighted / torch.where(valid[:, i], draft_at_draft[:, i], 1.0)
        weights[:, i + 1] = torch.where(valid[:, i], ratio.clamp(max=1.0), 0.0)
    # r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)) for i = 0..K-1: [B, K]
    masses = (target_probs[:, :max_k] * weights[:, :max_k, None]
              - draft_probs.to(dtype)).clamp_min(0.0).sum(-1)
    positions = torch.arange(max_k + 1, device=target_probs.device)[None, :]  # [1, K+1]
    complement = 1.0 - weights[:, :max_k]  # 1 - w_i taken first: exact in the limit w_i = 1
    stop_probs = torch.where(masses > 0, masses / (masses + complement), 0.0)  # [B, K]
    stop_probs = torch.cat([stop_probs, torch.zeros_like(stop_probs[:, :1])], 1)  # [B, K+1]
    stop_probs = torch.where(positions == num_draft[:, None], weights, stop_probs)
    stop_probs[:, 0] = 1.0  # tau = 0 needs no test
    return weights, torch.where(positions <= num_draft[:, None], stop_probs, 0.0)


def verify_block_with_randomness(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                                 target_probs: torch.Tensor, etas: torch.Tensor,
                                 next_uniforms: torch.Tensor,
                                 num_draft_tokens: torch.Tensor | None = None) -> VerifyResult:
    """verify_block_rows with its random numbers given, as a VerifyResult (a replay).

    Shapes as in verify_block_rows, plus etas [B, K] and next_uniforms [B], all in [0, 1):
    draft position i (1-based) passes iff etas[b, i-1] < h_i; the recovered/bonus token is the
    inverse-CDF draw of next_uniforms[b]. first_rejection equals num_accepted.
    """
    check_draft_tokens(draft_tokens)
    if draft_probs is None:
        raise UnsupportedFeatureError("block verification needs draft_probs [B, K, V].")
    num_draft = check_verify_inputs(draft_tokens, draft_probs, target_probs, etas,
                                     next_uniforms, num_draft_tokens)
    num_accepted, output_tokens = verify_block_rows_with_randomness(
        draft_tokens, draft_probs, target_probs, etas, next_uniforms, num_draft)
    return result_from_rows(num_accepted, output_tokens, num_draft, draft_tokens.device)


def acceptance_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p_target / p_draft) for every token: the chance it is accepted if proposed.

    Shapes: draft_probs [B, K, V], target_probs [B, K, V] -> [B, K, V] fp32. Where p_draft = 0
    the token is never proposed; the entry is 1 by convention.
    """
    ratio = target_probs / draft_probs
    return torch.where(draft_probs > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))


def sample_from_logprobs(logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of log-probabilities [..., V] (-inf allowed). -> tokens [...] int64."""
    return sample(torch.exp(logprobs.float()), generator)
