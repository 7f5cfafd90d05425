"""engine/: the decoding loop's contract (lengths, stops, streaming, seeds, metrics).

The output law itself is tested in test_losslessness.py, the depth policies in
tests/policy/test_policy.py; here the fixtures are small Markov chains and the checks are exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verispec import (
    BatchOptions,
    Engine,
    GenerationConfig,
    MarkovLM,
    SamplingConfig,
)
from verispec.engine.metrics import GenerationMetrics
from verispec.errors import TokenOutOfRangeError
from verispec.models.fixtures import FixedDistributionLM
from verispec.proposers import DraftModelProposer
from verispec.proposers.base import DraftPlan
from verispec.sample.sampling import make_generator, sample, to_probs

from markov_chains import (
    GREEDY,
    PROMPTS,
    VOCAB_SIZE,
    _decoder,
    _noisy_draft,
    _plain_greedy,
    _target,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")


# --- max_new_tokens --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stops_exactly_at_max_new_tokens(k, max_new_tokens, temperature):
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=k, seed=3,
                              sampling=SamplingConfig(temperature=temperature))
    result = decoder.generate(PROMPTS, config)
    assert [len(row) for row in result.token_ids] == [max_new_tokens] * len(PROMPTS)
    assert result.finish_reasons == ["length"] * len(PROMPTS)
    assert result.metrics.num_emitted == max_new_tokens * len(PROMPTS)
    assert result.metrics.num_target_calls <= max_new_tokens
    # never drafts past the budget: a round drafts at most (remaining - 1) tokens
    assert result.metrics.num_drafted <= result.metrics.num_row_rounds * min(k, max_new_tokens - 1)
    if max_new_tokens == 1:
        assert result.metrics.num_drafted == 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9, 10])
def test_max_new_tokens_below_k_still_gives_the_greedy_prefix(max_new_tokens):
    decoder, target = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=8,
                              sampling=GREEDY, seed=0)
    result = decoder.generate(PROMPTS, config)
    assert result.token_ids == [_plain_greedy(target, p, max_new_tokens) for p in PROMPTS]


# --- stop tokens -----------------------------------------------------------------------------


def _mid_chunk_stop(sequence: list[int], chunk: int) -> tuple[int, int]:
    """A token whose first occurrence is inside a chunk of ``chunk`` tokens, not at its end."""
    for position, token in enumerate(sequence):
        if sequence.index(token) == position and position % chunk not in (0, chunk - 1):
            return token, position
    raise AssertionError(f"no mid-chunk first occurrence in {sequence}")


def test_stop_token_in_the_middle_of_an_accepted_chunk():
    # draft == target at temperature 0: every round accepts all k = 8 and emits 9 tokens, so the
    # stop token sits inside a round's accepted chunk, and the tokens after it were accepted too.
    target = _target(order=2, seed=5)
    decoder = Engine.from_draft_model(target, MarkovLM(target.table.clone(), 2))
    prompt = [4, 2]
    plain = _plain_greedy(target, prompt, 60)
    stop_token, position = _mid_chunk_stop(plain, 9)
    config = GenerationConfig(max_new_tokens=60, num_draft_tokens=8, sampling=GREEDY, seed=0,
                              stop_token_ids=(stop_token,))
    run = decoder.stream([prompt], config)
    chunks = [chunk.token_ids[0] for chunk in run]
    result = run.result()
    assert result.token_ids == [plain[: position + 1]]
    assert result.finish_reasons == ["stop"]
    assert chunks[-1][-1] == stop_token and stop_token not in chunks[-1][:-1]
    # the last round produced more tokens than were emitted: they were cut after the stop
    metrics = result.metrics
    assert metrics.num_accepted + metrics.num_row_rounds > metrics.num_emitted
    assert metrics.num_emitted == position + 1


@pytest.mark.parametrize("seed", range(8))
def test_stop_cuts_the_sampled_output_at_the_first_stop(seed):
    # Batch 1: until the stop, the rounds (and so the random draws) are the same as without a
    # stop token, so the output is the stop-free output cut after its first stop token.
    decoder, _ = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, seed=seed)
    free = decoder.generate([[3, 5]], config).token_ids[0]
    stop_token = free[len(free) // 3]
    stopped = decoder.generate([[3, 5]], replace(config, stop_token_ids=(stop_token,)))
    first = free.index(stop_token)
    assert stopped.token_ids == [free[: first + 1]]
    assert stopped.finish_reasons == ["stop"]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_stop_tokens_in_a_sampled_batch(k):
    decoder, _ = _decoder(order=1)
    stops = (2, 6)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k, seed=11,
                              stop_token_ids=stops)
    result = decoder.generate(PROMPTS * 4, config)
    reasons = set()
    for tokens, reason in zip(result.token_ids, result.finish_reasons):
        reasons.add(reason)
        hits = [i for i, t in enumerate(tokens) if t in stops]
        if reason == "stop":
            assert hits == [len(tokens) - 1]  # exactly one stop token, and it is the last
        else:
            assert reason == "length" and hits == [] and len(tokens) == 30
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    assert result.metrics.num_emitted == sum(map(len, result.token_ids))


def test_stop_token_as_the_first_generated_token():
    target = _target(seed=2)
    decoder = Engine.from_draft_model(target, _noisy_draft(target))
    first = _plain_greedy(target, [3, 5], 1)[0]
    config = GenerationConfig(max_new_tokens=10, num_draft_tokens=4, sampling=GREEDY, seed=0,
                              stop_token_ids=(first,))
    result = decoder.generate([[3, 5]], config)
    assert result.token_ids == [[first]] and result.finish_reasons == ["stop"]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_stop_token_ids_outside_the_vocabulary_are_refused_when_rows_join(speculative):
    """With min_new_tokens they would index the logits: refused as a typed error naming the
    field, the id and the vocabulary, by generate and by a Batch's add alike."""
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=4, stop_token_ids=(VOCAB_SIZE + 5,),
                              min_new_tokens=2, seed=0)
    match = f"stop_token_ids.*{VOCAB_SIZE + 5}.*\\[0, {VOCAB_SIZE}\\)"
    with pytest.raises(TokenOutOfRangeError, match=match):
        decoder.generate(PROMPTS, config, speculative=speculative)
    batch = decoder.batch(speculative)
    with pytest.raises(TokenOutOfRangeError, match=match):
        batch.add([[3, 5]], [config], [make_generator(0)])


