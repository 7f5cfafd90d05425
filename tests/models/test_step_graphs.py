"""The fast path's static-shape steps (models/fast_llama/step_graphs.py) on the CPU: what a CUDA
graph replays, run eagerly, must give the reference's logits and the eager path's tokens. The
capture itself needs a GPU (tests/models/test_gpu.py)."""
# ruff: noqa: F811 (the tests take fast_llama_pair's module fixtures target and draft by name)

from __future__ import annotations

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.errors import ConfigError
from verispec.models.fast_llama.model import FastLlamaLM
from verispec.models.fast_llama.step_graphs import MIN_KEYS, bucket_keys, bucket_rows

from fast_llama_pair import (  # noqa: F401 (draft, target: its module fixtures)
    PROMPTS,
    VOCAB,
    check_logits_after_random_extend_and_rewind,
    draft,
    target,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def test_buckets_are_powers_of_two_and_keys_stay_inside_the_context():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert bucket_keys(5, None) == MIN_KEYS
    assert bucket_keys(MIN_KEYS + 1, None) == 2 * MIN_KEYS
    assert bucket_keys(300, 400) == 400  # the context bounds the padding
    assert bucket_keys(500, 400) == 512  # a row past the context (refused upstream) still fits


def test_static_steps_give_the_references_logits_on_ragged_rows(target):
    # five ragged rows: padded to a bucket of 8, three pad rows writing free slots
    lm = FastLlamaLM(target, step_graphs="static")
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12], [13]]
    check_logits_after_random_extend_and_rewind(target, lm.new_session(), VOCAB, prompts=prompts)
    assert lm.step_graphs is not None and lm.step_graphs.num_captured == 0  # nothing captured


def test_static_steps_take_logits_at_columns(target):
    lm = FastLlamaLM(target, step_graphs="static")
    session, reference = lm.new_session(), FastLlamaLM(target, step_graphs="off").new_session()
    for s in (session, reference):
        s.start([[1, 2, 3], [4, 5]])
    tokens = torch.tensor([[6, 7, 8], [9, 10, 11]])
    with torch.inference_mode():  # a step built under inference mode runs outside it too
        session.extend(tokens[:, :1])
    session.rewind([1, 1])
    session.extend(tokens[:, :1])
    session.rewind([1, 1])
    columns = session.extend(tokens, [2, 0])  # [B, V]
    full = reference.extend(tokens)  # [B, n, V]
    torch.testing.assert_close(columns, torch.stack([full[0, 2], full[1, 0]]), atol=1e-5,
                               rtol=1e-5)
    assert session.lengths == reference.lengths == [6, 5]


def test_static_steps_survive_rows_joining_leaving_and_the_cache_growing(target):
    """Joins riding a pass go eagerly, then steps resume at static shapes over the regrown
    cache (a new layout, so new steps); every row's logits still match a fresh forward."""
    lm = FastLlamaLM(target, step_graphs="static")
    session = lm.new_session()
    session.start([[1, 2]])
    history = [[1, 2]]
    generator = torch.Generator().manual_seed(3)
    for round_ in range(6):
        if round_ in (1, 3):  # two rows join: the cache grows its slots
            joining = [[20 + round_] * (3 + round_), [30 + round_]]
            session.add_rows(joining, ride=round_ == 1)
            history += [list(p) for p in joining]
        if round_ == 4:  # rows 0 and 2 leave
            session.keep_rows([1, 3, 4])
            history = [history[i] for i in (1, 3, 4)]
        width = MIN_KEYS if round_ == 5 else 2  # the last pass reaches a longer key bucket
        tokens = torch.randint(0, VOCAB, (len(history), width), generator=generator)
        logits = session.extend(tokens)
        for row, ids in enumerate(history):
            ids.extend(tokens[row].tolist())
            with torch.inference_mode():
                fresh = target(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(logits[row, -1], fresh, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_plain_on_static_steps(target, draft, k):
    static = Engine.from_draft_model(FastLlamaLM(target, step_graphs="static"),
                                                 FastLlamaLM(draft, step_graphs="static"))
    eager = Engine.from_draft_model(FastLlamaLM(target, step_graphs="off"),
                                                FastLlamaLM(draft, step_graphs="off"))
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0.0))
    plain = static.generate(PROMPTS, config, speculative=False)
    speculative = static.generate(PROMPTS, config)
    assert speculative.token_ids == plain.token_ids
    assert speculative.token_ids == eager.generate(PROMPTS, config).token_ids
    assert speculative.metrics.num_accepted > 0


def test_sampled_output_on_static_steps_equals_eager_with_the_same_seed(target, draft):
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, seed=5,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.9))
    outputs = [Engine.from_draft_model(FastLlamaLM(target, step_graphs=mode),
                                                   FastLlamaLM(draft, step_graphs=mode)
                                                   ).generate([[1, 2, 3], [9, 8]], config)
               for mode in ("static", "off")]
    assert outputs[0].token_ids == outputs[1].token_ids


def test_an_unknown_step_graphs_mode_names_the_choices(target):
    with pytest.raises(ConfigError, match="step_graphs='always' is invalid: expected one of "
                                          "auto, off, static"):
        FastLlamaLM(target, step_graphs="always")


def test_the_least_recently_used_steps_go_beyond_the_bound(target, monkeypatch):
    from verispec.models.fast_llama import step_graphs

    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 3)
    lm = FastLlamaLM(target, step_graphs="static")
    session = lm.new_session()
    session.start([[1, 2, 3]])
    for width in (1, 2, 3, 1, 4, 5):  # five shapes; width 1 used again before 4 and 5 come
        session.extend(torch.full((1, width), 7))
    kept = [key[3] for key in lm.step_graphs._steps]  # tokens a row of each kept step
    assert kept == [1, 4, 5]
