"""The text-level :class:`Decoder` that ``verispec.load()`` (load.py) returns.

    dec = verispec.load()                       # the shipped demo pair, on the CPU
    out = dec.generate("def fibonacci(n):", max_new_tokens=64)
    print(out.text, out.metrics.acceptance_rate)

This layer owns tokenisation, context-length checks and structured-output constraints (stop
strings and incremental detokenisation: stream.py); the engine below it sees token ids only.
A call's keywords are RequestSettings' fields (inputs.py, where each is documented); the
adapters, proposer and defaults the Decoder holds are built by assemble.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from ..config import GenerationConfig, SamplingConfig
from ..engine.constraints import ConstraintSet
from ..engine.rows import TokenLogprob
from ..engine.scoring import score_prompt
from ..errors import ConfigError, ContextLengthExceeded, EmptyPromptError, InputError
from ..policy.base import AdaptivePolicyConfig
from ..proposers import ModelFreeDraft
from ..spec.checks import as_index
from .assemble import DecoderOptions, LoadedModel, assemble
from .batch import BatchStream, TextBatch, is_batch, row_settings
from .chat import check_messages, require_chat_template, special_token_text
from .grammar import Grammar, InvalidConstraintError, TokenizerIndex, compile_response_format
from .inputs import (
    PreparedRow,
    RequestSettings,
    check_flag,
    check_keywords,
    penalty_config,
    settings_of,
)
from .prompts import check_prompt_ids, check_text
from .stream import Completion, TextStream, check_stop


class Decoder:
    """Text in, text out: speculative (or plain) decoding of a loaded model pair.

    ``Decoder(target_model, tokenizer, draft_model=None, **options)`` builds one from models
    already loaded; ``options`` are DecoderOptions' fields (assemble.py, where each is
    documented), the keywords of ``verispec.load()`` of the same names.
    """

    def __init__(self, target_model: LoadedModel, tokenizer,
                 draft_model: LoadedModel | ModelFreeDraft | None = None, **options) -> None:
        parts = assemble(target_model, tokenizer, draft_model,
                         settings_of(DecoderOptions, "Decoder", options))
        self.tokenizer, self.chat_template = tokenizer, parts.chat_template
        self.target, self.draft, self.engine = parts.target, parts.draft, parts.engine
        self.ngram, self.hybrid = parts.ngram, parts.hybrid
        self.stop_token_ids, self.num_draft_tokens = parts.stop_token_ids, parts.num_draft_tokens
        self.adaptive, self.verification = parts.adaptive, parts.verification  # calls' defaults
        self.cost_curve = parts.cost_curve  # the pair's measured pass costs (None: not measured)
        self._constraint_index: TokenizerIndex | None = None  # llguidance's tokenizer, lazily

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
                 **settings) -> Completion | list[Completion]:
        """Generate a completion of ``prompt`` (text, or token ids); ``settings``:
        RequestSettings' fields (text/inputs.py, which documents each); see :meth:`stream`.

        A list of prompts (texts, or token-id lists) is decoded as one batch and gives one
        Completion per prompt, each with its own metrics. Any of max_new_tokens, temperature,
        top_k, top_p, seed, stop, min_new_tokens and response_format may then be a list with
        one value per prompt (``stop``: one list of strings, or None, per prompt); an int
        ``seed`` seeds prompt i with seed + i. A seeded prompt's text is a function of the
        prompt, its seed and its settings alone: the same whatever else is in the batch, k,
        the draft or the depth policy, and the same as with ``speculative=False``.

        Errors: one prompt raises its typed error (a bad setting before any work; a fault of
        its own during generation: its grammar's dead end, ConstraintDeadEnd, or non-finite
        logits, NonFiniteError). In a list, settings are checked before any work (one bad
        prompt refuses the call), but a fault during generation fails that prompt alone: its
        Completion has finish_reason "error" and ``error`` (the exception), the others are
        exactly what they would have been without it. A fault of what the prompts share (the
        model's forward pass) raises for the call.
        """
        check_keywords(RequestSettings, "generate", settings)
        if is_batch(prompt):
            stream = self.stream_batch(prompt, **settings)
            for _ in stream:
                pass
            return stream.completions
        run = self.stream(prompt, **settings)
        for _ in run:
            pass
        return run.completion

    def chat(self, messages: Sequence[Mapping[str, str]], **settings) -> Completion:
        """The assistant's reply to ``messages`` (a list of {"role", "content"} dicts),
        rendered by the decoder's chat template (the model's own, or ``load(chat_template=)``)
        with the generation prompt; the reply ends at the template's end-of-turn token.
        ``settings``: :meth:`generate`'s (one conversation, so single values).

            dec.chat([{"role": "user", "content": "Name a prime."}], max_new_tokens=32).text
        """
        return self.generate(self.chat_prompt_ids(messages), **settings)

    def stream_chat(self, messages: Sequence[Mapping[str, str]], **settings) -> TextStream:
        """:meth:`chat` as text chunks (see :meth:`stream`)."""
        return self.stream(self.chat_prompt_ids(messages), **settings)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The token ids a reply to ``messages`` continues: the chat template's rendering with
        the generation prompt, encoded with its own special tokens (none added). Raises
        InputError for malformed messages and ChatTemplateMissing (chat.py) when the model has
        no template and none was named."""
        template = require_chat_template(self.chat_template)
        text = template.render(check_messages(messages), special_token_text(self.tokenizer))
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise EmptyPromptError("the chat template rendered the messages as no tokens; send "
                                   "a message with some content.", field="messages")
        return ids

    def prompt_logprobs(self, prompt: str | Sequence[int], num_top: int = 0
                        ) -> list[TokenLogprob | None]:
        """Each token of ``prompt`` (text, encoded as :meth:`generate` encodes it, or token
        ids) scored by the target: its logprob under the target's raw next-token distribution
        (log_softmax of the logits: no penalties, bias or temperature) after the tokens before
        it, with the ``num_top`` (0 to 20) most likely alternatives; None for the first token,
        which nothing predicts. One target pass over the prompt (engine/scoring.py), apart
        from any running generation.

            [lp.logprob for lp in dec.prompt_logprobs("The cat sat")[1:]]
        """
        prompt_ids = self._encode(prompt)
        window = self.target.max_positions
        if window is not None and len(prompt_ids) > window:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens, more than the target's context window "
                f"of {window}; shorten it.", field="prompt")
        return score_prompt(self.target, prompt_ids, num_top)

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], speculative: bool = True,
                     adaptive: AdaptivePolicyConfig | Literal[False] | None = None,
                     **settings) -> BatchStream:
        """Decode several prompts as one batch: an iterator of (prompt index, text delta) as
        each round is verified; ``.completions`` holds one Completion per prompt at the end.
        ``settings``: :meth:`generate`'s, one value for all prompts or a list of one each.
        A prompt that fails on a fault of its own ends in that round: its Completion has
        finish_reason "error" and ``error``; the others go on (see :meth:`generate`)."""
        check_keywords(RequestSettings, "stream_batch", settings)
        if not is_batch(prompts):
            raise InputError(f"prompts must be a non-empty list of texts or token-id lists; got "
                             f"{prompts!r:.80}.", field="prompts")
        text_batch = self.open_batch(speculative, adaptive)
        text_batch.add_rows([text_batch.prepare(prompts[index], index, adaptive=adaptive, **row)
                             for index, row in enumerate(row_settings(settings, len(prompts)))])
        return BatchStream(text_batch, len(prompts))

    def open_batch(self, speculative: bool = True,
                   adaptive: AdaptivePolicyConfig | Literal[False] | None = None) -> TextBatch:
        """An empty :class:`verispec.text.batch.TextBatch` (continuous batching): rows join with
        ``add(prompt, **settings)`` and leave between rounds; ``step()`` runs one round.
        ``adaptive``: the depth policy of rows that follow one (default: the decoder's)."""
        self._check_speculative(speculative)
        policy = self.adaptive if adaptive is None else (adaptive or None)
        return TextBatch(self, self.engine.batch(speculative, policy, self.num_draft_tokens))

    def stream(self, prompt: str | Sequence[int], **settings) -> TextStream:
        """Iterate text chunks as each round is verified; ``.completion`` is set at the end.
        ``settings``: RequestSettings' fields (text/inputs.py, which documents each), one value
        each.

        Generation stops at the tokenizer's end-of-generation tokens, at a stop string
        (excluded from the text), or after max_new_tokens. For several prompts at once see
        :meth:`stream_batch`.
        """
        request = settings_of(RequestSettings, "stream", settings)
        self._check_speculative(request.speculative)
        prepared = self.prepare(prompt, request)
        run = self.engine.stream([prepared.prompt_ids], prepared.config, request.speculative,
                                 prepared.constraints)
        return TextStream(run, self.tokenizer, prepared.stop, len(prepared.prompt_ids))

    def prepare(self, prompt: str | Sequence[int], settings: RequestSettings) -> PreparedRow:
        """One prompt and its settings checked and turned into what the engine takes: its token
        ids, GenerationConfig, stop strings and grammar. Raises typed errors: ConfigError for a bad
        setting, InputError for a bad prompt, ContextLengthExceeded, InvalidConstraintError."""
        k = settings.num_draft_tokens
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            num_draft_tokens=self.num_draft_tokens if k is None else k,
            sampling=SamplingConfig(temperature=settings.temperature, top_k=settings.top_k,
                                    top_p=settings.top_p, min_p=settings.min_p),
            stop_token_ids=() if settings.ignore_eos else self.stop_token_ids,
            min_new_tokens=settings.min_new_tokens, seed=settings.seed,
            adaptive=self.adaptive if settings.adaptive is None else (settings.adaptive or None),
            verification=(self.verification if settings.verification is None
                          else settings.verification),
            penalty=penalty_config(settings, self.target.vocab_size), logprobs=settings.logprobs)
        stop_strings = check_stop(settings.stop)
        prompt_ids = self._encode(prompt)
        self._check_context(len(prompt_ids), config, settings.speculative)
        constraints = self._constraints(settings.response_format, settings.min_new_tokens,
                                        settings.max_new_tokens)
        return PreparedRow(prompt_ids, config, stop_strings, constraints)

    def _check_speculative(self, speculative: object) -> None:
        check_flag("speculative", speculative)
        if speculative and self.engine.proposer is None:
            raise ConfigError("speculative=True needs a draft, and none is loaded; pass draft=... "
                              "(a model, or NgramDraft()) to verispec.load, or speculative=False.",
                              field="speculative")

    def _constraints(self, response_format: Mapping[str, object] | Grammar | None,
                     min_new_tokens: int, max_new_tokens: int) -> ConstraintSet | None:
        grammar = (response_format if isinstance(response_format, Grammar)
                   else compile_response_format(response_format))
        if grammar is None:
            return None
        if min_new_tokens:
            raise ConfigError("min_new_tokens cannot be combined with response_format: the "
                              "grammar decides where the output may end; drop one.",
                              field="min_new_tokens")
        if self._constraint_index is None:  # built once: about a second for a large vocabulary
            self._constraint_index = TokenizerIndex(self.tokenizer, self.target.vocab_size,
                                                    self.stop_token_ids)
        constraints = ConstraintSet(self._constraint_index, [grammar])
        forced = constraints.forced_lengths()[0]
        if forced > max_new_tokens:
            raise InvalidConstraintError(
                f"response_format ({grammar.kind}) forces {forced} tokens before its output can "
                f"end, more than max_new_tokens={max_new_tokens}: raise max_new_tokens.",
                field="max_new_tokens")
        return constraints

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids, each in the target's vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("prompt is empty; pass some text or token ids.",
                                       field="prompt")
            check_text(prompt, "prompt")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = _token_ids(prompt)
        if not ids:
            raise EmptyPromptError("prompt encodes to no tokens; pass some text or token ids.",
                                   field="prompt")
        check_prompt_ids(ids, self.target.vocab_size)
        return ids

    def _check_context(self, num_prompt_tokens: int, config: GenerationConfig,
                       speculative: bool) -> None:
        """prompt + max_new_tokens (+ k when drafting) must fit every model's window."""
        k = config.num_draft_tokens if speculative else 0
        needed = num_prompt_tokens + config.max_new_tokens + k
        models = [("target", self.target)] + (
            [("draft", self.draft)] if speculative and self.draft is not None else [])
        for role, lm in models:
            if lm.max_positions is not None and needed > lm.max_positions:
                raise ContextLengthExceeded(
                    f"prompt ({num_prompt_tokens} tokens) + max_new_tokens "
                    f"({config.max_new_tokens}) + draft depth ({k}) = {needed} exceeds the "
                    f"{role}'s context window of {lm.max_positions} tokens; shorten the prompt or "
                    "lower max_new_tokens.", field="prompt")


def _token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids: a list or tuple of ints (numpy integers too) or a 1-D
    integer tensor. Bytes are refused rather than read as ids (b"hi" would be [104, 105])."""
    if isinstance(prompt, (bytes, bytearray)):
        raise InputError("prompt is bytes; decode it to text first (prompt.decode('utf-8')) or "
                         "pass a list of token ids.", field="prompt")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or (
                prompt.dtype == torch.bool):
            raise InputError(f"prompt as a tensor must be 1-D of integer token ids; got shape "
                             f"{tuple(prompt.shape)} and dtype {prompt.dtype}.", field="prompt")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise InputError(f"prompt must be a string or a list of token ids; got "
                         f"{type(prompt).__name__}.", field="prompt")
    ids = [as_index(token) for token in prompt]
    if None in ids:
        position = ids.index(None)
        raise InputError(f"prompt[{position}]={prompt[position]!r:.40} is not a token id; pass "
                         "text, or a list of ints.", field="prompt")
    return ids
