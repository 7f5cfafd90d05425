"""One path for every request: a prompt alone, a list of prompts and a batch that rows join run
the same TextBatch code, under options of the batch (config.BatchOptions).

  * generate(p, **s) and generate([p], **s) give the same tokens, the same metrics counters
    (so the same rounds at the same depths) and the same first depth, for settings that include
    a depth policy and num_draft_tokens (the call's own batch takes both);
  * a row joining a running batch cannot bring options of its own (a depth policy, speculative,
    a prefill budget): a different one is a ConfigError naming it, never a silent override; its
    num_draft_tokens caps its depth under the batch's;
  * stream_batch admits a prompt longer than the prefill budget in chunks (text/admission.py)
    while the rows already in keep emitting, and every row's greedy text is its text alone.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

import verispec
from verispec import ConfigError, GoodputPolicyConfig, ThresholdPolicyConfig

from tiny_models import build_tokenizer, layer_dropped_draft, save_model, untied_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPT = "def add(a, b):"
# grows k on any acceptance, by acceptance counts alone (deterministic, unlike measured costs)
GROWING = ThresholdPolicyConfig(grow_above=0.01, shrink_below=0.0, window=1,
                                max_num_draft_tokens=8)
PRICED = GoodputPolicyConfig(cost_ratio=0.1, max_num_draft_tokens=8)  # a given cost: no clock
SETTINGS = {
    "the decoder's": {},
    "k": {"num_draft_tokens": 3},
    "a policy from k": {"num_draft_tokens": 6, "adaptive": GROWING},
    "a priced policy": {"num_draft_tokens": 2, "adaptive": PRICED},
    "a fixed k": {"adaptive": None, "num_draft_tokens": 5},
    "plain": {"speculative": False},
    "seeded, sampled, under a policy": {"temperature": 0.8, "seed": 3, "num_draft_tokens": 5,
                                        "adaptive": GROWING},
    "penalties, logprobs, stops": {"repetition_penalty": 1.3, "logprobs": 2, "stop": ["\n\n"],
                                   "min_new_tokens": 3, "num_draft_tokens": 2},
}
TIMES = ("draft_time", "target_time", "verify_time", "wall_time")


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """{"fixed": a decoder at k = 4, "policy": one whose batches follow GROWING from k = 2}."""
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("one_path_models")
    target = untied_llama(len(tokenizer), seed=1)
    dirs = (save_model(target, tokenizer, root / "target"),
            save_model(layer_dropped_draft(target, num_layers=1), tokenizer, root / "draft"))
    return {"fixed": verispec.load(*dirs, num_draft_tokens=4),
            "policy": verispec.load(*dirs, num_draft_tokens=2, adaptive=GROWING)}


def _counters(metrics: verispec.GenerationMetrics) -> dict[str, object]:
    """Every counter of the metrics (the rounds, their depths, what was tested and kept), not
    the clock's readings."""
    return {name: value for name, value in asdict(metrics).items() if name not in TIMES}


def _first_depth(decoder, settings: dict, listed: bool) -> int:
    """The depth of the first round of generate(PROMPT, **settings) (listed: of [PROMPT])."""
    stream = (decoder.stream_batch([PROMPT], **settings) if listed
              else decoder.stream(PROMPT, **settings))
    stream.text_batch.admit()
    stream.text_batch.step()
    return stream.text_batch.num_draft_tokens


