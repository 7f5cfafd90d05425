"""What a llama.cpp session reads from its model and context: LlamaCpp is LlamaCppLM, Context
is its llama_context (both model.py, which builds the session and so cannot be imported by it).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch


class Context(Protocol):
    """A llama_context with room for ``num_rows`` sequences (model._Context)."""

    num_rows: int
    capacity: int  # tokens per llama_decode call
    num_logits: int  # logits per position (the model's, >= the session's vocab_size)

    def decode(self, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
               logits: np.ndarray) -> torch.Tensor | None: ...

    def remove(self, row: int, start: int) -> None: ...


class LlamaCpp(Protocol):
    """A LanguageModel on llama.cpp (model.LlamaCppLM): one session live at a time."""

    vocab_size: int
    max_positions: int
    uniform_passes: bool  # LlamaCppConfig.uniform_passes, for a target

    def context(self, session: Any, num_rows: int) -> Context: ...

    def check_live(self, session: Any) -> None: ...
