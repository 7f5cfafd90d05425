"""verispec.load / Decoder end to end on tiny saved models: completions, streaming, errors.

Two kinds of model directories, built once per module:
  * a random-init Llama target and its 1-layer draft (tests/helpers/tiny_models.py), for the generic
    paths (metrics, overrides, seeds);
  * a scripted Llama (tiny_models.scripted_llama) whose greedy continuation of "a" is
    "ü✓λa" repeated, one byte-level token per byte, so every multi-byte character is split
    across tokens and chunk boundaries fall inside characters and inside stop strings at
    known places.
"""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec import (
    ConfigError,
    EmptyPromptError,
    InputError,
    ModelLoadError,
)
from verispec.policy import default_num_draft_tokens

from tiny_models import (
    build_tokenizer,
    layer_dropped_draft,
    save_model,
    scripted_llama,
    untied_llama,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

PROMPT = "def add(a, b):"
CYCLE_TEXT = "ü✓λa"  # the scripted model's continuation of "a", repeated


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("api_models")
    target = untied_llama(len(tokenizer), seed=1)
    draft = layer_dropped_draft(target, num_layers=1)
    return (save_model(target, tokenizer, root / "target"),
            save_model(draft, tokenizer, root / "draft"))


@pytest.fixture(scope="module")
def decoder(model_dirs):
    return verispec.load(*model_dirs, num_draft_tokens=4)


@pytest.fixture(scope="module")
def scripted_decoder(tokenizer, tmp_path_factory):
    cycle = tokenizer.encode("a" + CYCLE_TEXT[:-1])  # a ü✓λ: 8 byte tokens, all distinct
    assert len(cycle) == 8 and len(set(cycle)) == 8
    successors = {token: cycle[(i + 1) % len(cycle)] for i, token in enumerate(cycle)}
    root = tmp_path_factory.mktemp("scripted")
    target_dir = save_model(scripted_llama(len(tokenizer), successors, seed=0), tokenizer,
                            root / "target")
    draft_dir = save_model(scripted_llama(len(tokenizer), successors, seed=1), tokenizer,
                           root / "draft")
    return verispec.load(target_dir, draft_dir, num_draft_tokens=2)


def positions_tested(metrics) -> int:
    """How many draft positions were ever tested (1 + the deepest one reached)."""
    return max((i + 1 for i, n in enumerate(metrics.num_reached) if n > 0), default=0)


# ---------------------------------------------------------------------------------------------
# completions


def test_generate_returns_text_ids_and_metrics(decoder, tokenizer):
    out = decoder.generate(PROMPT, max_new_tokens=24)
    assert isinstance(out, verispec.Completion)
    assert isinstance(out.text, str) and out.text
    assert all(isinstance(t, int) for t in out.token_ids) and 1 <= len(out.token_ids) <= 24
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.num_prompt_tokens == len(tokenizer.encode(PROMPT))
    eos = tokenizer.eos_token_id
    assert out.finish_reason == ("stop" if eos in out.token_ids else "length")
    metrics = out.metrics
    assert 0.0 <= metrics.acceptance_rate <= 1.0
    assert 1.0 <= metrics.mean_accepted_length <= 5.0
    assert metrics.draft_time > 0 and metrics.target_time > 0
    assert metrics.num_emitted == len(out.token_ids)
    as_dict = out.to_dict()
    assert as_dict["text"] == out.text and as_dict["token_ids"] == out.token_ids
    for key in ("acceptance_rate", "mean_accepted_length", "draft_time", "target_time"):
        assert key in as_dict["metrics"], key


def test_plain_decoding_path(decoder):
    speculative = decoder.generate(PROMPT, max_new_tokens=24)
    plain = decoder.generate(PROMPT, max_new_tokens=24, speculative=False)
    assert plain.token_ids == speculative.token_ids  # greedy: both are the target's argmax path
    assert plain.metrics.num_drafted == 0 and plain.metrics.num_draft_steps == 0
    assert plain.metrics.mean_accepted_length == 1.0
    assert plain.metrics.num_target_calls == len(plain.token_ids)


def test_num_draft_tokens_default_is_the_devices(decoder, model_dirs):
    """No k given: 2 on a CPU whose target multiplies by MKL (a pass over 4+ tokens costs 1.6
    plain steps and up there), 4 on one with packed oneDNN weights (AMD: a few tokens cost about
    one step) and on an accelerator; an explicit k, to load or to a call, wins."""
    cpu_default = verispec.load(*model_dirs)
    expected = 4 if cpu_default.target.matmul == "onednn" else 2  # this machine's CPU
    assert cpu_default.num_draft_tokens == expected
    out = cpu_default.generate(PROMPT, max_new_tokens=40)
    assert positions_tested(out.metrics) == expected
    assert out.token_ids == decoder.generate(PROMPT, max_new_tokens=40).token_ids
    assert verispec.load(*model_dirs, num_draft_tokens=None).num_draft_tokens == expected
    on_mkl = verispec.load(*model_dirs, backend="transformers")  # no packed weights
    assert on_mkl.num_draft_tokens == 2
    # the default follows the target adapter's flat_verify, not its kernel's name
    assert cpu_default.target.flat_verify == (expected == 4) and not on_mkl.target.flat_verify
    assert default_num_draft_tokens("cpu") == 2
    assert default_num_draft_tokens("cpu", flat_verify=True) == 4  # packed oneDNN weights
    assert default_num_draft_tokens("cuda") == default_num_draft_tokens("mps") == 4
    # a Decoder built directly resolves the default and checks an explicit k the same way
    target_model = cpu_default.engine.target.model
    assert verispec.Decoder(target_model, cpu_default.tokenizer).num_draft_tokens == expected
    with pytest.raises(ConfigError, match="num_draft_tokens=0"):
        verispec.Decoder(target_model, cpu_default.tokenizer, num_draft_tokens=0)
    with pytest.raises(TypeError, match=r"Decoder\(\) got an unexpected keyword argument 'k'"):
        verispec.Decoder(target_model, cpu_default.tokenizer, k=2)


def test_num_draft_tokens_per_call_overrides_default(decoder, model_dirs):
    default = decoder.generate(PROMPT, max_new_tokens=40)  # k = 4 from load()
    rounds = default.metrics.num_rounds
    assert default.metrics.num_drafted > 2 * rounds  # mostly k = 4 (only the tail is capped)
    for k in (1, 2):
        out = decoder.generate(PROMPT, max_new_tokens=40, num_draft_tokens=k)
        assert out.token_ids == default.token_ids
        assert out.metrics.num_drafted <= k * out.metrics.num_rounds
        assert positions_tested(out.metrics) == k
    low_default = verispec.load(*model_dirs, num_draft_tokens=2)
    out = low_default.generate(PROMPT, max_new_tokens=40)
    assert positions_tested(out.metrics) == 2
    assert out.metrics.num_drafted <= 2 * out.metrics.num_rounds
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        decoder.generate(PROMPT, num_draft_tokens=0)


def test_adaptive_policy_per_call_and_as_the_decoders_default(decoder, model_dirs):
    fixed = decoder.generate(PROMPT, max_new_tokens=40, num_draft_tokens=1)
    # a threshold policy with a near-0 bar grows k on any acceptance: more positions tested
    growing = verispec.ThresholdPolicyConfig(grow_above=0.01, shrink_below=0.0, window=1,
                                             max_num_draft_tokens=6)
    out = decoder.generate(PROMPT, max_new_tokens=40, num_draft_tokens=1, adaptive=growing)
    assert out.token_ids == fixed.token_ids  # greedy: any depth schedule gives the same text
    assert positions_tested(out.metrics) > 1 and positions_tested(fixed.metrics) == 1
    with_default = verispec.load(*model_dirs, num_draft_tokens=1, adaptive=growing)
    out = with_default.generate(PROMPT, max_new_tokens=40)
    assert out.token_ids == fixed.token_ids and positions_tested(out.metrics) > 1
    goodput = decoder.generate(PROMPT, max_new_tokens=40,
                               adaptive=verispec.GoodputPolicyConfig())
    assert goodput.token_ids == fixed.token_ids
    with pytest.raises(ConfigError, match="adaptive"):
        decoder.generate(PROMPT, adaptive="goodput")
    with pytest.raises(ConfigError, match="adaptive"):
        verispec.load(*model_dirs, adaptive=3)


def test_prompt_as_token_ids(decoder, tokenizer):
    ids = tokenizer.encode(PROMPT)
    from_ids = decoder.generate(ids, max_new_tokens=16)
    from_text = decoder.generate(PROMPT, max_new_tokens=16)
    assert from_ids.token_ids == from_text.token_ids
    assert from_ids.num_prompt_tokens == len(ids)


def test_seed_reproducibility_at_temperature_one(decoder):
    kwargs = dict(max_new_tokens=24, temperature=1.0)
    first = decoder.generate(PROMPT, seed=123, **kwargs)
    again = decoder.generate(PROMPT, seed=123, **kwargs)
    assert first.token_ids == again.token_ids and first.text == again.text
    others = {tuple(decoder.generate(PROMPT, seed=s, **kwargs).token_ids) for s in (1, 2, 3)}
    assert len(others | {tuple(first.token_ids)}) > 1  # the seed matters
    stream = decoder.stream(PROMPT, seed=123, **kwargs)
    assert "".join(stream) == first.text
    assert stream.completion.token_ids == first.token_ids


# ---------------------------------------------------------------------------------------------
# streaming


def test_stream_deltas_concatenate_to_completion_text(decoder):
    stream = decoder.stream(PROMPT, max_new_tokens=32, temperature=1.0, seed=5)
    deltas = list(stream)
    assert stream.completion is not None
    assert "".join(deltas) == stream.completion.text
    assert all(deltas)  # no empty deltas
    assert stream.completion.finish_reason in ("length", "stop")


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_stream_never_splits_a_multibyte_character(scripted_decoder, speculative):
    # plain decoding: one byte token per chunk; speculative (k = 2, all accepted): 3 per chunk
    stream = scripted_decoder.stream("a", max_new_tokens=16, speculative=speculative)
    deltas = list(stream)
    assert stream.completion.text == CYCLE_TEXT * 2  # ends on a character boundary
    assert "".join(deltas) == stream.completion.text
    assert not any("\ufffd" in delta for delta in deltas), deltas
    assert len(deltas) > 1  # it did stream
    if speculative:
        assert stream.completion.metrics.acceptance_rate == 1.0


def test_stream_cut_inside_a_character_ends_with_replacement_only_at_the_end(scripted_decoder):
    # 14 tokens: "ü✓λaü✓" + the first byte of λ; the final text itself holds U+FFFD
    stream = scripted_decoder.stream("a", max_new_tokens=14, speculative=False)
    deltas = list(stream)
    assert stream.completion.text == "ü✓λaü✓\ufffd"
    assert "".join(deltas) == stream.completion.text
    assert not any("\ufffd" in delta for delta in deltas[:-1]), deltas


STOP_CASES = [  # stop -> expected text; continuation of "a" is ü✓λaü✓λa...
    ("✓λ", "ü"),  # stop string begins with a 3-byte character and continues with a 2-byte one
    ("λa", "ü✓"),
    (["zz", "aü"], "ü✓λ"),  # the earliest match of several
    ("ü", ""),  # stop right at the start: nothing is emitted
    (["✓λaü", "λ"], "ü✓"),  # "λ" lies inside the other and completes first: cut there
]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("stop,expected", STOP_CASES, ids=[str(c[0]) for c in STOP_CASES])
def test_stop_strings_cut_text_and_stream_never_emits_a_cut_prefix(scripted_decoder, stop,
                                                                   expected, speculative):
    out = scripted_decoder.generate("a", max_new_tokens=30, stop=stop, speculative=speculative)
    assert out.text == expected
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 30
    stream = scripted_decoder.stream("a", max_new_tokens=30, stop=stop, speculative=speculative)
    deltas = list(stream)
    # what was streamed can never be taken back: it must be exactly the final text
    assert "".join(deltas) == stream.completion.text == expected, deltas
    assert stream.completion.finish_reason == "stop"


def test_nested_stop_strings_give_plain_and_speculative_the_same_tokens(scripted_decoder,
                                                                        tokenizer):
    """Plain rounds deliver one byte token, speculative ones three: "λ" completes two tokens
    before "✓λaü" does, so both cut where token-by-token decoding cuts, with the same tokens."""
    plain, speculative = (scripted_decoder.generate("a", max_new_tokens=30, stop=["✓λaü", "λ"],
                                                    speculative=s) for s in (False, True))
    assert plain.text == speculative.text == "ü✓"
    assert plain.token_ids == speculative.token_ids == tokenizer.encode("ü✓")


def test_stop_string_never_seen_runs_to_length(scripted_decoder):
    # "✓x" shares its first character with the text: held back each time, then released
    stream = scripted_decoder.stream("a", max_new_tokens=16, stop="✓x")
    assert "".join(stream) == CYCLE_TEXT * 2 == stream.completion.text
    assert stream.completion.finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# errors


def test_hub_id_not_cached_says_offline_and_how_to_pass_a_path():
    with pytest.raises(ModelLoadError) as info:
        verispec.load("verispec-tests/not-a-cached-model", "verispec-tests/other-model")
    message = str(info.value)
    assert "offline" in message and "verispec-tests/not-a-cached-model" in message
    assert "pass the directory" in message


def test_nonexistent_path(tmp_path, model_dirs):
    with pytest.raises(ModelLoadError, match="does not exist"):
        verispec.load(tmp_path / "missing", model_dirs[1])
    with pytest.raises(ModelLoadError, match="does not exist"):
        verispec.load(model_dirs[0], str(tmp_path / "missing-draft"))


def test_dir_without_config_json(tmp_path, tokenizer, model_dirs):
    tokenizer.save_pretrained(tmp_path)  # tokenizer files only
    with pytest.raises(ModelLoadError, match="config.json"):
        verispec.load(tmp_path, model_dirs[1])


def test_a_draft_of_another_tokenizer_drafts_across_vocabularies(tmp_path, model_dirs):
    """Once refused at load; now drafted by the string rule (proposers/cross_vocab), with the
    same greedy text as the target alone."""
    other_tokenizer = build_tokenizer(vocab_size=300)  # same trainer, more merges
    other_draft = untied_llama(len(other_tokenizer), seed=2, hidden=16, layers=1)
    other_dir = save_model(other_draft, other_tokenizer, tmp_path / "other_draft")
    decoder = verispec.load(model_dirs[0], other_dir)
    assert decoder.cross_vocab == "string"  # 200 of the draft's 300 tokens are shared
    speculative = decoder.generate("def add(a, b):", max_new_tokens=16, num_draft_tokens=2,
                                   adaptive=None)
    plain = decoder.generate("def add(a, b):", max_new_tokens=16, speculative=False)
    # (this random model's text is mostly broken UTF-8, where the rule drafts nothing:
    # drafting itself is tested in tests/proposers/test_cross_vocab.py)
    assert speculative.token_ids == plain.token_ids


def test_empty_prompt(decoder):
    for prompt in ("", []):
        with pytest.raises(EmptyPromptError):
            decoder.generate(prompt)
        with pytest.raises(EmptyPromptError):
            decoder.stream(prompt)


def test_prompt_with_a_lone_surrogate_is_an_input_error(decoder):
    """What bytes that are not UTF-8 become in Python text; the tokenizer would raise a bare
    TypeError. Valid text with the same letters still generates."""
    with pytest.raises(InputError, match=r"'\\udcff' at character 2"):
        decoder.generate("ab\udcffc", max_new_tokens=2)
    assert decoder.generate("ab\u00ffc", max_new_tokens=2).token_ids


def test_prompt_token_ids_as_a_list_numpy_ints_or_a_tensor(decoder):
    numpy = pytest.importorskip("numpy")
    expected = decoder.generate([5, 6, 7], max_new_tokens=3).token_ids
    assert decoder.generate((5, 6, 7), max_new_tokens=3).token_ids == expected
    assert decoder.generate([numpy.int64(5), 6, 7], max_new_tokens=3).token_ids == expected
    assert decoder.generate(torch.tensor([5, 6, 7]), max_new_tokens=3).token_ids == expected


# settings whose values numpy holds exactly in float32, so both runs sample the same law
EXACT_SETTINGS = {"max_new_tokens": 6, "temperature": 0.75, "top_k": 50, "top_p": 0.875,
                  "min_p": 0.0625, "seed": 5, "logprobs": 2, "presence_penalty": 0.5,
                  "frequency_penalty": 0.25, "repetition_penalty": 1.125, "num_draft_tokens": 2,
                  "min_new_tokens": 1, "logit_bias": {5: -2.0, 7: 1.5}}


def test_numpy_scalars_are_read_as_the_python_numbers_they_hold(decoder):
    numpy = pytest.importorskip("numpy")
    as_numpy = {name: (numpy.float32(value) if isinstance(value, float) else numpy.int64(value))
                for name, value in EXACT_SETTINGS.items() if name != "logit_bias"}
    as_numpy["logit_bias"] = {numpy.int64(5): numpy.float32(-2.0), numpy.int32(7): 1.5}
    expected = decoder.generate(PROMPT, **EXACT_SETTINGS)
    out = decoder.generate(PROMPT, **as_numpy)
    assert out.token_ids == expected.token_ids and out.logprobs == expected.logprobs
    # a batch's int seed is seed + i per prompt; a numpy seed too
    prompts = [PROMPT, "x = 1"]
    assert [c.token_ids for c in decoder.generate(prompts, **as_numpy)] == [
        c.token_ids for c in decoder.generate(prompts, **EXACT_SETTINGS)]
    scored = decoder.prompt_logprobs(PROMPT, num_top=numpy.int64(2))
    assert scored == decoder.prompt_logprobs(PROMPT, num_top=2)


@pytest.mark.parametrize("name, value", [("max_new_tokens", True), ("logprobs", True),
                                         ("seed", "numpy.bool_"), ("top_k", False)])
def test_a_bool_is_not_a_number_setting(decoder, name, value):
    numpy = pytest.importorskip("numpy")
    value = numpy.bool_(True) if value == "numpy.bool_" else value
    with pytest.raises(ConfigError, match=name) as caught:
        decoder.generate(PROMPT, **{"max_new_tokens": 2, name: value})
    assert caught.value.field == name


@pytest.mark.parametrize("prompt, kwargs, error, field", [
    ([5, 10**6], {}, InputError, "prompt"),
    ([5, -1], {}, InputError, "prompt"),
    ("", {}, EmptyPromptError, "prompt"),
    (PROMPT, {"max_new_tokens": 10**6}, verispec.ContextLengthExceeded, "prompt"),
    (PROMPT, {"logit_bias": {10**6: 1.0}}, ConfigError, "logit_bias"),
    (PROMPT, {"repetition_penalty": 1e-40}, ConfigError, "repetition_penalty"),
    (PROMPT, {"stop": [""]}, ConfigError, "stop"),
])
def test_errors_name_the_setting_or_input_at_fault(decoder, prompt, kwargs, error, field):
    """Each error's field (what the server reports as its param)."""
    with pytest.raises(error) as caught:
        decoder.generate(prompt, **{"max_new_tokens": 2, **kwargs})
    assert caught.value.field == field


@pytest.mark.parametrize("prompt, expected", [
    (b"def f():", "bytes"),  # used to be read as token ids 100, 101, 102, ...
    (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
    (torch.tensor([1.0, 2.0]), "1-D of integer"),
    ([1, "a"], r"prompt\[1\]='a'"),
    ([True, 2], r"prompt\[0\]=True"),
    (None, "NoneType"),
])
def test_prompt_of_the_wrong_kind_is_an_input_error(decoder, prompt, expected):
    with pytest.raises(InputError, match=expected):
        decoder.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("kwargs, field", [(dict(stop=5), "stop="), (dict(stop=[5]), "stop="),
                                           (dict(speculative="no"), "speculative=")])
def test_generate_arguments_of_the_wrong_type_are_config_errors(decoder, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        decoder.generate("x", max_new_tokens=2, **kwargs)


def test_an_unknown_setting_is_a_type_error_naming_the_settings(decoder):
    """A keyword that is not a RequestSettings field, as Python's TypeError for a bad keyword,
    and a ConfigError naming the fields there are."""
    for call in (decoder.generate, decoder.stream, decoder.stream_batch):
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_tokens'"):
            call(["x", "y"] if call == decoder.stream_batch else "x", max_tokens=2)
    with pytest.raises(ConfigError, match="expected one of max_new_tokens, temperature"):
        decoder.generate(["x", "y"], max_tokens=2)
    with pytest.raises(ConfigError, match=r"TextBatch.add\(\) got an unexpected"):
        decoder.open_batch().add("x", max_tokens=2)


def test_speculative_without_draft(model_dirs):
    target_only = verispec.load(model_dirs[0])
    with pytest.raises(ConfigError, match="draft"):
        target_only.generate(PROMPT, max_new_tokens=4)
    assert len(target_only.generate(PROMPT, max_new_tokens=4, speculative=False).token_ids) > 0
    with pytest.raises(ConfigError, match="target"):
        verispec.load(draft=model_dirs[1])


@pytest.mark.parametrize("kwargs", [dict(dtype="bogus"), dict(dtype="float64"),
                                    dict(dtype=torch.int32), dict(device="bogus"),
                                    dict(device="tpu")], ids=str)
def test_bad_dtype_or_device(model_dirs, kwargs):
    with pytest.raises(ConfigError):
        verispec.load(*model_dirs, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_gpu(model_dirs):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        verispec.load(*model_dirs, device="cuda")
