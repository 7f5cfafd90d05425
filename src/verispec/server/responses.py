"""OpenAI response bodies and stream chunks for the two endpoints.

Every body carries ``usage``; a stream carries it only when the request asks
(``stream_options: {"include_usage": true}``), as OpenAI does: in one last chunk with
``choices: []`` before ``[DONE]``. Every body and the finishing chunk of every stream carry an
extra top-level ``speculation`` summary (clients built on the openai package keep unknown fields:
``response.model_extra["speculation"]``):

    "speculation": {"num_draft_tokens": 4, "depth_policy": "fixed",
                    "cross_vocab_rule": null, "drafted": 60,
                    "accepted": 41, "acceptance_rate": 0.683, "mean_accepted_length": 3.73,
                    "per_position_acceptance": [0.8, 0.7, 0.6, 0.6]}

A request with several choices (prompts x n) has one choice object per choice, ``index`` i;
its body's ``usage`` and ``speculation`` cover all of them (prompt tokens counted once a
prompt, as OpenAI counts them), and in a stream each choice's finishing chunk carries that
choice's ``speculation``.

With logprobs asked for, each choice carries them in OpenAI's shape for its endpoint
(logprobs.py), and in a stream each chunk carries those of the tokens its text shows (a token a
stop string may still cut waits; the finishing chunk brings any left), so a stream's logprobs
put together are the body's. With ``echo`` (completions) the prompt's text leads the choice's
text (in a stream: its own first chunk per choice) and its tokens lead the logprobs.

num_draft_tokens is the depth the request started at: the server's k (--k), under the request's
own num_draft_tokens, a cap (0 for plain decoding); depth_policy is "fixed", or the --adaptive
policy that moved k between rounds (a seeded request's text does not depend on it);
mean_accepted_length is the tokens produced per target call (see verispec.metrics).
"""

from __future__ import annotations

import json
import time
import uuid

from ..text.batch import TokenLogprob
from ..text.decoder import Completion
from .logprobs import Echo, TextOffsets, TokenTexts
from .worker import Delta

DONE_LINE = "data: [DONE]\n\n"


