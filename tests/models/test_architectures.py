"""Exact on every architecture verispec accepts; refused at load for those it cannot run exactly.

The matrix (tests/helpers/arch_specs.py): tiny random-init targets of the transformers causal LMs
with a simple config, each with a 1-layer draft cut from it. For each one:
  * greedy: plain decoding through the engine and speculative decoding at k in {1, 3, 6}, at
    batch 3 (ragged prompts, one already past the window) and batch 1, equal transformers' own
    ``generate(do_sample=False)`` token for token, for NUM_NEW_TOKENS = 4 x WINDOW tokens, so
    every sliding window and attention chunk is passed several times over;
  * the cache: after random ragged extend / rewind sequences growing past 3 x WINDOW, the next
    logits equal a fresh forward over the same tokens;
  * a sampled run completes, and the same seed gives the same tokens.
The refused architectures (recurrent, state-space and hybrid models, and two whose attention
verispec cannot mask) raise UnsupportedModelError when the model is loaded, with the reason.

Legend: B batch, n fed tokens, V vocabulary.
"""

from __future__ import annotations

import random

import pytest
import torch

import verispec
from verispec import Engine, GenerationConfig, SamplingConfig, UnsupportedModelError
from verispec.models.hf.adapter import TransformersLM

from arch_specs import REFUSED, SUPPORTED, VOCAB_SIZE, WINDOW, Arch, Refused
from tiny_models import build_tokenizer, save_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")

NUM_NEW_TOKENS = 4 * WINDOW
PROMPTS = [[5, 9, 17], [40, 2, 7, 7, 1, 99, 123, 64, 3, 11, 150], [8, 30, 31, 60, 90]]
assert len(PROMPTS[1]) > WINDOW  # one prompt is already past the window when decoding starts
KS = (1, 3, 6)
GREEDY = SamplingConfig(temperature=0.0)


def greedy_config(k: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, num_draft_tokens=k, sampling=GREEDY,
                            seed=0)


class Case:
    """One architecture's target, draft, engine and reference output."""

    def __init__(self, arch: Arch) -> None:
        self.arch = arch
        self.target, self.draft = arch.build_pair()
        self.engine = Engine.from_draft_model(TransformersLM(self.target),
                                                          TransformersLM(self.draft))
        self.reference = [self.hf_greedy(prompt) for prompt in PROMPTS]

    def hf_greedy(self, prompt: list[int]) -> list[int]:
        """transformers' own greedy decoding of one prompt (no EOS in these configs)."""
        input_ids = torch.tensor([prompt])  # [1, T]
        with torch.inference_mode():
            sequences = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                             do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                                             pad_token_id=0)
        return sequences[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=SUPPORTED, ids=lambda arch: arch.name)
def case(request) -> Case:
    return Case(request.param)


def test_plain_decoding_matches_generate(case):
    result = case.engine.generate(PROMPTS, greedy_config(1), speculative=False)
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in case.reference)
    assert result.token_ids == case.reference, case.arch.name


@pytest.mark.parametrize("k", KS)
def test_speculative_greedy_matches_generate_batched(case, k):
    result = case.engine.generate(PROMPTS, greedy_config(k))
    for row, tokens in enumerate(result.token_ids):
        assert tokens == case.reference[row], f"{case.arch.name} k={k} row {row}"
    assert result.metrics.num_drafted > 0


@pytest.mark.parametrize("k", KS)
def test_speculative_greedy_matches_generate_batch_one(case, k):
    for row, prompt in enumerate(PROMPTS):
        result = case.engine.generate([prompt], greedy_config(k))
        assert result.token_ids == [case.reference[row]], f"{case.arch.name} k={k} row {row}"


