"""Batched generation and continuous batching: rows with settings of their own, rows joining and
leaving between rounds, and each row's output independent of the others.

Three layers: the engine's engine.batch.Batch on fixture models (exact arithmetic, so "unchanged"
means equal token for token, and the G-test on a batch mixing temperatures, with its negative
control); the library's Decoder.generate over a list of prompts on real models (greedy text of
each prompt in a batch of mixed lengths == the prompt alone, k in {1, 2, 4}); the server's
continuous batching is tested in tests/server/test_server_batching.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verispec
from verispec import BatchOptions, Engine, GenerationConfig, SamplingConfig
from verispec.engine.batch import fill_from_the_end
from verispec.errors import ConfigError
from verispec.models.fixtures import MarkovLM
from verispec.models.hf.adapter import TransformersLM
from verispec.policy.base import AdaptivePolicy
from verispec.policy.scheduler import policy_evidence
from verispec.sample.sampling import make_generator
from verispec.text.demo import heldout_prompts

from injected_rules import _accept_all, _residual, _rule_verify, inject_verify
from law_checks import (
    PROMPT,
    VOCAB_SIZE,
    _assert_control_rejected,
    _assert_target_law,
    _check_law,
    _pair,
)
from tiny_models import build_tokenizer, save_model, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0.0)
HOT, COOL = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.6)


def _fixture_decoder(seed: int = 3) -> Engine:
    generator = torch.Generator().manual_seed(seed)
    target = MarkovLM.random(VOCAB_SIZE, generator, order=2)
    noisy = target.table + 0.8 * torch.randn(target.table.shape, generator=generator)
    return Engine.from_draft_model(target, MarkovLM(noisy, order=2))


def _run(batch, rows, until=None):
    """Step ``batch`` until ``rows`` (or all) are finished, or ``until`` rounds."""
    rounds = 0
    while batch.rows and (until is None or rounds < until):
        batch.step()
        rounds += 1
    return [row.token_ids for row in rows]


def _alone(decoder, prompt, config, seed):
    batch = decoder.batch()
    (row,) = batch.add([prompt], [config], [make_generator(seed)])
    return _run(batch, [row])[0]


# --- the engine's batch: per-row settings, joins and leaves ----------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rows_joining_and_leaving_leave_the_other_rows_unchanged(k):
    decoder = _fixture_decoder()
    greedy = GenerationConfig(max_new_tokens=20, num_draft_tokens=k, sampling=GREEDY)
    hot = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, sampling=HOT)
    cool = GenerationConfig(max_new_tokens=16, num_draft_tokens=k, sampling=COOL)
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6, 7, 0, 1], "d": [2, 2]}
    settings = {"a": (greedy, 11), "b": (hot, 12), "c": (cool, 13), "d": (hot, 14)}
    alone = {name: _alone(decoder, prompts[name], *settings[name]) for name in prompts}

    batch = decoder.batch()
    rows = dict(zip("ab", batch.add([prompts["a"], prompts["b"]],
                                    [settings["a"][0], settings["b"][0]],
                                    [make_generator(11), make_generator(12)])))
    _run(batch, [], until=2)
    # c joins mid-generation; then a leaves (cancelled) and d joins
    rows["c"], = batch.add([prompts["c"]], [cool], [make_generator(13)])
    _run(batch, [], until=2)
    batch.remove([rows["a"]])
    rows["d"], = batch.add([prompts["d"]], [hot], [make_generator(14)])
    _run(batch, [])
    assert rows["a"].finish_reason == "cancelled"
    assert rows["a"].token_ids == alone["a"][: len(rows["a"].token_ids)]
    for name in "bcd":
        assert rows[name].token_ids == alone[name], name
        assert rows[name].finish_reason == "length"
    assert rows["b"].metrics.num_target_calls >= 24 // (k + 1)


def test_a_seeded_row_is_the_same_whatever_else_is_in_the_batch():
    decoder = _fixture_decoder(seed=5)
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=3, sampling=HOT)
    alone = _alone(decoder, [3, 1], config, seed=42)
    for others in (1, 5):
        batch = decoder.batch()
        rows = batch.add([[7]] * others + [[3, 1]], [config] * (others + 1),
                         [make_generator(100 + i) for i in range(others)] + [make_generator(42)])
        assert _run(batch, rows)[-1] == alone
    # the negative control: another seed in the same place gives other tokens
    batch = decoder.batch()
    (row,) = batch.add([[3, 1]], [config], [make_generator(43)])
    assert _run(batch, [row])[0] != alone


def test_rows_with_different_max_new_tokens_and_stops_end_on_their_own():
    decoder = _fixture_decoder()
    configs = [GenerationConfig(max_new_tokens=n, num_draft_tokens=2, sampling=GREEDY,
                                stop_token_ids=stops)
               for n, stops in ((3, ()), (9, ()), (30, (0, 1)))]
    batch = decoder.batch()
    rows = batch.add([[1, 2]] * 3, configs, [make_generator(0)] * 3)
    _run(batch, rows)
    assert [len(row.token_ids) for row in rows[:2]] == [3, 9]
    assert rows[2].finish_reason == "stop" and rows[2].token_ids[-1] in (0, 1) or (
        len(rows[2].token_ids) == 30)
    assert not batch.rows  # every finished row left the batch


# --- exactness: the G-test on one batch that mixes temperatures ------------------------------

NUM_ROWS = 12_000  # per temperature


def _mixed_temperature_tokens(k: int, seed: int, verification: str = "block"):
    """Tokens [N, k+1] per temperature of one batch of 2 N interleaved rows; samplings; pair."""
    pair = _pair("reversed")
    decoder = Engine.from_draft_model(pair.target, pair.draft)
    generators = {"hot": make_generator(seed), "cool": make_generator(seed + 1)}
    samplings = {"hot": pair.sampling(1.0), "cool": pair.sampling(0.6)}
    names = ["hot", "cool"] * NUM_ROWS  # interleaved: every round mixes both
    batch = decoder.batch()
    rows = batch.add([PROMPT] * len(names),
                     [GenerationConfig(max_new_tokens=k + 1, num_draft_tokens=k,
                                       sampling=samplings[name], verification=verification)
                      for name in names],
                     [generators[name] for name in names])
    _run(batch, rows)
    return {name: np.array([row.token_ids for row, n in zip(rows, names) if n == name])
            for name in generators}, samplings, pair


@pytest.mark.parametrize("k", [2])
def test_a_batch_mixing_temperatures_has_each_rows_target_law(k):
    tokens, samplings, pair = _mixed_temperature_tokens(k, seed=2024)
    for name in ("hot", "cool"):
        _assert_target_law(f"mixed-temperatures {name} k={k}",
                           _check_law(pair.target, tokens[name], samplings[name]))


def test_the_mixed_temperature_g_test_rejects_a_broken_rule(monkeypatch):
    inject_verify(monkeypatch, _rule_verify(_accept_all, _residual))  # the token-wise rule's
    tokens, samplings, pair = _mixed_temperature_tokens(2, seed=2025, verification="token")
    _assert_control_rejected("mixed-temperatures accept-all hot",
                             _check_law(pair.target, tokens["hot"], samplings["hot"]))


# --- the library: Decoder.generate over a list of prompts ------------------------------------

PROMPTS = ["def add(a, b):", "x", "import os\n\nclass Stack:\n    def push(self, item):",
           "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory):
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("batching_models")
    target = save_model(tiny_llama(len(tokenizer), seed=1), tokenizer, root / "target")
    draft = save_model(tiny_llama(len(tokenizer), seed=2, layers=1), tokenizer, root / "draft")
    return {backend: verispec.load(target, draft, backend=backend)
            for backend in ("fast", "transformers")}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_batched_greedy_text_equals_each_prompt_alone(tiny_decoder, backend, k):
    decoder = tiny_decoder[backend]
    batched = decoder.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=k, ignore_eos=True)
    for prompt, completion in zip(PROMPTS, batched):
        alone = decoder.generate(prompt, max_new_tokens=24, speculative=False, ignore_eos=True)
        assert completion.token_ids == alone.token_ids, prompt
        assert completion.metrics.num_emitted == 24


@pytest.mark.parametrize("k", [1, 2, 4])
def test_demo_pair_batched_greedy_text_equals_each_prompt_alone(demo_decoder, k):
    batched = demo_decoder.generate(PROMPTS, max_new_tokens=32, num_draft_tokens=k)
    for prompt, completion in zip(PROMPTS, batched):
        alone = demo_decoder.generate(prompt, max_new_tokens=32, num_draft_tokens=k)
        assert completion.text == alone.text, prompt


@pytest.fixture(scope="module")
def twelve_alone(demo_decoder):
    """Twelve held-out prompts of 6-63 tokens and each one's plain greedy text, sent alone."""
    prompts = heldout_prompts()[:12]
    return prompts, [demo_decoder.generate(prompt, max_new_tokens=24, speculative=False).text
                     for prompt in prompts]


