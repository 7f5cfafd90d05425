"""``verispec.load()``: from local paths (or the shipped demo pair) to a :class:`Decoder`.

What it does: picks the backend (llama.cpp for GGUF files where installed, the fast Llama path,
or transformers), loads both models and their tokenizers on the asked device and dtype, and
checks before anything loads that the options combine and that the draft fits the target (the
same tokenizer). The Decoder then holds what assemble.py builds from the loaded models (the
adapters, the proposer, the default depth k). What it is not: the models' own loading
(models/loading.py) or the Decoder (decoder.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..config import CROSS_VOCAB_MODES, VERIFICATION_RULES
from ..errors import ConfigError
from ..models.llama_cpp import model as llama_cpp
from ..models.llama_cpp.model import LlamaCppConfig, LlamaCppModel
from ..models.llama_cpp.tokenizer import LlamaCppTokenizer
from ..models.loading import (
    is_gguf,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    tokenizer_difference,
)
from ..models.packaged import resolve_packaged
from ..policy.base import AdaptivePolicyConfig
from ..proposers import ModelFreeDraft
from .assemble import DecoderOptions, LoadedModel, check_draft_model_options, hybrid_lookup
from .decoder import Decoder

ModelSource = str | Path | PreTrainedModel
# what load() hands a Decoder: the target, its tokenizer, the draft (a model, model-free
# settings, or None), and the draft's tokenizer where it is not the target's (else None)
LoadedPair = tuple[LoadedModel, object, LoadedModel | ModelFreeDraft | None, object]


def load(target: ModelSource | None = None, draft: ModelSource | ModelFreeDraft | None = None, *,
         device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
         num_draft_tokens: int | None = None, tokenizer: str | Path | None = None,
         backend: str = "auto", adaptive: AdaptivePolicyConfig | None = None,
         hybrid: bool | ModelFreeDraft = False,
         llama_cpp_config: LlamaCppConfig | None = None,
         verification: str = VERIFICATION_RULES[0],
         chat_template: str | Path | None = None, cuda_graphs: bool = True,
         hybrid_chain: bool = False, draft_p_min: float = 0.0,
         cross_vocab: str = CROSS_VOCAB_MODES[0]) -> Decoder:
    """Load a target (and optionally a draft) from local paths; no arguments: the demo pair.

    A path is a transformers model directory or a ``.gguf`` file (its tokenizer is read from the
    file; quantized tensors are dequantized into ``dtype``; needs the ``gguf`` extra). A
    ``target`` or ``draft`` that is not a local path but a packaged model's name
    (models/packaged.py: "smollm2-135m-instruct", "gemma-3-270m") loads that package's GGUF file.
    ``draft=SuffixDraft()`` drafts without a model by the suffix-decoding rule (long drafts
    where the prompt, the output or an earlier request's text repeats, none elsewhere; what
    ``--suffix`` runs), ``draft=NgramDraft()`` by plain prompt lookup (no draft model at all;
    with no target, the demo target). ``hybrid=True`` (or the lookup's settings, NgramDraft or
    SuffixDraft), ``hybrid_chain`` and ``draft_p_min`` need a draft model (no target, no draft:
    the demo pair).

    ``tokenizer`` is needed only when ``target`` is a ``PreTrainedModel`` object (a path
    otherwise). A draft of another tokenizer than the target's drafts by the ``cross_vocab``
    rule (proposers/cross_vocab.py, docs/cross_vocab.md); each model of such a pair runs on
    the backend that suits it alone (a GGUF file on llama.cpp under backend "auto").
    ``device`` and ``dtype`` place transformers models; the llama.cpp backend runs on the CPU in
    the file's own types. The other keywords are DecoderOptions' fields (text/assemble.py, where
    each is documented): num_draft_tokens, backend, adaptive, hybrid, llama_cpp_config,
    verification, chat_template, cuda_graphs, hybrid_chain, draft_p_min, cross_vocab.
    """
    options = DecoderOptions(num_draft_tokens, backend, adaptive, hybrid, llama_cpp_config,
                             verification, chat_template, cuda_graphs, hybrid_chain,
                             draft_p_min, cross_vocab)  # checked before loading
    target, draft = _sources(resolve_packaged(target), resolve_packaged(draft), options)
    resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
    if _runs_on_llama_cpp(backend, target, draft, resolved_device):
        if resolved_device.type != "cpu" or resolved_dtype != torch.float32:
            raise ConfigError(f"device={device!r}, dtype={dtype!r} do not apply to the llama.cpp "
                              "backend, which runs on the CPU in the GGUF file's own tensor "
                              "types; leave them at their defaults (or pick another backend).")
        loaded = _load_llama_cpp(target, draft, llama_cpp_config)
    else:
        loaded = _load_transformers(target, draft, tokenizer, resolved_device, resolved_dtype,
                                    backend, llama_cpp_config)
    target_model, target_tokenizer, draft_model, draft_tokenizer = loaded
    return Decoder(target_model, target_tokenizer, draft_model, draft_tokenizer=draft_tokenizer,
                   **vars(options))


def _sources(target: ModelSource | None, draft: ModelSource | ModelFreeDraft | None,
             options: DecoderOptions
             ) -> tuple[ModelSource, ModelSource | ModelFreeDraft | None]:
    """What to load: the demo pair (or its target, with a model-free draft) where no target is
    named; the draft-model options' need of a draft model checked before anything loads."""
    check_draft_model_options(options, hybrid_lookup(options.hybrid, draft, target), draft,
                              target)
    if target is None and (draft is None or isinstance(draft, ModelFreeDraft)):
        from .demo import demo_pair  # the shipped assets; imported only when used

        pair = demo_pair()
        return pair.target, pair.draft if draft is None else draft
    if target is None:
        raise ConfigError("draft was given without target; pass target=... as well (or neither "
                          "to use the shipped demo pair).")
    return target, draft


