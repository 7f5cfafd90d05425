"""What a request conditions on, turned into token ids in the worker thread.

Three kinds: text (``prompt`` of /v1/completions), token ids (``prompt`` as a list of ints) and
chat messages (/v1/chat/completions). Each has ``encode(tokenizer) -> list[int]`` and ``param``,
the request field it came from. Text is
encoded exactly as :meth:`verispec.Decoder.generate` encodes a string, so a greedy request here
gives what ``verispec generate --temperature 0`` gives.

Chat template: the tokenizer's own ``chat_template`` when it has one (rendered with the
generation prompt, and encoded without extra special tokens, since templates add their own).
Otherwise (the demo tokenizer has none) the plain template of :func:`render_plain_chat`:

    system: You are terse.
    user: Say hi.
    assistant:
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import check_text
from ..errors import EmptyPromptError


@dataclass(frozen=True)
class TextPrompt:
    text: str
    param: ClassVar[str] = "prompt"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if not self.text:
            raise EmptyPromptError("prompt is empty; pass some text or token ids.")
        check_text(self.text, "prompt")

    def encode(self, tokenizer) -> list[int]:
        return list(tokenizer.encode(self.text))


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]
    param: ClassVar[str] = "prompt"

    def encode(self, tokenizer) -> list[int]:
        return list(self.token_ids)  # the engine checks emptiness and the vocabulary range


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        check_text(self.role, "messages[].role")
        check_text(self.content, "messages[].content")


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]
    param: ClassVar[str] = "messages"

    def __post_init__(self) -> None:
        if not self.messages:
            raise EmptyPromptError("messages is empty; send at least one message, e.g. "
                                   '[{"role": "user", "content": "Hi"}].')

    def encode(self, tokenizer) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            return list(tokenizer.encode(render_chat(tokenizer, self.messages),
                                         add_special_tokens=False))
        return list(tokenizer.encode(render_plain_chat(self.messages)))


# what a request conditions on, of any kind
Prompt = TextPrompt | TokenPrompt | ChatPrompt


def render_chat(tokenizer, messages: tuple[ChatMessage, ...]) -> str:
    """The prompt text a chat request conditions on (the tokenizer's template, else the plain
    one), ending where the assistant's reply starts."""
    if not getattr(tokenizer, "chat_template", None):
        return render_plain_chat(messages)
    turns = [{"role": m.role, "content": m.content} for m in messages]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def render_plain_chat(messages: tuple[ChatMessage, ...]) -> str:
    """One "role: content" line per message, then "assistant:" for the reply to continue."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