@pytest.mark.parametrize("k", [1, 4])
def test_demo_pair_batch_with_a_long_prompt_greedy_text_equals_plain_decoding_alone(
        demo_decoder, twelve_alone, k):
    """A ~300-token prompt among eleven of 6-63: the rows attend in ranges, each over its own
    keys (models/attention.segments_by_length), and no row's text may change."""
    prompts, alone = twelve_alone
    long_prompt = " ".join(heldout_prompts()[12:20])
    assert len(demo_decoder.tokenizer.encode(long_prompt)) > 200
    prompts = prompts[:5] + [long_prompt] + prompts[6:]
    alone = alone[:5] + [demo_decoder.generate(long_prompt, max_new_tokens=24,
                                               speculative=False).text] + alone[6:]
    batched = demo_decoder.generate(prompts, max_new_tokens=24, num_draft_tokens=k,
                                    adaptive=None)
    assert [completion.text for completion in batched] == alone


@pytest.mark.parametrize("k", [1, 2, 4])
def test_demo_pair_batch_of_twelve_greedy_text_equals_plain_decoding_alone(
        demo_decoder, twelve_alone, k):
    """Twelve rows: verification passes take attention's matmul path (models/attention.py),
    prompts and plain steps the flash kernel; no row's text may change."""
    prompts, alone = twelve_alone
    batched = demo_decoder.generate(prompts, max_new_tokens=24, num_draft_tokens=k,
                                    adaptive=None)
    assert [completion.text for completion in batched] == alone
    assert all(completion.metrics.num_drafted > 0 for completion in batched)


