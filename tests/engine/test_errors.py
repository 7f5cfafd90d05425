"""Every bad input raises its typed error, and the message names the field and the value.

The hierarchy (errors.py): VerispecError > ConfigError, InputError > (EmptyPromptError,
TokenOutOfRangeError), ShapeError, NonFiniteError, DraftContractError, IncompatibleModelsError.
"""

from __future__ import annotations

import math

import pytest
import torch

from verispec import (
    BatchOptions,
    ConfigError,
    EmptyPromptError,
    Engine,
    GenerationConfig,
    GoodputPolicyConfig,
    IncompatibleModelsError,
    InputError,
    MarkovLM,
    NonFiniteError,
    SamplingConfig,
    ShapeError,
    ThresholdPolicyConfig,
    TokenOutOfRangeError,
    VerispecError,
    verify,
)
from verispec.config import check_bool, check_int, check_number
from verispec.sample.sampling import make_generator

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB_SIZE = 8


def _markov(seed: int = 0, vocab_size: int = VOCAB_SIZE, order: int = 1) -> MarkovLM:
    return MarkovLM.random(vocab_size, make_generator(seed), order=order)


def _decoder() -> Engine:
    return Engine.from_draft_model(_markov(0), _markov(1))


def test_hierarchy():
    for error in (ConfigError, InputError, EmptyPromptError, TokenOutOfRangeError, ShapeError,
                  NonFiniteError, IncompatibleModelsError):
        assert issubclass(error, VerispecError)
    for error in (ConfigError, InputError, ShapeError, IncompatibleModelsError):
        assert issubclass(error, ValueError)
    assert issubclass(EmptyPromptError, InputError)
    assert issubclass(TokenOutOfRangeError, InputError)


# --- GenerationConfig / SamplingConfig -------------------------------------------------------


