"""A draft of another tokenizer on real models: the shipped demo draft (transformers, a byte-level
BPE of 8,192 tokens trained on Python) drafting SmolLM2-135M-Instruct (a GGUF file on llama.cpp,
49,152 tokens), each model on its own backend.

Greedy speculative decoding by either rule equals plain decoding (compared by
tests/helpers/near_ties.py: a pass over several tokens may round differently from a one-token
pass, and a reply may first differ at a near-tie, never elsewhere); a seeded request gives the
text of seeded plain decoding; a prompt longer than the draft's window still decodes (the row
stops drafting); load(), the CLI and the server take the pair and name the rule; bad pairs and
options get typed errors. The law of the sampled tokens is tested on fixture vocabularies in
tests/proposers/test_cross_vocab.py (G-test and its negative control); the coder pair's
SmolLM2-drafted 1.5B in tests/models/test_coder_pair.py.
"""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import verispec
from verispec import cli
from verispec.errors import (
    ConfigError,
    ContextLengthExceeded,
    IncompatibleModelsError,
    ModelLoadError,
)
from verispec.models.llama_cpp.model import LlamaCppModel
from verispec.models.llama_cpp.tokenizer import LlamaCppTokenizer
from verispec.models.packaged import packaged_model_path
from verispec.server import ServerSettings, create_app
from verispec.server.run import describe_decoding
from verispec.text.decoder import Decoder
from verispec.text.demo import demo_pair

from live_server import ServerThread
from near_ties import assert_greedy_agree, steps_of_completion

SMOLLM2 = "smollm2-135m-instruct"
RULES = ("string", "intersection")
PROMPTS = ["Write a Python function that returns the square of a number.",
           "Write a Python function is_even(n)."]
NUM_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models():
    """The loaded models and tokenizers, shared by one decoder per rule."""
    target = LlamaCppModel(str(packaged_model_path(SMOLLM2)), "target")
    draft_dir = demo_pair().draft
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    return target, LlamaCppTokenizer(target), draft, AutoTokenizer.from_pretrained(draft_dir)


@pytest.fixture(scope="module")
def decoders(models):
    target, tokenizer, draft, draft_tokenizer = models
    return {rule: Decoder(target, tokenizer, draft, draft_tokenizer=draft_tokenizer,
                          cross_vocab=rule) for rule in RULES}


@pytest.fixture(scope="module")
def plain_replies(decoders):
    decoder = decoders["string"]
    return [decoder.chat([{"role": "user", "content": p}], max_new_tokens=NUM_NEW_TOKENS,
                         ignore_eos=True, speculative=False, logprobs=5) for p in PROMPTS]


@pytest.mark.parametrize("rule", RULES)
def test_greedy_equals_plain_by_each_rule(decoders, plain_replies, rule):
    decoder = decoders[rule]
    assert decoder.cross_vocab == rule
    assert type(decoder.target).__name__ == "LlamaCppLM"
    assert type(decoder.draft).__name__ in ("FastLlamaLM", "TransformersLM")
    prompts = [decoder.chat_prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    replies = decoder.generate(prompts, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                               num_draft_tokens=3, adaptive=None, logprobs=5)
    for plain, reply in zip(plain_replies, replies):
        assert reply.metrics.num_drafted > 0 and reply.metrics.num_accepted > 0
        assert_greedy_agree(steps_of_completion(plain, decoder.tokenizer),
                            steps_of_completion(reply, decoder.tokenizer))


@pytest.mark.parametrize("rule", RULES)
def test_a_seeded_request_gives_the_text_of_seeded_plain_decoding(decoders, rule):
    decoder = decoders[rule]
    settings = {"max_new_tokens": 32, "temperature": 0.7, "seed": 11, "ignore_eos": True}
    messages = [{"role": "user", "content": PROMPTS[0]}]
    plain = decoder.chat(messages, speculative=False, **settings)
    speculative = decoder.chat(messages, num_draft_tokens=3, adaptive=None, **settings)
    assert speculative.metrics.num_drafted > 0
    assert speculative.token_ids == plain.token_ids


def test_a_prompt_longer_than_the_drafts_window_still_decodes(decoders):
    """The demo draft takes 1,024 positions; a prompt of more of its tokens, within the
    target's window, decodes as plain decoding does: that row stops drafting."""
    decoder = decoders["intersection"]
    text = "def f(x):\n    return x * 2\n" * 110  # ~1,300 demo-draft tokens
    prompt = decoder.encode(text)
    assert len(prompt) < 2048
    speculative = decoder.generate(prompt, max_new_tokens=12, num_draft_tokens=3, adaptive=None,
                                   logprobs=5)
    plain = decoder.generate(prompt, max_new_tokens=12, speculative=False, logprobs=5)
    assert_greedy_agree(steps_of_completion(plain, decoder.tokenizer),
                        steps_of_completion(speculative, decoder.tokenizer))
    assert speculative.metrics.num_drafted == 0


def test_a_prompt_longer_than_the_targets_window_is_a_context_length_error(decoders):
    decoder = decoders["string"]
    prompt = decoder.encode("x = 1\n" * 2100)  # past the 4,096 positions llama.cpp gives it
    with pytest.raises(ContextLengthExceeded, match="target"):
        decoder.generate(prompt, max_new_tokens=4, num_draft_tokens=2, adaptive=None)


def test_a_llama_cpp_draft_for_a_transformers_target():
    """The other mix: the demo target on the PyTorch path drafted by SmolLM2's GGUF file on
    llama.cpp (each model on its own backend), greedy equal to plain."""
    decoder = verispec.load(demo_pair().target, SMOLLM2, cross_vocab="string")
    assert type(decoder.draft).__name__ == "LlamaCppLM" and decoder.cross_vocab == "string"
    assert type(decoder.target).__name__ in ("FastLlamaLM", "TransformersLM")
    prompt = "def add(a, b):\n    return"
    speculative = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=3, adaptive=None)
    plain = decoder.generate(prompt, max_new_tokens=24, speculative=False)
    assert speculative.token_ids == plain.token_ids and speculative.metrics.num_drafted > 0


