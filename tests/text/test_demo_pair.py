"""The shipped demo draft/target pair: loadable offline, compatible, and the target is the better
LM.

Runs in a few seconds on CPU; needs HF_HUB_OFFLINE-safe local loading only.
"""

from __future__ import annotations

import calendar
import difflib
import fractions
import heapq
import inspect
import json
import pprint
import shlex
import statistics
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verispec import ModelLoadError, VerispecError
from verispec.text.demo import (
    DemoAssetsMissingError,
    DemoPair,
    demo_dir,
    demo_pair,
    heldout_prompts,
)

SEQ_LEN = 256
# never in the training data (see assets/demo/README.md)
HELDOUT_MODULES = (calendar, difflib, fractions, heapq, pprint, shlex, statistics, textwrap)


@pytest.fixture(scope="module")
def pair() -> DemoPair:
    return demo_pair()


@pytest.fixture(scope="module")
def tokenizers(pair):
    return AutoTokenizer.from_pretrained(pair.target), AutoTokenizer.from_pretrained(pair.draft)


@pytest.fixture(scope="module")
def models(pair):
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair.draft, dtype=torch.float32).eval()
    return target, draft


def test_demo_pair_paths_exist(pair):
    assert pair.target.is_dir() and pair.draft.is_dir()
    assert pair.target != pair.draft
    with pytest.raises(AttributeError):
        pair.target = pair.draft  # frozen


def test_tokenizers_identical_and_match_configs(tokenizers, models):
    target_tok, draft_tok = tokenizers
    target, draft = models
    assert target_tok.get_vocab() == draft_tok.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(target_tok)
    assert target_tok.eos_token_id == target.config.eos_token_id == draft.config.eos_token_id


def test_draft_is_much_smaller(models):
    target, draft = models
    num_target = sum(p.numel() for p in target.parameters())
    num_draft = sum(p.numel() for p in draft.parameters())
    assert num_draft * 4 < num_target


def test_logits_shapes(tokenizers, models):
    target_tok, _ = tokenizers
    input_ids = target_tok("def fibonacci(n):\n", return_tensors="pt")["input_ids"]  # [1, T]
    with torch.no_grad():
        for model in models:
            logits = model(input_ids=input_ids).logits  # [1, T, V]
            assert logits.shape == (1, input_ids.shape[1], model.config.vocab_size)
            assert torch.isfinite(logits).all()


def heldout_ce(model, windows: torch.Tensor) -> float:
    # windows: [W, SEQ_LEN + 1] int64
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits  # [W, SEQ_LEN, V]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


def test_target_beats_draft_on_heldout_code(tokenizers, models):
    target_tok, _ = tokenizers
    windows = []
    for module in HELDOUT_MODULES:
        ids = target_tok(inspect.getsource(module))["input_ids"]
        windows.append(torch.tensor(ids[500 : 500 + SEQ_LEN + 1]))
    windows = torch.stack(windows)  # [8, SEQ_LEN + 1]
    target, draft = models
    target_ce, draft_ce = heldout_ce(target, windows), heldout_ce(draft, windows)
    # uniform over the 8192-token vocabulary would be ln(8192) = 9.0 nats
    assert target_ce < draft_ce < 6.0, (target_ce, draft_ce)


def test_heldout_prompts():
    prompts = heldout_prompts()
    assert len(prompts) >= 20
    assert all(isinstance(p, str) and 20 <= len(p) <= 200 for p in prompts)
    assert len(set(prompts)) == len(prompts)


def test_report_matches_shipped_models(models):
    report = json.loads((demo_dir() / "report.json").read_text())
    target, draft = models
    assert report["models"]["target"]["parameters"] == sum(p.numel() for p in target.parameters())
    assert report["models"]["draft"]["parameters"] == sum(p.numel() for p in draft.parameters())
    assert 0.0 < report["agreement"]["greedy_agreement"] < 1.0


def test_missing_assets_raise_clear_error(tmp_path):
    with pytest.raises(DemoAssetsMissingError, match="expected config.json") as info:
        demo_pair(tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, ModelLoadError) and isinstance(info.value, VerispecError)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(DemoAssetsMissingError, match="held-out prompts"):
        heldout_prompts(tmp_path)