@pytest.mark.parametrize("kwargs, field, value", [
    ({"num_draft_tokens": 0}, "num_draft_tokens", "0"),
    ({"num_draft_tokens": 33}, "num_draft_tokens", "33"),
    ({"num_draft_tokens": 2.0}, "num_draft_tokens", "2.0"),
    ({"num_draft_tokens": True}, "num_draft_tokens", "True"),
    ({"max_new_tokens": 0}, "max_new_tokens", "0"),
    ({"max_new_tokens": -5}, "max_new_tokens", "-5"),
    ({"max_new_tokens": "64"}, "max_new_tokens", "'64'"),
    ({"seed": -1}, "seed", "-1"),
    ({"seed": 2**63}, "seed", str(2**63)),
    ({"seed": 1.5}, "seed", "1.5"),
    ({"seed": "42"}, "seed", "'42'"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids", "(-1,)"),
    ({"stop_token_ids": (2, "3")}, "stop_token_ids", "(2, '3')"),
    ({"stop_token_ids": [2]}, "stop_token_ids", "[2]"),
    ({"stop_token_ids": 2}, "stop_token_ids", "2"),
    ({"stop_token_ids": (1.0,)}, "stop_token_ids", "(1.0,)"),
    ({"sampling": {"temperature": 1.0}}, "sampling", "{'temperature': 1.0}"),
])
def test_bad_generation_config(kwargs, field, value):
    with pytest.raises(ConfigError) as info:
        GenerationConfig(**kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, VerispecError)
    message = str(info.value)
    assert f"{field}={value}" in message, message
    assert "expected" in message


@pytest.mark.parametrize("kwargs, field, value", [
    ({"temperature": -0.1}, "temperature", "-0.1"),
    ({"temperature": math.nan}, "temperature", "nan"),
    ({"temperature": math.inf}, "temperature", "inf"),
    ({"temperature": "hot"}, "temperature", "'hot'"),
    ({"top_p": 0}, "top_p", "0"),
    ({"top_p": 0.0}, "top_p", "0.0"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_p": -0.2}, "top_p", "-0.2"),
    ({"top_p": math.nan}, "top_p", "nan"),
    ({"top_k": 0}, "top_k", "0"),
    ({"top_k": -3}, "top_k", "-3"),
    ({"top_k": 2.5}, "top_k", "2.5"),
    ({"top_k": True}, "top_k", "True"),
])
def test_bad_sampling_config(kwargs, field, value):
    with pytest.raises(ConfigError) as info:
        SamplingConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert f"{field}={value}" in str(info.value), str(info.value)


def test_valid_configs_are_accepted():
    GenerationConfig(max_new_tokens=1, num_draft_tokens=1, seed=0, stop_token_ids=(0, 7))
    GenerationConfig(num_draft_tokens=32, seed=2**63 - 1)
    BatchOptions(num_draft_tokens=32, cost_ratio=0.05, adaptive=ThresholdPolicyConfig(),
                 prefill_budget=1, max_batch_size=1)
    SamplingConfig(temperature=0, top_k=1, top_p=1.0)


@pytest.mark.parametrize("kwargs, field, value", [
    ({"cost_ratio": 0}, "cost_ratio", "0"),
    ({"cost_ratio": -0.5}, "cost_ratio", "-0.5"),
    ({"cost_ratio": math.inf}, "cost_ratio", "inf"),
    ({"adaptive": "threshold"}, "adaptive", "'threshold'"),
    ({"adaptive": False}, "adaptive", "False"),  # None is the fixed k: no third state
    ({"num_draft_tokens": 0}, "num_draft_tokens", "0"),
    ({"num_draft_tokens": None}, "num_draft_tokens", "None"),
    ({"prefill_budget": 0}, "prefill_budget", "0"),
    ({"max_batch_size": 0}, "max_batch_size", "0"),
])
def test_bad_batch_options(kwargs, field, value):
    with pytest.raises(ConfigError) as info:
        BatchOptions(**kwargs)
    assert info.value.field == field
    assert f"{field}={value}" in str(info.value) and "expected" in str(info.value)


@pytest.mark.parametrize("name, value", [("adaptive", ThresholdPolicyConfig()),
                                         ("cost_ratio", 0.05)])
def test_a_rows_config_refuses_an_option_of_the_batch(name, value):
    # how fast a batch decodes is its options' (BatchOptions), never a row's: a row that names
    # one gets a ConfigError saying where it goes, not a value read as a flag or ignored
    with pytest.raises(ConfigError, match=f"{name}=.*option of the batch.*BatchOptions") as info:
        GenerationConfig(**{name: value})
    assert info.value.field == name


# --- adaptive configs ------------------------------------------------------------------------


@pytest.mark.parametrize("config_type", [ThresholdPolicyConfig, GoodputPolicyConfig])
@pytest.mark.parametrize("kwargs, fragment", [
    ({"min_num_draft_tokens": -1}, "min_num_draft_tokens=-1"),
    ({"max_num_draft_tokens": 33}, "max_num_draft_tokens=33"),
    ({"min_num_draft_tokens": 0, "max_num_draft_tokens": 0}, "max_num_draft_tokens=0"),
    ({"min_num_draft_tokens": 5, "max_num_draft_tokens": 3}, "min_num_draft_tokens=5"),
    ({"min_num_draft_tokens": 1.0}, "min_num_draft_tokens=1.0"),
])
def test_bad_adaptive_bounds(config_type, kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        config_type(**kwargs)


def test_only_the_goodput_policy_may_choose_plain_rounds():
    # goodput compares k = 0 with every depth; the threshold rule has no acceptance to judge
    # at k = 0, so it would never leave it
    assert GoodputPolicyConfig(min_num_draft_tokens=0).min_num_draft_tokens == 0
    with pytest.raises(ConfigError, match="1 <= min"):
        ThresholdPolicyConfig(min_num_draft_tokens=0)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"grow_above": 0.3, "shrink_below": 0.4}, "shrink_below=0.4, grow_above=0.3"),
    ({"grow_above": 1.5}, "grow_above=1.5"),
    ({"shrink_below": -0.1}, "shrink_below=-0.1"),
    ({"grow_above": math.nan}, "grow_above=nan"),
    ({"window": 0}, "window=0"),
    ({"window": 2.5}, "window=2.5"),
    ({"window": True}, "window=True"),
    ({"shrink_below": "0.1"}, "shrink_below='0.1'"),
])
def test_bad_threshold_policy_config(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ThresholdPolicyConfig(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"cost_ratio": 0.0}, "cost_ratio=0.0"),
    ({"cost_ratio": -1.0}, "cost_ratio=-1.0"),
    ({"cost_ratio": math.inf}, "cost_ratio=inf"),
    ({"cost_ratio": math.nan}, "cost_ratio=nan"),
    ({"decay": 0.0}, "decay=0.0"),
    ({"decay": 1.5}, "decay=1.5"),
    ({"prior_acceptance": 1.5}, "prior_acceptance=1.5"),
    ({"prior_acceptance": True}, "prior_acceptance=True"),
    ({"prior_acceptance": "0.5"}, "prior_acceptance='0.5'"),
    ({"prior_weight": -1.0}, "prior_weight=-1.0"),
    ({"prior_weight": math.inf}, "prior_weight=inf"),
    ({"probe_every": -1}, "probe_every=-1"),
    ({"probe_every": 2.5}, "probe_every=2.5"),
    ({"probe_every": True}, "probe_every=True"),
    ({"plain_margin": 0.9}, "plain_margin=0.9"),
    ({"plain_margin": math.nan}, "plain_margin=nan"),
    ({"plain_reprobe": 0}, "plain_reprobe=0"),
    ({"plain_probe_backoff": 1.5}, "plain_probe_backoff=1.5"),
    ({"thin_probes": True}, "thin_probes=True"),
    ({"thin_evidence": -1.0}, "thin_evidence=-1.0"),
    ({"first_use_weight": -0.1}, "first_use_weight=-0.1"),
    ({"outlier_cap": 0.5}, "outlier_cap=0.5"),
    ({"probe_share": True}, "probe_share=True"),
    ({"decay": "0.9"}, "decay='0.9'"),
])
def test_bad_goodput_policy_config(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        GoodputPolicyConfig(**kwargs)


# --- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompts, row", [([[]], 0), ([[1, 2], []], 1)])
def test_empty_prompt(prompts, row):
    with pytest.raises(EmptyPromptError, match=f"prompts\\[{row}\\] is empty"):
        _decoder().generate(prompts, GenerationConfig(max_new_tokens=2, seed=0))


@pytest.mark.parametrize("prompts, bad", [([[1, VOCAB_SIZE]], VOCAB_SIZE), ([[0], [-1]], -1),
                                          ([[3, 100]], 100)])
def test_prompt_token_out_of_range(prompts, bad):
    with pytest.raises(TokenOutOfRangeError, match=f"token id {bad}.*\\[0, {VOCAB_SIZE}\\)"):
        _decoder().generate(prompts, GenerationConfig(max_new_tokens=2, seed=0))


@pytest.mark.parametrize("prompts, fragment", [
    ([1, 2, 3], r"prompts\[0\]=1 is not a list"),  # a flat list instead of [[1, 2, 3]]
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([[1, 2.0]], "2.0"),
    ([[1, True]], "True"),
    ([[1, "2"]], "'2'"),
])
def test_malformed_prompts(prompts, fragment):
    with pytest.raises(InputError, match=fragment):
        _decoder().generate(prompts, GenerationConfig(max_new_tokens=2, seed=0))


def test_prompt_errors_are_raised_by_stream_before_any_work():
    with pytest.raises(InputError):
        _decoder().stream([1, 2, 3], GenerationConfig(max_new_tokens=2, seed=0))


@pytest.mark.parametrize("config", [None, {"max_new_tokens": 2}, SamplingConfig()])
def test_engine_config_of_the_wrong_type(config):
    """A ConfigError naming config, not an AttributeError from deep inside the run."""
    with pytest.raises(ConfigError, match="config=.*GenerationConfig"):
        _decoder().generate([[1, 2]], config)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "0"])
