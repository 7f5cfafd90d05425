"""From loaded models to what a :class:`~verispec.text.decoder.Decoder` holds: the adapters
(:func:`wrap_model`), the proposer, the pair's measured cost curve, the engine, the stop tokens
and the default depth k.

What this is: the assembly both ``verispec.load()`` (load.py, through the Decoder) and a
Decoder built from models already in memory run, with the decoder's options
(:class:`DecoderOptions`) checked once. What it is not: loading files (load.py,
models/loading.py) or the text API (decoder.py), which holds what :func:`assemble` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from ..config import (
    CROSS_VOCAB_MODES,
    VERIFICATION_RULES,
    BatchOptions,
    check_bool,
    check_draft_p_min,
    check_verification,
    require,
)
from ..engine.engine import Engine
from ..errors import ConfigError, VerispecError
from ..models.base import LanguageModel
from ..models.fast_llama import model as fast_llama
from ..models.hf.adapter import TransformersLM, output_width
from ..models.llama_cpp.costs import pass_costs
from ..models.llama_cpp.model import LlamaCppConfig, LlamaCppLM, LlamaCppModel
from ..models.llama_cpp.tokenizer import LlamaCppTokenizer
from ..models.loading import common_vocab_size
from ..models.token_text import check_cross_pair, token_text
from ..policy import default_num_draft_tokens
from ..policy.base import AdaptivePolicyConfig
from ..policy.costs import CURVE_DEPTH, CostCurve
from ..proposers import ModelFreeDraft, model_free_proposer
from ..proposers.base import Proposer
from ..proposers.cross_vocab import CrossVocabProposer, DraftPrompts
from ..proposers.draft_model import DraftModelProposer
from ..proposers.hybrid import HYBRID_LOOKUP, HybridProposer
from ..proposers.ngram import NgramDraft
from ..proposers.suffix import SuffixDraft
from .chat import ChatTemplate, chat_template_for, end_of_turn_ids, special_token_text

LoadedModel = PreTrainedModel | LlamaCppModel  # what a Decoder wraps in an adapter
# "auto" drafts a draft of another tokenizer by the intersection rule only where the two
# vocabularies are nearly one (the shared tokens this fraction of each), else by the string
# rule: a draft restricted to the shared tokens proposes its own, shorter tokens where the
# target's would merge them, and loses to the string rule on every measured pair (dev/LOG.md,
# 2026-11-29, cross-vocabulary rules)
CROSS_VOCAB_SHARE = 0.9
BACKENDS = ("auto", "fast", "transformers", "llama.cpp")


@dataclass(frozen=True)
class DecoderOptions:
    """A decoder's options: ``verispec.load()``'s and ``Decoder``'s keywords of these names.

    num_draft_tokens: the default depth k of every generation; None picks one: a SuffixDraft's
    max_depth; on llama.cpp with a measured cost curve (LlamaCppConfig.cost_curve), the depth
    it prices best; else for the device: 4 on a GPU, and on a CPU whose fast path multiplies by
    packed oneDNN weights (AMD and other non-Intel x86), where verifying a few tokens costs
    about one step; 2 on other CPUs (with MKL on Intel verifying 4 or more tokens costs well
    over one step).
    backend: "transformers" runs the models' own forward; "fast" a flat Llama forward
    (models/fast_llama/, Llama-architecture only); "llama.cpp" runs ``.gguf`` files on
    llama.cpp's own forward (models/llama_cpp/, the ``llamacpp`` extra; quantized files run
    natively, and the tokenizer is llama.cpp's); "auto" picks "llama.cpp" when the target and
    any draft model are ``.gguf`` files and llama-cpp-python is installed, else "fast" where
    supported.
    adaptive: the default depth policy of every generation (GoodputPolicyConfig() measures which
    k is fastest on this hardware; ThresholdPolicyConfig() follows acceptance); k is then where
    it starts, except that a goodput policy given the pair's cost curve starts where the curve
    prices best (policy/costs.py). None: a fixed k.
    hybrid: True with a draft model drafts by lookup (of the last 2-3 tokens;
    ``NgramDraft(...)`` sets other lengths, ``SuffixDraft(...)`` looks up by the suffix
    drafter instead) in rounds where every row's history has a match, and by the draft model
    otherwise (proposers/hybrid.py).
    hybrid_chain: with hybrid, a row whose lookup finds fewer than its k tokens goes on with
    the draft model's after them in the same round, instead of the round choosing one or the
    other (``--hybrid-chain``).
    draft_p_min: the draft model's confidence floor, 0 to 1 (0: none; ``--draft-p-min``): a
    row's draft ends before the first position where the draft's most likely token (after
    the row's sampling settings; a greedy row's at temperature 1) is less likely than it.
    Exact: only how many tokens are drafted changes (proposers/draft_model.py).
    llama_cpp_config: llama.cpp's threads, context, batch size, kernels and cost curve
    (LlamaCppConfig; defaults: all cores, the model's context up to 4096, 512).
    verification: the default rule of unseeded sampled rows with a draft model, "block" or
    "token" (GenerationConfig.verification); a call may override it.
    chat_template: what ``Decoder.chat`` renders messages with: "chatml", "gemma", "plain" or a
    Jinja file (chat.py); None: the model's own (chat then refuses a model that has none).
    cuda_graphs: on a CUDA device the fast path's decoding steps are captured as CUDA graphs and
    replayed (models/fast_llama/step_graphs.py); False runs them eagerly.
    cross_vocab: how a draft of another tokenizer proposes (config.CROSS_VOCAB_MODES,
    ``--cross-vocab``; proposers/cross_vocab.py): "string" (its text re-tokenized into target
    tokens, verified by exact match), "intersection" (drawn over the shared tokens, verified by
    the ratio test) or "auto" (docs/cross_vocab.md says which); unused with a draft of the
    target's own vocabulary.
    """

    num_draft_tokens: int | None = None
    backend: str = "auto"
    adaptive: AdaptivePolicyConfig | None = None
    hybrid: bool | NgramDraft = False
    llama_cpp_config: LlamaCppConfig | None = None
    verification: str = VERIFICATION_RULES[0]
    chat_template: str | Path | None = None
    cuda_graphs: bool = True
    hybrid_chain: bool = False
    draft_p_min: float = 0.0
    cross_vocab: str = CROSS_VOCAB_MODES[0]

    def __post_init__(self) -> None:
        check_verification(self.verification)
        require(self.cross_vocab in CROSS_VOCAB_MODES, "cross_vocab", self.cross_vocab,
                " or ".join(repr(rule) for rule in CROSS_VOCAB_MODES))
        check_draft_p_min(self.draft_p_min)
        check_bool("hybrid_chain", self.hybrid_chain)
        BatchOptions(adaptive=self.adaptive, num_draft_tokens=1 if self.num_draft_tokens is None
                     else self.num_draft_tokens)  # checks k and adaptive
        require(self.backend in BACKENDS, "backend", self.backend,
                f"one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class DecoderParts:
    """What a Decoder holds: the adapters, the model-free draft's settings (``model_free``, None
    with a draft model or none), the hybrid's lookup settings (None: not hybrid), the engine
    over the proposer, the chat template, the tokens generation ends at, the options of the
    batches it opens (batch_options: depth policy and k; a call may name its own), the
    verification rule of rows that name none, and the pair's measured cost curve (None: not
    measured; the engine prices the depth policy with it)."""

    target: LanguageModel
    draft: LanguageModel | None
    model_free: ModelFreeDraft | None
    hybrid: NgramDraft | SuffixDraft | None
    engine: Engine
    chat_template: ChatTemplate | None
    stop_token_ids: tuple[int, ...]
    batch_options: BatchOptions
    verification: str
    cost_curve: CostCurve | None = None
    cross_vocab: str | None = None  # the rule of a draft of another tokenizer (None: none)
    draft_chat: DraftChat | None = None  # such a draft's own chat template, where it has one


@dataclass(frozen=True)
class DraftChat:
    """A draft of another tokenizer's own chat template: the decoder renders a chat with it
    too and registers the draft's prompt with the proposer (DraftPrompts), so the draft reads
    the conversation as its own model was trained to."""

    template: ChatTemplate
    tokenizer: object
    prompts: DraftPrompts

    def register(self, messages, target_ids: list[int]) -> None:
        """The draft's rendering of ``messages`` (checked) registered for ``target_ids``; a
        template that cannot render them leaves the draft the target's text."""
        try:
            text = self.template.render(messages, special_token_text(self.tokenizer))
        except VerispecError:
            return
        draft_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if draft_ids:
            self.prompts.register(target_ids, draft_ids)