def test_per_row_settings_and_seeds(tiny_decoder):
    decoder = tiny_decoder["fast"]
    out = decoder.generate(PROMPTS[:3], max_new_tokens=[5, 9, 7], temperature=[0.0, 1.0, 0.8],
                           seed=[None, 7, 8], stop=[None, ["zzz"], None], ignore_eos=True)
    assert [len(c.token_ids) for c in out] == [5, 9, 7]
    assert out[1].text == decoder.generate(PROMPTS[1], max_new_tokens=9, temperature=1.0,
                                           seed=7, ignore_eos=True).text
    # an int seed seeds prompt i with seed + i
    seeded = decoder.generate(PROMPTS[:2], max_new_tokens=8, temperature=1.0, seed=3,
                              ignore_eos=True)
    assert seeded[1].text == decoder.generate(PROMPTS[1], max_new_tokens=8, temperature=1.0,
                                              seed=4, ignore_eos=True).text


def test_batched_stream_yields_each_rows_deltas(tiny_decoder):
    decoder = tiny_decoder["fast"]
    stream = decoder.stream_batch(PROMPTS[:2], max_new_tokens=12, ignore_eos=True)
    texts = ["", ""]
    for index, delta in stream:
        texts[index] += delta
    assert texts == [c.text for c in stream.completions]
    assert texts == [c.text for c in decoder.generate(PROMPTS[:2], max_new_tokens=12,
                                                      ignore_eos=True)]


def test_a_per_row_list_of_the_wrong_length_is_refused(tiny_decoder):
    with pytest.raises(ConfigError, match="max_new_tokens has 2 values for 3 prompts"):
        tiny_decoder["fast"].generate(PROMPTS[:3], max_new_tokens=[4, 5])


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_a_long_prompt_joins_a_batch_whose_cache_is_smaller(tiny_decoder, backend):
    # the running row's cache holds 128 positions; the joining prompt needs room for 2 * 100,
    # more than that and less than double it: the cache grows, keeping the running row
    decoder = tiny_decoder[backend]
    long_prompt = [5, 6, 7, 8] * 25
    batch = decoder.open_batch()
    short = batch.add(PROMPTS[0], max_new_tokens=6, ignore_eos=True)
    batch.step()
    joined = batch.add(long_prompt, max_new_tokens=6, ignore_eos=True)
    _finish_and_compare_alone(decoder, batch,
                              {PROMPTS[0]: (short, 6), tuple(long_prompt): (joined, 6)})


