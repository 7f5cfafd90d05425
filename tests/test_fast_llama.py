"""The flat Llama forward (models/fast_llama.py) against its reference, the transformers forward."""

from __future__ import annotations

import pytest
import torch

from tiny_models import tiny_gpt2, tiny_llama
from verispec import GenerationConfig, SamplingConfig, SpeculativeDecoder
from verispec.api import wrap_model
from verispec.errors import ConfigError, ShapeError
from verispec.models.fast_llama import FastLlamaLM, supports
from verispec.models.transformers import TransformersLM

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB = 97
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12, 13], [20], [30, 31, 32]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=11, hidden=64, layers=3)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(VOCAB, seed=12, hidden=32, layers=1)


def _fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def test_logits_match_transformers_after_random_extend_and_rewind(target):
    generator = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    session = FastLlamaLM(target).new_session()
    session.start(prompts)
    history = [list(p) for p in prompts]
    for _ in range(12):
        n = int(torch.randint(1, 5, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (3, n), generator=generator)
        logits = session.extend(tokens)
        for row in range(3):
            history[row].extend(tokens[row].tolist())
            torch.testing.assert_close(logits[row, -1], _fresh_logits(target, history[row]),
                                       atol=1e-4, rtol=1e-4)
        rewind = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=generator))
                               for _ in range(3)])
        session.rewind(rewind)
        for row in range(3):
            del history[row][len(history[row]) - int(rewind[row]):]


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


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_reference_backend_and_generate(target, draft, generate_reference, k):
    config = GenerationConfig(max_new_tokens=48, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0.0))
    fast = SpeculativeDecoder.from_draft_model(FastLlamaLM(target), FastLlamaLM(draft))
    reference = SpeculativeDecoder.from_draft_model(TransformersLM(target), TransformersLM(draft))
    fast_ids = fast.generate(PROMPTS, config).token_ids  # one ragged batch
    assert fast_ids == reference.generate(PROMPTS, config).token_ids
    assert fast_ids == generate_reference


def test_sampled_output_equals_reference_backend_with_same_seed(target, draft):
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, seed=5,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.9))
    fast = SpeculativeDecoder.from_draft_model(FastLlamaLM(target), FastLlamaLM(draft))
    reference = SpeculativeDecoder.from_draft_model(TransformersLM(target), TransformersLM(draft))
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