def assemble(target_model: LoadedModel, tokenizer, draft_model: LoadedModel | ModelFreeDraft
             | None, options: DecoderOptions, draft_tokenizer=None) -> DecoderParts:
    """The parts a Decoder holds, built from loaded models; raises IncompatibleModelsError
    where a model's output is narrower than its tokenizer, ConfigError for options that do not
    combine with the models. ``draft_tokenizer``: the draft model's, where it is not the
    target's (a draft of another vocabulary, proposers/cross_vocab.py); None: one tokenizer."""
    hybrid = hybrid_lookup(options.hybrid, draft_model, target_model)
    check_draft_model_options(options, hybrid, draft_model, target_model)
    # a model-free draft (n-gram or suffix settings) drafts without a model adapter
    model_free = draft_model if isinstance(draft_model, ModelFreeDraft) else None
    draft_model = None if model_free is not None else draft_model
    cross = draft_tokenizer is not None and draft_model is not None
    vocab_size = common_vocab_size(tokenizer, *(
        _num_logits(model) for model in (target_model, None if cross else draft_model)
        if model is not None))
    chat_template = chat_template_for(options.chat_template, tokenizer)
    stop_token_ids = _stop_token_ids(tokenizer, chat_template)
    target = wrap_model(target_model, vocab_size, options.backend, options.llama_cpp_config,
                        cuda_graphs=options.cuda_graphs)
    draft = None if draft_model is None else wrap_model(
        draft_model, common_vocab_size(draft_tokenizer, _num_logits(draft_model)) if cross
        else vocab_size, options.backend, options.llama_cpp_config, draft=True,
        cuda_graphs=options.cuda_graphs)
    cost_curve = measure_cost_curve(target, draft)
    draft_chat = None
    if cross:
        proposer, rule = _cross_vocab_proposer(draft, draft_tokenizer, tokenizer, vocab_size,
                                               hybrid, options)
        own_template = chat_template_for(None, draft_tokenizer)
        if own_template is not None:
            draft_chat = DraftChat(own_template, draft_tokenizer, proposer.draft_prompts)
    else:
        proposer, rule = _proposer(vocab_size, draft, model_free, hybrid, options), None
    engine = Engine(target, proposer, cost_curve)
    batch_options = BatchOptions(adaptive=options.adaptive, num_draft_tokens=_num_draft_tokens(
        options.num_draft_tokens, target, model_free, cost_curve))
    return DecoderParts(target, draft, model_free, hybrid, engine, chat_template, stop_token_ids,
                        batch_options, options.verification, cost_curve, rule, draft_chat)


