"""Request bodies of /v1/completions and /v1/chat/completions, and their checked translation
into :class:`GenerationParams` (pydantic stays here, at the HTTP boundary).

Two layers of checks, two status codes:
  422  the body does not fit the schema (a string where a number goes, a missing prompt):
       pydantic.ValidationError;
  400  the types are right but a value is not accepted: max_tokens outside 1..--max-tokens-limit
       (0 too with echo), n < 1, more choices (prompts x n) than one request may run, logprobs
       that are not an integer from 0 to 20, a logit_bias key that is not a token id
       (ParameterError here), and the library's own range checks (temperature in [0, 1e4],
       top_p in (0, 1], top_k >= 1, min_p in [0, 1], penalties in [-2, 2],
       repetition_penalty in [0.01, 100], a bias in [-100, 100], each token id once, seed,
       num_draft_tokens), run here by building the request's one RequestSettings, before the
       request is queued (a logit_bias id beyond the vocabulary, prompt ids, the context
       window: when the row is prepared, also a 400). Every 400 names its field in the error's
       param
       (the library's ConfigError.field, errors.py); the JSON schema shows these ranges.
Choices: a request may carry several prompts (/v1/completions: a list of texts or of token-id
lists) and ask for ``n`` choices of each, as OpenAI's API does; choice i (prompt i // n) is a
row of its own in the batch, seeded with seed + i when a seed is given (so a seeded request
gives the same choices wherever it runs, and its choices differ from each other).
Types are strict, as OpenAI's schema is: an integer field takes a JSON integer (not true, not
"5"), a number field a JSON number, a boolean field true or false. Unknown fields are ignored, as
OpenAI-compatible servers do, except those that would change the output (functions,
guided_json, ...: OUTPUT_CHANGING_FIELDS), which are refused (400 unsupported_parameter).
response_format (json_schema, json_object, and the regex and grammar extensions) and tools
(tool_choice "required" or a named function) constrain the output (engine/constraints.py); an
invalid schema, regex or grammar is a 400 naming the problem.

Logprobs: chat takes ``logprobs: true`` and ``top_logprobs: N``, /v1/completions ``logprobs: N``
(0 to 20 alternatives per token; logprobs.py has the shapes). ``echo: true`` (completions) puts
the prompt before the text, and with logprobs its tokens' scores first (the first token's null);
``max_tokens: 0`` with echo scores the prompt only, as evaluation harnesses ask.
Penalties: presence_penalty and frequency_penalty (OpenAI's), repetition_penalty and min_p
(extensions, as vLLM's), logit_bias ({"token id": bias}), all applied by the library to the
distribution speculative decoding keeps exact (RequestSettings).

Defaults: temperature 1.0 (OpenAI's); max_tokens omitted = as many tokens as fit in the context
window after the prompt, at most --max-tokens-limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

from ..config import (
    MAX_LOGIT_BIAS,
    MAX_NUM_DRAFT_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)
from ..errors import EmptyPromptError
from ..text.grammar import Grammar, InvalidConstraintError, compile_response_format
from ..text.inputs import RequestSettings
from .errors import ParameterError, UnsupportedParameter
from .prompts import ChatMessage, ChatPrompt, Prompt, TextPrompt, TokenPrompt

DEFAULT_TEMPERATURE = 1.0
Number = Annotated[float, Strict()]  # a JSON number (an integer too), never a bool or a string


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format, plus two extensions: {"type": "regex", "regex": ...} and
    {"type": "grammar", "grammar": <a Lark grammar>}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaSpec | None = None
    regex: StrictStr | None = None
    grammar: StrictStr | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


def _ranged(about: str, **bounds: float) -> Any:
    """An optional field whose range the library checks (a 400 naming it), shown in the JSON
    schema (minimum, maximum, ...) but not enforced by pydantic (which would answer 422)."""
    return Field(None, description=about, json_schema_extra=bounds)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept only to refuse OUTPUT_CHANGING_FIELDS

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = _ranged("0 = greedy", minimum=0, maximum=MAX_TEMPERATURE)
    top_p: Number | None = _ranged("nucleus mass kept", exclusiveMinimum=0, maximum=1)
    top_k: StrictInt | None = _ranged("extension: the k most likely tokens kept", minimum=1)
    seed: StrictInt | None = _ranged("choice i is seeded with seed + i", minimum=0,
                                     maximum=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    num_draft_tokens: StrictInt | None = _ranged(  # extension
        "the most draft tokens a round for this request, a cap on the server's depth k",
        minimum=1, maximum=MAX_NUM_DRAFT_TOKENS)
    ignore_eos: StrictBool = False  # extension (vLLM, llama.cpp): do not stop at EOS tokens
    min_tokens: StrictInt = 0  # extension (vLLM): no EOS token before this many tokens
    presence_penalty: Number | None = _ranged("OpenAI's", minimum=-MAX_PENALTY,
                                              maximum=MAX_PENALTY)
    frequency_penalty: Number | None = _ranged("OpenAI's", minimum=-MAX_PENALTY,
                                               maximum=MAX_PENALTY)
    repetition_penalty: Number | None = _ranged(  # extension (vLLM)
        "Hugging Face's, over prompt and output; 1 = off", minimum=MIN_REPETITION_PENALTY,
        maximum=MAX_REPETITION_PENALTY)
    min_p: Number | None = _ranged("extension (vLLM)", minimum=0, maximum=1)
    logit_bias: dict[str, Number] | None = Field(
        None, description=f"{{token id: bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]}}, "
        "each token id once")
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    # any JSON number or a boolean reaches the check (a 400 naming what it takes), not a 422
    logprobs: StrictInt | StrictBool | Number | None = None
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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


@dataclass(frozen=True)
class GenerationParams:
    """One request, checked; free of pydantic and HTTP. ``settings``: what each of its rows
    runs under, built once; the rest is the request's shape and how it is answered."""

    prompts: tuple[Prompt, ...]  # one per prompt, in order
    settings: RequestSettings
    max_tokens: int | None  # None: as many as fit in the context, at most --max-tokens-limit
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: a final usage chunk
    tool_names: tuple[str, ...] = ()  # tools: the output is a call of one of these functions
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: no logprobs; N: each token's with N alternatives
    echo: bool = False  # completions: the prompt before the text (and its logprobs first)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choice(self, index: int) -> tuple[Prompt, RequestSettings]:
        """Choice ``index``'s prompt (prompt index // n) and settings, seeded with seed + index
        when the request has a seed (choice 0's are the request's own)."""
        settings = self.settings
        if index and settings.seed is not None:
            settings = replace(settings, seed=settings.seed + index)
        return self.prompts[index // self.n], settings


# fields other servers take that would change the output, which verispec does not implement:
# refused rather than ignored (a dropped constraint is a wrong answer, not a degraded one)
OUTPUT_CHANGING_FIELDS = ("functions", "function_call", "guided_json", "guided_regex",
                          "guided_choice", "guided_grammar", "structured_outputs", "grammar",
                          "json_schema", "prediction")


def completion_params(body: CompletionRequest, max_tokens_limit: int,
                      max_choices: int) -> GenerationParams:
    _refuse(body.best_of not in (None, 1), "best_of", "best_of must be 1 (or omitted)")
    _refuse(bool(body.suffix), "suffix", "suffix (insertion) is not supported; omit it")
    logprobs = body.logprobs
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise ParameterError(f"logprobs={json.dumps(logprobs)} is invalid for /v1/completions: "
                             f"expected an integer from 0 to {MAX_TOP_LOGPROBS} (the "
                             "alternatives listed per token; chat takes logprobs: true with "
                             "top_logprobs).", "logprobs")
    return _params(body, _completion_prompts(body.prompt), body.max_tokens, max_tokens_limit,
                   max_choices, _response_grammar(body), logprobs=logprobs,
                   echo=bool(body.echo))


def chat_params(body: ChatCompletionRequest, max_tokens_limit: int,
                max_choices: int) -> GenerationParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise ParameterError("top_logprobs needs logprobs: true.", "top_logprobs")
    messages = tuple(ChatMessage(m.role, _content_text(m, i)) for i, m in enumerate(body.messages))
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    grammar, tool_names = _response_grammar(body), ()
    if body.tools and body.tool_choice != "none":
        _refuse(grammar is not None, "tools", "tools and response_format cannot be combined: "
                "send one of them")
        _refuse(bool(body.logprobs), "logprobs", "logprobs are not returned for tool calls; "
                "omit logprobs, or the tools")
        grammar, tool_names = _tool_grammar(body.tools, body.tool_choice)
    return _params(body, (ChatPrompt(messages),), max_tokens, max_tokens_limit, max_choices,
                   grammar, tool_names, logprobs=(body.top_logprobs or 0) if body.logprobs
                   else None)


def _response_grammar(body: _SamplingFields) -> Grammar | None:
    extra = body.model_extra or {}
    for name in OUTPUT_CHANGING_FIELDS:
        _refuse(extra.get(name) is not None, name, f"{name} is not supported by verispec; use "
                "response_format (json_schema, json_object, regex, grammar) or tools")
    if body.response_format is None:
        return None
    return _compiled(body.response_format.model_dump(by_alias=True, exclude_none=True),
                     "response_format")


def _tool_grammar(tools: list[Tool], choice) -> tuple[Grammar, tuple[str, ...]]:
    """The output as one call of a tool: {"name": ..., "arguments": {...}} (its parameters'
    schema), for tool_choice "required" (any of the tools) or a named function."""
    names = [tool.function.name for tool in tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ParameterError(f"tool_choice names function {choice.function.name!r}, which "
                                 f"is not among the tools ({', '.join(names)}).", "tool_choice")
        tools = [tool for tool in tools if tool.function.name == choice.function.name]
    else:
        _refuse(choice != "required", "tool_choice", f"tool_choice={choice or 'auto'!r} is not "
                "supported (the model would have to choose between text and a call): send "
                "tool_choice 'required' or {\"type\": \"function\", \"function\": {\"name\": "
                "...}}, or 'none'")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": tool.function.name},
                             "arguments": tool.function.parameters or {"type": "object"}}}
             for tool in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    grammar = _compiled({"type": "json_schema", "json_schema": {"name": "tool_call",
                                                                "schema": schema}}, "tools")
    return grammar, tuple(tool.function.name for tool in tools)


