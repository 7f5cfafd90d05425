"""Verification at temperature 0: accept while the draft token is the target's argmax.

At temperature 0 the target's rows are point masses, and so are the proposals (a greedy draft,
an n-gram lookup): the acceptance ratio p(x) / 1 is 1 when x is the target's token and 0
otherwise, and the residual at a rejection is the target's point mass itself. So the rule of
rejection.py reduces to comparing token ids: no random numbers and no work over the vocabulary.
Three forms of that one rule, checked against rejection.verify in tests/sample/test_verify.py:
verify_greedy (probabilities in), verify_greedy_tokens (the target's tokens in) and
verify_greedy_rows (host lists, what the engine calls).

Legend: B batch, K draft tokens (max over rows), V vocabulary. Vocabulary (accepted, recovered,
bonus) as in rejection.py, VerifyResult as in result.py.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError, TokenOutOfRangeError
from .checks import (
    check_draft_tokens,
    check_inputs,
    check_num_draft,
    check_token_range,
    proposed_mask,
)
from .result import PAD_TOKEN, VerifyResult, assemble_output


def verify_greedy(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                  num_draft_tokens: torch.Tensor | None = None) -> VerifyResult:
    """:func:`verify` at temperature 0: no random numbers, and no work over the vocabulary.

    With a point-mass draft and point-mass target rows (to_probs at temperature 0), the
    acceptance ratio p(x) / 1 is 1 when x is the target's token and 0 otherwise, and the
    residual max(0, p - one_hot(x)) at a rejection is p itself. So: accept while the draft
    token equals the target's argmax; the next token (recovered or bonus) is the target's
    argmax where the accepted prefix stops. Equal to :func:`verify` on such inputs for every
    generator (tests/sample/test_verify.py checks it); on targets that are not point masses it is
    not a valid verifier: it is for temperature 0 only (where the engine calls its host form,
    :func:`verify_greedy_rows`). Shapes as in :func:`verify`.
    """
    check_draft_tokens(draft_tokens)
    check_inputs(draft_tokens, None, target_probs, num_draft_tokens)  # shapes, finiteness
    target_tokens = target_probs.argmax(dim=-1)  # [B, K+1] the target's token at each position
    return verify_greedy_tokens(draft_tokens, target_tokens, target_probs.shape[-1],
                                num_draft_tokens)


def verify_greedy_tokens(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                         vocab_size: int, num_draft_tokens: torch.Tensor | None = None
                         ) -> VerifyResult:
    """:func:`verify_greedy` given the target's tokens instead of its point masses.

    Shapes: draft_tokens [B, K] int64; target_tokens [B, K+1] int64, sampling.greedy_tokens of
    the target logits: the argmax :func:`verify_greedy` would take of to_probs at temperature
    0, without building the [B, K+1, V] one-hot rows; num_draft_tokens [B] or None (all K).
    vocab_size: V, the range every token must lie in. The engine calls its host form,
    :func:`verify_greedy_rows`.
    """
    batch_size, max_k = check_draft_tokens(draft_tokens)
    if (not isinstance(target_tokens, torch.Tensor) or target_tokens.dtype != torch.int64
            or tuple(target_tokens.shape) != (batch_size, max_k + 1)):
        shape = tuple(target_tokens.shape) if isinstance(target_tokens, torch.Tensor) else None
        raise ShapeError(f"target_tokens must be an int64 tensor [B, K+1] = [{batch_size}, "
                         f"{max_k + 1}] for draft_tokens {tuple(draft_tokens.shape)}; got "
                         f"{shape}.")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ShapeError(f"vocab_size must be a positive int (the target's V); got "
                         f"{vocab_size!r}.")
    if target_tokens.device != draft_tokens.device:
        raise ShapeError(f"target_tokens are on {target_tokens.device} and draft_tokens on "
                         f"{draft_tokens.device}; move both to one device.")
    if bool(((target_tokens < 0) | (target_tokens >= vocab_size)).any()):
        raise TokenOutOfRangeError(f"target_tokens hold an id outside the vocabulary "
                                   f"[0, {vocab_size}): {target_tokens.tolist()}.")
    num_draft, valid = proposed_mask(check_num_draft(draft_tokens, num_draft_tokens), max_k,
                                      draft_tokens.device)
    check_token_range(draft_tokens, valid, vocab_size)
    return _verify_point_masses(draft_tokens, target_tokens, num_draft, valid)


def verify_greedy_rows(draft_tokens: list[list[int]], target_tokens: list[list[int]],
                       vocab_size: int) -> tuple[list[int], list[list[int]]]:
    """:func:`verify_greedy_tokens` on host lists: the engine's temperature-0 round, no tensor ops.

    draft_tokens: B rows of K ids; target_tokens: B rows of K+1 ids (the target's greedy token at
    each position). Returns (num_accepted [B], output_tokens [B][K+1]): the same values as
    ``verify_greedy_tokens(...).num_accepted.tolist()`` and ``.output_tokens.tolist()``.
    Why a second form: at batch 1 the tensor form is ~25 tiny ops, each run cold right after a
    target pass has streamed the weights through the cache; a loop over K+1 ints costs a small
    fraction of that (dev/LOG.md: host checks). tests/sample/test_verify.py checks the two agree.

    Example: draft [[7, 8, 9]], target [[7, 5, 9, 2]] -> ([1], [[7, 5, PAD, PAD]]).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ShapeError(f"vocab_size must be a positive int (the target's V); got "
                         f"{vocab_size!r}.")
    if len(target_tokens) != len(draft_tokens):
        raise ShapeError(f"target_tokens has {len(target_tokens)} rows and draft_tokens "
                         f"{len(draft_tokens)}; expected one row each per batch row.")
    num_accepted, output_tokens = [], []
    for drafted, target in zip(draft_tokens, target_tokens):
        max_k = len(drafted)
        if len(target) != max_k + 1:
            raise ShapeError(f"each target_tokens row needs K+1 = {max_k + 1} ids for {max_k} "
                             f"draft tokens; got {len(target)}.")
        for name, row in (("draft token", drafted), ("target token", target)):
            for token in row:
                if not 0 <= token < vocab_size:
                    raise TokenOutOfRangeError(f"{name} id {token} is outside the vocabulary "
                                               f"[0, {vocab_size}); draft and target must share a "
                                               "tokenizer.")
        accepted = 0
        while accepted < max_k and drafted[accepted] == target[accepted]:
            accepted += 1
        num_accepted.append(accepted)
        output_tokens.append(drafted[:accepted] + [target[accepted]]
                             + [PAD_TOKEN] * (max_k - accepted))
    return num_accepted, output_tokens


def _verify_point_masses(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                         num_draft: torch.Tensor, valid: torch.Tensor) -> VerifyResult:
    """Accept while draft_tokens [B, K] equal target_tokens [B, K+1] (where valid [B, K]);
    then the target's token."""
    max_k = draft_tokens.shape[1]
    accepted = valid & (draft_tokens == target_tokens[:, :max_k])  # [B, K]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return assemble_output(draft_tokens, num_accepted, next_tokens, num_draft)
