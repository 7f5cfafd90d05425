"""A fault of one row fails that row alone: its batch mates' tokens are exactly their tokens alone.

On the demo pair (real models), rows of one engine.batch.Batch: greedy, seeded (races on keyed
clocks) and unseeded sampled rows with generators of their own (block and token-wise
rejection sampling), next to a row made to fault through a real per-row hook: its logit
processing turns NaN (the target's and the draft's: a NonFiniteError of that row's own), or its
proposal breaks the draft contract for it (a DraftContractError raised inside its
verification group's one call, which draws the group's random numbers first: the others must
draw the same numbers again). The faulty row ends with finish_reason "error" and its typed
error; every other row's tokens equal the same row alone. Through the library
(Decoder.generate over a list, TextBatch): a grammar with a dead end (a genuine fault of the
request's own) and a row whose text fails; a single prompt still raises its typed error. On
the CPU, and on a CUDA device where there is one.
"""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec import Engine, GenerationConfig, PenaltyConfig, SamplingConfig
from verispec.errors import ConstraintDeadEnd, DraftContractError, NonFiniteError
from verispec.proposers.base import Proposal
from verispec.sample.sampling import make_generator

pytestmark = pytest.mark.usefixtures("single_thread_torch")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.fixture(scope="module", params=["cpu", CUDA])
def decoder(request, demo_decoder):
    """The demo pair on the CPU, and on a CUDA device where there is one (its fast path, step
    graphs and CUDA generators)."""
    return demo_decoder if request.param == "cpu" else verispec.load(device="cuda")

GREEDY, HOT = SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.9)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "for i in range("]
# a grammar with an empty language after its first token: "a", then a rule that never ends
DEAD_END = {"type": "grammar", "grammar": 'start: "a" x\nx: x "b"'}


def _ids(decoder, prompt: str) -> list[int]:
    return decoder.tokenizer.encode(prompt)


def _run(batch, rows) -> list[list[int]]:
    while batch.rows:
        batch.step()
    return [row.token_ids for row in rows]


def _alone(engine, prompt, config, seed) -> list[int]:
    batch = engine.batch()
    (row,) = batch.add([prompt], [config], [make_generator(seed)])
    return _run(batch, [row])[0]


def _poison_shaping(row, after: int) -> None:
    """The row's logit processing (the target's and the draft's) gives NaN once it has ``after``
    tokens: a fault of that row's own, through the per-row hook the engine calls."""
    process_logits, process_draft = row.process_logits, row.process_draft

    def poisoned_logits(logits, drafted=()):
        processed = process_logits(logits, drafted)
        return processed if row.num_generated < after else processed.fill_(float("nan"))

    def poisoned_draft(logits, drafted):
        processed = process_draft(logits, drafted)
        return processed if row.num_generated < after else processed.fill_(float("nan"))

    row.process_logits, row.process_draft = poisoned_logits, poisoned_draft


def _configs(verification: str = "block") -> dict[str, GenerationConfig]:
    common = {"max_new_tokens": 40, "num_draft_tokens": 3, "verification": verification}
    return {"greedy": GenerationConfig(sampling=GREEDY, **common),
            "seeded": GenerationConfig(sampling=HOT, seed=7, **common),
            "sampled": GenerationConfig(sampling=HOT, **common),
            "faulty": GenerationConfig(sampling=HOT, **common,
                                       penalty=PenaltyConfig(presence_penalty=0.5))}


SEEDS = {"greedy": 1, "seeded": 7, "sampled": 11, "faulty": 13}


def test_a_row_whose_logits_turn_nan_fails_alone_and_its_mates_are_unchanged(decoder):
    engine, configs = decoder.engine, _configs()
    prompts = dict(zip(configs, (_ids(decoder, p) for p in PROMPTS)))
    alone = {name: _alone(engine, prompts[name], configs[name], SEEDS[name])
             for name in ("greedy", "seeded", "sampled")}
    batch = engine.batch()
    rows = dict(zip(configs, batch.add([prompts[name] for name in configs],
                                       list(configs.values()),
                                       [make_generator(SEEDS[name]) for name in configs])))
    _poison_shaping(rows["faulty"], after=5)
    _run(batch, rows.values())
    faulty = rows["faulty"]
    assert faulty.finish_reason == "error" and isinstance(faulty.error, NonFiniteError)
    assert 5 <= faulty.num_generated < 40  # it ran until its fault, then took nothing
    for name, tokens in alone.items():
        assert rows[name].finish_reason == "length", name
        assert rows[name].token_ids == tokens, name