def _compiled(response_format: dict, param: str) -> Grammar | None:
    try:
        return compile_response_format(response_format)
    except InvalidConstraintError as exc:
        raise ParameterError(str(exc), param) from None


def _params(body: _SamplingFields, prompts: tuple[Prompt, ...],
            max_tokens: int | None, max_tokens_limit: int, max_choices: int,
            grammar: Grammar | None = None, tool_names: tuple[str, ...] = (),
            logprobs: int | None = None, echo: bool = False) -> GenerationParams:
    n = _checked_n(body, len(prompts), max_choices)
    _check_max_tokens(max_tokens, max_tokens_limit, echo)
    most = max_tokens_limit if max_tokens is None else max_tokens
    if not 0 <= body.min_tokens <= most:
        raise ParameterError(f"min_tokens={body.min_tokens} is invalid: expected an integer from "
                             f"0 to max_tokens ({most}).", "min_tokens")
    _check_logprobs(logprobs, "logprobs" if isinstance(body, CompletionRequest)
                    else "top_logprobs")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if not all(stop):
        raise ParameterError(f"stop={body.stop!r} is invalid: expected a non-empty string or a "
                             "list of non-empty strings.", "stop")
    if body.stream_options is not None and not body.stream:
        raise ParameterError("stream_options is only allowed with stream: true.",
                             "stream_options")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    # the request's one RequestSettings, checked by the library's own configs (ConfigError ->
    # 400, its field the error's param); without max_tokens, what fits after the prompt (with
    # max_tokens 0, an echo, nothing is generated: it is checked all the same)
    settings = RequestSettings(
        max_new_tokens=max_tokens or max_tokens_limit, fit_to_context=max_tokens is None,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed, stop=stop,
        num_draft_tokens=body.num_draft_tokens, ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_tokens, response_format=grammar,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias) or None, logprobs=logprobs)
    return GenerationParams(prompts, settings, max_tokens, body.stream, include_usage,
                            tool_names, n, logprobs, echo)


