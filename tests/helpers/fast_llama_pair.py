"""The tiny Llama pair the fast-path tests share, and their cache check.

VOCAB and PROMPTS (ragged rows), the module fixtures target and draft (tiny random Llamas), and
check_logits_after_random_extend_and_rewind: random extends and rewinds of a session checked
against fresh forwards. Used by test_fast_llama.py, test_step_graphs.py and test_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import tiny_llama

VOCAB = 97
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12, 13], [20], [30, 31, 32]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=11, hidden=64, layers=3)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(VOCAB, seed=12, hidden=32, layers=1)


def check_logits_after_random_extend_and_rewind(model, session, vocab_size: int,
                                               steps: int = 12,
                                               prompts: list[list[int]] | None = None) -> None:
    """Random extends and rewinds of ``session`` on ragged rows (``prompts``, by default three);
    after each extend every row's last logits must equal a fresh forward of ``model`` over that
    row's history (on the model's device)."""
    generator = torch.Generator().manual_seed(0)
    prompts = prompts or [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    num_rows = len(prompts)
    session.start(prompts)
    history = [list(p) for p in prompts]
    for _ in range(steps):
        n = int(torch.randint(1, 5, (1,), generator=generator))
        tokens = torch.randint(0, vocab_size, (num_rows, n), generator=generator)
        logits = session.extend(tokens.to(model.device))  # [B, n, V]
        for row in range(num_rows):
            history[row].extend(tokens[row].tolist())
            with torch.inference_mode():
                fresh = model(torch.tensor([history[row]], device=model.device)).logits[0, -1]
            torch.testing.assert_close(logits[row, -1], fresh, atol=1e-4, rtol=1e-4)
        rewind = [int(torch.randint(0, n + 1, (1,), generator=generator))
                  for _ in range(num_rows)]
        session.rewind(rewind)
        for row in range(num_rows):
            del history[row][len(history[row]) - rewind[row]:]
