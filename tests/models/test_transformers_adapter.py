"""The transformers adapter on tiny real models: greedy equality, cache rewind, vocab, context.

Three layers of evidence that the adapter (models/hf/adapter.py) is exact:
  * greedy equality, token for token, between speculative decoding (k in {1, 2, 4, 8}), plain
    decoding through the same engine, and transformers' own ``model.generate``, on a tiny
    random-init Llama and GPT-2 (batched ragged prompts and batch 1 through verispec.load) and
    on the shipped demo pair;
  * a draft identical to the target accepts every draft token;
  * after any extend / rewind sequence (and any score / commit round) the next logits equal a
    fresh full forward over the same tokens.
Plus the vocabulary restriction (a draft padded wider than the tokenizer) and the context
window checks.

EOS: ``model.generate`` stops at the EOS token while the engine (no stop ids) keeps going, so
every comparison with ``model.generate`` cuts the engine's tokens after the first EOS, keeping
it (``cut_after_eos``). min_new_tokens is not used: it masks EOS out of the logits, which
changes the greedy choice whenever EOS is the argmax.

Legend: B batch, n fed tokens, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import verispec
from verispec import (
    ContextLengthExceeded,
    Engine,
    GenerationConfig,
    IncompatibleModelsError,
    SamplingConfig,
)
from verispec.engine.scorer import TargetScorer
from verispec.models.hf.adapter import TransformersLM, output_width
from verispec.proposers.base import DraftPlan
from verispec.proposers.draft_model import DraftModelProposer
from verispec.sample.sampling import make_generator, to_probs
from verispec.text.decoder import Decoder
from verispec.text.demo import DemoAssetsMissingError, demo_pair, heldout_prompts

from tiny_models import (
    PROMPTS,
    build_tokenizer,
    layer_dropped_draft,
    save_model,
    untied_gpt2,
    untied_llama,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

NUM_NEW_TOKENS = 48
KS = (1, 2, 4, 8)
GREEDY = SamplingConfig(temperature=0.0)
ATOL = 1e-4  # float32: a k+1-token pass and 1-token passes differ by ~1e-7 on these logits


def greedy_config(num_draft_tokens: int = 4, max_new_tokens: int = NUM_NEW_TOKENS
                  ) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                            sampling=GREEDY, seed=0)


def cut_after_eos(tokens: list[int], eos: int) -> list[int]:
    """tokens up to and including the first EOS (what model.generate returns)."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """transformers' own greedy decoding, one prompt at a time (no padding), stopping at EOS."""
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])  # [1, T]
        with torch.inference_mode():
            sequences = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                       do_sample=False, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos, pad_token_id=eos)
        outputs.append(sequences[0, len(prompt):].tolist())
    return outputs