def _check_max_tokens(max_tokens: int | None, max_tokens_limit: int, echo: bool) -> None:
    """1 to --max-tokens-limit; 0 too with echo (the prompt scored, nothing generated)."""
    low = 0 if echo else 1
    if max_tokens is not None and not low <= max_tokens <= max_tokens_limit:
        raise ParameterError(f"max_tokens={max_tokens} is invalid: expected an integer from {low} "
                             f"to {max_tokens_limit} (the server's --max-tokens-limit"
                             + ("" if echo else "; 0 only with echo") + ").", "max_tokens")


def _check_logprobs(logprobs: int | None, param: str) -> None:
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ParameterError(f"{param}={logprobs} is invalid: expected an integer from 0 to "
                             f"{MAX_TOP_LOGPROBS} (the alternatives listed per token).", param)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} as {id: bias}; a key that is not a token id (a decimal
    integer), or one id twice ("5" and "05"), is a ParameterError. The ids' range is the
    model's: checked when the row is prepared (Decoder.prepare)."""
    pairs = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ParameterError(f"logit_bias key {key!r:.40} is invalid: expected a token id "
                                 "(a decimal integer string, e.g. \"50256\").", "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ParameterError(f"logit_bias[{key!r}]={value!r} is invalid: expected a number "
                                 f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].", "logit_bias")
        if int(key) in pairs:
            raise ParameterError(f"logit_bias names token id {int(key)} twice ({key!r} and "
                                 "another spelling); give each token id once.", "logit_bias")
        pairs[int(key)] = float(value)
    return pairs


