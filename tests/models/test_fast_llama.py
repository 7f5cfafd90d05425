"""The flat Llama forward (models/fast_llama/) against its reference, the transformers forward."""
# ruff: noqa: F811 (the tests take fast_llama_pair's module fixtures target and draft by name)

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.errors import ConfigError, ShapeError, UnsupportedFeatureError
from verispec.models import attention as attention_module
from verispec.models.fast_llama import matmul as matmul_module
from verispec.models.fast_llama import model as fast_llama_module
from verispec.models.fast_llama import session as fast_llama_session
from verispec.models.fast_llama.matmul import onednn_available, resolve_matmul
from verispec.models.fast_llama.model import FastLlamaLM, supports
from verispec.models.fixtures import MarkovLM
from verispec.models.hf.adapter import TransformersLM
from verispec.text.assemble import wrap_model

from fast_llama_pair import (  # noqa: F401 (draft, target: its module fixtures)
    PROMPTS,
    VOCAB,
    check_logits_after_random_extend_and_rewind,
    draft,
    target,
)
from tiny_models import tiny_gpt2, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

# both projection kernels, whichever "auto" picks on this machine (models/fast_llama/matmul.py)
MATMULS = ["aten", pytest.param("onednn", marks=pytest.mark.skipif(
    not onednn_available(), reason="this torch build has no oneDNN"))]


@pytest.mark.parametrize("matmul", MATMULS)
def test_logits_match_transformers_after_random_extend_and_rewind(target, matmul):
    check_logits_after_random_extend_and_rewind(
        target, FastLlamaLM(target, matmul=matmul).new_session(), VOCAB)


def test_logits_match_transformers_with_enough_rows_for_matmul_attention(target):
    """Nine ragged rows: passes of several tokens take attention's matmul path
    (models/attention.py), single tokens the flash kernel; both must give the reference's
    logits."""
    assert 9 >= attention_module.MATMUL_MIN_ROWS
    prompts = [[1 + row] * (1 + (3 * row) % 7) for row in range(9)]  # 1-7 tokens
    check_logits_after_random_extend_and_rewind(
        target, FastLlamaLM(target).new_session(), VOCAB, steps=8, prompts=prompts)


def test_segments_by_length_reads_the_fewest_key_rows():
    segments_by_length = attention_module.segments_by_length
    assert segments_by_length([60, 70, 900, 65], 64) == [(0, 2, 70), (2, 3, 900), (3, 4, 65)]
    assert segments_by_length([60, 70, 900, 65], 5000) == [(0, 4, 900)]  # calls too dear
    assert segments_by_length([50] * 16, 0) == [(0, 16, 50)]  # nothing to save
    generator = torch.Generator().manual_seed(3)
    for _ in range(40):  # against every split of up to 7 rows
        lengths = torch.randint(1, 300, (int(torch.randint(1, 8, (1,), generator=generator)),),
                                generator=generator).tolist()
        call_rows = float(torch.randint(0, 200, (1,), generator=generator))

        def cost(segments, call_rows=call_rows):
            return sum((stop - first) * num_keys + call_rows for first, stop, num_keys in segments)

        found = segments_by_length(lengths, call_rows)
        assert [first for first, _, _ in found] + [len(lengths)] == [0] + [
            stop for _, stop, _ in found]  # contiguous, covering every row in order
        assert all(num_keys == max(lengths[first:stop]) for first, stop, num_keys in found)
        best = min(cost([(cuts[i], cuts[i + 1], max(lengths[cuts[i]:cuts[i + 1]]))
                         for i in range(len(cuts) - 1)])
                   for mask in range(2 ** (len(lengths) - 1))
                   for cuts in [[0] + [i + 1 for i in range(len(lengths) - 1) if mask >> i & 1]
                                + [len(lengths)]])
        assert cost(found) == pytest.approx(best)