def measure_cost_curve(target: LanguageModel, draft: LanguageModel | None) -> CostCurve | None:
    """The pair's cost curve: a target pass over 1 .. CURVE_DEPTH + 1 tokens and a draft step
    (a model-free draft: none), measured or read from the cache as the target's
    LlamaCppConfig.cost_curve says (models/llama_cpp/costs.py). None on the other backends
    and with cost_curve "off"."""
    if not isinstance(target, LlamaCppLM):
        return None
    target_pass = pass_costs(target, CURVE_DEPTH + 1)
    if target_pass is None:
        return None
    draft_pass = pass_costs(draft, 1) if isinstance(draft, LlamaCppLM) else None
    return CostCurve(target_pass, None if draft_pass is None else draft_pass[0])


def wrap_model(model: LoadedModel, vocab_size: int, backend: str,
               llama_cpp_config: LlamaCppConfig | None = None, draft: bool = False,
               cuda_graphs: bool = True) -> LanguageModel:
    """The LanguageModel adapter for ``model`` under ``backend`` (DecoderOptions); ``draft``:
    the model only drafts (the fast path may then pick kernels by batch size); ``cuda_graphs``:
    the fast path captures its steps on a CUDA device (models/fast_llama/step_graphs.py)."""
    if isinstance(model, LlamaCppModel):  # a GGUF file loaded by llama.cpp has one forward
        return LlamaCppLM(model, vocab_size, llama_cpp_config, draft=draft)
    if backend == "llama.cpp":
        raise ConfigError("backend='llama.cpp' runs GGUF files loaded by llama.cpp; this model "
                          "is a transformers model: use backend='auto', 'fast' or "
                          "'transformers'.")
    if backend == "fast" or (backend == "auto" and fast_llama.supports(model)):
        return fast_llama.FastLlamaLM(model, vocab_size, draft=draft,
                                      step_graphs="auto" if cuda_graphs else "off")
    return TransformersLM(model, vocab_size)


def hybrid_lookup(hybrid: object, draft: object, target: object
                  ) -> NgramDraft | SuffixDraft | None:
    """The lookup settings of a hybrid proposer (None: not hybrid), checked against the draft."""
    if hybrid is False or hybrid is None:
        return None
    require(hybrid is True or isinstance(hybrid, ModelFreeDraft), "hybrid", hybrid,
            "True, False, NgramDraft(...) or SuffixDraft(...) (the lookup's settings)")
    if _no_draft_model(draft, target):
        given = f"draft={type(draft).__name__}()" if draft is not None else "no draft"
        raise ConfigError(f"hybrid falls back on a draft model where lookup finds nothing, and "
                          f"{given} was given; pass a draft model (or drop hybrid for lookup "
                          "only: draft=NgramDraft()).")
    return HYBRID_LOOKUP if hybrid is True else hybrid