# --- streaming and seeds ---------------------------------------------------------------------


@pytest.mark.parametrize("stops", [(), (4,)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_chunks_concatenate_to_generate(stops, temperature):
    decoder, _ = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=25, num_draft_tokens=3, seed=21,
                              stop_token_ids=stops,
                              sampling=SamplingConfig(temperature=temperature))
    generated = decoder.generate(PROMPTS, config)
    run = decoder.stream(PROMPTS, config)
    joined: list[list[int]] = [[] for _ in PROMPTS]
    previous_finished = [False] * len(PROMPTS)
    num_chunks = 0
    for chunk in run:
        num_chunks += 1
        assert len(chunk.token_ids) == len(PROMPTS)
        for row, (tokens, was_done) in enumerate(zip(chunk.token_ids, previous_finished)):
            assert not (was_done and tokens), "a finished row emitted tokens"
            joined[row].extend(tokens)
        assert all(now or not before for now, before in zip(chunk.finished, previous_finished))
        previous_finished = chunk.finished
    assert all(previous_finished)
    assert joined == generated.token_ids
    assert run.result().token_ids == generated.token_ids
    assert run.result().finish_reasons == generated.finish_reasons
    assert run.metrics.num_rounds == num_chunks == generated.metrics.num_rounds


def test_same_seed_same_output_different_seed_different_output():
    decoder, _ = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, seed=7)
    a = decoder.generate(PROMPTS, config)
    b = decoder.generate(PROMPTS, config)
    c = decoder.generate(PROMPTS, replace(config, seed=8))
    assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
    assert a.metrics.num_accepted == b.metrics.num_accepted
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8,
                                                                       top_k=6, top_p=0.9)],
                         ids=["t1", "truncated"])