def test_logits_match_transformers_with_a_long_row_among_short_ones(target, monkeypatch):
    """Rows of very different lengths attend in ranges of rows, each over its own keys
    (models/attention.segments_by_length); every row's logits must still be the reference's.
    A low call cost splits the rows into many ranges."""
    calls = []
    attend_segments = fast_llama_module.attend_segments
    monkeypatch.setattr(fast_llama_module, "attend_segments",
                        lambda *args: calls.append(args[-1]) or attend_segments(*args))
    lm = FastLlamaLM(target)
    lm.segment_call_rows = 4.0
    prompts = [[1 + row] * (1 + (3 * row) % 7) for row in range(9)]
    prompts[4] = [5, 6, 7] * 40  # 120 tokens among 1-7
    check_logits_after_random_extend_and_rewind(target, lm.new_session(), VOCAB, steps=8,
                                                prompts=prompts)
    assert calls and max(len(segments) for segments in calls) >= 3


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("rows, num_queries", [(1, 3), (8, 1), (8, 3), (12, 5)])
def test_attend_matches_scaled_dot_product_attention(rows, num_queries, num_heads,
                                                     num_kv_heads, monkeypatch):
    """attend() against scaled_dot_product_attention on ragged masked rows, grouped heads
    included; passes of several queries over MATMUL_MIN_ROWS rows or more must not call it."""
    generator = torch.Generator().manual_seed(rows * 10 + num_queries)
    head_dim, num_keys = 16, 40
    query = torch.randn(rows, num_heads, num_queries, head_dim, generator=generator)
    keys, values = (torch.randn(rows, num_kv_heads, num_keys, head_dim, generator=generator)
                    for _ in range(2))
    lengths = torch.randint(0, num_keys - num_queries, (rows,), generator=generator)
    positions = lengths[:, None] + torch.arange(num_queries)  # [B, n]
    mask = fast_llama_module._attention_mask(positions, 0, num_queries, num_keys, torch.float32,
                                             query.device)  # [B, 1, n, T], the forward's own
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.25, enable_gqa=num_heads != num_kv_heads)
    calls = []
    sdpa = attention_module.F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    out = attention_module.attend(query, keys, values, mask, 0.25)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    matmul_path = num_queries > 1 and rows >= attention_module.MATMUL_MIN_ROWS
    assert len(calls) == (0 if matmul_path else 1)


@pytest.fixture(scope="module")
def generate_reference(target):
    """transformers generate() greedy continuations of PROMPTS, 48 tokens each."""
    outputs = []
    for prompt in PROMPTS:
        with torch.inference_mode():
            out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48,
                                  min_new_tokens=48, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_reference_backend_and_generate(target, draft, generate_reference, k,
                                                      matmul):
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0.0))
    fast = Engine.from_draft_model(FastLlamaLM(target, matmul=matmul),
                                               FastLlamaLM(draft, matmul=matmul))
    reference = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    fast_ids = fast.generate(PROMPTS, config).token_ids  # one ragged batch
    assert fast_ids == reference.generate(PROMPTS, config).token_ids
    assert fast_ids == generate_reference


def test_sampled_output_equals_reference_backend_with_same_seed(target, draft):
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, seed=5,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.9))
    fast = Engine.from_draft_model(FastLlamaLM(target), FastLlamaLM(draft))
    reference = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    prompts = [[1, 2, 3], [9, 8]]
    assert fast.generate(prompts, config).token_ids == reference.generate(prompts, config).token_ids


def test_bfloat16_logits_close_to_transformers():
    model = tiny_llama(VOCAB, seed=3, hidden=64, layers=2).to(torch.bfloat16)
    session = FastLlamaLM(model).new_session()
    session.start([[1, 2, 3, 4]])
    logits = session.extend(torch.tensor([[5, 6]]))
    with torch.inference_mode():
        expected = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits[:, -2:]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_backend_selection():
    llama, gpt2 = tiny_llama(VOCAB, seed=1), tiny_gpt2(VOCAB, seed=1)
    assert supports(llama) and not supports(gpt2)
    assert isinstance(wrap_model(llama, VOCAB, "auto"), FastLlamaLM)
    assert isinstance(wrap_model(gpt2, VOCAB, "auto"), TransformersLM)
    assert isinstance(wrap_model(llama, VOCAB, "transformers"), TransformersLM)
    with pytest.raises(ConfigError, match="fast Llama path does not support"):
        wrap_model(gpt2, VOCAB, "fast")


def test_a_llama_with_a_non_linear_projection_takes_the_transformers_path():
    # e.g. a layer that keeps GGUF's quantized blocks and unpacks them in its own forward: the
    # flat forward reads .weight directly and would skip that, so it must not claim the model
    class UnpackingLinear(torch.nn.Linear):
        pass

    llama = tiny_llama(VOCAB, seed=1)
    down = llama.model.layers[1].mlp.down_proj
    llama.model.layers[1].mlp.down_proj = UnpackingLinear(down.in_features, down.out_features,
                                                          bias=False)
    assert not supports(llama)
    assert isinstance(wrap_model(llama, VOCAB, "auto"), TransformersLM)