def fresh_last_logits(model, tokens: list[int], num_last: int) -> torch.Tensor:
    """Logits after each of the last num_last tokens, from a fresh forward. -> [num_last, V]."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -num_last:]


# ---------------------------------------------------------------------------------------------
# fixtures: tiny target/draft pairs over one tokenizer, built once per module


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@dataclass
class TinyPair:
    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    engine: Engine
    prompts: list[list[int]]  # the tokenised PROMPTS (12, ragged lengths)
    target_dir: Path
    draft_dir: Path
    eos: int


BUILDERS = {"llama": untied_llama, "gpt2": untied_gpt2}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny_pair(request, tokenizer, tmp_path_factory) -> TinyPair:
    """A 2-layer target and its 1-layer draft (shared embeddings and head: greedy acceptance
    around 0.4, so both the accepted and the rejected paths of verification run)."""
    target = BUILDERS[request.param](len(tokenizer), seed=1)
    draft = layer_dropped_draft(target, num_layers=1)
    root = tmp_path_factory.mktemp(request.param)
    engine = Engine.from_draft_model(TransformersLM(target), TransformersLM(draft))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts) >= 10 and len({len(p) for p in prompts}) > 1  # a ragged batch
    return TinyPair(request.param, target, draft, engine, prompts,
                    save_model(target, tokenizer, root / "target"),
                    save_model(draft, tokenizer, root / "draft"), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def greedy_reference(tiny_pair):
    """Plain greedy decoding through the engine (batched) and through model.generate."""
    plain = tiny_pair.engine.generate(tiny_pair.prompts, greedy_config(), speculative=False)
    hf = hf_greedy(tiny_pair.target, tiny_pair.prompts, NUM_NEW_TOKENS, tiny_pair.eos)
    return plain.token_ids, hf


# ---------------------------------------------------------------------------------------------
# greedy equality on the tiny models


def test_plain_decoding_matches_hf_generate(tiny_pair, greedy_reference):
    plain, hf = greedy_reference
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in plain)
    assert [cut_after_eos(tokens, tiny_pair.eos) for tokens in plain] == hf
    assert sum(len(tokens) == NUM_NEW_TOKENS for tokens in hf) >= 10  # EOS cuts only a few
    assert sum(len(set(tokens)) > 5 for tokens in plain) >= 10  # not a constant sequence


@pytest.mark.parametrize("k", KS)
def test_speculative_greedy_matches_plain_and_hf_batched(tiny_pair, greedy_reference, k):
    plain, hf = greedy_reference
    result = tiny_pair.engine.generate(tiny_pair.prompts, greedy_config(k))
    for row, tokens in enumerate(result.token_ids):
        assert tokens == plain[row], f"{tiny_pair.name} k={k} prompt {PROMPTS[row]!r}"
        assert cut_after_eos(tokens, tiny_pair.eos) == hf[row]
    # both paths of verification ran: some draft tokens accepted, some rejected
    assert 0.0 < result.metrics.acceptance_rate < 1.0, result.metrics.acceptance_rate
    assert result.metrics.num_rounds < NUM_NEW_TOKENS


@pytest.fixture(scope="module")
def tiny_decoder(tiny_pair):
    return verispec.load(tiny_pair.target_dir, tiny_pair.draft_dir)


def test_speculative_greedy_batch_one_through_load(tiny_pair, tiny_decoder, greedy_reference):
    """One prompt at a time: through verispec.load on saved dirs (Decoder stops at EOS, like
    generate; load may pick its fast backend for Llama) and through the engine on the
    transformers adapter."""
    plain, hf = greedy_reference
    for row, k in ((0, 1), (4, 2), (5, 4), (11, 8)):
        single = tiny_pair.engine.generate([tiny_pair.prompts[row]], greedy_config(k))
        assert single.token_ids == [plain[row]], f"{tiny_pair.name} k={k} row {row}"
        out = tiny_decoder.generate(PROMPTS[row], max_new_tokens=NUM_NEW_TOKENS,
                                    num_draft_tokens=k)
        assert out.num_prompt_tokens == len(tiny_pair.prompts[row])
        assert out.token_ids == hf[row], f"{tiny_pair.name} k={k} prompt {PROMPTS[row]!r}"


# ---------------------------------------------------------------------------------------------
# a draft equal to the target accepts everything


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_identical_draft_accepts_every_token(tiny_pair, temperature):
    same = TransformersLM(tiny_pair.target)
    engine = Engine.from_draft_model(same, TransformersLM(tiny_pair.target))
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, seed=3,
                              sampling=SamplingConfig(temperature=temperature))
    result = engine.generate(tiny_pair.prompts, config)
    # At temperature 1 a token is accepted iff u < min(1, p/q), and p (one pass over k+1 tokens)
    # and q (one token per pass) differ only by float rounding (~1e-7 relative), so a rejection
    # has probability ~1e-7 per token: with this seed none happens.
    assert result.metrics.num_drafted > 0
    assert result.metrics.acceptance_rate == 1.0
    assert all(len(tokens) == 32 for tokens in result.token_ids)


# ---------------------------------------------------------------------------------------------
# cache rewind: the next logits always equal a fresh forward


def test_random_extend_rewind_matches_fresh_forward(tiny_pair):
    model = tiny_pair.target
    vocab_size = output_width(model)
    rng = random.Random(1234)
    token_gen = torch.Generator().manual_seed(1234)
    rows = [[5, 9, 17, 33, 2, 8, 11], [40], [7, 7, 1, 99, 123, 64, 3, 200, 19, 4, 6, 150]]
    session = TransformersLM(model).new_session()
    session.start(rows)
    for step in range(40):
        if step % 2 == 1:  # a ragged rewind (some rows by 0), always followed by an extend
            num_rewound = [rng.randint(0, min(4, len(r) - 1)) for r in rows]
            session.rewind(torch.tensor(num_rewound))
            rows = [r[: len(r) - n] for r, n in zip(rows, num_rewound)]
        num_new = rng.randint(1, 5)
        new_tokens = torch.randint(0, vocab_size, (len(rows), num_new), generator=token_gen)
        logits = session.extend(new_tokens)  # [B, n, V]
        rows = [r + t for r, t in zip(rows, new_tokens.tolist())]
        assert session.lengths.tolist() == [len(r) for r in rows]
        for b, row in enumerate(rows):
            torch.testing.assert_close(logits[b], fresh_last_logits(model, row, num_new),
                                       atol=ATOL, rtol=0, msg=f"step {step}, row {b}")
    assert session.cache.capacity > 64  # the rows outgrew the first allocation: grow() ran


def test_target_scorer_rounds_match_fresh_forward(tiny_pair):
    """score [pending, d_1..d_k] -> commit n accepted + next token, repeatedly, ragged n."""
    model = tiny_pair.target
    vocab_size = output_width(model)
    token_gen = torch.Generator().manual_seed(7)
    committed = [list(p) for p in tiny_pair.prompts[:3]]
    scorer = TargetScorer(TransformersLM(model).new_session(), committed)
    for round_index, num_accepted in enumerate(([0, 2, 4], [4, 0, 1], [3, 3, 0], [1, 4, 2])):
        draft_tokens = torch.randint(0, vocab_size, (3, 4), generator=token_gen)  # [B, K]
        target_logits = scorer.score(draft_tokens)  # [B, K+1, V]
        for b in range(3):
            expected = fresh_last_logits(model, committed[b] + draft_tokens[b].tolist(), 5)
            torch.testing.assert_close(target_logits[b], expected, atol=ATOL, rtol=0,
                                       msg=f"round {round_index}, row {b}")
        next_tokens = torch.randint(0, vocab_size, (3,), generator=token_gen)  # [B]
        scorer.commit(torch.tensor(num_accepted), next_tokens)
        for b, n in enumerate(num_accepted):
            committed[b] += draft_tokens[b, :n].tolist() + [int(next_tokens[b])]


def test_draft_proposer_rounds_match_fresh_forward(tiny_pair):
    """The draft's reported probabilities are softmax(fresh forward) after every commit."""
    model = tiny_pair.draft
    vocab_size = output_width(model)
    sampling = SamplingConfig(temperature=1.0)
    generator = make_generator(11)
    token_gen = torch.Generator().manual_seed(11)
    committed = [list(p) for p in tiny_pair.prompts[3:6]]
    session = DraftModelProposer(TransformersLM(model)).start(committed)
    for num_accepted in ([0, 3, 1], [3, 3, 3], [2, 0, 0], [1, 2, 3]):
        proposal = session.propose(DraftPlan.uniform(3, 3, sampling, generator))
        for b in range(3):
            drafted = proposal.draft_tokens[b].tolist()
            expected_logits = fresh_last_logits(model, committed[b] + drafted[:2], 3)
            torch.testing.assert_close(proposal.draft_probs[b],
                                       to_probs(expected_logits, sampling), atol=1e-5, rtol=0)
        next_tokens = torch.randint(0, vocab_size, (3,), generator=token_gen)
        session.commit(torch.tensor(num_accepted), next_tokens)
        for b, n in enumerate(num_accepted):
            committed[b] += proposal.draft_tokens[b, :n].tolist() + [int(next_tokens[b])]