class _ContractBreaker:
    """The draft model's proposer, except that for the row drawing from ``generator`` it
    reports probability 0 for its first draft token from its ``after``-th token on: a
    proposal that breaks the draft contract for that row alone, found by its verification."""

    def __init__(self, proposer, generator: torch.Generator, after: int) -> None:
        self.proposer, self.generator, self.after = proposer, generator, after
        self.vocab_size, self.device = proposer.vocab_size, proposer.device
        self.max_positions = proposer.max_positions
        self.rows = None  # the batch's rows, for the faulty row's progress

    def start(self, prompts):
        breaker = self

        class Session:
            def __init__(self, inner) -> None:
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def propose(self, plan, constraint=None):
                proposal = self.inner.propose(plan, constraint)
                rows = [b for b, g in enumerate(plan.generators) if g is breaker.generator]
                if not rows or breaker.rows[rows[0]].num_generated < breaker.after:
                    return proposal
                probs = proposal.draft_probs.clone()
                probs[rows[0], 0, proposal.draft_tokens[rows[0], 0]] = 0.0
                return Proposal(proposal.draft_tokens, probs, proposal.num_proposed)

        return Session(self.proposer.start(prompts))


@pytest.mark.parametrize("verification", ["block", "token"])
def test_a_row_whose_verification_fails_leaves_its_rule_mates_draws_unchanged(decoder,
                                                                             verification):
    # three unseeded rows under one rule: verified in one call that draws all their numbers
    # first; the call raises for the faulty row, and the others must get what they would have
    engine, config = decoder.engine, _configs(verification)["sampled"]
    prompts = [_ids(decoder, p) for p in PROMPTS[:3]]
    alone = [_alone(engine, prompt, config, seed) for prompt, seed in zip(prompts[:2], (21, 22))]
    faulty_generator = make_generator(23)
    breaker = _ContractBreaker(engine.proposer, faulty_generator, after=4)
    batch = Engine(engine.target, breaker).batch()
    rows = batch.add(prompts, [config] * 3, [make_generator(21), make_generator(22),
                                             faulty_generator])
    breaker.rows = batch.rows
    while batch.rows:
        breaker.rows = batch.rows  # rows leave and move between rounds
        batch.step()
    assert rows[2].finish_reason == "error" and isinstance(rows[2].error, DraftContractError)
    assert [row.token_ids for row in rows[:2]] == alone
    assert all(row.finish_reason == "length" for row in rows[:2])


def test_a_prompt_whose_grammar_dead_ends_fails_alone_in_a_list(decoder):
    settings = {"max_new_tokens": 24, "temperature": [0.0, 0.0, 0.8], "seed": [None, None, 5]}
    alone = [decoder.generate(PROMPTS[0], max_new_tokens=24),
             decoder.generate(PROMPTS[2], max_new_tokens=24, temperature=0.8, seed=5)]
    out = decoder.generate(PROMPTS[:3], response_format=[None, DEAD_END, None], **settings)
    assert out[1].finish_reason == "error" and isinstance(out[1].error, ConstraintDeadEnd)
    assert "response_format" in str(out[1].error)
    assert [(c.text, c.finish_reason, c.error) for c in (out[0], out[2])] == [
        (c.text, c.finish_reason, None) for c in alone]
    with pytest.raises(ConstraintDeadEnd):  # one prompt: its typed error is raised
        decoder.generate(PROMPTS[1], max_new_tokens=24, response_format=DEAD_END)


def test_a_rows_text_fault_fails_it_alone(decoder):
    # the tokenizer side: the row's text fails (here its feed raises) after two rounds
    alone = [decoder.generate(prompt, max_new_tokens=20).text for prompt in PROMPTS[:2]]
    batch = decoder.open_batch()
    rows = [batch.add(prompt, tag=i, max_new_tokens=20) for i, prompt in enumerate(PROMPTS[:3])]
    feed, calls = rows[2].text.feed, []

    def failing_feed(token_ids, final):
        calls.append(token_ids)
        if len(calls) > 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a bad byte")
        return feed(token_ids, final)

    rows[2].text.feed = failing_feed
    texts = {i: "" for i in range(3)}
    while len(batch):
        for row, delta in batch.step():
            texts[row.tag] += delta
    assert rows[2].completion.finish_reason == "error"
    assert isinstance(rows[2].completion.error, UnicodeDecodeError)
    assert [rows[i].completion.text for i in range(2)] == [texts[0], texts[1]] == alone
    assert not batch.batch.rows  # the failed row left the engine's batch too