def test_vocabulary_restriction_narrows_the_head():
    model = tiny_llama(VOCAB + 3, seed=4)
    lm = FastLlamaLM(model, vocab_size=VOCAB)
    session = lm.new_session()
    session.start([[1, 2]])
    assert session.extend(torch.tensor([[3]])).shape == (1, 1, VOCAB)


def test_rewind_past_a_rows_length_is_a_shape_error(target):
    session = FastLlamaLM(target).new_session()
    session.start([[1, 2, 3], [4]])
    with pytest.raises(ShapeError, match="rewind"):
        session.rewind(torch.tensor([0, 2]))  # row 1 holds one token
    with pytest.raises(ShapeError, match="rewind"):
        session.rewind(torch.tensor([-1, 0]))
    session.rewind(torch.tensor([3, 1]))  # to empty is fine
    assert session.lengths == [0, 0]


def check_next_logits(model, session, history: list[list[int]], first_token: int) -> None:
    """Extend every row of ``session`` by two tokens; each row's logits must equal a fresh
    forward of ``model`` over its own ``history`` and those tokens."""
    tokens = torch.arange(first_token, first_token + 2 * len(history)).reshape(len(history), 2)
    logits = session.extend(tokens)  # [B, 2, V]
    for row, row_history in enumerate(history):
        with torch.inference_mode():
            fresh = model(torch.tensor([row_history + tokens[row].tolist()])).logits[0]
        torch.testing.assert_close(logits[row], fresh[-2:], atol=1e-4, rtol=1e-4)


def count_passes(monkeypatch) -> list[str]:
    """Record each fast pass from now on: "padded" (FastLlamaLM.forward) or "packed"
    (models.fast_llama.packed.feed_packed, as the session calls it)."""
    passes: list[str] = []
    forward, packed = FastLlamaLM.forward, fast_llama_session.feed_packed

    def counted_forward(self, *args, **kwargs):
        passes.append("padded")
        return forward(self, *args, **kwargs)

    def counted_packed(*args, **kwargs):
        passes.append("packed")
        return packed(*args, **kwargs)
    monkeypatch.setattr(FastLlamaLM, "forward", counted_forward)
    monkeypatch.setattr(fast_llama_session, "feed_packed", counted_packed)
    return passes


def test_rows_joining_in_one_packed_pass_hold_their_own_prompts(target, monkeypatch):
    """Joining rows of very different lengths are prefilled in one packed pass (no padded
    one); each row's logits after the join and after an extend equal a fresh forward over its
    own history, and the rows already there are untouched."""
    lm = FastLlamaLM(target)
    joining = [[3], [4, 5], [6] * 9, [7] * 30, [8] * 31]
    session = lm.new_session()
    session.start([[1, 2, 3, 4, 5]])
    passes = count_passes(monkeypatch)
    session.add_rows(joining)
    assert passes == ["packed"]
    history = [[1, 2, 3, 4, 5]] + [list(p) for p in joining]
    assert session.lengths == [len(h) for h in history]
    check_next_logits(target, session, history, first_token=12)


@pytest.mark.parametrize("rows_before", [1, 9])  # 9 rows: verification attends by matmuls
def test_joining_prompts_ride_the_next_extend(target, rows_before, monkeypatch):
    """add_rows(ride=True): the prompts wait for the next pass, which carries them beside the
    rows' own tokens (one padded pass, no packed one); every row's logits, the joining rows'
    included, equal a fresh forward over its own history. A riding row that leaves before the
    pass is never prefilled, and one that stays moves with its slot."""
    lm = FastLlamaLM(target)
    before = [[1, 2, 3, 4, 5][: 1 + row % 5] for row in range(rows_before)]
    joining = [[3], [4, 5], [6] * 9, [7] * 30, [8] * 31]
    session = lm.new_session()
    session.start(before)
    passes = count_passes(monkeypatch)
    assert session.add_rows(joining, ride=True)
    assert passes == []
    history = [list(p) for p in before + joining]
    assert session.lengths == [len(h) for h in history]
    session.keep_rows([i for i in range(len(history)) if i != rows_before + 2])  # [6] * 9 leaves
    del history[rows_before + 2]
    check_next_logits(target, session, history, first_token=12)
    assert passes == ["padded"]


