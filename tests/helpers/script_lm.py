"""A fixture language model that follows a script text in its own vocabulary.

ScriptLM over a PieceText: after any sequence, it finds the longest suffix (up to
MATCH_BYTES) of the sequence's text in its script and puts ``sharpness`` on the first token of
its own encoding of the script's continuation there (a continuation may begin inside a
character: byte tokens). Elsewhere its logits are fixed noise. Two of them over different
vocabularies and one script (or a draft's edited copy) make a cross-vocabulary pair whose
greedy drafts are often right: acceptance is seen, and so are the rejections and rewinds of
the places where the scripts or the tokenizations part. A real session: ragged rows, exact
rewind.

Legend: B batch, n fed tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.models.base import logits_columns

from token_texts import PieceText

MATCH_BYTES = 12


class ScriptLM:
    def __init__(self, text: PieceText, script: str, sharpness: float = 6.0,
                 seed: int = 0) -> None:
        self.text = text
        self.script = script.encode() * 2  # cyclic: the end continues with the start
        self.sharpness = sharpness
        self.vocab_size = text.vocab_size
        self.device = torch.device("cpu")
        self.max_positions: int | None = None
        self.noise = torch.randn(text.vocab_size, generator=torch.Generator().manual_seed(seed))

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        """Logits [V] after the token sequence ``context``."""
        data = b"".join(self.text.piece(token_id) for token_id in context)[-MATCH_BYTES:]
        logits = self.noise.clone()
        for length in range(len(data), 0, -1):
            at = self.script.find(data[-length:])
            if at >= 0:
                rest = self.script[at + length: at + length + MATCH_BYTES]
                logits[self.text.encode_bytes(rest)[0]] += self.sharpness
                break
        return logits

    def new_session(self) -> ScriptSession:
        return ScriptSession(self)


class ScriptSession:
    """Each row's token history (LMSession)."""

    def __init__(self, model: ScriptLM) -> None:
        self.model = model
        self.rows: list[list[int]] = []

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.rows = [list(prompt) for prompt in prompts]

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        out = []
        for row, new in zip(self.rows, tokens.tolist()):
            steps = []
            for token in new:
                row.append(token)
                window = self.model.max_positions
                assert window is None or len(row) <= window, "a row outgrew the window"
                steps.append(self.model.next_logits(row))
            out.append(torch.stack(steps))
        return logits_columns(torch.stack(out), logits_at)  # [B, n, V] or [B, V]

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        for row, new in zip(self.rows, rows):
            row += list(new)

    def rewind(self, num_tokens: Sequence[int]) -> None:
        for row, n in zip(self.rows, list(num_tokens)):
            assert 0 <= int(n) <= len(row)
            del row[len(row) - int(n):]

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        self.rows += [list(prompt) for prompt in prompts]
        return False

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[row] for row in rows]
