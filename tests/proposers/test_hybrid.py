"""proposers/hybrid.py: n-gram lookup first, the draft model where there is no match.

Three layers: the draft model's catch-up after rounds it did not propose (ragged rows) against a
fresh session on tiny real models (both backends); greedy equality with plain decoding on
fixture Markov chains and real models (library, CLI), with both kinds of round shown to occur;
and the output law at temperature > 0 by the G-test harness (tests/helpers/law_checks.py), for
n-gram drafting alone and for the hybrid (whose first round is a lookup round that leaves rows
ragged, followed by draft-model rounds that catch up), with negative controls that must fail.
"""

from __future__ import annotations

import json

import pytest
import torch

import verispec
from verispec import (
    BatchOptions,
    Engine,
    GenerationConfig,
    GoodputPolicyConfig,
    MarkovLM,
    NgramDraft,
    SamplingConfig,
    ThresholdPolicyConfig,
    cli,
)
from verispec.errors import ConfigError
from verispec.proposers import DraftModelProposer, HybridProposer, NgramProposer
from verispec.proposers.base import DraftPlan
from verispec.proposers.hybrid import HYBRID_LOOKUP
from verispec.sample.sampling import make_generator
from verispec.text.assemble import wrap_model

from injected_rules import (
    _accept_all,
    _exact_accept,
    _residual,
    _rule_verify,
    _target,
    inject_verify,
)
from law_checks import VOCAB_SIZE, _assert_control_rejected, _assert_target_law, _proposer_law
from tiny_models import save_untied_pair, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0)


