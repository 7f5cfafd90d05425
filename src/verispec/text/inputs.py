"""A prompt checked and encoded for the engine (PreparedRow), and what a TextBatch asks of the
Decoder that prepares its rows (RowPreparer: the Decoder, text/decoder.py, which imports the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import GenerationConfig
from ..engine.constraints import ConstraintSet


@dataclass(frozen=True)
class PreparedRow:
    """One prompt ready for the engine (Decoder.prepare): token ids, config, stop strings,
    grammar (None: unconstrained)."""

    prompt_ids: list[int]
    config: GenerationConfig
    stop: tuple[str, ...]
    constraints: ConstraintSet | None


class RowPreparer(Protocol):
    """What a TextBatch calls on its Decoder: ``prepare`` (Decoder.prepare, a prompt's checks
    and encoding) and the ``tokenizer`` its rows' text is decoded with."""

    tokenizer: Any

    def prepare(self, prompt: str | Sequence[int], **settings: Any) -> PreparedRow: ...
