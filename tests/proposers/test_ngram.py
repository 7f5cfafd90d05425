"""proposers/ngram.py: prompt-lookup drafting, its lookup rules, and exactness through the engine.

Two layers here: the lookup on hand-made sequences; greedy equality with plain decoding on
fixture Markov chains and on a tiny real Llama (library, CLI). The third, the output law at
temperature > 0 with negative controls that must fail, is in test_hybrid.py, which runs it for
n-gram drafting alone and for the hybrid with the same harness.
"""

from __future__ import annotations

import pytest

import verispec
from verispec import (
    Engine,
    GenerationConfig,
    MarkovLM,
    NgramDraft,
    SamplingConfig,
    cli,
)
from verispec.errors import ConfigError
from verispec.proposers import NgramProposer
from verispec.proposers.base import DraftPlan
from verispec.sample.sampling import make_generator

from law_checks import VOCAB_SIZE
from tiny_models import save_untied_pair

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0)


def _session(prompts, config=None):
    return NgramProposer(100, config or NgramDraft()).start(prompts)


def _proposed(session, k):
    proposal = session.propose(DraftPlan.uniform(len(session.rows), k, GREEDY,
                                                  make_generator(0)))
    assert proposal.draft_probs is None  # deterministic: verified as a point mass
    return proposal.draft_tokens.tolist()


# --- the lookup ----------------------------------------------------------------------------


def test_longest_suffix_wins_then_the_latest_occurrence():
    # suffix (1, 2) occurred at 0-1 (followed by 7) and at 4-5 (followed by 9): the latest wins;
    # the 1-gram (2,) also matches later (position 8, followed by 4) but is shorter
    assert _proposed(_session([[1, 2, 7, 0, 1, 2, 9, 3, 2, 4, 1, 2]]), 2) == [[9, 3]]
    # 3-grams outrank 2-grams: (5, 1, 2) occurred once, followed by 6
    assert _proposed(_session([[5, 1, 2, 6, 8, 1, 2, 0, 5, 1, 2]]), 3) == [[6, 8, 1]]


def test_a_match_near_the_end_proposes_only_what_followed_it():
    assert _proposed(_session([[4, 4]]), 3) == [[4]]  # (4,) at 0 followed by one 4


def test_no_match_proposes_nothing():
    assert _proposed(_session([[1, 2, 3, 4]]), 4) == [[]]
    # min_ngram=2: a repeated single token is not enough
    assert _proposed(_session([[1, 2, 3, 2]], NgramDraft(min_ngram=2)), 2) == [[]]


def test_ragged_rows_are_padded_with_their_last_token():
    session = _session([[1, 2, 3, 1, 2], [6, 7, 8], [3, 3]])
    assert _proposed(session, 3) == [[3, 1, 2], [8, 8, 8], [3, 3, 3]]


def test_commit_appends_accepted_tokens_and_the_next_one_to_the_history():
    session = _session([[1, 2, 3, 9, 1]])
    assert _proposed(session, 2) == [[2, 3]]
    session.commit([1], [5])  # kept 2, then 5: history 1 2 3 9 1 2 5
    assert session.rows[0].tokens == [1, 2, 3, 9, 1, 2, 5]
    assert _proposed(session, 2) == [[]]  # (2, 5) and (5,) are new
    session.commit([0], [1])  # a round without a match: only the next token
    assert session.rows[0].tokens[-2:] == [5, 1]
    assert _proposed(session, 2) == [[2, 5]]  # (5, 1) is new; (1,) last at 4, then 2 5


@pytest.mark.parametrize("kwargs, fragment", [
    ({"max_ngram": 0}, "max_ngram=0"), ({"min_ngram": 3, "max_ngram": 2}, "min_ngram=3"),
    ({"max_ngram": 17}, "max_ngram=17"), ({"min_ngram": 1.0}, "min_ngram=1.0"),
])
def test_bad_ngram_config(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        NgramDraft(**kwargs)


# --- greedy: token-for-token equality with plain decoding ----------------------------------


def _repetitive_target(seed: int) -> MarkovLM:
    return MarkovLM.random(VOCAB_SIZE, make_generator(seed), order=2, sharpness=2.0)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_plain_decoding(k):
    target = _repetitive_target(3)
    decoder = Engine(target, NgramProposer(VOCAB_SIZE))
    prompts = [[3, 5, 3, 5, 2], [1], [7, 7, 2, 0, 7, 7]]  # batch 3, ragged matches
    config = GenerationConfig(max_new_tokens=50, num_draft_tokens=k, sampling=GREEDY, seed=0)
    speculative = decoder.generate(prompts, config)
    plain = decoder.generate(prompts, config, speculative=False)
    assert speculative.token_ids == plain.token_ids
    metrics = speculative.metrics
    assert metrics.num_accepted > 0 and metrics.num_rounds < plain.metrics.num_rounds
    for prompt, expected in zip(prompts, plain.token_ids):  # batch 1 too
        assert decoder.generate([prompt], config).token_ids == [expected]


# --- real models: library and CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_untied_pair(tmp_path_factory.mktemp("ngram_models"))


def test_library_ngram_drafting_on_a_real_model_keeps_the_greedy_output(model_dirs):
    decoder = verispec.load(model_dirs[0], verispec.NgramDraft(), num_draft_tokens=3)
    assert decoder.draft is None and decoder.model_free == NgramDraft()
    with pytest.warns(DeprecationWarning, match="Decoder.model_free"):
        assert decoder.ngram is decoder.model_free  # its former name
    prompt = "def add(a, b):\n    return a + b\ndef add(a, b):"
    speculative = decoder.generate(prompt, max_new_tokens=40)
    assert speculative.token_ids == decoder.generate(prompt, max_new_tokens=40,
                                                     speculative=False).token_ids
    assert speculative.metrics.num_drafted > 0


def test_cli_ngram_equals_no_draft(model_dirs, capsys):
    args = ["generate", "for i in range(10):\n    print(i)\nfor i in", "--target", model_dirs[0],
            "--temperature", "0", "--max-new-tokens", "30", "--json"]
    import json

    assert cli.main(args + ["--suffix", "--k", "2"]) == 0
    with_ngram = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--no-draft"]) == 0
    assert with_ngram["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.parametrize("extra, fragment", [(["--draft", "d"], "drop --draft"),
                                             (["--no-draft"], "drop --no-draft")])
def test_cli_ngram_with_a_draft_exits_2(model_dirs, capsys, extra, fragment):
    status = cli.main(["generate", "x", "--target", model_dirs[0], "--suffix", *extra])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and fragment in err