def _checked_n(body: _SamplingFields, num_prompts: int, max_choices: int) -> int:
    """n (choices per prompt), checked: at least 1, prompts x n within what the server runs for
    one request, and seed + i (choice i's seed) below 2**63."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise ParameterError(f"n={n} is invalid: expected an integer >= 1 (choices per "
                             "prompt).", "n")
    num_choices = num_prompts * n
    if num_choices > max_choices:
        raise ParameterError(f"{num_prompts} prompt(s) x n={n} = {num_choices} choices is more "
                             f"than the {max_choices} this server runs for one request (the "
                             "smaller of --max-batch-size and --max-queue); send fewer prompts "
                             "or a smaller n, or split the request.",
                             "n" if num_prompts == 1 else "prompt")
    if body.seed is not None and body.seed < 2**63 <= body.seed + num_choices - 1:
        raise ParameterError(f"seed={body.seed} is invalid for {num_choices} choices: choice i "
                             "is seeded with seed + i, which must stay below 2**63.", "seed")
    return n


def _completion_prompts(prompt: str | list) -> tuple[Prompt, ...]:
    """A string or one list of token ids (one prompt), or a list of strings or of token-id
    lists (one prompt each, as OpenAI's API takes them)."""
    if isinstance(prompt, str):
        return (TextPrompt(prompt),)
    if not prompt:
        raise EmptyPromptError("prompt is an empty list; pass some text or token ids.",
                               field="prompt")
    if all(isinstance(t, int) for t in prompt):
        return (TokenPrompt(tuple(prompt)),)
    if any(isinstance(p, list) and not p for p in prompt):
        raise EmptyPromptError("prompt holds an empty list of token ids; every prompt needs at "
                               "least one token.", field="prompt")
    return tuple(TextPrompt(p) if isinstance(p, str) else TokenPrompt(tuple(p)) for p in prompt)


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
