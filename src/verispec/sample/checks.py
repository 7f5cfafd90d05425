"""Input checks shared by the verification forms (rejection.py, greedy.py, block.py), as_index,
the integer test of theory.py's arguments and of token-id prompts (text/decoder.py), and
check_prompts, the engine's check of a batch of token-id prompts.

Legend: B batch, K draft tokens (max over rows), V vocabulary.

Each check raises a typed error naming the argument, what was expected and what came:
ShapeError for shapes, ragged lengths and devices, NonFiniteError for NaN/inf probabilities,
InputError for negative ones or a prompt that is no list of ids (EmptyPromptError for an empty
one), TokenOutOfRangeError for a draft, stop or prompt token outside the vocabulary, ConfigError
for a generator that is not a torch.Generator. Not here: the math.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from ..errors import (
    ConfigError,
    EmptyPromptError,
    InputError,
    NonFiniteError,
    ShapeError,
    TokenOutOfRangeError,
)


def check_verify_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, uniforms: torch.Tensor,
                         next_uniforms: torch.Tensor, num_draft_tokens: torch.Tensor | None
                         ) -> list[int]:
    """check_inputs plus the random numbers' shapes; returns num_draft (B host ints)."""
    batch_size, max_k = check_draft_tokens(draft_tokens)
    num_draft = check_inputs(draft_tokens, draft_probs, target_probs, num_draft_tokens)
    if tuple(uniforms.shape) != (batch_size, max_k) or tuple(next_uniforms.shape) != (batch_size,):
        raise ShapeError(f"uniforms must be [B, K] = [{batch_size}, {max_k}] and next_uniforms "
                         f"[B] = [{batch_size}]; got {tuple(uniforms.shape)} and "
                         f"{tuple(next_uniforms.shape)}.")
    return num_draft


def check_generator(generator: object) -> None:
    """Every random draw takes an explicit torch.Generator: never None, never the global RNG."""
    if not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator={generator!r:.60} is invalid: expected a torch.Generator, "
                          "e.g. torch.Generator().manual_seed(0) (verify never uses the global "
                          "RNG).")


def check_draft_tokens(draft_tokens: torch.Tensor) -> tuple[int, int]:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2 or (
            draft_tokens.dtype != torch.int64):
        shape = tuple(draft_tokens.shape) if isinstance(draft_tokens, torch.Tensor) else None
        raise ShapeError(f"draft_tokens must be an int64 tensor [B, K]; got shape {shape}.")
    return draft_tokens.shape[0], draft_tokens.shape[1]


def check_inputs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, num_draft_tokens: torch.Tensor | None
                  ) -> list[int]:
    """Validate shapes and values; return num_draft, each row's number of proposed tokens
    (see :func:`check_num_draft`). The token range is checked by each verification path."""
    batch_size, max_k = draft_tokens.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (batch_size, max_k + 1):
        raise ShapeError(f"target_probs must be [B, K+1, V] = [{batch_size}, {max_k + 1}, V] "
                         f"for draft_tokens {tuple(draft_tokens.shape)}; got "
                         f"{tuple(target_probs.shape)}.")
    vocab_size = target_probs.shape[-1]
    for name, tensor in (("draft_tokens", draft_tokens), ("draft_probs", draft_probs)):
        if tensor is not None and tensor.device != target_probs.device:
            raise ShapeError(f"{name} is on {tensor.device} but target_probs on "
                             f"{target_probs.device}; expected every verification input on one "
                             f"device: move it with .to(target_probs.device).")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch_size, max_k, vocab_size):
        raise ShapeError(f"draft_probs must be [B, K, V] = [{batch_size}, {max_k}, {vocab_size}]"
                         f"; got {tuple(draft_probs.shape)}. Draft and target must share a "
                         "vocabulary.")
    num_draft = check_num_draft(draft_tokens, num_draft_tokens)
    for name, probs in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if probs is not None and probs.numel():
            check_probs_values(name, probs)
    return num_draft