def test_riding_prompts_go_in_before_a_feed_or_a_rewind(target):
    """A feed after a riding join puts each prompt before its row's tokens (one packed pass);
    a rewind prefills the prompts first. Either way each row then holds its own history."""
    lm = FastLlamaLM(target)
    for verb in ("feed", "rewind"):
        session = lm.new_session()
        session.start([[1, 2, 3]])
        session.add_rows([[4, 5, 6, 7], [8]], ride=True)
        history = [[1, 2, 3], [4, 5, 6, 7], [8]]
        if verb == "feed":
            session.feed([[9], [10, 11], []])
            history = [h + f for h, f in zip(history, [[9], [10, 11], []])]
        else:
            session.rewind([1, 2, 0])
            history = [h[: len(h) - n] for h, n in zip(history, [1, 2, 0])]
        check_next_logits(target, session, history, first_token=20)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_feed_leaves_each_row_as_if_its_tokens_had_been_extended(target, backend, monkeypatch):
    """A draft's catch-up (LMSession.feed): ragged rows, some with nothing to feed, one far
    behind, one empty before the feed. Each row's next logits then equal a fresh forward over
    its own history; the fast backend feeds every row in one packed pass and computes no
    logits (no padded pass at all)."""
    lm = wrap_model(target, VOCAB, backend)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8], [9, 10, 11], []]
    rows = [[12, 13], [], [14, 15, 16], list(range(20, 50)), [17, 18, 19]]
    session = lm.new_session()
    session.start(prompts)
    passes = count_passes(monkeypatch)
    session.feed(rows)
    if backend == "fast":
        assert passes == ["packed"]
        session.feed([[]] * len(rows))  # nothing to feed: no pass
        assert passes == ["packed"]
    history = [p + r for p, r in zip(prompts, rows)]
    check_next_logits(target, session, history, first_token=60)
    with pytest.raises(ShapeError, match="one list of tokens per row"):
        session.feed([[1]])


@pytest.mark.parametrize("backend", ["fast", "transformers", "fixture"])
def test_logits_at_one_column_a_row_equal_those_columns_of_a_full_extend(target, backend):
    """LMSession.extend's logits_at (a draft feeding ragged rows needs each row's last real
    position only): [B, V], row b's logits at its column, what a full extend returns there
    (the fast backend runs its output layer at those positions only, so to float32
    rounding), and the cache as after a full extend. One column for every row too; a column
    outside the pass or a missing row is a ShapeError."""
    lm = MarkovLM.random(VOCAB, torch.Generator().manual_seed(3), order=2) if (
        backend == "fixture") else wrap_model(target, VOCAB, backend)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    tokens = torch.tensor([[10, 11, 12], [13, 14, 15], [16, 17, 18]])
    full, picked = lm.new_session(), lm.new_session()
    full.start(prompts)
    picked.start(prompts)
    for logits_at in ([2, 0, 1], [2, 2, 2], [0, 0, 0]):
        expected = full.extend(tokens)[torch.arange(3), torch.tensor(logits_at)]  # [B, V]
        logits = picked.extend(tokens, logits_at)
        assert logits.shape == (3, VOCAB)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
        full.rewind([1, 2, 0])
        picked.rewind([1, 2, 0])
    nxt = torch.tensor([[20], [21], [22]])
    torch.testing.assert_close(picked.extend(nxt), full.extend(nxt), atol=1e-5, rtol=1e-5)
    for bad in ([0, 1], [0, 1, 2]):  # two rows for three; column 2 of a 2-token pass
        with pytest.raises(ShapeError, match="logits_at"):
            picked.extend(tokens[:, :2], bad)


def test_rows_that_move_on_a_leave_keep_their_keys_and_values(target):
    """A leave moves the last rows into the freed slots, copying each moved row's held
    positions only (not the cache's whole capacity): the rows that stay, moved or not, then
    continue exactly as a fresh forward over their own history, and so do new tokens written
    past what was copied. A moved row's stale tail (a longer row's keys in its new slot) is
    never read."""
    lm = FastLlamaLM(target)
    prompts = [list(range(1, 40)), [2, 3], [4, 5, 6, 7], [8] * 9]
    session = lm.new_session()
    session.start(prompts)  # capacity 128: every row holds far fewer positions
    session.extend(torch.tensor([[50], [51], [52], [53]]))
    history = [p + [50 + i] for i, p in enumerate(prompts)]
    session.keep_rows([3, 1, 2])  # row 0 leaves: row 3 moves into slot 0 over its 40 keys
    check_next_logits(target, session, [history[3], history[1], history[2]], first_token=60)