def sse(payload: dict[str, object]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(completions: list[Completion], n: int) -> dict[str, int]:
    """Tokens of a request's choices, in choice order (choice i of prompt i // n): each
    prompt's tokens once, every choice's completion tokens."""
    num_prompt = sum(completion.num_prompt_tokens for completion in completions[::n])
    num_completion = sum(len(completion.token_ids) for completion in completions)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def speculation(completions: list[Completion], num_draft_tokens: int,
                depth_policy: str | None = None, cross_vocab: str | None = None
                ) -> dict[str, object]:
    """The summary over these choices (their metrics add up exactly: engine/metrics.py);
    ``cross_vocab``: the rule of a draft of another tokenizer (None: the target's own)."""
    metrics = sum(completion.metrics for completion in completions)
    return {"num_draft_tokens": num_draft_tokens, "depth_policy": depth_policy or "fixed",
            "cross_vocab_rule": cross_vocab,
            "drafted": metrics.num_drafted,
            "accepted": metrics.num_accepted, "acceptance_rate": metrics.acceptance_rate,
            "num_rounds": metrics.num_row_rounds,
            "mean_num_draft_tokens": metrics.mean_num_draft_tokens,
            "mean_accepted_length": metrics.mean_accepted_length,
            "per_position_acceptance": list(metrics.per_position_acceptance)}


class _Format:
    """What the two endpoints share: id, creation time, model name, the summary fields."""

    id_prefix = ""

    def __init__(self, model: str, num_draft_tokens: int, depth_policy: str | None = None,
                 tool_names: tuple[str, ...] = (), n: int = 1,
                 token_texts: TokenTexts | None = None, cross_vocab: str | None = None
                 ) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.depth_policy = depth_policy
        self.cross_vocab = cross_vocab  # the rule of a draft of another tokenizer, or None
        self.tool_names = tool_names  # chat with tools: the output is a call, not content
        self.n = n  # choices per prompt (usage counts each prompt once)
        self.token_texts = token_texts  # None: the request asked for no logprobs
        self._num_sent: dict[int, int] = {}  # choice -> its token logprobs streamed so far

    object_name = ""  # of a stream's chunks

    def _envelope(self, object_name: str, choices: list[dict[str, object]],
                  completions: list[Completion] | None = None, with_usage: bool = True
                  ) -> dict[str, object]:
        body: dict[str, object] = {"id": self.id, "object": object_name, "created": self.created,
                                   "model": self.model, "choices": choices}
        if completions:
            if with_usage:
                body["usage"] = usage(completions, self.n)
            body["speculation"] = speculation(completions, self.num_draft_tokens,
                                              self.depth_policy, self.cross_vocab)
        return body

    def _left_over(self, completion: Completion, index: int) -> list[TokenLogprob]:
        """The choice's logprobs its stream has not sent yet (and from now on, none)."""
        sent = self._num_sent.get(index, 0)
        self._num_sent[index] = len(completion.token_ids)
        return (completion.logprobs or [])[sent : len(completion.token_ids)]

    def _count_sent(self, delta: Delta, index: int) -> None:
        self._num_sent[index] = self._num_sent.get(index, 0) + len(delta.logprobs)

    def usage_chunk(self, completions: list[Completion]) -> dict[str, object]:
        """The last chunk of a stream that asked for include_usage: no choices, the usage."""
        body = self._envelope(self.object_name, [])
        body["usage"] = usage(completions, self.n)
        return body


class CompletionFormat(_Format):
    """/v1/completions: object "text_completion" for the body and for each chunk."""

    id_prefix = "cmpl-"
    object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, TextOffsets] = {}  # choice -> its new tokens' text offsets

    def body(self, completions: list[Completion], echoes: list[Echo | None]
             ) -> dict[str, object]:
        choices = []
        for index, (completion, echo) in enumerate(zip(completions, echoes)):
            text = completion.text if echo is None else echo.text + completion.text
            logprobs = None
            if self.token_texts is not None:
                offsets = self._start_offsets(index, echo)(completion.token_ids)
                logprobs = self.token_texts.completion_logprobs(
                    [*_echoed(echo), *(completion.logprobs or [])],
                    [*_echoed_ids(echo), *completion.token_ids],
                    [*_echoed_offsets(echo), *offsets])
            choices.append(self._choice(index, text, completion.finish_reason, logprobs))
        return self._envelope("text_completion", choices, completions)

    def opening_chunks(self, echoes: list[Echo | None]) -> list[dict[str, object]]:
        """With echo, each choice's prompt first (and its logprobs)."""
        if self.token_texts is not None:
            for index, echo in enumerate(echoes):
                self._start_offsets(index, echo)
        return [self._envelope("text_completion", [self._choice(
            index, echo.text, None, None if self.token_texts is None
            else self.token_texts.completion_logprobs(_echoed(echo), echo.token_ids,
                                                      _echoed_offsets(echo)))])
            for index, echo in enumerate(echoes) if echo is not None]

    def _start_offsets(self, index: int, echo: Echo | None) -> TextOffsets:
        """Choice ``index``'s text offsets of new tokens, which follow its echoed prompt."""
        assert self.token_texts is not None
        self._offsets[index] = TextOffsets(self.token_texts.tokenizer,
                                           start=0 if echo is None else len(echo.text))
        return self._offsets[index]

    def delta_chunk(self, delta: Delta, index: int) -> dict[str, object]:
        self._count_sent(delta, index)
        return self._envelope("text_completion", [self._choice(
            index, delta.text, None, self._new_logprobs(delta.logprobs, index))])

    def final_chunks(self, completion: Completion, index: int) -> list[dict[str, object]]:
        logprobs = self._new_logprobs(self._left_over(completion, index), index)
        return [self._envelope("text_completion",
                               [self._choice(index, "", completion.finish_reason, logprobs)],
                               [completion], with_usage=False)]

    def _new_logprobs(self, logprobs: list[TokenLogprob], index: int
                      ) -> dict[str, object] | None:
        """The completions logprobs object of a choice's next new tokens, their text offsets
        going on from its tokens before."""
        if self.token_texts is None:
            return None
        token_ids = [lp.token_id for lp in logprobs]
        offsets = self._offsets.get(index) or self._start_offsets(index, None)
        return self.token_texts.completion_logprobs(logprobs, token_ids, offsets(token_ids))

    @staticmethod
    def _choice(index: int, text: str, finish_reason: str | None,
                logprobs: dict[str, object] | None = None) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}


