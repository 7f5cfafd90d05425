"""Decoder.prompt_logprobs (engine/scoring.py): a prompt's tokens scored by the target, equal to
a direct transformers forward's log_softmax on every backend, apart from running generations.

Tolerances: the fast path and the transformers adapter agree with transformers' own forward to
1e-4; llama.cpp (the demo target exported to F32 GGUF) computes in its own kernels with an
f16 KV cache, and agrees to 1e-2 (the measurement behind it: dev/LOG.md).
"""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec.engine.scoring import SCORING_CHUNK
from verispec.errors import ConfigError, ContextLengthExceeded, TokenOutOfRangeError
from verispec.text.demo import demo_pair

from direct_logprobs import direct_logprobs, load_demo_target

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
LLAMA_CPP_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def reference():
    return load_demo_target()


def max_error(scored, expected: torch.Tensor, ids: list[int]) -> float:
    """The largest gap over every token's logprob and every listed alternative."""
    gaps = [0.0]
    for i in range(1, len(ids)):
        gaps.append(abs(scored[i].logprob - expected[i - 1, ids[i]].item()))
        gaps += [abs(value - expected[i - 1, token].item()) for token, value in scored[i].top]
    return max(gaps)


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_prompt_logprobs_equal_a_direct_forward(backend, reference):
    decoder = verispec.load(backend=backend)
    ids = decoder.tokenizer.encode(PROMPT * 16)
    assert len(ids) > SCORING_CHUNK  # more than one pass
    scored = decoder.prompt_logprobs(ids, num_top=5)
    assert len(scored) == len(ids) and scored[0] is None
    assert [lp.token_id for lp in scored[1:]] == ids[1:]
    assert max_error(scored, direct_logprobs(reference, ids), ids) < 1e-4
    for lp in scored[1:]:
        values = [value for _, value in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] + 1e-6
    # text is encoded as generate encodes it
    assert decoder.prompt_logprobs(PROMPT) == decoder.prompt_logprobs(
        decoder.tokenizer.encode(PROMPT))


def test_prompt_logprobs_leave_a_running_generation_alone():
    decoder = verispec.load()
    expected = decoder.generate(PROMPT, max_new_tokens=24)
    stream = decoder.stream(PROMPT, max_new_tokens=24)
    text = next(stream)
    assert decoder.prompt_logprobs(PROMPT * 3, num_top=2)[1].top
    text += "".join(stream)
    assert text == expected.text and stream.completion.token_ids == expected.token_ids


def test_prompt_logprobs_bad_inputs_are_typed_errors():
    decoder = verispec.load()
    assert decoder.prompt_logprobs([5]) == [None]
    for num_top in (-1, 21, 2.0, True):
        with pytest.raises(ConfigError, match="num_top"):
            decoder.prompt_logprobs(PROMPT, num_top)
    with pytest.raises(TokenOutOfRangeError):
        decoder.prompt_logprobs([1, decoder.target.vocab_size])
    with pytest.raises(ContextLengthExceeded):
        decoder.prompt_logprobs([1] * (decoder.target.max_positions + 1))


def test_prompt_logprobs_on_llama_cpp(tmp_path, reference):
    pytest.importorskip("llama_cpp")
    from verispec.models.gguf_export import export_gguf

    pair = demo_pair()
    decoder = verispec.load(str(export_gguf(pair.target, tmp_path / "target.gguf")),
                            str(export_gguf(pair.draft, tmp_path / "draft.gguf")),
                            backend="llama.cpp")
    ids = decoder.tokenizer.encode(PROMPT * 16)
    expected = decoder.generate(PROMPT, max_new_tokens=16)
    stream = decoder.stream(PROMPT, max_new_tokens=16)
    text = next(stream)
    # llama.cpp keeps one live session a model: scoring runs on a context of its own
    scored = decoder.prompt_logprobs(ids, num_top=3)
    assert text + "".join(stream) == expected.text
    assert max_error(scored, direct_logprobs(reference, ids), ids) < LLAMA_CPP_TOLERANCE
