"""Chat templates (chat.py) and Decoder.chat: messages in, the prompt a chat model continues out.

Unit level on a tiny tokenizer and a tiny random model: the built-in templates render the
strings chat.py documents, a template file works, bad names / files / Jinja are ConfigError
naming the value, a template's raise_exception and malformed messages are InputError, and the
end-of-turn token is found only where the vocabulary has it as one token. Then the shipped demo
pair, whose tokenizer carries the "plain" template: Decoder.chat is Decoder.generate on the
rendered prompt, token for token, and stream_chat and `verispec chat` give the same text.
Real chat models (SmolLM2, Gemma 3) are in tests/models/test_real_models.py.
"""

from __future__ import annotations

import io
import re
import sys

import pytest

import verispec
from verispec import cli
from verispec.errors import (
    ConfigError,
    EmptyPromptError,
    InputError,
    UnsupportedFeatureError,
)
from verispec.text.chat import (
    CHAT_TEMPLATES,
    ChatTemplate,
    ChatTemplateMissing,
    chat_template_for,
    check_messages,
    end_of_turn_ids,
)

from tiny_models import build_tokenizer, tiny_llama

SPECIAL = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "", "unk_token": ""}
HI = [{"role": "user", "content": "Hi"}]
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny BPE tokenizer (no chat template, no turn tokens); tests that change it copy it."""
    return build_tokenizer()


def render(name: str, messages, add_generation_prompt: bool = True) -> str:
    return ChatTemplate(name, CHAT_TEMPLATES[name]).render(messages, SPECIAL,
                                                           add_generation_prompt)


# --- the built-in templates ------------------------------------------------------------------


@pytest.mark.parametrize("name, messages, expected", [
    ("chatml", HI, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("chatml", CONVERSATION,
     ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
      "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
      "<|im_start|>assistant\n")),
    ("gemma", HI, "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    # the system message opens the first user turn; the assistant is "model"; content trimmed
    ("gemma", CONVERSATION,
     ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
      "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")),
    ("plain", HI, "user: Hi\nassistant:"),
    ("plain", CONVERSATION,
     "system: Be brief.\nuser:  Hi \nassistant: Hello.\nuser: Bye\nassistant:"),
])
def test_built_in_templates_render_the_documented_prompt(name, messages, expected):
    assert render(name, messages) == expected


@pytest.mark.parametrize("name, expected", [
    ("chatml", "<|im_start|>user\nHi<|im_end|>\n"),
    ("gemma", "<bos><start_of_turn>user\nHi<end_of_turn>\n"),
    ("plain", "user: Hi\n"),
])
def test_without_the_generation_prompt_the_text_ends_after_the_last_turn(name, expected):
    assert render(name, HI, add_generation_prompt=False) == expected


def test_a_built_in_name_and_the_models_own_template_are_found(tokenizer):
    assert chat_template_for("gemma", tokenizer) == ChatTemplate("gemma", CHAT_TEMPLATES["gemma"])
    assert chat_template_for(None, tokenizer) is None  # no template of its own, none named
    own = build_tokenizer()
    own.chat_template = CHAT_TEMPLATES["plain"]
    assert chat_template_for(None, own) == ChatTemplate("model", CHAT_TEMPLATES["plain"])
    # a name beats the model's own
    assert chat_template_for("chatml", own).name == "chatml"


def test_a_template_file_is_read_and_rendered(tokenizer, tmp_path):
    path = tmp_path / "turns.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}", encoding="utf-8")
    for name in (path, str(path)):
        template = chat_template_for(name, tokenizer)
        assert template.name == str(path)
        assert template.render(HI, SPECIAL) == "[user] Hi\n[assistant]"


# --- bad templates: ConfigError naming the value; a template's refusal: InputError -----------


@pytest.mark.parametrize("name", ["chatmk", "ChatML", "/no/such/template.jinja"])
def test_an_unknown_name_or_a_missing_file_is_a_config_error_naming_it(tokenizer, name):
    with pytest.raises(ConfigError, match=re.escape(f"chat_template='{name}'") + ".*chatml, "):
        chat_template_for(name, tokenizer)


@pytest.mark.parametrize("name", ["", 3])
def test_a_name_that_is_not_text_is_a_config_error(tokenizer, name):
    with pytest.raises(ConfigError, match=f"chat_template={name!r} is invalid"):
        chat_template_for(name, tokenizer)


def test_a_template_file_that_is_not_jinja_is_a_config_error_at_load(tokenizer, tmp_path):
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"chat template '{path}' is not valid")):
        chat_template_for(path, tokenizer)


def test_a_models_own_template_that_is_not_jinja_is_a_config_error_not_the_messages():
    own = build_tokenizer()
    own.chat_template = "{% if add_generation_prompt %}"
    decoder = verispec.Decoder(tiny_llama(len(own), seed=1), own)  # loads: completions work
    with pytest.raises(ConfigError, match="chat template 'model' is not valid Jinja"):
        decoder.chat_prompt_ids(HI)


def test_raise_exception_in_a_template_is_an_input_error():
    template = ChatTemplate("strict", "{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('the first turn must be the user') }}{% endif %}"
                            "{{ messages[0]['content'] }}")
    assert template.render(HI, SPECIAL) == "Hi"
    with pytest.raises(InputError, match="rejected the messages: the first turn must be the user"):
        template.render([{"role": "assistant", "content": "Hi"}], SPECIAL)


def test_a_template_failing_on_the_messages_is_an_input_error():
    template = ChatTemplate("second", "{{ messages[1]['content'] }}")
    with pytest.raises(InputError, match="cannot be rendered by chat template 'second'"):
        template.render(HI, SPECIAL)
    # the sandbox: a template cannot change what it is given
    template = ChatTemplate("mutating", "{{ messages.append(messages[0]) }}")
    with pytest.raises(InputError, match="unsafe"):
        template.render(HI, SPECIAL)


# --- messages --------------------------------------------------------------------------------


@pytest.mark.parametrize("messages, match", [
    ("Hi", "messages='Hi' is invalid"),
    ([], "messages=.* is invalid: expected a non-empty list"),
    ({"role": "user", "content": "Hi"}, "expected a non-empty list"),
    (None, "expected a non-empty list"),
    (["Hi"], r"messages\[0\]='Hi' is invalid"),
    ([{"role": "user"}], r"messages\[0\]=.* expected a dict with text \"role\" and \"content\""),
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": 3}], r"messages\[1\]"),
    ([{"role": None, "content": "Hi"}], r"messages\[0\]"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], r"messages\[0\]"),
    ([{"role": "user", "content": "x\ud800"}], r"messages\[0\].content holds"),
])
def test_check_messages_rejects_bad_shapes(messages, match):
    with pytest.raises(InputError, match=match):
        check_messages(messages)


def test_check_messages_keeps_role_and_content_only():
    messages = ({"role": "user", "content": "Hi", "name": "ann"},)
    assert check_messages(messages) == [{"role": "user", "content": "Hi"}]


# --- end of turn -----------------------------------------------------------------------------


def test_end_of_turn_is_found_only_where_it_is_one_token(tokenizer):
    chatml = chat_template_for("chatml", tokenizer)
    assert len(tokenizer.encode("<|im_end|>", add_special_tokens=False)) > 1
    assert end_of_turn_ids(chatml, tokenizer) == ()  # several tokens: never a stop token
    with_turns = build_tokenizer()
    with_turns.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    im_end = with_turns.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(chat_template_for("chatml", with_turns), with_turns) == (im_end,)
    # a template that never writes the marker does not stop there
    assert end_of_turn_ids(chat_template_for("plain", with_turns), with_turns) == ()
    assert end_of_turn_ids(None, with_turns) == ()


def test_decoder_stops_at_its_templates_end_of_turn():
    with_turns = build_tokenizer()
    with_turns.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    im_end = with_turns.convert_tokens_to_ids("<|im_end|>")
    model = tiny_llama(len(with_turns), seed=1)
    eos = with_turns.eos_token_id
    assert verispec.Decoder(model, with_turns).stop_token_ids == (eos,)
    assert verispec.Decoder(model, with_turns, chat_template="chatml").stop_token_ids == (
        eos, im_end)
    decoder = verispec.Decoder(model, with_turns, chat_template="chatml")
    assert decoder.chat_prompt_ids(HI) == with_turns.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert decoder.chat_prompt_ids(HI)[0] == with_turns.convert_tokens_to_ids("<|im_start|>")


# --- Decoder.chat ----------------------------------------------------------------------------


def test_chat_without_a_template_is_refused_naming_the_option(tokenizer):
    decoder = verispec.Decoder(tiny_llama(len(tokenizer), seed=1), tokenizer)
    with pytest.raises(ChatTemplateMissing, match="chat_template=.*--chat-template") as raised:
        decoder.chat(HI, max_new_tokens=2)
    assert isinstance(raised.value, UnsupportedFeatureError)  # the server's 400
    with pytest.raises(ChatTemplateMissing):
        decoder.stream_chat(HI)
    assert decoder.generate("def", max_new_tokens=2, ignore_eos=True,
                            speculative=False).token_ids  # text still works


def test_chat_of_malformed_messages_is_an_input_error(tokenizer):
    decoder = verispec.Decoder(tiny_llama(len(tokenizer), seed=1), tokenizer,
                               chat_template="plain")
    with pytest.raises(InputError, match="messages="):
        decoder.chat("Hi")


def test_a_template_rendering_nothing_is_an_empty_prompt(tokenizer, tmp_path):
    path = tmp_path / "empty.jinja"
    path.write_text("{% if false %}x{% endif %}", encoding="utf-8")
    decoder = verispec.Decoder(tiny_llama(len(tokenizer), seed=1), tokenizer, chat_template=path)
    with pytest.raises(EmptyPromptError, match="no tokens"):
        decoder.chat_prompt_ids(HI)


# --- the demo pair: its tokenizer's "plain" template -----------------------------------------

DEMO_MESSAGES = [{"role": "system", "content": "You write Python."},
                 {"role": "user", "content": "def read_lines(path):"}]
DEMO_PROMPT = "system: You write Python.\nuser: def read_lines(path):\nassistant:"


def test_demo_pair_chats_in_the_plain_template(demo_decoder):
    assert demo_decoder.chat_template == ChatTemplate("model", CHAT_TEMPLATES["plain"])
    # encoded as generate encodes the text: the demo pair chats as it did before templates
    assert demo_decoder.chat_prompt_ids(DEMO_MESSAGES) == demo_decoder.tokenizer.encode(
        DEMO_PROMPT)
    assert demo_decoder.stop_token_ids == (demo_decoder.tokenizer.eos_token_id,)


@pytest.mark.parametrize("settings", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 4}])
def test_demo_chat_is_generate_on_the_rendered_prompt(demo_decoder, settings):
    reply = demo_decoder.chat(DEMO_MESSAGES, max_new_tokens=16, **settings)
    expected = demo_decoder.generate(DEMO_PROMPT, max_new_tokens=16, **settings)
    assert reply.token_ids == expected.token_ids and reply.text == expected.text
    assert reply.num_prompt_tokens == expected.num_prompt_tokens
    assert reply.finish_reason == expected.finish_reason
    stream = demo_decoder.stream_chat(DEMO_MESSAGES, max_new_tokens=16, **settings)
    assert "".join(stream) == reply.text
    assert stream.completion.token_ids == reply.token_ids


def test_cli_chat_answers_each_stdin_line_as_the_next_turn(demo_decoder, capsys, monkeypatch):
    """`verispec chat` with no MESSAGE: each stdin line is a user turn of one conversation,
    answered with the whole conversation so far; replies are the library's."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):\n\nclass Point:\n"))
    settings = ["--max-new-tokens", "8", "--temperature", "0", "--quiet"]
    assert cli.main(["chat", "--system", "You write Python.", *settings]) == 0
    out, err = capsys.readouterr()
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    first = demo_decoder.chat(messages, max_new_tokens=8).text
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": "class Point:"}]
    second = demo_decoder.chat(messages, max_new_tokens=8).text
    assert out == f"{first}\n{second}\n" and err == ""
