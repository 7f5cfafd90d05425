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

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ..config import BatchOptions, DepthPolicyConfig, GenerationConfig
from ..engine.constraints import ConstraintSet
from ..engine.rows import TokenLogprob
from ..engine.scoring import score_prompt
from ..errors import ConfigError, ContextLengthExceeded, EmptyPromptError, InputError
from ..proposers import ModelFreeDraft
from ..sample.checks import as_index
from .assemble import DecoderOptions, LoadedModel, assemble
from .batch import BatchStream, TextBatch, TextStream, is_batch, row_settings
from .chat import check_messages, require_chat_template, special_token_text
from .grammar import Grammar, InvalidConstraintError, TokenizerIndex, compile_response_format
from .inputs import (
    CALL_OPTIONS,
    PreparedRow,
    RequestSettings,
    check_flag,
    check_keywords,
    penalty_config,
    settings_of,
)
from .prompts import check_prompt_ids, check_text
from .stream import Completion, check_stop


class Decoder:
    """Text in, text out: speculative (or plain) decoding of a loaded model pair.

    ``Decoder(target_model, tokenizer, draft_model=None, draft_tokenizer=None, **options)``
    builds one from models already loaded; ``draft_tokenizer``: the draft's, where it is not
    the target's (a draft of another vocabulary, drafting by the ``cross_vocab`` rule);
    ``options`` are DecoderOptions' fields (assemble.py, where each is documented), the
    keywords of ``verispec.load()`` of the same names.

    One path: a call on one prompt, on a list of prompts, and the server's continuous batching
    all run on a :class:`verispec.text.batch.TextBatch` (:meth:`open_batch`); a call opens one
    of its own, under ``batch_options`` (the decoder's depth policy and k: config.BatchOptions)
    with the call's ``speculative``, ``adaptive`` and ``num_draft_tokens`` in their place.
    """

    def __init__(self, target_model: LoadedModel, tokenizer,
                 draft_model: LoadedModel | ModelFreeDraft | None = None, *,
                 draft_tokenizer=None, **options) -> None:
        parts = assemble(target_model, tokenizer, draft_model,
                         settings_of(DecoderOptions, "Decoder", options), draft_tokenizer)
        self.tokenizer, self.chat_template = tokenizer, parts.chat_template
        self.target, self.draft, self.engine = parts.target, parts.draft, parts.engine
        self.model_free, self.hybrid = parts.model_free, parts.hybrid
        self.stop_token_ids = parts.stop_token_ids
        self.batch_options = parts.batch_options  # the batches it opens, unless a call says
        self.verification = parts.verification  # of rows that name none
        self.cost_curve = parts.cost_curve  # the pair's measured pass costs (None: not measured)
        self.cross_vocab = parts.cross_vocab  # a draft of another tokenizer: its rule (else None)
        self._draft_chat = parts.draft_chat  # such a draft's own chat template (else None)
        self._constraint_index: TokenizerIndex | None = None  # llguidance's tokenizer, lazily

    @property
    def ngram(self) -> ModelFreeDraft | None:
        """Deprecated name of :attr:`model_free` (the model-free draft, n-gram or suffix)."""
        warnings.warn("Decoder.ngram is deprecated: it is Decoder.model_free (the model-free "
                      "draft: NgramDraft or SuffixDraft)", DeprecationWarning, stacklevel=2)
        return self.model_free

    @property
    def speculative(self) -> bool:
        """Whether it drafts (a draft model, or a model-free draft): else every batch is
        plain."""
        return self.engine.proposer is not None

    @property
    def num_draft_tokens(self) -> int:
        """The depth k of the batches it opens (batch_options.num_draft_tokens)."""
        return self.batch_options.num_draft_tokens

    @property
    def adaptive(self) -> DepthPolicyConfig | None:
        """The depth policy of the batches it opens (batch_options.adaptive; None: fixed k)."""
        return self.batch_options.adaptive

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
                 **settings) -> Completion | list[Completion]:
        """Generate a completion of ``prompt`` (text, or token ids); ``settings``:
        RequestSettings' fields and the call's ``speculative`` and ``adaptive`` (text/inputs.py,
        which documents each); see :meth:`stream`.

        A list of prompts (texts, or token-id lists) is decoded as one batch and gives one
        Completion per prompt, each with its own metrics. Any of max_new_tokens, temperature,
        top_k, top_p, seed, stop, min_new_tokens and response_format may then be a list with
        one value per prompt (``stop``: one list of strings, or None, per prompt); an int
        ``seed`` seeds prompt i with seed + i. A seeded prompt's text is a function of the
        prompt, its seed and its settings alone: the same whatever else is in the batch, k,
        the draft or the depth policy, and the same as with ``speculative=False``. One prompt
        and a list of that one prompt run the same code: the same tokens, metrics and depths.

        Errors: one prompt raises its typed error (a bad setting before any work; a fault of
        its own during generation: its grammar's dead end, ConstraintDeadEnd, or non-finite
        logits, NonFiniteError). In a list, settings are checked before any work (one bad
        prompt refuses the call), but a fault during generation fails that prompt alone: its
        Completion has finish_reason "error" and ``error`` (the exception), the others are
        exactly what they would have been without it. A fault of what the prompts share (the
        model's forward pass) raises for the call.
        """
        check_keywords(RequestSettings, "generate", settings, CALL_OPTIONS)
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
        no template and none was named. A draft of another tokenizer with a chat template of its
        own gets the messages rendered by that (assemble.DraftChat)."""
        template = require_chat_template(self.chat_template)
        messages = check_messages(messages)
        text = template.render(messages, special_token_text(self.tokenizer))
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise EmptyPromptError("the chat template rendered the messages as no tokens; send "
                                   "a message with some content.", field="messages")
        if self._draft_chat is not None:
            self._draft_chat.register(messages, ids)
        return ids

    def prompt_logprobs(self, prompt: str | Sequence[int], num_top: int = 0, *,
                        checked: bool = False) -> list[TokenLogprob | None]:
        """Each token of ``prompt`` (text, encoded as :meth:`generate` encodes it, or token
        ids) scored by the target: its logprob under the target's raw next-token distribution
        (log_softmax of the logits: no penalties, bias or temperature) after the tokens before
        it, with the ``num_top`` (0 to 20) most likely alternatives; None for the first token,
        which nothing predicts. One target pass over the prompt (engine/scoring.py), apart
        from any running generation.

            [lp.logprob for lp in dec.prompt_logprobs("The cat sat")[1:]]

        ``checked``: ``prompt`` is token ids that :meth:`encode` returned already (the server's
        echo), not checked again.
        """
        prompt_ids = list(prompt) if checked else self.encode(prompt)
        window = self.target.max_positions
        if window is not None and len(prompt_ids) > window:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens, more than the target's context window "
                f"of {window}; shorten it.", field="prompt")
        return score_prompt(self.target, prompt_ids, num_top)

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], **settings) -> BatchStream:
        """Decode several prompts as one batch: an iterator of (prompt index, text delta) as
        each round is verified; ``.completions`` holds one Completion per prompt at the end.
        ``settings``: :meth:`generate`'s, one value for all prompts or a list of one each.
        The prompts join as the server's requests do (TextBatch.submit): at most
        BatchOptions.prefill_budget prompt tokens a gap, a longer prompt prefilled in chunks
        while the rows already in decode. A prompt that fails on a fault of its own ends in
        that round: its Completion has finish_reason "error" and ``error``; the others go on
        (see :meth:`generate`)."""
        if not is_batch(prompts):
            raise InputError(f"prompts must be a non-empty list of texts or token-id lists; got "
                             f"{prompts!r:.80}.", field="prompts")
        text_batch, row = self._call_batch("stream_batch", settings)
        pending = [text_batch.prepare(prompts[index], index, **one)
                   for index, one in enumerate(row_settings(row, len(prompts)))]
        for item in pending:
            text_batch.submit(item)
        return BatchStream(text_batch, len(prompts))

    def open_batch(self, speculative: bool = True,
                   options: BatchOptions | None = None) -> TextBatch:
        """An empty :class:`verispec.text.batch.TextBatch` (continuous batching): rows join with
        ``add(prompt, **settings)`` or ``submit`` and leave between rounds; ``step()`` runs one
        round. ``options``: how it decodes (config.BatchOptions; default: ``batch_options``,
        the decoder's; ``dataclasses.replace(decoder.batch_options, adaptive=None)`` for a
        fixed k)."""
        self._check_speculative(speculative)
        options = self.batch_options if options is None else options
        return TextBatch(self, self.engine.batch(speculative, options))

    def stream(self, prompt: str | Sequence[int], **settings) -> TextStream:
        """Iterate text chunks as each round is verified; ``.completion`` is set at the end.
        ``settings``: RequestSettings' fields (text/inputs.py, which documents each), one value
        each, and the call's ``speculative`` and ``adaptive``.

        Generation stops at the tokenizer's end-of-generation tokens, at a stop string
        (excluded from the text), or after max_new_tokens. For several prompts at once see
        :meth:`stream_batch`.
        """
        text_batch, row = self._call_batch("stream", settings)
        pending = text_batch.prepare(prompt, **row)
        text_batch.submit(pending)
        return TextStream(text_batch, text_batch.admit()[0])

    def _call_batch(self, caller: str, settings: dict[str, object]
                    ) -> tuple[TextBatch, dict[str, object]]:
        """The batch a call runs on its own, and its rows' settings: the call's ``speculative``
        and batch options (CALL_OPTIONS: ``adaptive``, ...), and its ``num_draft_tokens`` as the
        batch's k, in place of batch_options' (BatchOptions checks them)."""
        check_keywords(RequestSettings, caller, settings, CALL_OPTIONS)
        row = dict(settings)
        speculative = row.pop("speculative", True)
        changes = {name: row.pop(name) for name in CALL_OPTIONS[1:] if name in row}
        if row.get("num_draft_tokens") is not None:
            changes["num_draft_tokens"] = row.pop("num_draft_tokens")
        return self.open_batch(speculative, replace(self.batch_options, **changes)), row

    def prepare(self, prompt: str | Sequence[int], settings: RequestSettings,
                depth: int) -> PreparedRow:
        """One prompt and its settings checked and turned into what the engine takes: its token
        ids, GenerationConfig, stop strings and grammar; ``depth``: its first k in its batch (0
        without drafts), which must fit the context with it. Raises typed errors: ConfigError
        for a bad setting, InputError for a bad prompt, ContextLengthExceeded,
        InvalidConstraintError."""
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens, num_draft_tokens=settings.num_draft_tokens,
            sampling=settings.sampling,
            stop_token_ids=() if settings.ignore_eos else self.stop_token_ids,
            min_new_tokens=settings.min_new_tokens, seed=settings.seed,
            verification=(self.verification if settings.verification is None
                          else settings.verification),
            penalty=penalty_config(settings, self.target.vocab_size), logprobs=settings.logprobs)
        prompt_ids = self.encode(prompt)
        k = depth if config.num_draft_tokens is None else min(depth, config.num_draft_tokens)
        if settings.fit_to_context:
            config = self._fitted(config, len(prompt_ids), k)
        self._check_context(len(prompt_ids), config.max_new_tokens, k)
        constraints = self._constraints(settings.response_format, config.min_new_tokens,
                                        config.max_new_tokens)
        return PreparedRow(prompt_ids, config, check_stop(settings.stop), constraints)

    def _check_speculative(self, speculative: object) -> None:
        check_flag("speculative", speculative)
        if speculative and not self.speculative:
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

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids (text encoded as :meth:`generate` encodes it; token ids as
        given), each checked to be in the target's vocabulary: InputError, EmptyPromptError or
        TokenOutOfRangeError otherwise."""
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

    def _windows(self, k: int) -> list[tuple[str, int]]:
        """The context windows a row drafting ``k`` tokens must fit: (role, positions). A draft
        of another tokenizer counts its own tokens, which the target's do not bound: a row
        that outgrows its window stops drafting instead (proposers/cross_vocab)."""
        own_draft = self.draft is not None and self.cross_vocab is None
        models = [("target", self.target)] + ([("draft", self.draft)] if k and own_draft else [])
        return [(role, lm.max_positions) for role, lm in models if lm.max_positions is not None]

    def _fitted(self, config: GenerationConfig, num_prompt_tokens: int,
                k: int) -> GenerationConfig:
        """RequestSettings.fit_to_context: max_new_tokens lowered to the room left after the
        prompt and k draft positions, at least 1 (so that an overlong prompt still gets
        ContextLengthExceeded), and min_new_tokens with it."""
        room = min((window for _, window in self._windows(k)), default=None)
        if room is None:
            return config
        max_new_tokens = max(1, min(config.max_new_tokens, room - num_prompt_tokens - k))
        return replace(config, max_new_tokens=max_new_tokens,
                       min_new_tokens=min(config.min_new_tokens, max_new_tokens))

    def _check_context(self, num_prompt_tokens: int, max_new_tokens: int, k: int) -> None:
        """prompt + max_new_tokens (+ k when drafting) must fit every model's window."""
        needed = num_prompt_tokens + max_new_tokens + k
        for role, window in self._windows(k):
            if needed > window:
                raise ContextLengthExceeded(
                    f"prompt ({num_prompt_tokens} tokens) + max_new_tokens "
                    f"({max_new_tokens}) + draft depth ({k}) = {needed} exceeds the "
                    f"{role}'s context window of {window} tokens; shorten the prompt or "
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
