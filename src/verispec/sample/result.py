"""What a verification round returns, assembled the same way by every rule.

Each row of a round emits num_accepted + 1 tokens: its accepted draft tokens, then the recovered
or bonus token (the vocabulary of rejection.py); the rest of its K+1 slots hold PAD_TOKEN. The
token-wise rule (rejection.py), block verification (block.py) and the temperature-0 forms
(greedy.py) build their output here, as tensors (assemble_output) or as host lists (assemble_rows,
result_from_rows). What this is not: any acceptance rule or random number.

Legend: B batch, K draft tokens (max over rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN = -1  # fills output_tokens after each row's emitted tokens


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification round for a batch.

    Shapes:
      num_accepted    [B] int64: accepted draft tokens per row (0..num_draft_tokens[b]).
      output_tokens   [B, K+1] int64: accepted tokens, then the recovered or bonus token, then
                      PAD_TOKEN. Row b holds num_accepted[b] + 1 real tokens.
      num_emitted     [B] int64: num_accepted + 1.
      first_rejection [B] int64: position of the first rejected draft token; num_draft_tokens[b]
                      when every draft token was accepted (the next token is then a bonus).
      all_accepted    [B] bool: whether the last token of the row is a bonus token.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor
    num_emitted: torch.Tensor
    first_rejection: torch.Tensor
    all_accepted: torch.Tensor

    @property
    def next_tokens(self) -> torch.Tensor:
        """The recovered or bonus token of each row. -> [B] int64."""
        return self.output_tokens.gather(1, self.num_accepted[:, None]).squeeze(1)


def assemble_output(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
                    next_tokens: torch.Tensor, num_draft: torch.Tensor) -> VerifyResult:
    """Rows of accepted draft tokens, then the next token, then PAD_TOKEN. -> [B, K+1].

    Example: draft [7, 8, 9], num_accepted 1, next token 5 -> [7, 5, PAD, PAD].
    """
    batch_size, max_k = draft_tokens.shape
    positions = torch.arange(max_k + 1, device=draft_tokens.device)[None, :]
    padded_draft = torch.cat([draft_tokens, draft_tokens.new_full((batch_size, 1), PAD_TOKEN)], 1)
    output_tokens = torch.where(positions < num_accepted[:, None], padded_draft,
                                torch.full_like(padded_draft, PAD_TOKEN))
    output_tokens.scatter_(1, num_accepted[:, None], next_tokens[:, None])
    return VerifyResult(num_accepted=num_accepted, output_tokens=output_tokens,
                        num_emitted=num_accepted + 1, first_rejection=num_accepted,
                        all_accepted=num_accepted == num_draft)


def assemble_rows(draft_rows: list[list[int]], num_accepted: list[int],
                  next_tokens: list[int]) -> list[list[int]]:
    """:func:`assemble_output` on host lists: B draft rows of K ints -> B rows of K+1 ints."""
    return [row[:n] + [token] + [PAD_TOKEN] * (len(row) - n)
            for row, n, token in zip(draft_rows, num_accepted, next_tokens)]


def result_from_rows(num_accepted: list[int], output_tokens: list[list[int]],
                     num_draft: list[int], device: torch.device) -> VerifyResult:
    """A :class:`VerifyResult` built from host ints (rows as in :func:`assemble_rows`)."""
    accepted = torch.tensor(num_accepted, dtype=torch.int64, device=device)
    max_k = len(output_tokens[0]) - 1 if output_tokens else 0
    return VerifyResult(
        num_accepted=accepted,
        output_tokens=torch.tensor(output_tokens, dtype=torch.int64,
                                   device=device).reshape(len(output_tokens), max_k + 1),
        num_emitted=accepted + 1, first_rejection=accepted,
        all_accepted=torch.tensor([n == k for n, k in zip(num_accepted, num_draft)],
                                  dtype=torch.bool, device=device))