def _finish_and_compare_alone(decoder, batch, rows) -> None:
    """Step ``batch`` until every row of ``rows`` {prompt: (text row, max_new_tokens)} is
    complete (token prompts as tuples); each one's greedy text must equal its prompt generated
    alone."""
    while any(row.completion is None for row, _ in rows.values()):
        batch.step()
    for prompt, (row, max_new_tokens) in rows.items():
        alone = decoder.generate(list(prompt) if isinstance(prompt, tuple) else prompt,
                                 max_new_tokens=max_new_tokens, ignore_eos=True)
        assert row.completion.text == alone.text


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_a_long_prompt_prefilled_in_chunks_joins_as_if_prefilled_whole(tiny_decoder, backend,
                                                                       speculative):
    # engine/prefill.py: the prompt goes in 7 tokens a gap while the running row decodes, then its
    # row joins with its cache copied in; both rows' greedy text equals each sent alone
    decoder = tiny_decoder[backend]
    long_prompt = [5, 6, 7, 8] * 25
    batch = decoder.open_batch(speculative)
    short = batch.add(PROMPTS[0], max_new_tokens=100, ignore_eos=True)
    pending = batch.prepare(long_prompt, max_new_tokens=6, ignore_eos=True)
    chunked = batch.start_prefill(pending)
    rounds = 0
    while not chunked.done:
        assert chunked.advance(7) == min(7, 99 - 7 * rounds)
        batch.step()
        rounds += 1
    assert rounds == 15 and short.completion is None  # the running row decoded meanwhile
    assert chunked.advance(7) == 0
    (joined,) = batch.add_rows([pending], prefilled=[chunked])
    _finish_and_compare_alone(decoder, batch,
                              {PROMPTS[0]: (short, 100), tuple(long_prompt): (joined, 6)})


def test_a_backend_that_cannot_adopt_a_row_prefills_long_prompts_whole():
    # the fixture models' sessions have no adopt_rows: no chunked prefill, the row joins whole
    assert _fixture_decoder().batch().start_prefill([1, 2, 3]) is None


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_rows_leaving_from_the_middle_leave_the_others_text_unchanged(tiny_decoder, backend):
    # rows 0 and 2 of 5 leave: the last rows move into their places (fill_from_the_end), the
    # caches copy only them, and every staying row still decodes as it would alone
    decoder = tiny_decoder[backend]
    batch = decoder.open_batch()
    rows = batch.add_rows([batch.prepare(prompt, max_new_tokens=8, ignore_eos=True)
                           for prompt in PROMPTS + ["while True:"]])
    batch.step()
    batch.remove(rows[0])
    batch.remove(rows[2])
    while any(row.completion is None for row in (rows[1], rows[3], rows[4])):
        batch.step()
    for index in (1, 3, 4):
        assert rows[index].completion.text == decoder.generate(
            (PROMPTS + ["while True:"])[index], max_new_tokens=8, ignore_eos=True).text, index


@pytest.mark.parametrize(("kept", "order"), [
    ([0, 2, 4, 5], [0, 4, 2, 5]),  # rows 1 and 3 left: 4 and 5 fill their places
    ([0, 1, 2], [0, 1, 2]),  # the last rows left: nobody moves
    ([3, 4], [3, 4]),  # the first rows left: all move, in order
    ([1, 2, 3], [3, 1, 2]),  # row 0 left: the last row takes its place
])
def test_fill_from_the_end_moves_only_the_rows_past_the_kept_count(kept, order):
    assert fill_from_the_end(kept) == order
    assert sorted(order) == kept