# ---------------------------------------------------------------------------------------------
# vocabulary restriction


@pytest.fixture(scope="module")
def wide_draft_dirs(tokenizer, tmp_path_factory):
    """A target of exact width V and a draft whose output layer is padded to V + 3.

    The padded rows are +100u and -100u for a random u: whatever the hidden state h, one of
    them scores |100 h.u|, so an unrestricted draft would (almost) always pick a padding id.
    """
    vocab_size = len(tokenizer)
    target = untied_llama(vocab_size, seed=21)
    draft = untied_llama(vocab_size + 3, seed=22, hidden=16, layers=1)
    with torch.no_grad():
        direction = torch.randn(16, generator=torch.Generator().manual_seed(0))
        draft.lm_head.weight[vocab_size] = 100.0 * direction
        draft.lm_head.weight[vocab_size + 1] = -100.0 * direction
    root = tmp_path_factory.mktemp("wide")
    return save_model(target, tokenizer, root / "target"), save_model(draft, tokenizer,
                                                                      root / "draft")


def test_padded_draft_logits_are_restricted_to_tokenizer(tokenizer, wide_draft_dirs):
    vocab_size = len(tokenizer)
    decoder = verispec.load(*wide_draft_dirs)
    draft_model = decoder.draft.model
    assert output_width(draft_model) == vocab_size + 3
    assert decoder.draft.vocab_size == decoder.target.vocab_size == vocab_size
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    with torch.inference_mode():
        full_logits = draft_model(torch.tensor([prompts[0]])).logits[0]  # [T, V + 3]
    assert bool((full_logits.argmax(-1) >= vocab_size).all())  # padding would win unrestricted
    # the transformers adapter itself (load may pick another backend for Llama models)
    session = TransformersLM(draft_model, vocab_size).new_session()
    session.start([prompts[0][:-2]])
    logits = session.extend(torch.tensor([prompts[0][-2:]]))  # [1, 2, V]
    assert logits.shape[-1] == vocab_size
    torch.testing.assert_close(logits[0], full_logits[-2:, :vocab_size], atol=ATOL, rtol=0)