class _CountingHybrid(HybridProposer):
    """The real proposer, keeping its sessions so a test can see which kinds of round ran."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sessions = []

    def start(self, prompts):
        session = super().start(prompts)
        self.sessions.append(session)
        return session


# --- the draft model catches up on tokens it did not propose -------------------------------


@pytest.mark.parametrize("build, backend", [(tiny_llama, "fast"), (tiny_llama, "transformers"),
                                            (tiny_gpt2, "transformers")])
def test_ragged_catch_up_equals_a_fresh_session(build, backend):
    model = wrap_model(build(50, seed=4), 50, backend)
    sampling = SamplingConfig(temperature=1.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    caught_up = DraftModelProposer(model).start(prompts)
    caught_up.append_committed([[9], [10, 11, 12, 13]])  # rows now lag by 2 and 5 tokens
    full = [[1, 2, 3, 9], [4, 5, 6, 7, 8, 10, 11, 12, 13]]
    fresh = DraftModelProposer(model).start(full)
    got = caught_up.propose(DraftPlan.uniform(2, 3, sampling, make_generator(7)))
    expected = fresh.propose(DraftPlan.uniform(2, 3, sampling, make_generator(7)))
    assert got.draft_tokens.tolist() == expected.draft_tokens.tolist()
    torch.testing.assert_close(got.draft_probs, expected.draft_probs, atol=1e-5, rtol=1e-4)
    # and the cache stays right through the next commit and proposal
    caught_up.commit([1, 3], [20, 21])
    fresh.commit([1, 3], [20, 21])
    plan = lambda: DraftPlan.uniform(2, 2, sampling, make_generator(8))  # noqa: E731
    torch.testing.assert_close(caught_up.propose(plan()).draft_probs,
                               fresh.propose(plan()).draft_probs,
                               atol=1e-5, rtol=1e-4)


# --- greedy: token-for-token equality with plain decoding ----------------------------------


def _markov(seed: int, order: int = 2) -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(seed), order=order, sharpness=2.0)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_plain_decoding_with_both_kinds_of_round(k):
    target, draft = _markov(3), _markov(5, order=1)
    proposer = _CountingHybrid(DraftModelProposer(draft), NgramDraft(min_ngram=2))
    decoder = Engine(target, proposer)
    prompts = [[3, 5, 3, 5, 2], [1], [7, 7, 2, 0, 7, 7]]  # batch 3, ragged matches
    config = GenerationConfig(max_new_tokens=50, num_draft_tokens=k, sampling=GREEDY, seed=0)
    speculative = decoder.generate(prompts, config)
    assert speculative.token_ids == decoder.generate(prompts, config, speculative=False).token_ids
    for prompt, expected in zip(prompts, speculative.token_ids):  # batch 1 too
        assert decoder.generate([prompt], config).token_ids == [expected]
    ngram_rounds = sum(s.num_ngram_rounds for s in proposer.sessions)
    draft_rounds = sum(s.num_draft_rounds for s in proposer.sessions)
    assert ngram_rounds > 0 and draft_rounds > 0, (ngram_rounds, draft_rounds)


@pytest.mark.parametrize("adaptive", [
    ThresholdPolicyConfig(),
    # a draft step priced like a target step: plain rounds (k = 0, no proposal at all) win
    GoodputPolicyConfig(min_num_draft_tokens=0, cost_ratio=1.0),
])
def test_greedy_output_under_an_adaptive_policy(adaptive):
    proposer = _CountingHybrid(DraftModelProposer(_markov(5, order=1)), NgramDraft(min_ngram=2))
    decoder = Engine(_markov(3), proposer)
    prompts = [[3, 5, 3, 5, 2], [7, 7, 2, 0, 7, 7]]
    config = GenerationConfig(max_new_tokens=50, sampling=GREEDY, seed=0)
    speculative = decoder.generate(prompts, config,
                                   options=BatchOptions(adaptive=adaptive, num_draft_tokens=2))
    assert speculative.token_ids == decoder.generate(prompts, config, speculative=False).token_ids
    session = proposer.sessions[0]
    proposed = session.num_ngram_rounds + session.num_draft_rounds
    assert proposed > 0
    if adaptive.min_num_draft_tokens == 0:  # rounds without a proposal did happen
        assert proposed < speculative.metrics.num_rounds


# --- the output law at temperature > 0: n-gram drafting alone, and the hybrid ---------------

PROMPT = [3, 5, 3, 5, 2, 3]  # repeats: the first round is a lookup round (5, 2, 3, ...)


def _law_results(kind: str, k: int, temperature: float, seed: int,
                 verification: str = "block"):
    """(G-test results, metrics, proposer) of the law harness (law_checks.py) for one proposer."""
    proposer = (NgramProposer(VOCAB_SIZE) if kind == "ngram" else
                _CountingHybrid(DraftModelProposer(_markov(12, order=1)), NgramDraft()))
    results, metrics = _proposer_law(_markov(11), proposer, k, temperature, seed, PROMPT,
                                     verification)
    return results, metrics, proposer


@pytest.mark.slow
@pytest.mark.parametrize("kind, k, temperature, seed", [
    ("ngram", 1, 1.0, 40_001), ("ngram", 2, 1.0, 40_002), ("ngram", 4, 1.0, 40_003),
    ("ngram", 2, 0.7, 40_004), ("ngram", 4, 0.7, 40_005),
    ("hybrid", 2, 1.0, 41_001), ("hybrid", 4, 1.0, 41_002), ("hybrid", 2, 0.7, 41_003),
    ("hybrid", 4, 0.7, 41_004)])
def test_sampled_output_has_the_target_law(kind, k, temperature, seed):
    results, metrics, proposer = _law_results(kind, k, temperature, seed)
    assert metrics.num_drafted > 0 and 0 < metrics.num_accepted < metrics.num_drafted
    if kind == "hybrid":  # a lookup round leaves rows ragged; draft-model rounds catch up
        session = proposer.sessions[0]
        assert session.num_ngram_rounds >= 1 and session.num_draft_rounds >= 1
    _assert_target_law(f"{kind} k={k} T={temperature}", results)


@pytest.mark.slow
@pytest.mark.parametrize("kind, seed", [("ngram", 40_100), ("hybrid", 41_100)])
@pytest.mark.parametrize("control, accept, recover", [
    ("accept_everything", _accept_all, _residual),
    ("resample_from_target", _exact_accept, _target),
])
def test_broken_rules_are_rejected(monkeypatch, kind, seed, control, accept, recover):
    # the losslessness module's injected verify with a broken rule, on lookup point masses
    # (and, for the hybrid, the draft model's rounds too)
    inject_verify(monkeypatch, _rule_verify(accept, recover))  # the token-wise rule's entry
    _assert_control_rejected(f"{kind} {control}",
                             _law_results(kind, 2, 1.0, seed, verification="token")[0])


# --- real models: library and CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_untied_pair(tmp_path_factory.mktemp("hybrid_models"))


PROMPT_TEXT = "def add(a, b):\n    return a + b\ndef add(a, b):"


def test_library_hybrid_keeps_the_greedy_output(model_dirs):
    decoder = verispec.load(*model_dirs, hybrid=True, num_draft_tokens=3)
    assert decoder.draft is not None and decoder.hybrid == HYBRID_LOOKUP
    assert isinstance(decoder.engine.proposer, HybridProposer)
    speculative = decoder.generate(PROMPT_TEXT, max_new_tokens=40)
    assert speculative.token_ids == decoder.generate(PROMPT_TEXT, max_new_tokens=40,
                                                     speculative=False).token_ids
    assert speculative.metrics.num_drafted > 0


def test_library_hybrid_seeded_sampling_is_reproducible(model_dirs):
    decoder = verispec.load(*model_dirs, hybrid=NgramDraft(min_ngram=1), num_draft_tokens=2)
    assert decoder.hybrid == NgramDraft(min_ngram=1)
    runs = [decoder.generate(PROMPT_TEXT, max_new_tokens=30, temperature=1.0, seed=5).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("draft, hybrid, fragment", [
    (NgramDraft(), True, "draft=NgramDraft\\(\\) was given"),  # lookup twice
    (None, True, "no draft was given"),  # a target with no draft model to fall back on
    ("draft", 3, "hybrid=3 is invalid"),
])
def test_bad_hybrid_choices_raise_before_loading(model_dirs, draft, hybrid, fragment):
    draft = model_dirs[1] if draft == "draft" else draft
    with pytest.raises(ConfigError, match=fragment):
        verispec.load(model_dirs[0], draft, hybrid=hybrid)


def test_cli_hybrid_equals_no_draft(model_dirs, capsys):
    args = ["generate", "for i in range(10):\n    print(i)\nfor i in", "--target", model_dirs[0],
            "--temperature", "0", "--max-new-tokens", "30", "--json"]
    assert cli.main(args + ["--draft", model_dirs[1], "--hybrid", "--k", "2"]) == 0
    hybrid = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--no-draft"]) == 0
    assert hybrid["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert hybrid["metrics"]["num_drafted"] > 0


@pytest.mark.parametrize("extra, fragment", [(["--suffix"], "drop --suffix"),
                                             (["--no-draft"], "drop --no-draft")])
def test_cli_hybrid_conflicts_exit_2(model_dirs, capsys, extra, fragment):
    status = cli.main(["generate", "x", "--target", model_dirs[0], "--draft", model_dirs[1],
                       "--hybrid", *extra])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and fragment in err