class _ScriptedPolicy(AdaptivePolicy):
    """A depth policy playing a script of k's and keeping the stats it is given."""

    def __init__(self, script: tuple[int, ...]) -> None:
        self.script, self.seen = list(script), []
        self.num_draft_tokens = self.script.pop(0)

    def next_num_draft_tokens(self, stats):
        self.seen.append(stats)
        self.num_draft_tokens = self.script.pop(0) if self.script else self.num_draft_tokens
        return self.num_draft_tokens


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_a_round_whose_target_pass_carried_a_join_is_not_timed(backend):
    # on the fast path a join's prompt rides the next round's target pass
    # (TargetScorer.add_rows): that round's timings weigh like a first use
    # (RoundStats.timed False), the round after it is timed again, and the rows' greedy text
    # is the target's own. Control: the transformers backend prefills a join in a pass of
    # its own, so the same round is timed
    from verispec.text.assemble import wrap_model

    target, draft = tiny_llama(VOCAB_SIZE, seed=21), tiny_llama(VOCAB_SIZE, seed=22, layers=1)
    decoder = Engine.from_draft_model(wrap_model(target, VOCAB_SIZE, backend),
                                                  wrap_model(draft, VOCAB_SIZE, backend))
    config = GenerationConfig(max_new_tokens=12, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(
        adaptive=verispec.GoodputPolicyConfig(min_num_draft_tokens=0), num_draft_tokens=2))
    scripted = _ScriptedPolicy((1,) * 12)
    batch.scheduler.policies[2] = scripted  # the 2-row bucket's
    prompts = [[3, 5, 1, 2], [3, 5], [5, 1, 6, 2, 7]]
    first, second = batch.add(prompts[:2], [config] * 2, [make_generator(i) for i in (0, 1)])
    batch.step()
    batch.step()  # the bucket's shape has run: timed
    batch.remove([second])
    (third,) = batch.add(prompts[2:], [config], [make_generator(2)])
    batch.step()  # carried the join on the fast path
    batch.step()
    assert [stats.timed for stats in scripted.seen] == [False, True, backend != "fast", True]
    _run(batch, [first, third])
    for row, prompt in ((first, prompts[0]), (third, prompts[2])):
        alone = decoder.generate([prompt], GenerationConfig(max_new_tokens=12, sampling=GREEDY),
                                 speculative=False)
        assert row.token_ids == alone.token_ids[0]


def test_a_proposal_after_plain_rounds_is_timed_on_its_own_steps():
    # plain rounds, a row joining during them (its draft prefill deferred), then drafting:
    # the draft catches up before the round's clock starts, so that round's draft time is
    # priced (draft_timed), and every row's greedy text is still the target's own
    from verispec.policy.goodput import GoodputPolicyConfig

    decoder = _fixture_decoder()
    config = GenerationConfig(max_new_tokens=12, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(
        adaptive=GoodputPolicyConfig(min_num_draft_tokens=0), num_draft_tokens=2))
    scripted = _ScriptedPolicy((0, 0, 0, 0, 2, 2, 3, 3, 2, 2, 2, 2, 2, 2))
    batch.scheduler.policies[1] = batch.scheduler.policies[2] = scripted  # buckets of 1 and 2 rows
    (first,) = batch.add([PROMPT], [config], [make_generator(0)])
    batch.step()
    batch.step()
    (joined,) = batch.add([PROMPT[:2]], [config], [make_generator(1)])
    assert batch.proposer.unfed[1] == list(PROMPT[:2])  # deferred: held for the proposal
    _run(batch, [first, joined])
    plain, drafted = scripted.seen[3], scripted.seen[4]
    assert plain.num_draft_tokens == 0 and drafted.num_draft_tokens == 2
    assert drafted.draft_timed
    for row, prompt in ((first, PROMPT), (joined, PROMPT[:2])):
        alone = decoder.generate([prompt], GenerationConfig(max_new_tokens=12, sampling=GREEDY),
                                 speculative=False)
        assert row.token_ids == alone.token_ids[0]


# --- a row near the end of its context beside a deeper row -----------------------------------


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama])
def test_a_row_at_the_end_of_its_context_is_not_fed_a_deeper_rows_draft(build):
    # Row "end" fits its window exactly at its own k = 1 (prompt + max_new_tokens + k = the
    # window, as Decoder's context check allows); row "deep" drafts k = 8. A round feeds every
    # row the batch's largest k + 1 tokens, which ran "end" past its window (GPT-2's learned
    # positions: IndexError; llama.cpp: ContextLengthExceeded) and failed the whole batch.
    window = 32
    target = TransformersLM(build(VOCAB_SIZE, seed=31, max_positions=window))
    draft = TransformersLM(build(VOCAB_SIZE, seed=32, layers=1, max_positions=window))
    decoder = Engine.from_draft_model(target, draft)
    end = GenerationConfig(max_new_tokens=window - 24 - 1, num_draft_tokens=1, sampling=GREEDY)
    deep = GenerationConfig(max_new_tokens=20, num_draft_tokens=8, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(num_draft_tokens=8))
    rows = batch.add([[1] * 24, [2, 3]], [end, deep], [make_generator(0)] * 2)
    _run(batch, rows)
    alone = _alone(decoder, [1] * 24, end, seed=0)
    assert rows[0].token_ids == alone and len(alone) == end.max_new_tokens