def fresh_last_logits(model, tokens: list[int], num_last: int) -> torch.Tensor:
    """Logits after each of the last num_last tokens, from a fresh forward. -> [num_last, V]."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -num_last:, :VOCAB_SIZE]


def test_rewind_matches_fresh_forward(case):
    """Random ragged extend / rewind rounds (as verification does) until every row is past
    3 x WINDOW: the logits always equal a fresh forward's."""
    rng = random.Random(sum(map(ord, case.arch.name)))
    token_gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rows = [list(prompt) for prompt in PROMPTS]
    session = TransformersLM(case.target).new_session()
    session.start(rows)
    step = 0
    while min(map(len, rows)) < 3 * WINDOW + 2:
        if step % 2 == 1:  # a ragged rewind (some rows by 0), always followed by an extend
            num_rewound = [rng.randint(0, min(6, len(row) - 1)) for row in rows]
            session.rewind(torch.tensor(num_rewound))
            rows = [row[: len(row) - n] for row, n in zip(rows, num_rewound)]
        num_new = rng.randint(1, 7)
        new_tokens = torch.randint(0, VOCAB_SIZE, (len(rows), num_new), generator=token_gen)
        logits = session.extend(new_tokens)  # [B, n, V]
        rows = [row + new for row, new in zip(rows, new_tokens.tolist())]
        for b, row in enumerate(rows):
            torch.testing.assert_close(logits[b], fresh_last_logits(case.target, row, num_new),
                                       atol=1e-4, rtol=0,
                                       msg=lambda m, step=step, b=b:
                                       f"{case.arch.name} step {step} row {b}: {m}")
        step += 1


def test_sampled_run_completes_and_repeats_with_its_seed(case):
    config = GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, num_draft_tokens=3, seed=7,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.95))
    first = case.engine.generate(PROMPTS, config)
    again = case.engine.generate(PROMPTS, config)
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in first.token_ids)
    assert all(0 <= t < VOCAB_SIZE for tokens in first.token_ids for t in tokens)
    assert again.token_ids == first.token_ids
    assert first.metrics.num_drafted > 0


# ---------------------------------------------------------------------------------------------
# refused at load


@pytest.mark.parametrize("refused", REFUSED, ids=lambda refused: refused.name)
def test_unsupported_architecture_is_refused_at_load(refused: Refused):
    model = refused.arch.build(2)
    with pytest.raises(UnsupportedModelError, match=refused.arch.model_type) as error:
        TransformersLM(model)
    assert refused.reason in str(error.value)


@pytest.mark.parametrize("name", ["Mamba", "Jamba (hybrid)", "GPT-Neo"])
def test_load_of_a_saved_unsupported_model_raises_before_any_request(name, tmp_path):
    """Through verispec.load on a saved directory: the error comes at load, not on a request."""
    refused = next(r for r in REFUSED if r.name == name)
    tokenizer = build_tokenizer()
    model = refused.arch.build(2, vocab_size=len(tokenizer))
    model_dir = save_model(model, tokenizer, tmp_path / "model")
    with pytest.raises(UnsupportedModelError, match=refused.reason):
        verispec.load(model_dir)


def test_a_mixed_window_model_gets_one_mask_per_layer_kind():
    """Gemma 2 style: the local layer masks past the window, the global layer does not."""
    gemma2 = next(arch for arch in SUPPORTED if arch.model_type == "gemma2")
    lm = TransformersLM(gemma2.build(2))
    assert lm.mask_plan.per_layer_type
    assert set(lm.mask_plan.layer_types) == {"sliding_attention", "full_attention"}
    from verispec.models.hf.masks import build_masks

    positions = torch.tensor([[3 * WINDOW]])  # one query far past the window
    masks = build_masks(lm.mask_plan, positions, 3 * WINDOW + 1, torch.float32)
    visible = {kind: (mask[0, 0, 0] == 0).nonzero().flatten().tolist()
               for kind, mask in masks.items()}
    assert visible["full_attention"] == list(range(3 * WINDOW + 1))
    assert visible["sliding_attention"] == list(range(2 * WINDOW + 1, 3 * WINDOW + 1))


def test_readme_lists_exactly_the_matrix():
    """README.md and docs/architectures.md are generated from this matrix (scripts/arch_table.py)
    and must not drift from it."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "arch_table.py"
    check = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