def _echoed(echo: Echo | None) -> list[TokenLogprob | None]:
    """An echoed prompt's logprobs (None for its first token), or none without echo."""
    if echo is None:
        return []
    return echo.logprobs if echo.logprobs is not None else [None] * len(echo.token_ids)


def _echoed_ids(echo: Echo | None) -> list[int]:
    return [] if echo is None else echo.token_ids


def _echoed_offsets(echo: Echo | None) -> list[int]:
    """An echoed prompt's text offsets (computed with its logprobs), or none without echo."""
    if echo is None:
        return []
    assert echo.text_offsets is not None and len(echo.text_offsets) == len(echo.token_ids)
    return echo.text_offsets


class ChatFormat(_Format):
    """/v1/chat/completions: "chat.completion", or "chat.completion.chunk" when streaming (a
    first chunk carries the assistant role, as OpenAI's does)."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion.chunk"

    def body(self, completions: list[Completion], echoes: list[Echo | None]
             ) -> dict[str, object]:
        return self._envelope("chat.completion", [self._message_choice(index, completion)
                                                  for index, completion in enumerate(completions)],
                              completions)

    def _message_choice(self, index: int, completion: Completion) -> dict[str, object]:
        message: dict[str, object] = {"role": "assistant", "content": completion.text}
        call = self._tool_call(completion)
        if call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"index": index, "message": message,
                "logprobs": self._chat_logprobs(completion.logprobs or []),
                "finish_reason": "tool_calls" if call is not None else completion.finish_reason}

    def opening_chunks(self, echoes: list[Echo | None]) -> list[dict[str, object]]:
        return [self._chunk(index, {"role": "assistant", "content": ""}, None)
                for index in range(len(echoes))]

    def delta_chunk(self, delta: Delta, index: int) -> dict[str, object] | None:
        if self.tool_names:  # a call is sent whole at the end, once its JSON is complete
            return None
        self._count_sent(delta, index)
        return self._chunk(index, {"content": delta.text}, None,
                           logprobs=self._chat_logprobs(delta.logprobs))

    def final_chunks(self, completion: Completion, index: int) -> list[dict[str, object]]:
        call = self._tool_call(completion)
        if call is None:
            logprobs = self._chat_logprobs(self._left_over(completion, index))
            if self.tool_names:  # cut by max_tokens before the call was complete: as text
                return [self._chunk(index, {"content": completion.text}, None),
                        self._chunk(index, {}, completion.finish_reason, completion)]
            return [self._chunk(index, {}, completion.finish_reason, completion, logprobs)]
        return [self._chunk(index, {"tool_calls": [{"index": 0, **call}]}, None),
                self._chunk(index, {}, "tool_calls", completion)]

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, object] | None:
        if self.token_texts is None:
            return None
        return self.token_texts.chat_logprobs(logprobs)

    def _tool_call(self, completion: Completion) -> dict[str, object] | None:
        """OpenAI's tool_calls entry for an output constrained to {"name", "arguments"}; None
        without tools, or when max_tokens cut the call short (finish_reason "length")."""
        if not self.tool_names or completion.finish_reason != "stop":
            return None
        call = json.loads(completion.text)  # the grammar made it valid JSON of this shape
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}

    def _chunk(self, index: int, delta: dict[str, str], finish_reason: str | None,
               completion: Completion | None = None,
               logprobs: dict[str, object] | None = None) -> dict[str, object]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_name, [choice],
                              None if completion is None else [completion], with_usage=False)


ResponseFormat = CompletionFormat | ChatFormat
