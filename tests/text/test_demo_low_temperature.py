"""The default sampler at a low temperature and under a logit_bias of +100, on the shipped demo
pair (verispec.load()): unseeded sampling with the draft model, block verification.

Where draft and target are both near-certain of the next token, block verification's residual
mass r falls below 2^-53 with the weight w = 1, and its stop probability r / (r + 1 - w) was
computed as r / 0: a ZeroDivisionError on ordinary requests, at T = 0.1 in most 64-token
generations of the demo pair (sample/block.py now takes the complement 1 - w first). Each case
here decodes a batch of unseeded rows from an explicit generator (so a failure reproduces) and
checks that every row runs to its length with valid tokens; at +100 the biased token is every
token.

Legend: B rows, k draft tokens.
"""

from __future__ import annotations

import pytest

from verispec import GenerationConfig, PenaltyConfig, SamplingConfig
from verispec.sample.sampling import make_generator

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPT = "def fibonacci(n):"
MAX_NEW_TOKENS = 64
ROWS = 3


def _generate(demo_decoder, k: int, seed: int, temperature: float,
              logit_bias: tuple[tuple[int, float], ...] = ()):
    """ROWS unseeded rows of PROMPT from one generator seeded ``seed``, block verification."""
    prompt_ids = demo_decoder.tokenizer.encode(PROMPT)
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=temperature),
                              verification="block", penalty=PenaltyConfig(logit_bias=logit_bias))
    return demo_decoder.engine.generate([prompt_ids] * ROWS, config,
                                        generator=make_generator(seed))


@pytest.mark.parametrize("k, seed", [(2, 11), (4, 12), (4, 13)])
def test_block_verification_at_a_low_temperature_completes(demo_decoder, k, seed):
    result = _generate(demo_decoder, k, seed, temperature=0.1)
    vocab_size = demo_decoder.engine.target.vocab_size
    assert result.finish_reasons == ["length"] * ROWS
    for tokens in result.token_ids:
        assert len(tokens) == MAX_NEW_TOKENS and all(0 <= t < vocab_size for t in tokens)
    assert result.metrics.num_drafted > 0 and result.metrics.num_accepted > 0


def test_block_verification_under_a_logit_bias_of_100_emits_the_biased_token(demo_decoder):
    token = demo_decoder.tokenizer.encode(" return")[-1]
    result = _generate(demo_decoder, 4, 14, temperature=1.0, logit_bias=((token, 100.0),))
    assert result.token_ids == [[token] * MAX_NEW_TOKENS] * ROWS
