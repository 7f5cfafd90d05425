"""A prompt's own log-probabilities under the target: what an OpenAI ``echo`` request and an
evaluation harness's loglikelihood scores read.

Legend: T prompt tokens, C tokens fed in one pass, V vocabulary.

What this is: one target pass over the prompt through the session protocol (models/base.py),
``start`` with an empty row, then ``extend`` over the prompt in chunks of at most
SCORING_CHUNK tokens, and the raw ``log_softmax`` of the logits at every position. Position
i's logits predict token i + 1, so token 0 has no logprob (None, as OpenAI's first echo
token). What this is not: the distribution a request samples from (no penalties, bias,
temperature or truncation: those belong to generated tokens, engine/rows.py TokenLogprob) or a
decoding step (nothing is cached for later: the session is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import MAX_TOP_LOGPROBS, check_int, plain_number
from ..models.base import LanguageModel, ScoresApart
from .rows import TokenLogprob, token_logprobs

# tokens a pass feeds: bounds the logits held at once ([C, V] fp32, 50 MB at V = 50k) while a
# long prompt still takes few passes
SCORING_CHUNK = 256


def score_prompt(model: LanguageModel, prompt_ids: Sequence[int], num_top: int = 0
                 ) -> list[TokenLogprob | None]:
    """Each prompt token's logprob under the target's raw next-token distribution after the
    tokens before it, with the ``num_top`` most likely (token id, logprob) pairs there, most
    likely first; None for the first token. ``prompt_ids``: at least one token id in [0, V)
    (checked by the caller, as a prompt is); a session apart from the decoding ones where the
    model needs one (models.base.ScoresApart)."""
    num_top = plain_number(num_top)  # numpy's integers too
    check_int("num_top", num_top, 0, MAX_TOP_LOGPROBS)
    ids = [int(token) for token in prompt_ids]
    session = model.scoring_session() if isinstance(model, ScoresApart) else model.new_session()
    session.start([[]])
    scored: list[TokenLogprob | None] = [None]
    # 1 feed tokens 0 .. T-2 (the last token's logits predict past the prompt), a chunk a pass
    for begin in range(0, len(ids) - 1, SCORING_CHUNK):
        fed = torch.tensor([ids[begin : begin + SCORING_CHUNK]], dtype=torch.int64)  # [1, C]
        logits = session.extend(fed.to(model.device))[0]  # [C, V]
        # 2 score the tokens they predict, 1 .. T-1
        scored += token_logprobs(torch.log_softmax(logits.float(), dim=-1),
                                 ids[begin + 1 : begin + 1 + fed.shape[1]], num_top)
    return scored