def check_probs_values(name: str, probs: torch.Tensor) -> None:
    """No NaN or inf (NonFiniteError) and no negative entry (InputError): rejection sampling
    would sample from them. One reduction and one host sync: the min and max in one pass (a
    NaN makes both NaN, an inf reaches one of them)."""
    low, high = torch.stack(list(torch.aminmax(probs))).tolist()
    if not (math.isfinite(low) and math.isfinite(high)):
        raise NonFiniteError(f"{name} contains NaN or inf; expected finite probabilities "
                             "from verispec.sample.sampling.to_probs.")
    if low < 0:
        raise InputError(f"{name} holds a negative entry ({low:g}); expected probabilities "
                         "in [0, 1], e.g. from verispec.sample.sampling.to_probs.")


def check_num_draft(draft_tokens: torch.Tensor, num_draft_tokens: torch.Tensor | None
                     ) -> list[int]:
    """num_draft_tokens as host ints in [0, K], one per row (all K when None)."""
    batch_size, max_k = draft_tokens.shape
    if num_draft_tokens is None:
        return [max_k] * batch_size
    as_tensor = torch.as_tensor(num_draft_tokens, dtype=torch.int64)
    num_draft = as_tensor.tolist()
    if as_tensor.shape != (batch_size,) or not all(0 <= n <= max_k for n in num_draft):
        raise ShapeError(f"num_draft_tokens must be [B] = [{batch_size}] with values in "
                         f"[0, {max_k}]; got {num_draft}.")
    return num_draft


def proposed_mask(num_draft: list[int], max_k: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """num_draft as a [B] int64 tensor, and valid [B, K]: which positions each row proposed."""
    num_draft_tensor = torch.tensor(num_draft, dtype=torch.int64, device=device)
    valid = torch.arange(max_k, device=device)[None, :] < num_draft_tensor[:, None]
    return num_draft_tensor, valid


def check_token_range(draft_tokens: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
    """Every proposed token (valid [B, K]) is an id in [0, V)."""
    if draft_tokens.numel() == 0:
        return
    out_of_range = valid & ((draft_tokens < 0) | (draft_tokens >= vocab_size))
    if bool(out_of_range.any()):
        raise_out_of_range(draft_tokens[out_of_range].tolist(), vocab_size)


def check_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """Every stop token id is in [0, V): min_new_tokens masks them in the target's logits, and
    an id the model cannot emit could never end a row. Checked as a row joins the batch."""
    bad = next((token for token in stop_token_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise TokenOutOfRangeError(
            f"stop_token_ids={tuple(stop_token_ids)} holds {bad}, outside the vocabulary "
            f"[0, {vocab_size}); pass ids of this model's tokenizer (e.g. its eos_token_id).")


def raise_out_of_range(tokens: list[int], vocab_size: int) -> None:
    """Raise TokenOutOfRangeError for the first id in tokens outside [0, V)."""
    bad = next(token for token in tokens if not 0 <= token < vocab_size)
    raise TokenOutOfRangeError(f"draft token id {bad} is outside the vocabulary [0, "
                               f"{vocab_size}); draft and target must share a tokenizer.")


def as_index(value: object) -> int | None:
    """value as an int when it is an integer (numpy's too; not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Validate a batch of token-id prompts; return them as lists of ints."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError(f"prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]]; "
                         f"got {prompts!r:.80}.")
    checked = []
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, int) or not isinstance(prompt, Sequence):
            raise InputError(f"prompts[{row}]={prompt!r:.40} is not a list of token ids; pass a "
                             "batch, e.g. [[1, 2, 3]] for one prompt.")
        if len(prompt) == 0:
            raise EmptyPromptError(f"prompts[{row}] is empty; a prompt needs at least one token "
                                   "(for example the BOS token).")
        ids = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InputError(f"prompts[{row}] holds {token!r}; token ids must be ints.")
            if not 0 <= token < vocab_size:
                raise TokenOutOfRangeError(f"prompts[{row}] holds token id {token}, outside the "
                                           f"vocabulary [0, {vocab_size}).")
            ids.append(token)
        checked.append(ids)
    return checked
