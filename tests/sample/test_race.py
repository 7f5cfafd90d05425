"""sample/seeded.py's race against the first arrival over every clock of a position, drawn whole.

Legend: V vocabulary, N blocks of clocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.sample.sampling import make_generator
from verispec.sample.seeded import RaceClocks, race, stream_key

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.mark.parametrize("vocab", [1000, 4096])  # 1000: a last block short of 32 tokens
def test_the_race_is_the_first_arrival_over_every_clock(vocab):
    gen = make_generator(11)
    for trial in range(20):
        probs = torch.softmax(torch.randn(vocab, generator=gen) * 2.0, -1)
        probs[torch.rand(vocab, generator=gen) < 0.2] = 0.0  # tokens top-p or a mask dropped
        clocks = RaceClocks(stream_key(trial), trial, vocab)
        every = clocks.blocks(list(range(clocks.num_blocks))).reshape(-1)[:vocab]  # [V]
        with np.errstate(divide="ignore"):
            arrivals = every / probs.double().numpy()
        assert race(probs, clocks) == int(arrivals.argmin())


def test_negative_control_other_clocks_give_other_winners():
    # the comparison above can fail: the same probabilities raced on the next position's
    # clocks (what a race keyed one position off would read) pick other tokens
    probs = torch.full((4096,), 1.0 / 4096)
    winners = {race(probs, RaceClocks(stream_key(1), position, 4096)) for position in range(8)}
    assert len(winners) > 1
