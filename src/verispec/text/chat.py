"""Chat templates: from a list of messages to the prompt text a chat model continues.

What this is: the template a :class:`verispec.Decoder` renders chat messages with (the model's
own ``chat_template``, or one named by the user: ``load(..., chat_template="chatml")``, the
CLI's and server's ``--chat-template``), rendered by Jinja2 in a sandbox the way transformers
renders templates (``messages``, ``add_generation_prompt``, the special tokens' text,
``raise_exception``), and the end-of-turn tokens the template closes a turn with, which end a
generation as the tokenizer's EOS does.

What it is not: tokenisation. The rendered text carries its own special tokens (BOS, turn
markers), so the Decoder encodes it without adding any (``add_special_tokens=False``), special
tokens written in the text parsed as the model's special tokens.

Built-in templates (CHAT_TEMPLATES):

    chatml  <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n      (SmolLM2, Qwen, ...)
    gemma   <bos><start_of_turn>user\\nHi<end_of_turn>\\n<start_of_turn>model\\n  (a system
            message is put in front of the first user turn, as Gemma's own template does)
    plain   user: Hi\\nassistant:                       (the demo pair's; no special tokens)

A model with no template of its own and none named gets :class:`ChatTemplateMissing` (a 400 on
the server's chat route) naming the option, rather than a format it was never trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ConfigError, InputError, UnsupportedFeatureError
from .prompts import check_text

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set preamble = messages[0]['content'] + '\n\n' %}"
        "{% set turns = messages[1:] %}"
        "{% else %}{% set preamble = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + (preamble if loop.first else '')"
        " + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "plain": (
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
}

# Text a template closes a turn with, where the vocabulary has it as one token: generation of a
# chat reply ends there (llama.cpp marks most of these end-of-generation in GGUF files already;
# a transformers tokenizer names only its EOS).
END_OF_TURN_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


class ChatTemplateMissing(UnsupportedFeatureError):
    """Chat was asked of a model with no chat template, and none was named."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template: ``name`` is a built-in's name, a file's path, or "model" (the
    model's own ``chat_template``); ``source`` is its Jinja text."""

    name: str
    source: str

    def compiled(self):
        """The Jinja template (compiled once per source); ConfigError if it is not Jinja."""
        return _compile(self.name, self.source)

    def render(self, messages: Sequence[Mapping[str, str]], special_tokens: Mapping[str, str],
               add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (dicts with "role" and "content"); with
        ``add_generation_prompt`` it ends where the assistant's reply starts.
        ``special_tokens``: the text of bos_token, eos_token, ... as templates name them."""
        # a template that is not Jinja (the model's own) is a ConfigError naming it, not an
        # InputError blaming the messages
        compiled = self.compiled()
        try:
            return compiled.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt, **special_tokens)
        except InputError:
            raise
        except Exception as exc:  # a template's own checks, or a message shape it rejects
            raise InputError(f"messages cannot be rendered by chat template {self.name!r}: "
                             f"{exc}; check the roles and their order.", field="messages") from exc


@lru_cache(maxsize=16)
def _compile(name: str, source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise_template_error
    try:
        return environment.from_string(source)
    except Exception as exc:  # jinja2's TemplateSyntaxError and kin
        raise ConfigError(f"chat template {name!r} is not valid Jinja: {exc}; fix the template "
                          f"or pick a built-in one ({', '.join(CHAT_TEMPLATES)}).") from exc


def _raise_template_error(message: str) -> None:
    raise InputError(f"the chat template rejected the messages: {message}", field="messages")


def chat_template_for(name: str | Path | None, tokenizer) -> ChatTemplate | None:
    """The template a Decoder renders chat with: ``name`` (a built-in's name or a Jinja file),
    else the tokenizer's own ``chat_template``; None when there is neither."""
    if name is None:
        own = getattr(tokenizer, "chat_template", None)
        return ChatTemplate("model", own) if isinstance(own, str) and own else None
    if not isinstance(name, (str, Path)) or not str(name):
        raise ConfigError(f"chat_template={name!r} is invalid: expected one of "
                          f"{', '.join(CHAT_TEMPLATES)} or the path of a Jinja template file.")
    if str(name) in CHAT_TEMPLATES:
        return ChatTemplate(str(name), CHAT_TEMPLATES[str(name)])
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"chat_template={str(name)!r} is neither a built-in template "
                          f"({', '.join(CHAT_TEMPLATES)}) nor an existing file; pass one of "
                          "those names or the path of a Jinja template file.")
    template = ChatTemplate(str(path), path.read_text(encoding="utf-8"))
    template.compiled()  # a syntax error is the caller's now, not the first request's
    return template


def require_chat_template(template: ChatTemplate | None) -> ChatTemplate:
    """``template``, or ChatTemplateMissing naming the fix."""
    if template is None:
        raise ChatTemplateMissing(
            "this model has no chat template, so chat messages cannot be turned into its prompt; "
            "name one: chat_template= in verispec.load (--chat-template in the CLI and server) "
            f"set to {', '.join(CHAT_TEMPLATES)} or a Jinja file, or send a plain completion.")
    return template


def special_token_text(tokenizer) -> dict[str, str]:
    """The text of the tokenizer's special tokens, as templates name them (bos_token, ...)."""
    texts = {}
    for name in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        text = getattr(tokenizer, f"{name}_token", None)
        if not isinstance(text, str) and token_id is not None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        texts[f"{name}_token"] = text if isinstance(text, str) else ""
    return texts


def end_of_turn_ids(template: ChatTemplate | None, tokenizer) -> tuple[int, ...]:
    """Tokens ``template`` closes a turn with (END_OF_TURN_MARKERS it writes that the
    vocabulary has as single tokens), in vocabulary order."""
    if template is None:
        return ()
    found = set()
    for marker in END_OF_TURN_MARKERS:
        if marker in template.source:
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if len(ids) == 1:
                found.add(int(ids[0]))
    return tuple(sorted(found))


def check_messages(messages: object) -> list[dict[str, str]]:
    """``messages`` as a list of {"role", "content"} dicts of text, or InputError."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputError(f"messages={messages!r:.80} is invalid: expected a non-empty list of "
                         '{"role": ..., "content": ...} dicts, e.g. '
                         '[{"role": "user", "content": "Hi"}].', field="messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(
                isinstance(message.get(field), str) for field in ("role", "content")):
            raise InputError(f"messages[{index}]={message!r:.80} is invalid: expected a dict "
                             'with text "role" and "content".', field="messages")
        check_text(message["role"], f"messages[{index}].role")
        check_text(message["content"], f"messages[{index}].content")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked
