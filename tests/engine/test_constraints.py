"""Structured output under exact speculation (engine/constraints.py): equality, the law, validity.

  * greedy constrained speculative == greedy constrained plain, k in {1, 2, 4}, for the draft
    model, n-gram and hybrid proposers, on tiny models (batch 3, a different grammar per row and
    one unconstrained row) and on the demo pair;
  * the G-test on the joint law of the first two tokens under a small regex, against the law
    enumerated from the target masked by the grammar and renormalised; a negative control in
    which the mask reaches only the target's side of the acceptance test (the draft draws under
    the mask but reports its unmasked distribution) is rejected by the same test;
  * every output of a suite of 12 JSON schemas validates with the jsonschema package, greedy and
    sampled.
Compiling a response_format (text/grammar.py) is tested in tests/text/test_grammar.py.

Legend: B batch, V vocabulary.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from verispec import Engine, GenerationConfig, NgramDraft, SamplingConfig
from verispec.engine.constraints import ConstraintSet
from verispec.models.hf.adapter import TransformersLM
from verispec.proposers import DraftModelProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.ngram import NgramProposer
from verispec.sample.sampling import make_generator, to_probs
from verispec.text.grammar import TokenizerIndex, compile_response_format

from helpers_stats import g_test, pair_counts
from tiny_models import build_tokenizer, layer_dropped_draft, untied_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

GREEDY = SamplingConfig(temperature=0.0)
REGEX = {"type": "regex", "regex": r"(ab|a[0-9]|b[a-c])+"}
SMALL_SCHEMA = {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "y": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["x", "y"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    target = untied_llama(len(tokenizer), seed=5, hidden=32, layers=2)
    draft = layer_dropped_draft(target)
    index = TokenizerIndex(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return tokenizer, target, draft, index


def constraints_for(index, formats) -> ConstraintSet:
    return ConstraintSet(index, [compile_response_format(f) for f in formats])


PROPOSERS = ["draft-model", "ngram", "hybrid"]


def proposer_of(name: str, draft, vocab_size: int):
    if name == "draft-model":
        return DraftModelProposer(TransformersLM(draft))
    ngram = NgramProposer(vocab_size, NgramDraft(min_ngram=1, max_ngram=2))
    if name == "ngram":
        return ngram
    return HybridProposer(DraftModelProposer(TransformersLM(draft)), NgramDraft(min_ngram=1,
                                                                                max_ngram=2))


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_constrained_speculative_equals_plain_on_tiny_models(tiny, proposer, k):
    tokenizer, target, draft, index = tiny
    formats = [REGEX, SMALL_SCHEMA, None]  # one grammar per row, one row unconstrained
    prompts = [tokenizer.encode(p) for p in ("def add(a, b):", "for i in", "class Point:")]
    engine = Engine(TransformersLM(target), proposer_of(proposer, draft,
                                                                    len(tokenizer)))
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=k, sampling=GREEDY,
                              stop_token_ids=(tokenizer.eos_token_id,))
    plain = engine.generate(prompts, config, speculative=False,
                            constraints=constraints_for(index, formats))
    spec = engine.generate(prompts, config, constraints=constraints_for(index, formats))
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.num_drafted > 0
    regex_text = tokenizer.decode(plain.token_ids[0], skip_special_tokens=True)
    assert regex_text and all(c in "ab0123456789c" for c in regex_text), regex_text
    unconstrained = engine.generate(prompts[2:], config, speculative=False)
    assert plain.token_ids[2] == unconstrained.token_ids[0]  # the free row is untouched


def test_a_grammar_changes_the_output_and_the_output_obeys_it(tiny):
    tokenizer, target, draft, index = tiny
    engine = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    prompt = [tokenizer.encode("import os")]
    config = GenerationConfig(max_new_tokens=30, num_draft_tokens=3, sampling=GREEDY,
                              stop_token_ids=(tokenizer.eos_token_id,))
    free = engine.generate(prompt, config).token_ids[0]
    constrained = engine.generate(prompt, config, constraints=constraints_for(index,
                                                                              [SMALL_SCHEMA]))
    ids = constrained.token_ids[0]
    assert ids != free and constrained.finish_reasons == ["stop"] and ids[-1] == 0
    jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)),
                        SMALL_SCHEMA["json_schema"]["schema"])


# ---------------------------------------------------------------------------------------------
# the law of the first two tokens under a regex


NUM_SAMPLES = 20_000
LAW_REGEX = {"type": "regex", "regex": r"(a|b|c|d|1|2|3)(a|b|c|d|1|2|3)+"}


@pytest.fixture(scope="module")
def law_setup():
    tokenizer = build_tokenizer()
    target = untied_llama(len(tokenizer), seed=11, hidden=32, layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # peakier: the allowed tokens get distinct masses
    draft = layer_dropped_draft(target)
    index = TokenizerIndex(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return tokenizer, target, draft, index


def exact_constrained_law(tokenizer, target, index, prompt, sampling) -> np.ndarray:
    """P(x1, x2) for the target masked by the grammar and renormalised, by enumeration."""
    vocab_size = len(tokenizer)
    start = constraints_for(index, [LAW_REGEX])
    first_allowed = start.allowed()[0]  # [V]
    with torch.inference_mode():
        first_logits = target(torch.tensor([prompt])).logits[0, -1, :vocab_size]
    first = to_probs(first_logits, sampling, first_allowed).double()
    law = np.zeros((vocab_size, vocab_size))
    for x1 in torch.nonzero(first).flatten().tolist():
        state = constraints_for(index, [LAW_REGEX])
        state.advance([x1])
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + [x1]])).logits[0, -1, :vocab_size]
        second = to_probs(logits, sampling, state.allowed()[0]).double()
        law[x1] = first[x1].item() * second.numpy()
    return law


def first_two_constrained(tokenizer, target, draft, index, prompt, sampling, seed):
    engine = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    # unseeded rows (rejection sampling, the default block rule) from a generator seeded here
    config = GenerationConfig(max_new_tokens=4, num_draft_tokens=3, sampling=sampling)
    run = engine.stream([prompt] * NUM_SAMPLES, config,
                        constraints=constraints_for(index, [LAW_REGEX] * NUM_SAMPLES),
                        generator=make_generator(seed))
    for _ in run:
        if min(map(len, run.token_ids)) >= 2:
            break
    return np.array([row[:2] for row in run.token_ids]), run.metrics.acceptance_rate


@pytest.mark.slow
def test_first_two_tokens_follow_the_constrained_target_law(law_setup):
    tokenizer, target, draft, index = law_setup
    prompt, sampling = tokenizer.encode("x = "), SamplingConfig(temperature=1.0)
    law = exact_constrained_law(tokenizer, target, index, prompt, sampling)
    tokens, acceptance_rate = first_two_constrained(tokenizer, target, draft, index, prompt,
                                                    sampling, seed=3)
    result = g_test(pair_counts(tokens, 0, len(tokenizer)), law)
    print(f"constrained: {result}, acceptance rate {acceptance_rate:.3f}")
    assert 0.1 < acceptance_rate < 0.95, acceptance_rate
    assert result.dof >= 10 and result.num_impossible_hits == 0, result
    assert result.p_value > 1e-3, result


@pytest.mark.slow
def test_negative_control_a_mask_on_the_target_side_only_is_rejected(law_setup, monkeypatch):
    """The draft draws under the grammar's mask but reports its unmasked distribution: the
    acceptance test then compares the masked target with a distribution the token was not
    drawn from, and the output leaves the constrained law."""
    import verispec.proposers.draws as draws_module
    from verispec.sample.sampling import sample_from_logits

    def masked_draw_unmasked_report(logits, sampling, uniforms, allowed=None):
        _, tokens = sample_from_logits(logits, sampling, uniforms, allowed)
        unmasked, _ = sample_from_logits(logits, sampling, uniforms)
        return unmasked, tokens

    monkeypatch.setattr(draws_module, "sample_from_logits", masked_draw_unmasked_report)
    tokenizer, target, draft, index = law_setup
    prompt, sampling = tokenizer.encode("x = "), SamplingConfig(temperature=1.0)
    law = exact_constrained_law(tokenizer, target, index, prompt, sampling)
    tokens, _ = first_two_constrained(tokenizer, target, draft, index, prompt, sampling, seed=4)
    result = g_test(pair_counts(tokens, 0, len(tokenizer)), law)
    print(f"control: {result}")
    assert result.p_value < 1e-6, result


# ---------------------------------------------------------------------------------------------
# a schema suite on the demo pair: every output validates


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "enum": _object({"color": {"enum": ["red", "green", "blue"]}}),
    "bounded_integers": _object({"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                 "y": {"type": "integer", "minimum": 100, "maximum": 999}}),
    "pattern_string": _object({"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "bounded_string": _object({"name": {"type": "string", "minLength": 1, "maxLength": 8}}),
    "boolean_and_null": _object({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    "array_of_integers": _object({"values": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}}),
    "nested_object": _object({"point": _object({"x": {"type": "integer", "maximum": 99,
                                                       "minimum": 0},
                                                 "y": {"type": "integer", "maximum": 99,
                                                       "minimum": 0}}),
                              "label": {"enum": ["a", "b"]}}),
    "array_of_objects": _object({"items": {"type": "array", "maxItems": 2, "items": _object(
        {"k": {"type": "string", "maxLength": 4}, "v": {"type": "integer", "minimum": 0,
                                                          "maximum": 9}})}}),
    "const_and_number": _object({"version": {"const": 2},
                                 "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    "optional_fields": _object({"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                "b": {"type": "string", "maxLength": 3}}, required=["a"]),
    "any_of": _object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"enum": ["none"]}]}}),
    "enum_array": _object({"tags": {"type": "array", "maxItems": 3,
                                    "items": {"enum": ["x", "y", "z"]}}}),
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_of_the_schema_suite_validates(demo_decoder, name):
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    prompt = f"# {name.replace('_', ' ')} as JSON\ndata = "
    greedy = demo_decoder.generate(prompt, max_new_tokens=120, response_format=response_format)
    plain = demo_decoder.generate(prompt, max_new_tokens=120, response_format=response_format,
                                  speculative=False)
    assert greedy.text == plain.text  # exact under the constraint, on the real pair
    assert greedy.finish_reason == "stop", greedy.text
    jsonschema.validate(json.loads(greedy.text), schema)
    # sampled: a draw may run to max_new_tokens inside a number the schema leaves unbounded
    # (about half do under const_and_number at T = 0.8, seeded or not); every one that
    # completes validates
    sampled = demo_decoder.generate([prompt] * 8, max_new_tokens=120, seed=7,
                                    response_format=response_format, temperature=0.8,
                                    num_draft_tokens=4)
    complete = [c for c in sampled if c.finish_reason == "stop"]
    assert len(complete) >= 2, [c.text for c in sampled]
    for completion in complete:
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_demo_pair_greedy_under_a_schema_equals_plain(demo_decoder, k):
    prompt = "def point():\n    return "
    spec = demo_decoder.generate(prompt, max_new_tokens=48, response_format=SMALL_SCHEMA,
                                 num_draft_tokens=k)
    plain = demo_decoder.generate(prompt, max_new_tokens=48, response_format=SMALL_SCHEMA,
                                  speculative=False)
    assert spec.text == plain.text and json.loads(spec.text).keys() == {"x", "y"}
    assert 0 < spec.metrics.acceptance_rate < 1 or spec.metrics.num_drafted > 0


def test_ignore_eos_ends_where_the_grammar_is_complete(demo_decoder):
    """A complete grammar allows only EOS: under ignore_eos (no stop tokens for the engine) the
    output still ends there, as without it, never padded with EOS to max_new_tokens. An
    unconstrained row beside it keeps ignore_eos's fixed length."""
    prompt = "def point():\n    return "
    expected = demo_decoder.generate(prompt, max_new_tokens=40, response_format=SMALL_SCHEMA)
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 40
    for speculative in (False, True):
        stream = demo_decoder.stream(prompt, max_new_tokens=40, response_format=SMALL_SCHEMA,
                                     ignore_eos=True, speculative=speculative)
        assert "".join(stream) == expected.text
        out = stream.completion
        assert (out.text, out.token_ids, out.finish_reason) == (
            expected.text, expected.token_ids, "stop"), speculative
    constrained, free = demo_decoder.generate([prompt, prompt], max_new_tokens=40,
                                              ignore_eos=True, response_format=[SMALL_SCHEMA, None])
    assert (constrained.text, constrained.token_ids, constrained.finish_reason) == (
        expected.text, expected.token_ids, "stop")
    assert free.finish_reason == "length" and len(free.token_ids) == 40