def test_padded_draft_generates_exactly(tokenizer, wide_draft_dirs):
    vocab_size = len(tokenizer)
    decoder = verispec.load(*wide_draft_dirs)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    config = greedy_config(4, max_new_tokens=24)
    speculative = decoder.engine.generate(prompts, config)
    plain = decoder.engine.generate(prompts, config, speculative=False)
    assert speculative.token_ids == plain.token_ids
    sampled = decoder.engine.generate(prompts, GenerationConfig(
        max_new_tokens=24, num_draft_tokens=4, sampling=SamplingConfig(temperature=1.0), seed=5))
    assert max(max(tokens) for tokens in sampled.token_ids) < vocab_size
    assert sampled.metrics.num_drafted > 0


def test_output_layer_narrower_than_tokenizer_is_rejected(tokenizer):
    narrow = untied_llama(len(tokenizer) - 1, seed=3, hidden=16, layers=1)
    with pytest.raises(IncompatibleModelsError, match=str(len(tokenizer))):
        Decoder(narrow, tokenizer)


# ---------------------------------------------------------------------------------------------
# context window


@pytest.fixture(scope="module")
def short_window_decoder(tokenizer):
    """Target window 64, draft window 32 (Llama: positions past the window would not crash, so
    only the check guards them)."""
    vocab_size = len(tokenizer)
    target = untied_llama(vocab_size, seed=31, max_positions=64)
    draft = untied_llama(vocab_size, seed=32, hidden=16, layers=1, max_positions=32)
    return Decoder(target, tokenizer, draft, num_draft_tokens=4)


PROMPT_10 = list(range(10, 20))  # 10 token ids


def test_context_overflow_of_target(short_window_decoder):
    with pytest.raises(ContextLengthExceeded) as info:
        short_window_decoder.generate(PROMPT_10, max_new_tokens=51)  # 10 + 51 + 4 = 65 > 64
    message = str(info.value)
    for number in ("10", "51", "4", "65", "64", "target"):
        assert number in message, message
    with pytest.raises(ContextLengthExceeded, match="64"):  # plain decoding: 10 + 55 > 64
        short_window_decoder.generate(PROMPT_10, max_new_tokens=55, speculative=False)