@pytest.mark.parametrize("kind", ["fixed", "policy"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_prompt_and_a_list_of_it_run_the_same_batch(decoders, kind, name):
    decoder, settings = decoders[kind], dict(SETTINGS[name], max_new_tokens=24)
    alone = decoder.generate(PROMPT, **settings)
    (listed,) = decoder.generate([PROMPT], **settings)
    assert listed.token_ids == alone.token_ids and listed.text == alone.text
    assert listed.finish_reason == alone.finish_reason and listed.logprobs == alone.logprobs
    assert _counters(listed.metrics) == _counters(alone.metrics)
    assert alone.metrics.num_rounds > 0
    expected = 0 if settings.get("speculative") is False else settings.get(
        "num_draft_tokens", decoder.num_draft_tokens)
    assert _first_depth(decoder, settings, listed=False) == expected
    assert _first_depth(decoder, settings, listed=True) == expected


def test_a_row_cannot_bring_options_of_its_own_into_a_running_batch(decoders):
    decoder = decoders["policy"]
    batch = decoder.open_batch()  # the decoder's options: GROWING from k = 2
    for name, value in (("adaptive", PRICED), ("adaptive", None), ("speculative", False),
                        ("prefill_budget", 3)):
        with pytest.raises(ConfigError, match=f"{name}=.*differs from this batch's") as info:
            batch.add(PROMPT, **{name: value})
        assert info.value.field == name
    assert len(batch) == 0  # refused before joining
    # its own batch's options are no conflict; num_draft_tokens caps the row's depth
    capped = batch.add(PROMPT, adaptive=GROWING, num_draft_tokens=1, max_new_tokens=16)
    free = batch.add(PROMPT, max_new_tokens=16)
    while capped.completion is None or free.completion is None:
        batch.step()
    assert capped.completion.metrics.num_draft_steps == capped.completion.metrics.num_rounds
    assert free.completion.metrics.num_draft_steps > free.completion.metrics.num_rounds
    assert capped.completion.token_ids == free.completion.token_ids  # greedy: any depth


def test_an_option_of_the_batch_in_a_rows_engine_config_is_refused():
    with pytest.raises(ConfigError, match="option of the batch") as info:
        verispec.GenerationConfig(adaptive=GROWING)
    assert info.value.field == "adaptive"


def test_a_prompt_longer_than_the_prefill_budget_joins_stream_batch_in_chunks(decoders):
    # budget 8: the long prompt (~80 tokens) comes after two short ones and goes in 8 tokens a
    # gap (engine/prefill.py) while the short rows decode; then it joins, and every row's
    # greedy text is its text alone
    decoder = decoders["fixed"]
    long_prompt = "def f(x):\n    return x + 1\n" * 3
    num_tokens = len(decoder.tokenizer.encode(long_prompt))
    assert 60 < num_tokens < 120
    prompts = [PROMPT, "class Stack:", long_prompt]
    stream = decoder.stream_batch(prompts, max_new_tokens=[120, 120, 8], ignore_eos=True,
                                  prefill_budget=8)
    batch = stream.text_batch
    rounds_prefilling, deltas_prefilling = set(), []
    for index, _ in stream:
        if batch.num_prefilling:
            rounds_prefilling.add(batch.batch.recorder.snapshot().num_rounds)
            deltas_prefilling.append(index)
    assert set(deltas_prefilling) == {0, 1}  # the long row emitted nothing before it joined
    # the running rows had a round at least every other gap of the prefill's (num_tokens - 1)
    # tokens at 8 a gap
    assert len(rounds_prefilling) >= (num_tokens - 1) // 8 // 2
    for prompt, completion, max_new_tokens in zip(prompts, stream.completions, (120, 120, 8)):
        alone = decoder.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
        assert completion.token_ids == alone.token_ids


def test_a_burst_of_prompts_joins_stream_batch_over_several_gaps(decoders):
    # the budget caps the prompt tokens of a gap (at least one prompt a gap): with 16, three
    # prompts of 10-14 tokens do not all join in the first gap; the text is the same either way
    decoder = decoders["fixed"]
    prompts = [PROMPT, "class Stack:", "import os\n"]
    assert all(8 < len(decoder.tokenizer.encode(p)) <= 16 for p in prompts)
    stream = decoder.stream_batch(prompts, max_new_tokens=12, prefill_budget=16)
    assert len(stream.text_batch.admit()) < 3 and stream.text_batch.num_waiting > 0
    for _ in stream:
        pass
    together = decoder.generate(prompts, max_new_tokens=12, prefill_budget=1024)
    assert [c.token_ids for c in stream.completions] == [c.token_ids for c in together]


def test_the_decoders_options_are_one_object(decoders):
    options = decoders["policy"].batch_options
    assert options == verispec.BatchOptions(adaptive=GROWING, num_draft_tokens=2)
    assert decoders["policy"].adaptive is GROWING and decoders["policy"].num_draft_tokens == 2
    fixed = decoders["policy"].open_batch(options=replace(options, adaptive=None))
    assert fixed.batch.options.adaptive is None