def test_a_sampling_draft_draws_each_token_from_the_probs_it_reports(sampling):
    # the draft takes its round's uniforms in one draw; its tokens must be exactly those that
    # one sample.sampling.sample call per step, on the distributions it reports, gives from the same
    # generator, and the generator must end where those calls leave it
    target = _target(order=2)
    draft = _noisy_draft(target)
    session = DraftModelProposer(draft).start(PROMPTS)
    committed = [list(prompt) for prompt in PROMPTS]
    for round_index, k in enumerate((1, 3, 5, 2)):
        generator = make_generator(round_index)
        proposal = session.propose(DraftPlan.uniform(len(PROMPTS), k, sampling, generator))
        drafted = proposal.draft_tokens.tolist()  # [B][K]
        reference = make_generator(round_index)
        for step in range(k):
            probs = proposal.draft_probs[:, step]  # [B, V]
            fresh_logits = torch.stack([draft.next_logits(history + row[:step])
                                        for history, row in zip(committed, drafted)])
            assert torch.equal(probs, to_probs(fresh_logits, sampling))
            assert sample(probs, reference).tolist() == [row[step] for row in drafted]
        assert torch.equal(generator.get_state(), reference.get_state())
        num_accepted = [min(b, k) for b in range(len(PROMPTS))]  # ragged: 0, 1, 2
        session.commit(num_accepted, [round_index] * len(PROMPTS))
        for history, row, n in zip(committed, drafted, num_accepted):
            history += row[:n] + [round_index]


@pytest.mark.parametrize("seed", [0, None])
def test_generate_leaves_the_global_rng_untouched(seed):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    decoder, _ = _decoder()
    decoder.generate(PROMPTS, GenerationConfig(max_new_tokens=20, num_draft_tokens=3, seed=seed))
    decoder.generate(PROMPTS, GenerationConfig(max_new_tokens=5, seed=seed, sampling=GREEDY),
                     speculative=False)
    assert torch.equal(torch.get_rng_state(), before)


# --- metrics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_metrics_are_consistent(k, temperature):
    decoder, _ = _decoder(order=2)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=k, seed=5,
                              sampling=SamplingConfig(temperature=temperature),
                              stop_token_ids=(9,))
    result = decoder.generate(PROMPTS, config)
    m = result.metrics
    assert m.num_emitted == sum(map(len, result.token_ids))
    assert m.num_drafted > 0
    assert m.acceptance_rate == pytest.approx(m.num_accepted / m.num_drafted)
    assert 0.0 <= m.acceptance_rate <= 1.0
    rates = m.per_position_acceptance
    assert 1 <= len(rates) <= k
    assert all(0.0 <= rate <= 1.0 for rate in rates)
    assert m.num_reached[0] <= m.num_row_rounds  # rows tested at position 0 in some round
    # tested positions: each row-round tests its accepted prefix plus at most one rejection
    assert sum(m.num_reached) <= m.num_drafted
    assert 0 <= sum(m.num_reached) - sum(m.num_accepted_at) <= m.num_reached[0]
    assert sum(m.num_accepted_at) == m.num_accepted
    assert m.mean_accepted_length >= 1.0
    assert m.mean_accepted_length == pytest.approx((m.num_accepted + m.num_row_rounds)
                                                   / m.num_row_rounds)
    assert m.num_target_calls == m.num_rounds
    assert m.num_row_rounds >= m.num_rounds
    assert m.wall_time > 0 and m.draft_time >= 0 and m.target_time > 0
    as_dict = m.to_dict()
    assert as_dict["acceptance_rate"] == m.acceptance_rate
    assert len(as_dict["num_reached"]) == len(rates)


