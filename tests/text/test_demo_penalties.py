"""Penalties, logit bias, min-p and logprobs on the shipped demo pair (a real vocabulary):
speculative == plain token for token for the draft model, n-gram lookup and the hybrid at
k in {1, 2, 4, 8}, alone and in a batch; logprobs under speculation equal plain decoding's on
the fast path and the transformers backend, greedy and sampled."""

from __future__ import annotations

import pytest

import verispec
from verispec import ConfigError, NgramDraft

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):",
           "import os\nimport sys\n"]
NUM_NEW = 32
SETTINGS = [
    {"frequency_penalty": 1.2},
    {"presence_penalty": 1.5},
    {"repetition_penalty": 1.4},
    {"logit_bias": {271: 4.0, 284: -100.0}},
    {"frequency_penalty": 0.6, "presence_penalty": -0.4, "logit_bias": {198: 2.0}},
    {"min_p": 0.1, "temperature": 0.9, "seed": 5},
]


@pytest.fixture(scope="module")
def decoders(demo_decoder):
    return {"draft model": demo_decoder, "n-gram": verispec.load(draft=NgramDraft()),
            "hybrid": verispec.load(hybrid=True)}


def _plain(decoder, prompts, settings):
    return [c.token_ids for c in decoder.generate(prompts, max_new_tokens=NUM_NEW,
                                                  speculative=False, **_greedy(settings))]


def _greedy(settings: dict) -> dict:
    return {"temperature": 0.0, **settings}


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
@pytest.mark.parametrize("proposer", ["draft model", "n-gram", "hybrid"])
def test_speculative_equals_plain_with_penalties(decoders, proposer, settings):
    decoder = decoders[proposer]
    plain = _plain(decoder, PROMPTS, settings)
    for k in (1, 2, 4, 8):
        batch = decoder.generate(PROMPTS, max_new_tokens=NUM_NEW, num_draft_tokens=k,
                                 adaptive=None, **_greedy(settings))
        assert [c.token_ids for c in batch] == plain, k
    # alone: row 0 (a seed shared by a batch's rows tells them apart by their place)
    alone = decoder.generate(PROMPTS[0], max_new_tokens=NUM_NEW, num_draft_tokens=4,
                             adaptive=None, **_greedy(settings))
    assert alone.token_ids == plain[0]


def test_penalties_change_the_output(demo_decoder):
    """The equality above is not vacuous: each setting moves the greedy text."""
    base = _plain(demo_decoder, PROMPTS, {})
    for settings in SETTINGS[:5]:
        assert _plain(demo_decoder, PROMPTS, settings) != base, settings


def test_draft_shaped_like_the_target_keeps_acceptance(demo_decoder):
    """The draft applies the same penalties to its steps: acceptance under a frequency penalty
    stays near the unpenalised one (a draft blind to it would propose repeats the target
    penalises)."""
    def acceptance(**settings):
        out = demo_decoder.generate(PROMPTS, max_new_tokens=64, temperature=0, num_draft_tokens=4,
                                    adaptive=None, **settings)
        return sum(c.metrics.num_accepted for c in out) / sum(c.metrics.num_drafted for c in out)
    assert acceptance(frequency_penalty=0.5) > 0.6 * acceptance()


def _logprobs_pair(decoder, **settings):
    spec = decoder.generate(PROMPTS[0], max_new_tokens=24, num_draft_tokens=4, adaptive=None,
                            logprobs=5, **settings)
    plain = decoder.generate(PROMPTS[0], max_new_tokens=24, speculative=False, logprobs=5,
                             **settings)
    return spec, plain


@pytest.mark.parametrize("backend", ["auto", "transformers"])
@pytest.mark.parametrize("settings", [{"temperature": 0.0},
                                      {"temperature": 0.8, "seed": 3, "top_k": 40},
                                      {"temperature": 1.0, "seed": 4, "frequency_penalty": 0.8}],
                         ids=["greedy", "sampled", "penalised"])
def test_logprobs_under_speculation_equal_plain(demo_decoder, backend, settings):
    decoder = demo_decoder if backend == "auto" else verispec.load(backend="transformers")
    spec, plain = _logprobs_pair(decoder, **settings)
    assert spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(spec.token_ids)
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) < 1e-4
        assert len(a.top) == 5 and [t for t, _ in a.top[:2]] == [t for t, _ in b.top[:2]]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4


def test_streamed_logprobs_match_the_completion(demo_decoder):
    stream = demo_decoder.stream(PROMPTS[2], max_new_tokens=20, temperature=0, logprobs=2,
                                 stop="\n\n")
    text = "".join(stream)
    completion = stream.completion
    assert completion.text == text
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert stream.logprobs[: len(completion.token_ids)] == completion.logprobs


def test_no_logprobs_unless_asked(demo_decoder):
    assert demo_decoder.generate(PROMPTS[0], max_new_tokens=4, temperature=0).logprobs is None


@pytest.mark.parametrize("settings, field", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
    ({"logit_bias": {"12": 1.0}}, "logit_bias"),
    ({"logit_bias": {12: 150.0}}, "logit_bias"),
    ({"logit_bias": [(12, 1.0)]}, "logit_bias"),
    ({"min_p": -0.1}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
])
def test_bad_settings_name_the_field(demo_decoder, settings, field):
    with pytest.raises(ConfigError, match=field):
        demo_decoder.generate(PROMPTS[0], max_new_tokens=4, **settings)