def test_make_generator_rejects_seeds_torch_would_wrap_or_refuse(seed):
    # torch.Generator().manual_seed(-1) is accepted and means 2**64 - 1: a surprise
    with pytest.raises(ConfigError, match="seed="):
        make_generator(seed)


# --- models ----------------------------------------------------------------------------------


def test_vocabulary_mismatch_at_construction():
    target, draft = _markov(0, vocab_size=8), _markov(1, vocab_size=6)
    with pytest.raises(IncompatibleModelsError, match="draft vocab_size=6.*target vocab_size=8"):
        Engine.from_draft_model(target, draft)


def test_a_draft_on_another_device_is_refused_at_construction():
    target, draft = _markov(0), _markov(1)
    # any device but the target's (tests/models/test_gpu.py: cuda)
    draft.device = torch.device("meta")
    with pytest.raises(IncompatibleModelsError,
                       match="draft is on meta but the target on cpu.*same device="):
        Engine.from_draft_model(target, draft)


@pytest.mark.parametrize("where", ["target", "draft"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_logits_from_a_model(where, bad):
    target, draft = _markov(0), _markov(1)
    bad_model = target if where == "target" else draft
    bad_model.table[5, 2] = bad  # logits after token 5: the prompt's last token below
    decoder = Engine.from_draft_model(target, draft)
    with pytest.raises(NonFiniteError, match="NaN or \\+inf"):
        decoder.generate([[1, 5]], GenerationConfig(max_new_tokens=4, num_draft_tokens=2, seed=0))


def test_non_finite_logits_in_plain_greedy_decoding():
    target = _markov(0)
    target.table[3] = -math.inf  # a context where every token is impossible
    decoder = Engine(target)
    with pytest.raises(NonFiniteError):
        decoder.generate([[3]], GenerationConfig(max_new_tokens=2,
                                                 sampling=SamplingConfig(temperature=0)))


# --- verify ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target_shape, draft_shape, fragment", [
    ((1, 2, 4), None, r"target_probs must be \[B, K\+1, V\] = \[1, 3, V\].*got \(1, 2, 4\)"),
    ((2, 3, 4), None, r"got \(2, 3, 4\)"),
    ((1, 3, 4), (1, 2, 5), r"draft_probs must be \[B, K, V\] = \[1, 2, 4\].*got \(1, 2, 5\)"),
    ((1, 3, 4), (1, 3, 4), r"got \(1, 3, 4\)"),
])
def test_verify_shape_mismatches(target_shape, draft_shape, fragment):
    draft_tokens = torch.tensor([[0, 1]])
    target_probs = torch.full(target_shape, 0.25)
    draft_probs = None if draft_shape is None else torch.full(draft_shape, 0.25)
    with pytest.raises(ShapeError, match=fragment):
        verify(draft_tokens, draft_probs, target_probs, make_generator(0))