def test_context_overflow_of_draft_window(short_window_decoder):
    with pytest.raises(ContextLengthExceeded) as info:
        short_window_decoder.generate(PROMPT_10, max_new_tokens=20)  # 10 + 20 + 4 = 34 > 32
    message = str(info.value)
    for number in ("10", "20", "34", "32", "draft"):
        assert number in message, message
    # the draft's window does not bind plain decoding, and k = 2 fits exactly (32 = 32)
    assert len(short_window_decoder.generate(PROMPT_10, max_new_tokens=20,
                                             speculative=False).token_ids) == 20
    assert len(short_window_decoder.generate(PROMPT_10, max_new_tokens=20,
                                             num_draft_tokens=2).token_ids) == 20


def test_context_boundary_on_learned_positions(tokenizer):
    """GPT-2's position table has exactly n_positions rows: a generation that fits the check
    exactly must run, one more token must be refused before any forward pass."""
    vocab_size = len(tokenizer)
    target = untied_gpt2(vocab_size, seed=41, max_positions=32)
    decoder = Decoder(target, tokenizer, layer_dropped_draft(target), num_draft_tokens=4)
    out = decoder.generate(PROMPT_10, max_new_tokens=18)  # 10 + 18 + 4 = 32
    assert len(out.token_ids) == 18 or out.finish_reason == "stop"
    with pytest.raises(ContextLengthExceeded, match="33"):
        decoder.generate(PROMPT_10, max_new_tokens=19)


# ---------------------------------------------------------------------------------------------
# the shipped demo pair (needs src/verispec/assets/demo; being trained when this was written)


@pytest.fixture(scope="module")
def demo_decoder():
    try:
        demo_pair()
    except DemoAssetsMissingError as exc:
        pytest.fail(f"the demo pair assets are missing, so the demo tests cannot run: {exc}")
    return verispec.load()


@pytest.fixture(scope="module")
def demo_engine(demo_decoder):
    """The demo pair on the transformers adapter (verispec.load may pick another backend)."""
    vocab_size = demo_decoder.target.vocab_size
    return Engine.from_draft_model(
        TransformersLM(demo_decoder.target.model, vocab_size),
        TransformersLM(demo_decoder.draft.model, vocab_size))


@pytest.fixture(scope="module")
def demo_reference(demo_decoder, demo_engine):
    texts = heldout_prompts()[:10]  # read once: every test below uses these same prompts
    prompts = [demo_decoder.tokenizer.encode(p) for p in texts]
    assert len(prompts) == 10
    eos = demo_decoder.tokenizer.eos_token_id
    plain = demo_engine.generate(prompts, greedy_config(), speculative=False)
    hf = hf_greedy(demo_decoder.target.model, prompts, NUM_NEW_TOKENS, eos)
    return texts, prompts, plain.token_ids, hf


def test_demo_plain_decoding_matches_hf_generate(demo_decoder, demo_reference):
    _, _, plain, hf = demo_reference
    eos = demo_decoder.tokenizer.eos_token_id
    assert [cut_after_eos(tokens, eos) for tokens in plain] == hf


@pytest.mark.parametrize("k", KS)
def test_demo_speculative_greedy_matches_plain_and_hf(demo_decoder, demo_engine, demo_reference,
                                                      k):
    texts, prompts, plain, hf = demo_reference
    eos = demo_decoder.tokenizer.eos_token_id
    result = demo_engine.generate(prompts, greedy_config(k))
    assert result.token_ids == plain
    assert [cut_after_eos(tokens, eos) for tokens in result.token_ids] == hf
    assert result.metrics.acceptance_rate > 0.0
    # batch 1 through the text API, whatever backend load() chose (stops at EOS, as
    # model.generate does)
    out = demo_decoder.generate(texts[k], max_new_tokens=NUM_NEW_TOKENS, num_draft_tokens=k)
    assert out.token_ids == hf[k]