def test_token_acceptance_estimates_the_per_token_acceptance_probability():
    # Context-free draft and target: every tested draft token is accepted with probability
    # a = sum(min(p, q)) independently, the i.i.d. model of Leviathan et al. token_acceptance
    # must recover a at k = 8; acceptance_rate (accepted / drafted) must fall well below it,
    # since tokens after a rejection are drafted but never tested (the control).
    target_probs = torch.tensor([0.5, 0.3, 0.1, 0.1])
    draft_probs = torch.tensor([0.3, 0.3, 0.3, 0.1])
    a = float(torch.minimum(target_probs, draft_probs).sum())  # 0.8
    decoder = Engine.from_draft_model(FixedDistributionLM.from_probs(target_probs),
                                                  FixedDistributionLM.from_probs(draft_probs))
    # unseeded rows (rejection sampling, token-wise) drawing from a generator seeded here
    config = GenerationConfig(max_new_tokens=40, verification="token",
                              sampling=SamplingConfig(temperature=1.0))
    batch = decoder.batch(options=BatchOptions(num_draft_tokens=8))
    batch.add([[0]] * 400, [config] * 400, [torch.Generator().manual_seed(3)] * 400)
    while batch.rows:
        batch.step()
    m = batch.recorder.snapshot()
    tested = sum(m.num_reached)
    assert m.token_acceptance == pytest.approx(a, abs=4 * (a * (1 - a) / tested) ** 0.5)
    assert m.acceptance_rate < a - 0.15
    assert m.to_dict()["token_acceptance"] == m.token_acceptance


def test_plain_decoding_metrics():
    decoder, _ = _decoder()
    result = decoder.generate([[3, 5]], GenerationConfig(max_new_tokens=12, seed=0),
                              speculative=False)
    m = result.metrics
    assert m.num_drafted == 0 and m.num_accepted == 0
    assert m.mean_accepted_length == 1.0
    assert m.acceptance_rate == 0.0
    assert m.per_position_acceptance == ()
    assert m.num_target_calls == 12 and m.num_emitted == 12


def test_decoder_without_proposer_decodes_plainly():
    target = _target(order=2)
    result = Engine(target).generate(
        PROMPTS, GenerationConfig(max_new_tokens=15, sampling=GREEDY, seed=0))
    assert result.token_ids == [_plain_greedy(target, p, 15) for p in PROMPTS]
    assert result.metrics.num_drafted == 0 and result.metrics.mean_accepted_length == 1.0


def test_metrics_addition_sums_counters():
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=20, seed=1)
    options = BatchOptions(num_draft_tokens=4, cost_ratio=0.1)
    a = decoder.generate(PROMPTS, config, options=options).metrics
    b = decoder.generate(PROMPTS[:1], config, options=replace(options, num_draft_tokens=2)).metrics
    total = a + b
    for name in ("num_rounds", "num_row_rounds", "num_drafted", "num_accepted", "num_emitted",
                 "num_draft_steps", "num_target_calls"):
        assert getattr(total, name) == getattr(a, name) + getattr(b, name), name
    for name in ("draft_time", "target_time", "verify_time", "wall_time"):
        assert getattr(total, name) == pytest.approx(getattr(a, name) + getattr(b, name))
    assert total.num_reached == tuple(x + y for x, y in zip(a.num_reached, b.num_reached))
    assert total.num_accepted_at == tuple(x + y for x, y in zip(a.num_accepted_at,
                                                               b.num_accepted_at))
    assert total.acceptance_rate == pytest.approx(
        (a.num_accepted + b.num_accepted) / (a.num_drafted + b.num_drafted))
    assert total.fixed_cost_ratio == 0.1
    assert sum([a, b]) == total  # sum() starts from 0
    assert sum([a, b], GenerationMetrics()) == total
    assert (a + replace(b, fixed_cost_ratio=0.2)).fixed_cost_ratio is None  # they differ


def test_empty_metrics_is_the_identity_of_addition():
    # engine/metrics.py documents `sum(..., GenerationMetrics())` as a way to add metrics up
    # exactly; that needs GenerationMetrics() to be neutral, fixed_cost_ratio included. Regression:
    # the sum once dropped m's fixed_cost_ratio (None != 0.1 -> None), silently switching
    # modelled_speedup from the configured ratio to the measured one.
    decoder, _ = _decoder()
    config = GenerationConfig(max_new_tokens=10, seed=1)
    m = decoder.generate(PROMPTS, config,
                         options=BatchOptions(num_draft_tokens=3, cost_ratio=0.1)).metrics
    assert GenerationMetrics() + m == m, "GenerationMetrics() + m lost m.fixed_cost_ratio"
    assert m + GenerationMetrics() == m
    assert m.modelled_speedup == (GenerationMetrics() + m).modelled_speedup