def test_packed_feed_writes_what_single_row_extends_write(target):
    """models.packed against the padded forward, row by row: after a packed feed of ragged
    rows (a row mid-sequence, an empty one, a 40-token one), every layer's keys and values at
    each row's positions equal those of feeding that row alone, one extend at a time, to
    float32 rounding (the projections see the rows in another layout)."""
    lm = FastLlamaLM(target)
    prompts = [[1, 2, 3], [4], [5, 6]]
    rows = [[7, 8], [], list(range(10, 50))]
    packed = lm.new_session()
    packed.start(prompts)
    packed.feed(rows)
    for row, (prompt, fed) in enumerate(zip(prompts, rows)):
        alone = lm.new_session()
        alone.start([prompt])
        for token in fed:
            alone.extend(torch.tensor([[token]]))
        end = len(prompt) + len(fed)
        for layer in range(len(lm.layers)):
            for mine, theirs in ((packed.cache.keys, alone.cache.keys),
                                 (packed.cache.values, alone.cache.values)):
                torch.testing.assert_close(mine[layer][row, :, :end], theirs[layer][0, :, :end],
                                           atol=1e-5, rtol=1e-5)


def pack_every_weight(monkeypatch) -> None:
    """Under "onednn", pack even the tiny test models' weights (by default a weight under
    SMALL_WEIGHT_ELEMENTS stays dense for ATen, and every weight here is that small)."""
    monkeypatch.setattr(matmul_module, "SMALL_WEIGHT_ELEMENTS", 0)


@pytest.mark.parametrize("matmul,packed", [("aten", False)] + [
    pytest.param("onednn", packed, id=f"onednn-{'every-weight-packed' if packed else 'default'}",
                 marks=pytest.mark.skipif(not onednn_available(), reason="no oneDNN"))
    for packed in (False, True)])
def test_plain_and_speculative_greedy_agree_under_each_kernel(target, draft, matmul, packed,
                                                              monkeypatch):
    # exactness is with respect to the target as run: one kernel for both paths
    if packed:
        pack_every_weight(monkeypatch)
    lm = FastLlamaLM(target, matmul=matmul)
    decoder = Engine.from_draft_model(lm, FastLlamaLM(draft, matmul=matmul))
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=3,
                              sampling=SamplingConfig(temperature=0.0))
    plain = decoder.generate(PROMPTS, config, speculative=False)
    speculative = decoder.generate(PROMPTS, config)
    assert lm.matmul == matmul
    assert speculative.token_ids == plain.token_ids
    assert speculative.metrics.num_accepted > 0  # the draft was really tested


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_projections_match_aten_and_are_deterministic(target, monkeypatch):
    pack_every_weight(monkeypatch)
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    logits = {}
    for matmul in ("aten", "onednn"):
        session = FastLlamaLM(target, matmul=matmul).new_session()
        session.start([[1, 2], [3, 4]])
        logits[matmul] = session.extend(tokens)
    torch.testing.assert_close(logits["onednn"], logits["aten"], atol=1e-5, rtol=1e-5)
    session = FastLlamaLM(target, matmul="onednn").new_session()
    session.start([[1, 2], [3, 4]])
    assert torch.equal(session.extend(tokens), logits["onednn"])  # same input, same bits


