"""``verispec.load()``: from local paths (or the shipped demo pair) to a :class:`Decoder`.

What it does: picks the backend (llama.cpp for GGUF files where installed, the fast Llama path,
or transformers), loads both models and their tokenizers on the asked device and dtype, and
checks before anything runs that the draft fits the target (the same tokenizer, settings that
combine). What it is not: the models' own loading (models/loading.py) or the Decoder that wraps
them (decoder.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..policy.base import AdaptivePolicyConfig
from .decoder import BACKENDS, Decoder, hybrid_lookup
from ..config import VERIFICATION_RULES, GenerationConfig, check_verification
from ..errors import ConfigError
from ..models.llama_cpp import model as llama_cpp
from ..models.llama_cpp.model import LlamaCppConfig, LlamaCppModel
from ..models.llama_cpp.tokenizer import LlamaCppTokenizer
from ..models.packaged import resolve_packaged
from ..models.loading import (
    check_same_tokenizer,
    is_gguf,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from ..proposers import ModelFreeDraft
from ..proposers.ngram import NgramDraft

ModelSource = str | Path | PreTrainedModel


def load(target: ModelSource | None = None, draft: ModelSource | ModelFreeDraft | None = None, *,
         device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
         num_draft_tokens: int | None = None, tokenizer: str | Path | None = None,
         backend: str = "auto", adaptive: AdaptivePolicyConfig | None = None,
         hybrid: bool | NgramDraft = False,
         llama_cpp_config: LlamaCppConfig | None = None,
         verification: str = VERIFICATION_RULES[0],
         chat_template: str | Path | None = None, cuda_graphs: bool = True) -> Decoder:
    """Load a target (and optionally a draft) from local paths; no arguments: the demo pair.

    A path is a transformers model directory or a ``.gguf`` file (its tokenizer is read from the
    file; quantized tensors are dequantized into ``dtype``; needs the ``gguf`` extra).
    ``draft=SuffixDraft()`` drafts without a model by the suffix-decoding rule (long drafts
    where the prompt, the output or an earlier request's text repeats, none elsewhere; what
    ``--ngram`` runs), ``draft=NgramDraft()`` by plain prompt lookup (no draft model at all;
    with no target, the demo target). ``hybrid=True`` with a draft model drafts by lookup (of
    the last 2-3 tokens; ``hybrid=NgramDraft(...)`` sets other lengths) in rounds where every
    row's history has a match, and by the draft model otherwise (no target, no draft: the demo
    pair).

    ``tokenizer`` is needed only when ``target`` is a ``PreTrainedModel`` object (a path
    otherwise); the draft must use the same tokenizer (checked here, IncompatibleModelsError).
    ``backend``: "transformers" runs the models' own forward; "fast" a flat Llama forward
    (models/fast_llama/, Llama-architecture only); "llama.cpp" runs ``.gguf`` files on
    llama.cpp's own forward (models/llama_cpp/, the ``llamacpp`` extra; quantized files run
    natively, and the tokenizer is llama.cpp's); "auto" picks "llama.cpp" when the target and
    any draft model are ``.gguf`` files and llama-cpp-python is installed, else "fast" where
    supported. ``llama_cpp_config``: llama.cpp's threads, context and batch size
    (LlamaCppConfig; defaults: all cores, the model's context up to 4096, 512).
    ``num_draft_tokens``: the default depth k of every generation; None picks one for the
    device: 4 on a GPU, and on a CPU whose fast path multiplies by packed oneDNN weights (AMD and
    other non-Intel x86), where verifying a few tokens costs about one step; 2 on other CPUs
    (with MKL on Intel verifying 4 or more tokens costs well over one step). ``adaptive``: the
    default depth policy of every generation (GoodputPolicyConfig() measures which k is fastest
    on this hardware; ThresholdPolicyConfig() follows acceptance); k is then where it starts.
    None: a fixed k. ``verification``: the default rule of unseeded sampled rows with a draft
    model, "block" or "token" (GenerationConfig.verification); a call may override it.
    ``chat_template``: what :meth:`Decoder.chat` renders messages with: "chatml", "gemma",
    "plain" or a Jinja file (chat.py); None: the model's own (chat then refuses a model that has
    none). A ``target`` or ``draft`` that is not a local path but a packaged model's name
    (models/packaged.py: "smollm2-135m-instruct", "gemma-3-270m") loads that package's GGUF file.
    ``cuda_graphs``: on a CUDA device the fast path's decoding steps are captured as CUDA graphs
    and replayed (models/fast_llama/step_graphs.py); False runs them eagerly.
    """
    target, draft = resolve_packaged(target), resolve_packaged(draft)
    hybrid_lookup(hybrid, draft, target)  # checked before anything loads
    check_verification(verification)
    if target is None and (draft is None or isinstance(draft, ModelFreeDraft)):
        from .demo import demo_pair  # the shipped assets; imported only when used

        pair = demo_pair()
        target, draft = pair.target, pair.draft if draft is None else draft
    elif target is None:
        raise ConfigError("draft was given without target; pass target=... as well (or neither "
                          "to use the shipped demo pair).")
    GenerationConfig(num_draft_tokens=1 if num_draft_tokens is None else num_draft_tokens,
                     adaptive=adaptive)  # validated before anything loads
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is invalid: expected one of {', '.join(BACKENDS)}.")
    resolved_device, resolved_dtype = resolve_device(device), resolve_dtype(dtype)
    if _runs_on_llama_cpp(backend, target, draft, resolved_device):
        if resolved_device.type != "cpu" or resolved_dtype != torch.float32:
            raise ConfigError(f"device={device!r}, dtype={dtype!r} do not apply to the llama.cpp "
                              "backend, which runs on the CPU in the GGUF file's own tensor "
                              "types; leave them at their defaults (or pick another backend).")
        target_model = LlamaCppModel(target, "target")
        draft_model = draft if isinstance(draft, ModelFreeDraft) else (
            None if draft is None else LlamaCppModel(draft, "draft"))
        target_tokenizer = LlamaCppTokenizer(target_model)
        if isinstance(draft_model, LlamaCppModel):
            check_same_tokenizer(target_tokenizer, LlamaCppTokenizer(draft_model))
        return Decoder(target_model, target_tokenizer, draft_model, num_draft_tokens, backend,
                       adaptive, hybrid, llama_cpp_config, verification, chat_template)
    target_tokenizer = _tokenizer_for(target, tokenizer, "target")
    target_model = load_model(target, device=resolved_device, dtype=resolved_dtype, role="target")
    draft_model = draft if isinstance(draft, ModelFreeDraft) else None
    if draft is not None and draft_model is None:
        draft_tokenizer = _tokenizer_for(draft, tokenizer, "draft")
        check_same_tokenizer(target_tokenizer, draft_tokenizer)
        draft_model = load_model(draft, device=resolved_device, dtype=resolved_dtype, role="draft")
    return Decoder(target_model, target_tokenizer, draft_model, num_draft_tokens, backend,
                   adaptive, hybrid, verification=verification, chat_template=chat_template,
                   cuda_graphs=cuda_graphs)


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