def check_draft_model_options(options: DecoderOptions, hybrid: object, draft: object,
                              target: object) -> None:
    """hybrid_chain needs hybrid, and a draft_p_min floor a draft model (ConfigError naming
    the option); ``hybrid``: hybrid_lookup's result."""
    if options.hybrid_chain and hybrid is None:
        raise ConfigError("hybrid_chain=True chains a hybrid's lookup and its draft model; pass "
                          "hybrid=True (--hybrid) as well, or drop hybrid_chain.")
    if options.draft_p_min > 0 and _no_draft_model(draft, target):
        raise ConfigError(f"draft_p_min={options.draft_p_min!r} is a floor on a draft model's "
                          "confidence, and no draft model was given; pass one (--draft), or "
                          "drop draft_p_min.")


def _no_draft_model(draft: object, target: object) -> bool:
    """Whether the target decodes without a draft model (a model-free draft, or none: a
    target named alone; neither named is the demo pair, which has one)."""
    return isinstance(draft, ModelFreeDraft) or (draft is None and target is not None)


def _proposer(vocab_size: int, draft: LanguageModel | None, model_free: ModelFreeDraft | None,
              hybrid: NgramDraft | SuffixDraft | None, options: DecoderOptions
              ) -> Proposer | None:
    """What drafts: the model-free rule, else the draft model (behind lookup when hybrid);
    None: no draft, the target decodes alone."""
    if model_free is not None:
        return model_free_proposer(vocab_size, model_free)
    proposer = None if draft is None else DraftModelProposer(draft, options.draft_p_min)
    return proposer if hybrid is None else HybridProposer(proposer, hybrid,
                                                          options.hybrid_chain)


def _cross_vocab_proposer(draft: LanguageModel, draft_tokenizer, tokenizer, vocab_size: int,
                          hybrid: NgramDraft | SuffixDraft | None, options: DecoderOptions
                          ) -> tuple[Proposer, str]:
    """A draft of another tokenizer than the target's, and the rule it drafts by: the one
    ``options.cross_vocab`` names, or for "auto" the intersection rule where the two
    vocabularies are nearly one (CROSS_VOCAB_SHARE), else the string rule (docs/cross_vocab.md).
    ConfigError for the draft-model options it does not take."""
    for name, value in (("hybrid", hybrid is not None), ("draft_p_min", options.draft_p_min)):
        if value:
            raise ConfigError(f"{name} is not available with a draft of another tokenizer than "
                              "the target's; drop it, or draft with a model of the target's "
                              "own vocabulary.", field=name)
    draft_text, target_text = token_text(draft_tokenizer, "draft"), token_text(tokenizer, "target")
    shared = check_cross_pair(draft_text, target_text)  # text in common, spelled back exactly
    rule = options.cross_vocab
    if rule == "auto":
        nearly_one = min(shared.draft_coverage, shared.target_coverage) >= CROSS_VOCAB_SHARE
        rule = "intersection" if nearly_one else "string"
    pairs = list(zip(shared.draft_ids.tolist(), shared.target_ids.tolist()))
    proposer = CrossVocabProposer(draft, draft_text, target_text, rule,
                                  draft_prefix=_added_prefix(draft_tokenizer),
                                  target_vocab_size=vocab_size, shared_pairs=pairs)
    return proposer, rule


def _added_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before a text of its own accord (its BOS, where it adds one):
    what a draft model expects its context to start with."""
    with_special = tokenizer.encode("a")
    without = tokenizer.encode("a", add_special_tokens=False)
    cut = len(with_special) - len(without)
    return list(with_special[:cut]) if cut > 0 and with_special[cut:] == without else []


def _num_draft_tokens(asked: int | None, target: LanguageModel, model_free: ModelFreeDraft | None,
                      cost_curve: CostCurve | None) -> int:
    """The depth of calls that name none: ``asked``, else a suffix drafter's max_depth (its own
    rule sets each row's depth, as deep as its match: k only caps it), else the one the cost
    curve prices best, else the device's."""
    if asked is not None:
        return asked
    if isinstance(model_free, SuffixDraft):
        return model_free.max_depth
    # the measured curve, else the target adapter's flat_verify: a pass over a few tokens costs
    # far less than as many one-token passes (policy.default_num_draft_tokens)
    return default_num_draft_tokens(target.device.type, target.flat_verify, cost_curve)


def _num_logits(model: LoadedModel) -> int:
    return model.num_logits if isinstance(model, LlamaCppModel) else output_width(model)


def _stop_token_ids(tokenizer, chat_template: ChatTemplate | None) -> tuple[int, ...]:
    """The tokens generation ends at: the tokenizer's end-of-generation tokens (llama.cpp's set,
    EOS, EOT, ..., for its tokenizer; the EOS token for a transformers one) and the chat
    template's end-of-turn tokens (a completion of chat-formatted text stops there too)."""
    if isinstance(tokenizer, LlamaCppTokenizer):
        own = tuple(tokenizer.stop_token_ids)
    else:
        own = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return tuple(sorted(set(own) | set(end_of_turn_ids(chat_template, tokenizer))))
