"""Request bodies of /v1/completions and /v1/chat/completions, and their checked translation
into :class:`GenerationParams` (pydantic stays here, at the HTTP boundary).

Two layers of checks, two status codes:
  422  the body does not fit the schema (a string where a number goes, a missing prompt):
       pydantic.ValidationError;
  400  the types are right but a value is not accepted: max_tokens outside 1..--max-tokens-limit,
       n != 1, logprobs, penalties, several prompts (ParameterError here), and the library's own
       range checks (temperature >= 0, top_p in (0, 1], top_k >= 1, seed, num_draft_tokens),
       run here by building the library's configs, before the request is queued.
Types are strict, as OpenAI's schema is: an integer field takes a JSON integer (not true, not
"5"), a number field a JSON number, a boolean field true or false. Unknown fields are ignored, as
OpenAI-compatible servers do.

Defaults: temperature 1.0 (OpenAI's); max_tokens omitted = as many tokens as fit in the context
window after the prompt, at most --max-tokens-limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt, StrictStr

from ..config import GenerationConfig, SamplingConfig
from ..errors import EmptyPromptError
from .errors import ParameterError, UnsupportedParameter
from .prompts import ChatMessage, ChatPrompt, TextPrompt, TokenPrompt

DEFAULT_TEMPERATURE = 1.0
Number = Annotated[float, Strict()]  # a JSON number (an integer too), never a bool or a string


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # extension
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    num_draft_tokens: StrictInt | None = None  # extension: speculation depth k for this request
    ignore_eos: StrictBool = False  # extension (vLLM, llama.cpp): do not stop at EOS tokens
    min_tokens: StrictInt = 0  # extension (vLLM): no EOS token before this many tokens
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageBody]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


@dataclass(frozen=True)
class GenerationParams:
    """One request's generation settings, checked; free of pydantic and HTTP."""

    prompt: TextPrompt | TokenPrompt | ChatPrompt
    max_tokens: int | None  # None: as many as fit in the context, at most --max-tokens-limit
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    num_draft_tokens: int | None  # None: the server's --k
    stream: bool
    ignore_eos: bool = False
    min_tokens: int = 0
    include_usage: bool = False  # stream_options.include_usage: a final usage chunk


def completion_params(body: CompletionRequest, max_tokens_limit: int) -> GenerationParams:
    _refuse(body.logprobs is not None, "logprobs",
            "logprobs are not returned by verispec; omit logprobs")
    _refuse(bool(body.echo), "echo", "echo is not supported; omit it")
    _refuse(body.best_of not in (None, 1), "best_of", "best_of must be 1 (or omitted)")
    _refuse(bool(body.suffix), "suffix", "suffix (insertion) is not supported; omit it")
    return _params(body, _completion_prompt(body.prompt), body.max_tokens, max_tokens_limit)


def chat_params(body: ChatCompletionRequest, max_tokens_limit: int) -> GenerationParams:
    _refuse(bool(body.logprobs) or body.top_logprobs is not None, "logprobs",
            "logprobs are not returned by verispec; omit logprobs")
    messages = tuple(ChatMessage(m.role, _content_text(m, i)) for i, m in enumerate(body.messages))
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    return _params(body, ChatPrompt(messages), max_tokens, max_tokens_limit)


def _params(body: _SamplingFields, prompt: TextPrompt | TokenPrompt | ChatPrompt,
            max_tokens: int | None, max_tokens_limit: int) -> GenerationParams:
    _refuse(body.n not in (None, 1), "n", f"n={body.n} is not supported: verispec returns one "
            "choice per request; omit n (or send n=1) and make several requests")
    for name in ("presence_penalty", "frequency_penalty"):
        _refuse(getattr(body, name) not in (None, 0), name, f"{name} is not supported (it would "
                "change the target distribution that speculative decoding preserves)")
    _refuse(bool(body.logit_bias), "logit_bias", "logit_bias is not supported; omit it")
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        raise ParameterError(f"max_tokens={max_tokens} is invalid: expected an integer from 1 to "
                             f"{max_tokens_limit} (the server's --max-tokens-limit).", "max_tokens")
    if not 0 <= body.min_tokens <= (max_tokens or max_tokens_limit):
        raise ParameterError(f"min_tokens={body.min_tokens} is invalid: expected an integer from "
                             f"0 to max_tokens ({max_tokens or max_tokens_limit}).", "min_tokens")
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    sampling = SamplingConfig(temperature=temperature, top_k=body.top_k, top_p=body.top_p)
    # the library's own range checks, before the request is queued (ConfigError -> 400)
    GenerationConfig(max_new_tokens=max_tokens or 1, num_draft_tokens=body.num_draft_tokens or 1,
                     sampling=sampling, seed=body.seed)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if body.stream_options is not None and not body.stream:
        raise ParameterError("stream_options is only allowed with stream: true.",
                             "stream_options")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return GenerationParams(prompt, max_tokens, temperature, body.top_k, body.top_p, body.seed,
                            stop, body.num_draft_tokens, body.stream, body.ignore_eos,
                            body.min_tokens, include_usage)


def _completion_prompt(prompt: str | list) -> TextPrompt | TokenPrompt:
    """A string, one list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if not prompt:
        raise EmptyPromptError("prompt is an empty list; pass some text or token ids.")
    if all(isinstance(t, int) for t in prompt):
        return TokenPrompt(tuple(prompt))
    if len(prompt) == 1:
        return _completion_prompt(prompt[0])
    raise UnsupportedParameter(f"prompt holds {len(prompt)} prompts; verispec serves one prompt "
                               "per request: send them as separate requests.", "prompt")


def _content_text(message: ChatMessageBody, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        _refuse(part.type != "text" or part.text is None, f"messages[{index}].content",
                f"messages[{index}] has a content part of type {part.type!r}; only text parts "
                "are supported")
        parts.append(part.text)
    return "".join(parts)


def _refuse(condition: bool, param: str, reason: str) -> None:
    if condition:
        raise UnsupportedParameter(f"{reason}.", param)
