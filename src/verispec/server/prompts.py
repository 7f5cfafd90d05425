"""What a request conditions on, turned into token ids in the worker thread.

Three kinds: text (``prompt`` of /v1/completions), token ids (``prompt`` as a list of ints) and
chat messages (/v1/chat/completions). Each has ``encode(decoder) -> list[int]`` and ``param``,
the request field it came from. Text is encoded exactly as :meth:`verispec.Decoder.generate`
encodes a string, and chat messages as :meth:`verispec.Decoder.chat` renders them (the
decoder's chat template: the model's own or ``--chat-template``; a model with neither gets
text.chat.ChatTemplateMissing, a 400 naming the option), so a greedy request here gives what the
library gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import EmptyPromptError
from ..text.prompts import check_text


@dataclass(frozen=True)
class TextPrompt:
    text: str
    param: ClassVar[str] = "prompt"  # the request field it came from, for error messages
    # its echo is the text sent, which holds no added special token (BOS): none is counted in
    # its text offsets
    echo_shows_special_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.text:
            raise EmptyPromptError("prompt is empty; pass some text or token ids.",
                                   field="prompt")
        check_text(self.text, "prompt")

    def encode(self, decoder) -> list[int]:
        return list(decoder.tokenizer.encode(self.text))

    def echo_text(self, decoder, token_ids: list[int]) -> str:
        """The prompt as a completion with ``echo`` repeats it: the text sent."""
        return self.text


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]
    param: ClassVar[str] = "prompt"
    echo_shows_special_tokens: ClassVar[bool] = True

    def encode(self, decoder) -> list[int]:
        return list(self.token_ids)  # the engine checks emptiness and the vocabulary range

    def echo_text(self, decoder, token_ids: list[int]) -> str:
        """The prompt as a completion with ``echo`` repeats it: its tokens' decode."""
        return decoder.tokenizer.decode(token_ids,
                                        skip_special_tokens=not self.echo_shows_special_tokens)


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
                                   '[{"role": "user", "content": "Hi"}].', field="messages")

    def encode(self, decoder) -> list[int]:
        return decoder.chat_prompt_ids([{"role": m.role, "content": m.content}
                                        for m in self.messages])


# what a request conditions on, of any kind
Prompt = TextPrompt | TokenPrompt | ChatPrompt