def assert_extend_matches_forward(lm: FastLlamaLM, model) -> None:
    """Logits of a 2-token prompt then a 4-token extend equal the model's own forward."""
    session = lm.new_session()
    session.start([[1, 2]])
    with torch.inference_mode():
        fresh = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits[:, 2:]
    logits = session.extend(torch.tensor([[3, 4, 5, 6]]))
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_reads_packed_copies_and_leaves_the_models_weights_as_they_were(monkeypatch):
    pack_every_weight(monkeypatch)
    model = tiny_llama(VOCAB, seed=13, hidden=64, layers=2)
    attn = model.model.layers[0].self_attn
    before = attn.o_proj.weight.clone()
    lm = FastLlamaLM(model, matmul="onednn")
    # packed: oneDNN's blocked layout, read only by its kernel (models/fast_llama/matmul.py)
    assert all(w.is_mkldnn for layer in lm.layers
               for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert lm.head_weight.is_mkldnn
    # the model keeps dense weights with the same values, so its own forward still runs
    assert not attn.o_proj.weight.is_mkldnn and torch.equal(attn.o_proj.weight, before)
    assert not FastLlamaLM(model, matmul="aten").layers[0].o.is_mkldnn
    assert_extend_matches_forward(lm, model)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_leaves_small_weights_to_aten_and_packs_large_ones():
    # hidden 64, vocabulary 4096: the output layer (4096 x 64 = 2^18 elements) is packed, every
    # layer's projections (at most 256 x 64) are under SMALL_WEIGHT_ELEMENTS and stay dense
    model = tiny_llama(4096, seed=14, hidden=64, layers=1)
    lm = FastLlamaLM(model, matmul="onednn")
    assert lm.head_weight.is_mkldnn
    layer = lm.layers[0]
    assert not any(w.is_mkldnn for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert layer.o is model.model.layers[0].self_attn.o_proj.weight  # no copy where not packed
    assert_extend_matches_forward(lm, model)


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_a_draft_picks_its_small_projections_kernel_by_rows_and_stays_exact(target, draft):
    # a draft (draft=True) keeps small weights dense and packed: ATen over one row, oneDNN over
    # more. Its numbers then differ between batch sizes, which exactness allows: greedy
    # speculative output still equals plain decoding of the target
    lm = FastLlamaLM(draft, matmul="onednn", draft=True)
    layer = lm.layers[0]
    assert isinstance(layer.qkv, matmul_module.BothLayouts) and layer.qkv.packed.is_mkldnn
    assert not layer.qkv.dense.is_mkldnn
    calls = []
    real_linear = torch.ops.mkldnn._linear_pointwise
    def counting(*args):
        calls.append(args[0].shape)
        return real_linear(*args)
    session = lm.new_session()
    session.start([[1, 2, 3]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matmul_module.torch.ops.mkldnn, "_linear_pointwise", counting)
        one_row = session.extend(torch.tensor([[4]]))
        assert calls == []  # one row: every small projection by ATen
        session.rewind([1])
        two_rows = session.extend(torch.tensor([[4, 5]]))
        assert len(calls) == 4 * len(lm.layers) + 1  # two rows: all by oneDNN, the head too
    with torch.inference_mode():
        fresh = draft(torch.tensor([[1, 2, 3, 4, 5]])).logits[0, 3:]
    torch.testing.assert_close(one_row[0, 0], fresh[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two_rows[0], fresh, atol=1e-5, rtol=1e-5)
    # a target never gets both layouts: its kernel is fixed per weight
    assert not isinstance(FastLlamaLM(target, matmul="onednn").layers[0].qkv,
                          matmul_module.BothLayouts)
    decoder = Engine.from_draft_model(FastLlamaLM(target, matmul="onednn"), lm)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=3,
                              sampling=SamplingConfig(temperature=0.0))
    speculative = decoder.generate(PROMPTS, config)
    assert speculative.token_ids == decoder.generate(PROMPTS, config, speculative=False).token_ids
    assert speculative.metrics.num_accepted > 0


def test_wrap_model_gives_only_the_draft_the_by_rows_kernel(target):
    by_rows = wrap_model(target, VOCAB, "fast", draft=True)
    assert by_rows.linear is (matmul_module._linear_by_rows if by_rows.matmul == "onednn"
                              else torch.nn.functional.linear)
    assert wrap_model(target, VOCAB, "fast").linear is not matmul_module._linear_by_rows


def test_matmul_auto_picks_onednn_only_for_fp32_on_cpus_other_than_intels(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(matmul_module.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(matmul_module, "cpu_vendor", lambda: "GenuineIntel")
    assert resolve_matmul("auto", cpu, torch.float32) == "aten"
    monkeypatch.setattr(matmul_module, "cpu_vendor", lambda: "AuthenticAMD")
    expected = "onednn" if onednn_available() else "aten"
    assert resolve_matmul("auto", cpu, torch.float32) == expected
    assert resolve_matmul("auto", cpu, torch.bfloat16) == "aten"  # ATen uses oneDNN already
    assert resolve_matmul("auto", torch.device("cuda"), torch.float32) == "aten"
    monkeypatch.setattr(matmul_module.platform, "machine", lambda: "arm64")
    assert resolve_matmul("auto", cpu, torch.float32) == "aten"
    assert resolve_matmul("aten", cpu, torch.float32) == "aten"


def test_matmul_choice_errors_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match="matmul='blas' is invalid: expected one of auto"):
        resolve_matmul("blas", torch.device("cpu"), torch.float32)
    with pytest.raises(UnsupportedFeatureError, match="device=cuda.*Use matmul='aten'"):
        resolve_matmul("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(UnsupportedFeatureError, match="float16"):
        resolve_matmul("onednn", torch.device("cpu"), torch.float16)


# ---------------------------------------------------------------------------------------------
# Llama-compatible architectures: Mistral and Qwen2 (q/k/v biases) without a window


def llama_compatible(model_type: str, seed: int, **overrides):
    from arch_specs import Arch

    arch = Arch(model_type, model_type, "", dict(hidden_size=64, **overrides))
    model = arch.build(3, seed=seed, vocab_size=VOCAB)
    with torch.no_grad():  # random init leaves Qwen2's biases at zero: make them count
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_llama_compatible_architectures_take_the_fast_path_exactly(model_type):
    target = llama_compatible(model_type, seed=21, sliding_window=None)
    draft = llama_compatible(model_type, seed=22, sliding_window=None)
    assert supports(target) and isinstance(wrap_model(target, VOCAB, "auto"), FastLlamaLM)
    if model_type == "qwen2":
        assert target.model.layers[0].self_attn.q_proj.bias is not None
    check_logits_after_random_extend_and_rewind(target, FastLlamaLM(target).new_session(), VOCAB)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=3,
                              sampling=SamplingConfig(temperature=0.0))
    fast = Engine.from_draft_model(FastLlamaLM(target), FastLlamaLM(draft))
    reference = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    assert fast.generate(PROMPTS, config).token_ids == reference.generate(PROMPTS, config).token_ids


@pytest.mark.parametrize("model_type, window", [("mistral", dict(sliding_window=8)),
                                                ("qwen2", dict(sliding_window=8,
                                                               use_sliding_window=True,
                                                               max_window_layers=1))])
def test_a_windowed_model_takes_the_transformers_path(model_type, window):
    model = llama_compatible(model_type, seed=23, **window)
    assert not supports(model)
    assert isinstance(wrap_model(model, VOCAB, "auto"), TransformersLM)
    with pytest.raises(ConfigError, match="fast Llama path does not support"):
        wrap_model(model, VOCAB, "fast")


# a process that packs a 512 x 512 weight through the library, multiplies one row, then N other
# row counts, then one row again; oneDNN's verbose mode prints a line per primitive compiled
CACHE_SCRIPT = """
import sys, torch
from verispec.models.fast_llama.matmul import linear_kernel
kernel = linear_kernel("onednn")
weight = kernel.prepare(torch.randn(512, 512))
for rows in [1, *range(2, 2 + int(sys.argv[1])), 1]:
    kernel.linear(torch.randn(rows, 512), weight)
"""


def one_row_compilations(num_other_shapes: int, **env: str) -> int:
    """How many times the process above compiled its one-row product (the environment: this
    one's without the cache variables, which the library set here, plus ``env``)."""
    inherited = {name: value for name, value in os.environ.items()
                 if name not in matmul_module.ONEDNN_CACHE_VARIABLES}
    completed = subprocess.run(
        [sys.executable, "-c", CACHE_SCRIPT, str(num_other_shapes)], capture_output=True,
        text=True, timeout=120, check=True,
        env={**inherited, "ONEDNN_VERBOSE": "profile_create", **env})
    return sum("create:cache_miss" in line and ",mb1ic512oc512," in line
               for line in completed.stdout.splitlines())


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_caches_are_bounded_unless_the_environment_sets_them():
    """A server meets a new row count in most passes that carry prompts; oneDNN's and ideep's
    caches keep every compiled product (1024 each by default) and its memory grew for minutes.
    The library caps both (models.fast_llama.matmul.bound_onednn_caches): the one-row product,
    pushed out by more shapes than the cap, is compiled again; with the user's own larger capacities
    (the control) it is compiled once."""
    beyond_cap = matmul_module.ONEDNN_CACHE_CAPACITY + 44
    assert one_row_compilations(beyond_cap) == 2
    users = dict.fromkeys(matmul_module.ONEDNN_CACHE_VARIABLES, "1024")
    assert one_row_compilations(beyond_cap, **users) == 1
