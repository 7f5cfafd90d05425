"""Seed invariance: a seeded sampled request's text is a function of (model, prompt, seed,
sampling settings) alone.

The claim (verispec.sample.seeded): each token of a seeded sampled row is the target's own sample at
its absolute position, an exponential race on clocks keyed by (seed, lane, position); a draft
token is kept while it equals the target's race winner. So on the demo pair, on the fast path
and the transformers backend, at T in {0.7, 1.0}, with top-p 0.9 and under a JSON schema, the
seeded text equals seeded plain decoding (speculative=False) token for token, whatever
  * the proposer: draft model, n-gram, hybrid;
  * k in {1, 2, 4, 8}, or a depth policy (goodput, threshold, goodput-plain) choosing k;
  * the batch: alone, or among at most 4 rows whose mates (greedy, unseeded, other
    temperatures, top-p, a schema) join and leave between rounds, some cancelled midway;
  * the interface: generate, stream, an open TextBatch, the CLI.

Design (a minute on one core in all). The plain reference is decoded once per backend, all
SEEDS in one batch. A (backend, proposer) then runs seeds through open batches of at most
BATCH_WIDTH rows, by segments of 25 seeds: one segment at a fixed depth, one under each depth
policy (the batch's, config.BatchOptions), which two seeds in three follow while the third caps
its depth at its k (a fixed segment's rows each draft their own k: the batch's is the largest).
The fast path runs all four segments (every seed) for each proposer; the transformers
backend, twice as slow and sharing everything but the forward, the fixed one and one policy's
(another for each proposer). Seed i's settings rotate with i on coprime cycles (_cases, _depth),
so every (k, temperature, top-p) combination recurs every 16 seeds: each (proposer, k) sees
10-15 fixed-depth seeds on the fast path and 6-11 on transformers, each (proposer, policy)
16-17 seeds following it. The full product, 100 seeds x proposers x k x modes x backends,
would be ~4,000 generations, ~7 minutes on one core, each a check of the same rule. Alone,
streamed: 8 seeds per (backend, proposer), rotating k and policy.

Exactness of the race itself (fixture models, exact laws by enumeration, helpers_stats): the
law of keyed rows' first emitted tokens, one seed a row, is the target's (G-test), with a
draft of another distribution; the same test rejects clocks reused across positions.

Legend: N samples (rows), V vocabulary, k draft tokens.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import verispec
import verispec.sample.seeded
from verispec import (
    BatchOptions,
    Engine,
    GenerationConfig,
    GoodputPolicyConfig,
    MarkovLM,
    NgramDraft,
    PenaltyConfig,
    SamplingConfig,
    ThresholdPolicyConfig,
    cli,
)
from verispec.policy import named_policy
from verispec.sample.sampling import make_generator
from verispec.text.demo import heldout_prompts

from helpers_stats import first_two_law, g_test, pair_counts, pair_law
from law_checks import EXTREME_CASES, extreme_case

pytestmark = pytest.mark.usefixtures("single_thread_torch")

SCHEMA = {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "y": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["x", "y"], "additionalProperties": False}}}
K_VALUES = (1, 2, 4, 8)
POLICIES = {"goodput": GoodputPolicyConfig(), "threshold": ThresholdPolicyConfig(),
            "goodput-plain": named_policy("goodput-plain")}
SEGMENTS = (None, "goodput", "threshold", "goodput-plain")  # 25 seeds each
SEGMENTS_RUN = {"fast": {"draft": (0, 1, 2, 3), "ngram": (0, 1, 2, 3), "hybrid": (0, 1, 2, 3)},
                "transformers": {"draft": (0, 1), "ngram": (0, 2), "hybrid": (0, 3)}}
PROPOSERS = {"draft": {}, "ngram": {"draft": NgramDraft()}, "hybrid": {"hybrid": True}}
BACKENDS = ("fast", "transformers")
BATCH_WIDTH = 4
NUM_SEEDS = 100
SEEDS = [0, 2**63 - 1] + [1_000 + 7_919 * i for i in range(NUM_SEEDS - 2)]


@dataclass(frozen=True)
class Case:
    """One seeded request: its prompt and its sampling settings (Decoder.stream's keywords)."""

    prompt: str
    seed: int
    temperature: float
    top_p: float | None
    response_format: dict | None
    max_new_tokens: int

    def settings(self) -> dict[str, object]:
        return dict(seed=self.seed, temperature=self.temperature, top_p=self.top_p,
                    response_format=self.response_format, max_new_tokens=self.max_new_tokens)


def _short_prompts() -> list[str]:
    """Held-out demo prompts of at most ~40 tokens (~160 characters): a plain batch of all the
    seeds pads every prompt to its longest."""
    return [prompt for prompt in heldout_prompts() if len(prompt) <= 160]


def _cases() -> list[Case]:
    """Seed i: T 0.7 (even i) or 1.0 (odd), top-p 0.9 on half of each, the JSON schema on one
    in five (i % 10 in {3, 8}: both temperatures, with and without top-p), 10-20 new tokens."""
    prompts = _short_prompts()
    return [Case(prompts[i % len(prompts)], seed, (0.7, 1.0)[i % 2],
                 (None, 0.9)[(i // 2) % 2], SCHEMA if i % 10 in (3, 8) else None,
                 10 + (7 * i) % 11)
            for i, seed in enumerate(SEEDS)]


CASES = _cases()


@pytest.fixture(scope="module")
def decoders():
    """(backend, proposer name) -> the demo pair's Decoder, each loaded once, when first used."""
    loaded: dict[tuple[str, str], verispec.Decoder] = {}

    def get(backend: str, proposer: str) -> verispec.Decoder:
        if (backend, proposer) not in loaded:
            loaded[backend, proposer] = verispec.load(backend=backend, **PROPOSERS[proposer])
        return loaded[backend, proposer]

    return get


@pytest.fixture(scope="module")
def plain_reference(decoders):
    """backend -> the token ids of every case by seeded plain decoding (one batch)."""
    computed: dict[str, list[list[int]]] = {}

    def get(backend: str) -> list[list[int]]:
        if backend not in computed:
            outs = decoders(backend, "draft").generate(
                [case.prompt for case in CASES], speculative=False,
                **{name: [case.settings()[name] for case in CASES]
                   for name in CASES[0].settings()})
            computed[backend] = [out.token_ids for out in outs]
        return computed[backend]

    return get


# --- batch mates: other settings, some cancelled midway --------------------------------------

MATES = [  # never compared: they only share the rounds
    dict(temperature=0.0, num_draft_tokens=2, max_new_tokens=8),
    dict(temperature=1.0, num_draft_tokens=8, max_new_tokens=14),
    dict(temperature=0.7, top_p=0.9, num_draft_tokens=1, max_new_tokens=12,
         response_format=SCHEMA),
    dict(temperature=1.0, verification="token", num_draft_tokens=4, max_new_tokens=18),
]
MATE_EVERY = 5  # seeded rows between two mates
CANCEL_AFTER = 2  # rounds; every third mate is removed then, before it is complete


def _depth(index: int) -> tuple[int, bool]:
    """Case index's k (K[(i // 4) % 4]: each k meets all four (temperature, top-p) settings)
    and whether it follows a segment's policy uncapped (i % 3 != 0)."""
    return K_VALUES[(index // 4) % len(K_VALUES)], index % 3 != 0


@dataclass(frozen=True)
class Join:
    """A row to join an open batch: its tag (a case index; a tuple for a mate), prompt,
    Decoder.stream settings, and the rounds after which it is removed (None: never)."""

    tag: object
    prompt: str
    settings: dict
    cancel_after: int | None = None


def _segment_rows(segment: int) -> list[Join]:
    """The seeded rows of one segment with a mate after every MATE_EVERY of them."""
    policy = SEGMENTS[segment]
    size = NUM_SEEDS // len(SEGMENTS)
    joins = []
    for index in range(segment * size, (segment + 1) * size):
        case = CASES[index]
        k, follows = _depth(index)
        joins.append(Join(index, case.prompt, dict(
            case.settings(), num_draft_tokens=None if policy and follows else k)))
        if index % MATE_EVERY == MATE_EVERY - 1:
            number = index // MATE_EVERY
            mate = MATES[number % len(MATES)]
            joins.append(Join(("mate", number), CASES[-1 - index].prompt, dict(mate),
                              CANCEL_AFTER if number % 3 == 0 else None))
    return joins


def _run_open_batch(decoder, joins: list[Join], policy: str | None
                    ) -> tuple[dict[object, list[int]], int]:
    """Rows join an open batch in order, at most BATCH_WIDTH at a time: on even rounds as many
    as there is room for (joining together), on odd ones one. -> ({tag: token ids} of the rows
    that completed, the number of rounds)."""
    batch = decoder.open_batch(options=replace(
        decoder.batch_options, adaptive=POLICIES[policy] if policy else None,
        num_draft_tokens=max(K_VALUES)))
    pending, live, rounds_in = deque(joins), {}, {}
    token_ids: dict[object, list[int]] = {}
    num_rounds = 0
    while pending or len(batch):
        joining = []
        while pending and len(batch) + len(joining) < BATCH_WIDTH:
            joining.append(pending.popleft())
            if num_rounds % 2:
                break
        pendings = [batch.prepare(join.prompt, join.tag, **join.settings) for join in joining]
        for join, text_row in zip(joining, batch.add_rows(pendings)):
            live[join.tag], rounds_in[join.tag] = (text_row, join), 0
        for text_row, _ in batch.step():
            rounds_in[text_row.tag] += 1
            if text_row.completion is not None:
                token_ids[text_row.tag] = text_row.completion.token_ids
                del live[text_row.tag]
        num_rounds += 1
        for tag, (text_row, join) in list(live.items()):
            if join.cancel_after is not None and rounds_in[tag] >= join.cancel_after:
                batch.remove(text_row)
                del live[tag]
    return token_ids, num_rounds


@pytest.mark.slow
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_rows_in_a_changing_batch_of_four_equal_plain_decoding(
        decoders, plain_reference, backend, proposer):
    decoder, expected = decoders(backend, proposer), plain_reference(backend)
    num_rows = 0
    for segment in SEGMENTS_RUN[backend][proposer]:
        policy = SEGMENTS[segment]
        joins = _segment_rows(segment)
        token_ids, num_rounds = _run_open_batch(decoder, joins, policy)
        seeded = [join.tag for join in joins if isinstance(join.tag, int)]
        assert len(seeded) == NUM_SEEDS // len(SEGMENTS)
        for index in seeded:
            assert token_ids[index] == expected[index], (
                f"{backend} {proposer} seed {CASES[index].seed} (case {index}, policy {policy}, "
                f"k, follows {_depth(index)}): {token_ids[index]} != {expected[index]}")
        num_rows += len(joins)
        assert num_rounds < sum(join.settings["max_new_tokens"] for join in joins)  # batched
    assert num_rows > len(SEGMENTS_RUN[backend][proposer]) * NUM_SEEDS // len(SEGMENTS)


# --- alone, streamed -------------------------------------------------------------------------

ALONE_PER_RUN = 8


def _alone_cases(backend: str, proposer: str) -> list[tuple[int, int, str | None]]:
    """(case index, k, policy) for ALONE_PER_RUN seeds per (backend, proposer), disjoint across
    them; k rotates through K_VALUES, the second half under a policy each."""
    offset = BACKENDS.index(backend) * len(PROPOSERS) + list(PROPOSERS).index(proposer)
    stride = len(BACKENDS) * len(PROPOSERS)
    policies = [None] * (ALONE_PER_RUN // 2) + list(POLICIES) * ALONE_PER_RUN
    return [(offset + stride * j, K_VALUES[j % len(K_VALUES)], policies[j])
            for j in range(ALONE_PER_RUN) if offset + stride * j < NUM_SEEDS]


@pytest.mark.slow
@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_rows_alone_stream_the_text_of_plain_decoding(decoders, plain_reference,
                                                             backend, proposer):
    decoder, expected = decoders(backend, proposer), plain_reference(backend)
    for index, k, policy in _alone_cases(backend, proposer):
        case = CASES[index]
        stream = decoder.stream(case.prompt, num_draft_tokens=k,
                                adaptive=POLICIES[policy] if policy else None, **case.settings())
        deltas = list(stream)
        out = stream.completion
        assert out.token_ids == expected[index], (backend, proposer, case, k, policy)
        assert "".join(deltas) == out.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_decoding_alone_equals_the_plain_batch(decoders, plain_reference, backend):
    """The reference itself: a seeded plain row alone gives what it gives among all the
    seeds (schema, top-p and both temperatures among these)."""
    decoder, expected = decoders(backend, "draft"), plain_reference(backend)
    for index in (0, 1, 3, 8, 99):
        case = CASES[index]
        out = decoder.generate(case.prompt, speculative=False, **case.settings())
        assert out.token_ids == expected[index], (backend, case)


def test_a_list_of_prompts_seeds_prompt_i_with_seed_plus_i(decoders):
    """Decoder.generate over a list with one int seed: prompt i is seeded seed + i, as if
    alone, whatever the batch, k and decoding."""
    decoder = decoders("fast", "draft")
    prompts = [case.prompt for case in CASES[:3]]
    together = decoder.generate(prompts, max_new_tokens=16, temperature=0.7, top_p=0.9,
                                seed=41, num_draft_tokens=4)
    for i, prompt in enumerate(prompts):
        alone = decoder.generate(prompt, max_new_tokens=16, temperature=0.7, top_p=0.9,
                                 seed=41 + i, speculative=False)
        assert together[i].token_ids == alone.token_ids
    assert len({tuple(out.token_ids) for out in together}) == 3


# --- the command line ------------------------------------------------------------------------

CLI_FLAGS = [["--no-draft"], ["--k", "8"], ["--suffix", "--k", "2"],
             ["--hybrid", "--adaptive", "goodput"]]


def test_the_cli_gives_a_seed_the_text_of_plain_decoding(decoders, capsys):
    case = CASES[7]  # T 1.0, top-p 0.9
    expected = decoders("fast", "draft").generate(case.prompt, speculative=False,
                                                  **case.settings())
    common = ["generate", case.prompt, "--seed", str(case.seed), "--temperature",
              str(case.temperature), "--top-p", str(case.top_p), "--max-new-tokens",
              str(case.max_new_tokens)]
    for flags in CLI_FLAGS:
        assert cli.main(common + flags + ["--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["text"], out["token_ids"]) == (expected.text, expected.token_ids), flags
    assert cli.main(common + ["--quiet"]) == 0  # streamed to stdout
    assert capsys.readouterr().out == expected.text + "\n"


# --- exactness of the keyed sampler: the law of emitted tokens ------------------------------

VOCAB_SIZE = 8
PROMPT = [3, 5]
NUM_SAMPLES = 3_000
ALPHA = 1e-3  # a correct sampler fails one G-test with this probability
CONTROL_ALPHA = 1e-6  # a broken one must be rejected far beyond chance


def _markov_pair() -> tuple[MarkovLM, MarkovLM]:
    """An order-1 target, flat enough for ~35 cells of expected count >= 5 in each law tested,
    with impossible tokens; a draft of another distribution near it (the target's logits plus
    noise): about half of the drafts are kept."""
    generator = make_generator(73)
    target = MarkovLM.random(VOCAB_SIZE, generator, order=1, sharpness=0.8, zero_fraction=0.2)
    noise = 0.8 * torch.randn(target.table.shape, generator=generator)
    return target, MarkovLM(target.table + noise, order=1)


def _keyed_tokens(k: int, sampling: SamplingConfig, num_samples: int = NUM_SAMPLES,
                  first_seed: int = 0, pair: tuple[MarkovLM, MarkovLM] | None = None,
                  penalty: PenaltyConfig | None = None
                  ) -> tuple[np.ndarray, verispec.GenerationMetrics]:
    """Tokens [N, k + 1] of N rows of one prompt, row i seeded first_seed + i (lane 0: one
    seed a row, as requests are), all in one batch; the first round drafts k for each.
    ``pair``: (target, draft), _markov_pair's by default; ``penalty``: none by default."""
    target, draft = _markov_pair() if pair is None else pair
    penalty = PenaltyConfig() if penalty is None else penalty
    batch = Engine.from_draft_model(target, draft).batch(
        options=BatchOptions(num_draft_tokens=k))
    configs = [GenerationConfig(max_new_tokens=k + 1, sampling=sampling,
                                seed=first_seed + i, penalty=penalty)
               for i in range(num_samples)]
    rows = batch.add([PROMPT] * num_samples, configs, [make_generator(0)] * num_samples)
    assert all(row.keyed for row in rows)
    while batch.rows:
        batch.step()
    return np.array([row.token_ids for row in rows], dtype=np.int64), batch.recorder.snapshot()


def _law_tests(tokens: np.ndarray, sampling: SamplingConfig,
               target: MarkovLM | None = None) -> list:
    """G-tests of (x1, x2) and, past two tokens, of the last two, against the law of
    ``target`` (_markov_pair's by default)."""
    target = _markov_pair()[0] if target is None else target
    results = [("x1,x2", g_test(pair_counts(tokens, 0, VOCAB_SIZE),
                                first_two_law(target, PROMPT, sampling)))]
    num_new = tokens.shape[1]
    if num_new > 2:
        results.append((f"x{num_new - 1},x{num_new}",
                        g_test(pair_counts(tokens, num_new - 2, VOCAB_SIZE),
                               pair_law(target, PROMPT, sampling, num_new))))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("k, sampling", [(1, SamplingConfig(temperature=1.0)),
                                         (3, SamplingConfig(temperature=0.7, top_p=0.9))],
                         ids=["k1-T1", "k3-T0.7-top_p0.9"])
def test_keyed_rows_have_the_target_law(k, sampling):
    tokens, metrics = _keyed_tokens(k, sampling)
    assert 0.2 < metrics.acceptance_rate < 0.9  # both kept and rejected drafts are exercised
    results = _law_tests(tokens, sampling)
    print(f"PVALUE keyed k={k} {sampling}: " + "; ".join(f"{label} {r}" for label, r in results))
    for label, result in results:
        assert result.p_value > ALPHA, f"law of {label} differs from the target's: {result}"


@pytest.mark.slow
def test_the_law_test_rejects_clocks_reused_across_positions(monkeypatch):
    """Negative control: every position keyed as position 0 (the same clocks each time). The
    tokens stay samples of their own distributions one by one, but no longer independent."""
    original = verispec.sample.seeded.position_key
    monkeypatch.setattr(verispec.sample.seeded, "position_key",
                        lambda key, position: original(key, 0))
    sampling = SamplingConfig(temperature=1.0)
    tokens, _ = _keyed_tokens(1, sampling, num_samples=1_000)
    (label, result), = _law_tests(tokens, sampling)
    print(f"PVALUE control reused clocks: {label} {result}")
    assert result.p_value < CONTROL_ALPHA, f"the G-test failed to reject reused clocks: {result}"


# A low temperature and a logit_bias of +-100 (law_checks.extreme_case): near-certain rows,
# tails below 2^-53, fp32 subnormals and zeros; the race reads none of the ratios that broke
# the block rule there, and must keep the law.
KEYED_EXTREME_CASES = [("cold_T0.01", 2), ("cold_T0.1", 3), ("bias_plus100", 2),
                       ("bias_minus100", 2)]
assert {name for name, _ in KEYED_EXTREME_CASES} == set(EXTREME_CASES)


def _keyed_extreme_tokens(name: str, k: int, num_samples: int) -> np.ndarray:
    case = extreme_case(name)
    tokens, _ = _keyed_tokens(k, case.pair.sampling(case.temperature), num_samples,
                              pair=(case.pair.target, case.pair.draft), penalty=case.penalty)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("name, k", KEYED_EXTREME_CASES)
def test_keyed_rows_have_the_target_law_at_low_temperature_and_extreme_bias(name, k):
    case = extreme_case(name)
    tokens = _keyed_extreme_tokens(name, k, 1_500)
    results = _law_tests(tokens, case.pair.sampling(case.temperature), case.law_target)
    print(f"PVALUE keyed {name} k={k}: " + "; ".join(f"{label} {r}" for label, r in results))
    for label, result in results:
        assert result.p_value > ALPHA, f"law of {label} differs from the target's: {result}"


@pytest.mark.slow
def test_the_law_test_rejects_clocks_reused_across_positions_at_low_temperature(monkeypatch):
    original = verispec.sample.seeded.position_key
    monkeypatch.setattr(verispec.sample.seeded, "position_key",
                        lambda key, position: original(key, 0))
    case = extreme_case("cold_T0.1")
    tokens = _keyed_extreme_tokens("cold_T0.1", 1, 1_000)
    (label, result), = _law_tests(tokens, case.pair.sampling(case.temperature), case.law_target)
    print(f"PVALUE control reused clocks cold_T0.1: {label} {result}")
    assert result.p_value < CONTROL_ALPHA, f"the G-test failed to reject reused clocks: {result}"


# --- the engine: one seed for a batch, a lane a row --------------------------------------------


def test_a_one_seed_run_gives_row_i_the_clocks_of_lane_i_at_any_k():
    """Engine.generate with one seed: row i races on (seed, lane i), so it equals
    plain decoding's row i at every k, and row i joining a batch alone with lane i; rows of
    one prompt differ (their lanes do)."""
    target, draft = _markov_pair()
    decoder = Engine.from_draft_model(target, draft)
    prompts = [PROMPT] * 3 + [[1], [6, 2, 0]]
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)

    def config(k: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=12, num_draft_tokens=k, sampling=sampling,
                                seed=2024)

    plain = decoder.generate(prompts, config(1), speculative=False).token_ids
    assert len({tuple(tokens) for tokens in plain[:3]}) == 3
    for k in K_VALUES:
        assert decoder.generate(prompts, config(k)).token_ids == plain, k
    for lane in (0, 4):
        batch = decoder.batch()
        (row,) = batch.add([prompts[lane]], [config(2)], [make_generator(0)], lanes=[lane])
        while batch.rows:
            batch.step()
        assert row.token_ids == plain[lane]