@pytest.mark.parametrize("check, expected", [
    (lambda: check_int("top_k", 0, 1), "top_k=0 is invalid: expected an integer >= 1."),
    (lambda: check_int("k", True, 1, 32), "k=True is invalid: expected an integer from 1 to 32."),
    (lambda: check_int("batch_size", 8, 16, note=" (tokens per call)"),
     "batch_size=8 is invalid: expected an integer >= 16 (tokens per call)."),
    (lambda: check_number("top_p", 0, 0, 1, low_open=True),
     "top_p=0 is invalid: expected a number in (0, 1]."),
    (lambda: check_number("temperature", math.nan, 0, 1e4),
     "temperature=nan is invalid: expected a number in [0, 10000]."),
    (lambda: check_number("cost_ratio", math.inf, 0, math.inf, low_open=True),
     "cost_ratio=inf is invalid: expected a finite number > 0."),
    (lambda: check_number("margin", False, 1.0),
     "margin=False is invalid: expected a number >= 1."),
    (lambda: check_bool("carry_over", 1), "carry_over=1 is invalid: expected True or False."),
])
def test_shared_checks_name_the_field_the_value_and_the_range(check, expected):
    # the one message form of every config's checks (config.py), with the field for the server
    with pytest.raises(ConfigError) as info:
        check()
    assert str(info.value) == expected
    assert info.value.field == expected.split("=")[0]


def test_shared_checks_pass_the_bounds_themselves():
    check_int("top_k", 1, 1)
    check_int("k", 32, 1, 32)
    check_number("top_p", 1.0, 0, 1, low_open=True)
    check_number("min_p", 0, 0, 1)
    check_number("margin", math.inf, 1.0)  # no upper bound: inf passes
    check_bool("flag", False)


def test_named_policies():
    from verispec.policy import named_policy

    assert named_policy(None) is None
    assert named_policy("goodput") == GoodputPolicyConfig()
    assert named_policy("goodput-plain") == GoodputPolicyConfig(min_num_draft_tokens=0)
    assert named_policy("threshold") == ThresholdPolicyConfig()
    assert named_policy("goodput", carry_over=True) == GoodputPolicyConfig(carry_over=True)
    with pytest.raises(ConfigError, match="adaptive='fastest'"):
        named_policy("fastest")
    with pytest.raises(ConfigError, match="carry_over=True needs an adaptive policy"):
        named_policy(None, carry_over=True)


@pytest.mark.parametrize("config_type", [ThresholdPolicyConfig, GoodputPolicyConfig])
def test_bad_carry_over(config_type):
    with pytest.raises(ConfigError, match="carry_over=1 is invalid"):
        config_type(carry_over=1)