def test_load_cli_and_server_take_the_pair_and_name_the_rule(decoders, capsys):
    draft_dir = str(demo_pair().draft)
    decoder = verispec.load(SMOLLM2, draft_dir, cross_vocab="string")
    assert decoder.cross_vocab == "string"
    status = cli.main(["generate", "def square(x):", "--target", SMOLLM2, "--draft", draft_dir,
                       "--cross-vocab", "string", "--max-new-tokens", "6", "--k", "2"])
    assert status == 0 and capsys.readouterr().out.strip()
    settings = ServerSettings(target=SMOLLM2, draft=draft_dir, cross_vocab="string",
                              model_name="smollm2")
    assert "of another tokenizer (string rule)" in describe_decoding(decoder, settings)
    with ServerThread(create_app(decoder, settings)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):  # a 400, then on
            client.chat.completions.create(model="smollm2", max_tokens=0,
                                           messages=[{"role": "user", "content": "x"}])
        reply = client.chat.completions.create(
            model="smollm2", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": PROMPTS[1]}])
        exposed = httpx.get(server.url + "/metrics").text
    assert reply.choices[0].message.content
    assert reply.model_extra["speculation"]["cross_vocab_rule"] == "string"
    assert 'verispec_drafting_info{cross_vocab_rule="string"} 1.0' in exposed


def test_auto_drafts_by_the_string_rule_unless_the_vocabularies_are_nearly_one(models):
    target, tokenizer, draft, draft_tokenizer = models
    # the demo draft's tokens are 0.71 of its vocabulary but 0.12 of SmolLM2's
    assert Decoder(target, tokenizer, draft, draft_tokenizer=draft_tokenizer).cross_vocab == (
        "string")


def test_options_a_cross_draft_does_not_take_are_refused_by_name(models):
    target, tokenizer, draft, draft_tokenizer = models
    for option in ({"hybrid": True}, {"draft_p_min": 0.5}):
        with pytest.raises(ConfigError, match=next(iter(option))):
            Decoder(target, tokenizer, draft, draft_tokenizer=draft_tokenizer, **option)
    with pytest.raises(ConfigError, match="cross_vocab"):
        Decoder(target, tokenizer, draft, draft_tokenizer=draft_tokenizer, cross_vocab="bytes")
    with pytest.raises(SystemExit) as exited:  # argparse: one line on stderr, status 2
        cli.main(["generate", "x", "--target", SMOLLM2, "--draft", str(demo_pair().draft),
                  "--cross-vocab", "bytes"])
    assert exited.value.code == 2


def test_a_draft_whose_tokenizer_cannot_load_is_a_model_load_error(tmp_path):
    broken = tmp_path / "draft"
    shutil.copytree(demo_pair().draft, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="draft"):
        verispec.load(SMOLLM2, str(broken))


def test_a_tokenizer_that_cannot_spell_text_back_is_refused(models):
    """A WordPiece tokenizer (lower-cases, drops spaces) cannot say which text its tokens
    are: IncompatibleModelsError naming why, before anything decodes."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    target, tokenizer, draft, _ = models
    vocab = {"[UNK]": 0, **{chr(c): i + 1 for i, c in enumerate(range(97, 123))}}
    wordpiece = Tokenizer(tokenizer_models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(IncompatibleModelsError, match="draft"):
        Decoder(target, tokenizer, draft,
                draft_tokenizer=PreTrainedTokenizerFast(tokenizer_object=wordpiece))
