"""A model written to the documented protocol alone (models/base.py: LanguageModel and the six
LMSession verbs, no optional ability) decodes: plain, speculative, rows joining and leaving.

The session below implements exactly the verbs LMSession declares, so a verb the engine calls
but the protocol does not declare fails here first.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.models.base import AdoptsRows, LMSession
from verispec.sample.sampling import make_generator

VOCAB_SIZE = 11
GREEDY = SamplingConfig(temperature=0.0)


class BigramSession:
    """Rows of token ids; the logits after a token are its row of the model's table."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [V, V]: logits of the next token given the last one
        self.rows: list[list[int]] = []

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        self.rows = [list(p) for p in prompts]

    def extend(self, tokens: torch.Tensor, logits_at: Sequence[int] | None = None
               ) -> torch.Tensor:
        for row, new in zip(self.rows, tokens.tolist()):
            row.extend(new)
        logits = self.table[tokens]  # [B, n, V]
        if logits_at is None:
            return logits
        return logits[torch.arange(len(self.rows)), torch.tensor(list(logits_at))]

    def feed(self, rows: Sequence[Sequence[int]]) -> None:
        for row, new in zip(self.rows, rows):
            row.extend(int(t) for t in new)

    def rewind(self, num_tokens: torch.Tensor | Sequence[int]) -> None:
        counts = num_tokens.tolist() if isinstance(num_tokens, torch.Tensor) else num_tokens
        for row, count in zip(self.rows, counts):
            del row[len(row) - int(count):]

    def add_rows(self, prompts: Sequence[Sequence[int]], ride: bool = False) -> bool:
        self.rows += [list(p) for p in prompts]
        return False

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[r] for r in rows]


class BigramLM:
    """A LanguageModel: vocab_size, device, max_positions and new_session, nothing else."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = 3.0 * torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=generator)
        self.vocab_size = VOCAB_SIZE
        self.device = torch.device("cpu")
        self.max_positions = None

    def new_session(self) -> BigramSession:
        return BigramSession(self.table)


def _greedy_reference(table: torch.Tensor, prompt: list[int], num_tokens: int) -> list[int]:
    tokens, last = [], prompt[-1]
    for _ in range(num_tokens):
        last = int(table[last].argmax())
        tokens.append(last)
    return tokens


def _verbs(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_session_implements_exactly_the_documented_verbs():
    assert _verbs(BigramSession) == _verbs(LMSession)
    assert _verbs(LMSession) == {"start", "extend", "feed", "rewind", "add_rows", "keep_rows"}
    session = BigramLM(0).new_session()
    assert isinstance(session, LMSession) and not isinstance(session, AdoptsRows)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_protocol_only_model_decodes_greedy_exactly(k):
    target, draft = BigramLM(1), BigramLM(2)
    decoder = Engine.from_draft_model(target, draft)
    prompts = [[1, 2, 3], [4], [5, 6]]
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=k, sampling=GREEDY)
    result = decoder.generate(prompts, config)
    expected = [_greedy_reference(target.table, p, 12) for p in prompts]
    assert result.token_ids == expected
    assert result.metrics.num_rounds < 3 * 12  # it drafted: fewer rounds than plain decoding
    # control: a draft that is the target keeps every draft token
    same = Engine.from_draft_model(target, target).generate(prompts, config)
    assert same.token_ids == expected and same.metrics.acceptance_rate == 1.0


def test_rows_join_and_leave_a_protocol_only_batch():
    target, draft = BigramLM(3), BigramLM(4)
    batch = Engine.from_draft_model(target, draft).batch()
    config = GenerationConfig(max_new_tokens=8, num_draft_tokens=3, sampling=GREEDY)
    first = batch.add([[1, 2], [3]], [config] * 2, [make_generator(0)] * 2)
    batch.step()
    batch.remove([first[1]])  # leaves: keep_rows
    (joined,) = batch.add([[7, 8]], [config], [make_generator(0)])  # joins: add_rows
    assert batch.start_prefill([1, 2, 3]) is None  # no AdoptsRows: a long prompt joins whole
    while batch.rows:
        batch.step()
    assert first[0].token_ids == _greedy_reference(target.table, [1, 2], 8)
    assert joined.token_ids == _greedy_reference(target.table, [7, 8], 8)
    assert first[1].finish_reason == "cancelled"