def _load_llama_cpp(target: ModelSource, draft: ModelSource | ModelFreeDraft | None,
                    config: LlamaCppConfig | None) -> LoadedPair:
    """GGUF files loaded by llama.cpp, with llama.cpp's tokenizers (the draft's kept where it is
    not the target's: a draft of another vocabulary)."""
    target_model = LlamaCppModel(target, "target", config)
    target_tokenizer = LlamaCppTokenizer(target_model)
    if draft is None or isinstance(draft, ModelFreeDraft):
        return target_model, target_tokenizer, draft, None
    draft_model = LlamaCppModel(draft, "draft", config)
    draft_tokenizer = LlamaCppTokenizer(draft_model)
    other = tokenizer_difference(target_tokenizer, draft_tokenizer) is not None
    return target_model, target_tokenizer, draft_model, draft_tokenizer if other else None


def _load_transformers(target: ModelSource, draft: ModelSource | ModelFreeDraft | None,
                       tokenizer: str | Path | None, device: torch.device, dtype: torch.dtype,
                       backend: str = "auto", config: LlamaCppConfig | None = None
                       ) -> LoadedPair:
    """transformers models on ``device`` in ``dtype`` and their tokenizers (compared before the
    draft loads). A draft of another vocabulary and a GGUF file among the two: each model on
    its own backend (_load_apart)."""
    target_tokenizer = _tokenizer_for(target, tokenizer, "target")
    if draft is None or isinstance(draft, ModelFreeDraft):
        target_model = load_model(target, device=device, dtype=dtype, role="target")
        return target_model, target_tokenizer, draft, None
    draft_tokenizer = _tokenizer_for(draft, tokenizer, "draft")
    if tokenizer_difference(target_tokenizer, draft_tokenizer) is None:
        target_model = load_model(target, device=device, dtype=dtype, role="target")
        draft_model = load_model(draft, device=device, dtype=dtype, role="draft")
        return target_model, target_tokenizer, draft_model, None
    target_model, target_tokenizer = _load_apart(target, target_tokenizer, "target", device,
                                                 dtype, backend, config)
    draft_model, draft_tokenizer = _load_apart(draft, draft_tokenizer, "draft", device, dtype,
                                               backend, config)
    return target_model, target_tokenizer, draft_model, draft_tokenizer


def _load_apart(source: ModelSource, tokenizer, role: str, device: torch.device,
                dtype: torch.dtype, backend: str, config: LlamaCppConfig | None
                ) -> tuple[LoadedModel, object]:
    """One model of a pair of two vocabularies, on the backend that suits it alone: a GGUF
    file on llama.cpp (backend "auto" on the CPU with llama-cpp-python installed), else
    transformers; with its tokenizer (llama.cpp's for a file llama.cpp runs)."""
    if _runs_on_llama_cpp(backend, source, None, device):
        model = LlamaCppModel(source, role, config)
        return model, LlamaCppTokenizer(model)
    return load_model(source, device=device, dtype=dtype, role=role), tokenizer


def _runs_on_llama_cpp(backend: str, target: object, draft: object,
                       device: torch.device) -> bool:
    """Whether load() puts the models on llama.cpp: asked for, or "auto" with GGUF files only
    (a GGUF target with a transformers draft stays on transformers, as both must share one
    backend's tokenizer) on the CPU with llama-cpp-python installed."""
    gguf_only = is_gguf(target) and (draft is None or isinstance(draft, ModelFreeDraft)
                                     or is_gguf(draft))
    if backend == "llama.cpp":
        if not gguf_only:
            raise ConfigError(f"backend='llama.cpp' needs .gguf files: target={str(target)!r}, "
                              f"draft={str(draft)!r}; pass GGUF files (verispec export-gguf "
                              "writes them from a Llama checkpoint) or another backend.")
        llama_cpp.bindings()  # raises UnsupportedFeatureError naming the extra when missing
        return True
    return (backend == "auto" and gguf_only and device.type == "cpu"
            and llama_cpp.is_available())


def _tokenizer_for(source: ModelSource, tokenizer: str | Path | None, role: str):
    if tokenizer is not None:
        return load_tokenizer(tokenizer, role)
    if isinstance(source, PreTrainedModel):
        raise ConfigError(f"{role} is a model object, so its tokenizer cannot be found; pass "
                          "tokenizer='/path/to/tokenizer'.")
    return load_tokenizer(source, role, model_dir=True)
