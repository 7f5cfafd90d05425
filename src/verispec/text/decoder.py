"""The text-level :class:`Decoder` that ``verispec.load()`` (load.py) returns, and the
adapter each loaded model gets (:func:`wrap_model`).

    dec = verispec.load()                       # the shipped demo pair, on the CPU
    out = dec.generate("def fibonacci(n):", max_new_tokens=64)
    print(out.text, out.metrics.acceptance_rate)

This layer owns tokenisation, context-length checks and structured-output constraints (stop
strings and incremental detokenisation: stream.py); the engine below it sees token ids only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel

from ..policy.base import AdaptivePolicyConfig
from ..engine.constraints import ConstraintSet
from .grammar import Grammar, InvalidConstraintError, TokenizerIndex, compile_response_format
from ..config import VERIFICATION_RULES, GenerationConfig, SamplingConfig, check_verification
from ..policy import default_num_draft_tokens
from ..spec.checks import as_index
from .prompts import check_text
from ..engine.decoder import SpeculativeDecoder
from ..errors import ConfigError, ContextLengthExceeded, EmptyPromptError, InputError
from ..models.loading import common_vocab_size
from ..models.fast_llama import model as fast_llama
from ..models.llama_cpp.model import LlamaCppConfig, LlamaCppLM, LlamaCppModel
from ..models.llama_cpp.tokenizer import LlamaCppTokenizer
from ..models.hf.adapter import TransformersLM, output_width
from ..proposers.draft_model import DraftModelProposer
from ..proposers.hybrid import HYBRID_LOOKUP, HybridProposer
from ..proposers import ModelFreeDraft, model_free_proposer
from ..proposers.ngram import NgramDraft
from ..proposers.suffix import SuffixDraft
from .chat import (ChatTemplate, check_messages, chat_template_for, end_of_turn_ids,
                   require_chat_template, special_token_text)
from .batch import BatchStream, TextBatch, is_batch, row_settings
from .inputs import PreparedRow
from .stream import Completion, TextStream, check_stop


LoadedModel = PreTrainedModel | LlamaCppModel  # what a Decoder wraps in an adapter
BACKENDS = ("auto", "fast", "transformers", "llama.cpp")


def wrap_model(model: LoadedModel, vocab_size: int, backend: str,
               llama_cpp_config: LlamaCppConfig | None = None, draft: bool = False,
               cuda_graphs: bool = True):
    """The LanguageModel adapter for ``model`` under ``backend`` (see :func:`load`); ``draft``:
    the model only drafts (the fast path may then pick kernels by batch size); ``cuda_graphs``:
    the fast path captures its steps on a CUDA device (models/fast_llama/step_graphs.py)."""
    if isinstance(model, LlamaCppModel):  # a GGUF file loaded by llama.cpp has one forward
        return LlamaCppLM(model, vocab_size, llama_cpp_config)
    if backend == "llama.cpp":
        raise ConfigError("backend='llama.cpp' runs GGUF files loaded by llama.cpp; this model "
                          "is a transformers model: use backend='auto', 'fast' or "
                          "'transformers'.")
    if backend == "fast" or (backend == "auto" and fast_llama.supports(model)):
        return fast_llama.FastLlamaLM(model, vocab_size, draft=draft,
                                      step_graphs="auto" if cuda_graphs else "off")
    return TransformersLM(model, vocab_size)


def _num_logits(model: LoadedModel) -> int:
    return model.num_logits if isinstance(model, LlamaCppModel) else output_width(model)


def hybrid_lookup(hybrid: object, draft: object, target: object) -> NgramDraft | None:
    """The lookup settings of a hybrid proposer (None: not hybrid), checked against the draft."""
    if hybrid is False or hybrid is None:
        return None
    if not (hybrid is True or isinstance(hybrid, NgramDraft)):
        raise ConfigError(f"hybrid={hybrid!r} is invalid: expected True, False or "
                          "NgramDraft(...) (the lookup's settings).")
    if isinstance(draft, ModelFreeDraft) or (draft is None and target is not None):
        given = f"draft={type(draft).__name__}()" if draft is not None else "no draft"
        raise ConfigError(f"hybrid falls back on a draft model where lookup finds nothing, and "
                          f"{given} was given; pass a draft model (or drop hybrid for lookup "
                          "only: draft=NgramDraft()).")
    return HYBRID_LOOKUP if hybrid is True else hybrid


class Decoder:
    """Text in, text out: speculative (or plain) decoding of a loaded model pair."""

    def __init__(self, target_model: LoadedModel, tokenizer, draft_model: LoadedModel |
                 ModelFreeDraft | None = None, num_draft_tokens: int | None = None,
                 backend: str = "auto",
                 adaptive: AdaptivePolicyConfig | None = None,
                 hybrid: bool | NgramDraft = False,
                 llama_cpp_config: LlamaCppConfig | None = None,
                 verification: str = VERIFICATION_RULES[0],
                 chat_template: str | Path | None = None, cuda_graphs: bool = True) -> None:
        ngram = draft_model if isinstance(draft_model, ModelFreeDraft) else None
        hybrid = hybrid_lookup(hybrid, draft_model, target_model)
        draft_model = None if ngram is not None else draft_model
        widths = [_num_logits(target_model)]
        if draft_model is not None:
            widths.append(_num_logits(draft_model))
        vocab_size = common_vocab_size(tokenizer, *widths)
        self.tokenizer = tokenizer
        # what chat() renders messages with (chat.py); None: the model has none, chat refuses
        self.chat_template: ChatTemplate | None = chat_template_for(chat_template, tokenizer)
        # generation ends at these: the tokenizer's end-of-generation tokens and the chat
        # template's end-of-turn token (a completion of chat-formatted text stops there too)
        self.stop_token_ids = tuple(sorted(set(_stop_token_ids(tokenizer)) | set(
            end_of_turn_ids(self.chat_template, tokenizer))))
        self.target = wrap_model(target_model, vocab_size, backend, llama_cpp_config,
                                 cuda_graphs=cuda_graphs)
        # the draft model's adapter; None with no draft or an n-gram one (self.ngram)
        self.draft = None if draft_model is None else wrap_model(
            draft_model, vocab_size, backend, llama_cpp_config, draft=True,
            cuda_graphs=cuda_graphs)
        self.ngram = ngram
        self.hybrid = hybrid  # lookup settings, n-grams first, then self.draft; None: not hybrid
        proposer = (model_free_proposer(vocab_size, ngram) if ngram is not None else
                    None if self.draft is None else DraftModelProposer(self.draft))
        if hybrid is not None:
            proposer = HybridProposer(proposer, hybrid)
        self.engine = SpeculativeDecoder(self.target, proposer)
        # the depth of calls that name none; None: the target adapter's default (its flat_verify,
        # policy.default_num_draft_tokens); a suffix drafter's own rule sets each row's depth (as
        # deep as its match): k only caps it
        self.num_draft_tokens = (num_draft_tokens if num_draft_tokens is not None else
                                 ngram.max_depth if isinstance(ngram, SuffixDraft) else
                                 default_num_draft_tokens(self.target.device.type,
                                                          self.target.flat_verify))
        GenerationConfig(num_draft_tokens=self.num_draft_tokens, adaptive=adaptive)  # checked
        self.adaptive = adaptive
        check_verification(verification)
        self.verification = verification  # the rule of calls that name none
        self._constraint_index: TokenizerIndex | None = None  # llguidance's tokenizer, lazily

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
                 max_new_tokens: int | Sequence[int] = 64,
                 temperature: float | Sequence[float] = 0.0,
                 top_k: int | None | Sequence[int | None] = None,
                 top_p: float | None | Sequence[float | None] = None,
                 seed: int | None | Sequence[int | None] = None,
                 stop: str | Sequence[str] | Sequence[Sequence[str] | None] | None = None,
                 num_draft_tokens: int | None = None, speculative: bool = True,
                 adaptive: AdaptivePolicyConfig | Literal[False] | None = None,
                 ignore_eos: bool = False, min_new_tokens: int | Sequence[int] = 0,
                 response_format: Mapping[str, object] | Grammar | None | Sequence[
                     Mapping[str, object] | Grammar | None] = None,
                 verification: str | None = None) -> Completion | list[Completion]:
        """Generate a completion of ``prompt`` (text, or token ids); see :meth:`stream`.

        A list of prompts (texts, or token-id lists) is decoded as one batch and gives one
        Completion per prompt, each with its own metrics. Any of max_new_tokens, temperature,
        top_k, top_p, seed, stop, min_new_tokens and response_format may then be a list with
        one value per prompt (``stop``: one list of strings, or None, per prompt); an int
        ``seed`` seeds prompt i with seed + i. A seeded prompt's text is a function of the
        prompt, its seed and its settings alone: the same whatever else is in the batch, k,
        the draft or the depth policy, and the same as with ``speculative=False``.
        """
        settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop=stop, num_draft_tokens=num_draft_tokens,
                        adaptive=adaptive, ignore_eos=ignore_eos,
                        min_new_tokens=min_new_tokens, response_format=response_format,
                        verification=verification)
        if is_batch(prompt):
            stream = self.stream_batch(prompt, speculative=speculative, **settings)
            for _ in stream:
                pass
            return stream.completions
        run = self.stream(prompt, speculative=speculative, **settings)
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
                                   "a message with some content.")
        return ids

    def stream_batch(self, prompts: Sequence[str | Sequence[int]], speculative: bool = True,
                     adaptive: AdaptivePolicyConfig | Literal[False] | None = None,
                     **settings) -> BatchStream:
        """Decode several prompts as one batch: an iterator of (prompt index, text delta) as
        each round is verified; ``.completions`` holds one Completion per prompt at the end.
        ``settings``: :meth:`generate`'s, one value for all prompts or a list of one each."""
        if not is_batch(prompts):
            raise InputError(f"prompts must be a non-empty list of texts or token-id lists; got "
                             f"{prompts!r:.80}.")
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

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 64,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, stop: str | Sequence[str] | None = None,
               num_draft_tokens: int | None = None, speculative: bool = True,
               adaptive: AdaptivePolicyConfig | Literal[False] | None = None,
               ignore_eos: bool = False, min_new_tokens: int = 0,
               response_format: Mapping[str, object] | Grammar | None = None,
               verification: str | None = None) -> TextStream:
        """Iterate text chunks as each round is verified; ``.completion`` is set at the end.

        Generation stops at the tokenizer's EOS token, at a stop string (excluded from the
        text), or after max_new_tokens. ``speculative=False`` decodes with the target alone
        through the same code path. ``num_draft_tokens`` and ``adaptive`` override the
        decoder's defaults for this call (k is the starting depth under a policy;
        ``adaptive=False``: a fixed k for this call whatever the decoder's default).
        ``ignore_eos``: do not stop at end-of-generation tokens (they are generated and kept
        like any other token; for benchmarks that need a fixed length). ``min_new_tokens``: no
        end-of-generation token before this many new tokens (the target's distribution there is
        renormalised without them, exactly, as vLLM's min_tokens); stop strings still apply.
        ``response_format``: constrain the output (engine.constraints.compile_response_format: a
        JSON schema, any JSON object, a regex, a Lark grammar, in OpenAI's dict shape); draft and
        target are masked alike, so the output has exactly the constrained target's law.
        ``seed``: the text is then the same for any k, draft, depth policy and batch, and with
        ``speculative=False`` (each token is the target's sample on clocks keyed by the seed
        and its position, spec/seeded.py). ``verification``: "block" or "token", the rule that
        tests an unseeded sampled row's draft-model tokens (default: the decoder's).
        For several prompts at once see :meth:`stream_batch`.
        """
        self._check_speculative(speculative)
        prepared = self.prepare(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                num_draft_tokens, speculative, adaptive, ignore_eos,
                                min_new_tokens, response_format, verification)
        run = self.engine.stream([prepared.prompt_ids], prepared.config, speculative,
                                 prepared.constraints)
        return TextStream(run, self.tokenizer, prepared.stop, len(prepared.prompt_ids))

    def prepare(self, prompt: str | Sequence[int], max_new_tokens: int = 64,
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                seed: int | None = None, stop: str | Sequence[str] | None = None,
                num_draft_tokens: int | None = None, speculative: bool = True,
                adaptive: AdaptivePolicyConfig | Literal[False] | None = None,
                ignore_eos: bool = False, min_new_tokens: int = 0,
                response_format: Mapping[str, object] | Grammar | None = None,
                verification: str | None = None) -> PreparedRow:
        """One prompt's :meth:`stream` arguments checked and turned into what the engine takes:
        its token ids, GenerationConfig, stop strings and grammar. Raises the typed errors
        :meth:`stream` documents (ConfigError, InputError, ContextLengthExceeded, ...)."""
        if not isinstance(ignore_eos, bool):
            raise ConfigError(f"ignore_eos={ignore_eos!r} is invalid: expected True or False.")
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, num_draft_tokens=k,
            sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
            stop_token_ids=() if ignore_eos else self.stop_token_ids,
            min_new_tokens=min_new_tokens, seed=seed,
            adaptive=self.adaptive if adaptive is None else (adaptive or None),
            verification=self.verification if verification is None else verification)
        stop_strings = check_stop(stop)
        prompt_ids = self._encode(prompt)
        self._check_context(len(prompt_ids), config, speculative)
        constraints = self._constraints(response_format, min_new_tokens, max_new_tokens)
        return PreparedRow(prompt_ids, config, stop_strings, constraints)

    def _check_speculative(self, speculative: object) -> None:
        if not isinstance(speculative, bool):
            raise ConfigError(f"speculative={speculative!r} is invalid: expected True or False.")
        if speculative and self.engine.proposer is None:
            raise ConfigError("speculative=True needs a draft, and none is loaded; pass draft=... "
                              "(a model, or NgramDraft()) to verispec.load, or speculative=False.")

    def _constraints(self, response_format: Mapping[str, object] | Grammar | None,
                     min_new_tokens: int, max_new_tokens: int) -> ConstraintSet | None:
        grammar = (response_format if isinstance(response_format, Grammar)
                   else compile_response_format(response_format))
        if grammar is None:
            return None
        if min_new_tokens:
            raise ConfigError("min_new_tokens cannot be combined with response_format: the "
                              "grammar decides where the output may end; drop one.")
        if self._constraint_index is None:  # built once: about a second for a large vocabulary
            self._constraint_index = TokenizerIndex(self.tokenizer, self.target.vocab_size,
                                                    self.stop_token_ids)
        constraints = ConstraintSet(self._constraint_index, [grammar])
        forced = constraints.forced_lengths()[0]
        if forced > max_new_tokens:
            raise InvalidConstraintError(
                f"response_format ({grammar.kind}) forces {forced} tokens before its output can "
                f"end, more than max_new_tokens={max_new_tokens}: raise max_new_tokens.")
        return constraints

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("prompt is empty; pass some text or token ids.")
            check_text(prompt, "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = _token_ids(prompt)
        if not ids:
            raise EmptyPromptError("prompt encodes to no tokens; pass some text or token ids.")
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
                    "lower max_new_tokens.")


def _stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokens generation ends at: llama.cpp's end-of-generation set (EOS, EOT, ...) for its
    tokenizer, the EOS token for a transformers one."""
    if isinstance(tokenizer, LlamaCppTokenizer):
        return tokenizer.stop_token_ids
    eos = tokenizer.eos_token_id
    return () if eos is None else (eos,)


def _token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids: a list or tuple of ints (numpy integers too) or a 1-D
    integer tensor. Bytes are refused rather than read as ids (b"hi" would be [104, 105])."""
    if isinstance(prompt, (bytes, bytearray)):
        raise InputError("prompt is bytes; decode it to text first (prompt.decode('utf-8')) or "
                         "pass a list of token ids.")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or (
                prompt.dtype == torch.bool):
            raise InputError(f"prompt as a tensor must be 1-D of integer token ids; got shape "
                             f"{tuple(prompt.shape)} and dtype {prompt.dtype}.")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise InputError(f"prompt must be a string or a list of token ids; got "
                         f"{type(prompt).__name__}.")
    ids = [as_index(token) for token in prompt]
    if None in ids:
        position = ids.index(None)
        raise InputError(f"prompt[{position}]={prompt[position]!r:.40} is not a token id; pass "
                         "text, or a list of ints.")
    return ids