def test_a_round_that_captured_a_step_graph_is_not_timed(monkeypatch):
    # a CUDA graph's capture (models/fast_llama/step_graphs.py) is a one-off cost of the round that
    # made it: that round reaches the policy untimed, like a first use. No GPU here: the static
    # steps run eagerly, and every new step is counted as a capture. Control: the same rounds with
    # no step new are timed
    from verispec.models.fast_llama.model import FastLlamaLM
    from verispec.models.fast_llama.step_graphs import StepGraphs

    new_step = StepGraphs._new_step

    def counted(self, *args):
        self.num_captured += 1
        return new_step(self, *args)

    monkeypatch.setattr(StepGraphs, "_new_step", counted)
    target, draft = tiny_llama(VOCAB_SIZE, seed=21), tiny_llama(VOCAB_SIZE, seed=22, layers=1)
    decoder = Engine.from_draft_model(FastLlamaLM(target, step_graphs="static"),
                                                  FastLlamaLM(draft, step_graphs="static"))
    config = GenerationConfig(max_new_tokens=12, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(
        adaptive=verispec.GoodputPolicyConfig(min_num_draft_tokens=0), num_draft_tokens=1))
    scripted = _ScriptedPolicy((1,) * 12)
    batch.scheduler.policies[1] = scripted  # the 1-row bucket's
    (row,) = batch.add([[3, 5, 1, 2]], [config], [make_generator(0)])
    for _ in range(4):
        batch.step()
    # round 1: the depth's first use; round 2 still runs a step shape of its own for the first
    # time (a capture on a GPU); rounds 3-4 run steps already captured
    assert [stats.timed for stats in scripted.seen] == [False, False, True, True]
    assert decoder.target.num_captured > 0 and decoder.proposer.num_captured > 0


def test_policy_evidence_counts_a_missing_draft_position_as_rejected():
    # a lookup that finds fewer tokens than asked gains nothing at the first position it
    # lacks: the depth policy sees it tested and rejected there (policy.scheduler.policy_evidence)
    assert policy_evidence([4, 4], [2, 0], [2, 0]) == (4, [2, 1, 1, 0], [1, 1, 0, 0])
    assert policy_evidence([3], [3], [1]) == (3, [1, 1, 0], [1, 0, 0])  # a draft model's
    assert policy_evidence([0, 0], [0, 0], [0, 0]) == (0, [], [])


def test_a_lookup_round_reaches_the_policy_at_the_depth_it_asked():
    # four rows asked for k = 3 by the policy; only the row whose prompt repeats finds an
    # n-gram draft. The policy's stats price the round at k = 3 and count the three rows
    # without a draft as rejected at position 0: a draft in one row of four is not the gain
    # of four. The greedy text is the target's own (control: the n-gram changes no token)
    from verispec.proposers.ngram import NgramProposer

    target = MarkovLM.random(VOCAB_SIZE, torch.Generator().manual_seed(5), order=2)
    decoder = Engine(target, NgramProposer(VOCAB_SIZE))
    adaptive = verispec.GoodputPolicyConfig(min_num_draft_tokens=0)
    config = GenerationConfig(max_new_tokens=6, sampling=GREEDY)
    batch = decoder.batch(options=BatchOptions(adaptive=adaptive, num_draft_tokens=3))
    scripted = _ScriptedPolicy((3,) * 8)
    batch.scheduler.policies[4] = scripted  # the 3-4-row bucket's
    repeating = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    prompts = [repeating, [1, 2], [3, 4], [0, 1]]
    rows = batch.add(prompts, [config] * 4, [make_generator(0)] * 4)
    batch.step()
    assert batch.last_num_draft_tokens == 3  # the repeating row's draft; the others found none
    stats = scripted.seen[0]
    assert stats.num_draft_tokens == 3 and stats.num_rows == 4
    assert stats.num_reached[0] == 4  # every row tested at position 0, drafted or not
    assert stats.num_accepted_at[0] <= 1  # at most the repeating row kept a draft token
    _run(batch, rows)
    for row, prompt in zip(rows, prompts):
        assert row.token_ids == _alone(decoder, prompt, config, seed=0)
