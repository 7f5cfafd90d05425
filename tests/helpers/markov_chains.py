"""Small Markov-chain models for the engine and policy tests: a random target and a draft that
often, not always, agrees with it."""

from __future__ import annotations

import torch

from verispec import Engine, MarkovLM, SamplingConfig
from verispec.sample.sampling import make_generator

VOCAB_SIZE = 10
PROMPTS = [[3, 5], [1], [7, 7, 2, 0]]
GREEDY = SamplingConfig(temperature=0)


def _target(order: int = 1, seed: int = 0) -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(seed), order=order, zero_fraction=0.2)


def _noisy_draft(target: MarkovLM, seed: int = 1, scale: float = 1.0) -> MarkovLM:
    """A draft that often, not always, agrees with the target."""
    noise = torch.randn(target.table.shape, generator=make_generator(seed))
    return MarkovLM(target.table + scale * noise, order=target.order)


def _decoder(order: int = 1) -> tuple[Engine, MarkovLM]:
    target = _target(order)
    return Engine.from_draft_model(target, _noisy_draft(target)), target


def _plain_greedy(model: MarkovLM, prompt: list[int], num_new: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_new):
        context.append(int(model.next_logits(context).argmax()))
    return context[len(prompt):]
