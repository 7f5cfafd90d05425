"""Loading transformers models and tokenizers from local paths, offline, with typed errors.

verispec never reaches a model hub: a source is a local directory (config.json + safetensors or
bin weights), a local ``.gguf`` file (llama.cpp's format: config, weights and tokenizer in one
file), an id already in the local Hugging Face cache, or an already-constructed
``PreTrainedModel``. Anything else is a :class:`ModelLoadError` that says how to pass a path.

GGUF goes through transformers' own GGUF loader (it needs ``accelerate``: the ``gguf`` extra).
Quantized tensors (Q8_0, Q4_K, ...) are dequantized into ``dtype`` on load, so a GGUF target is
verified in full precision of its dequantized weights: exactness is with respect to that model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from ..errors import ConfigError, IncompatibleModelsError, ModelLoadError, UnsupportedFeatureError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ConfigError(f"dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}.")


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is invalid: expected 'cpu', 'cuda' or "
                          "'cuda:N'.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} was requested but CUDA is not available on this "
                          "machine; use device='cpu'.")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported: expected 'cpu' or 'cuda'.")
    return resolved


def _offline_hint(source: str, role: str) -> str:
    return (f"{role} {source!r} is not a local model directory and is not in the local Hugging "
            f"Face cache; verispec runs offline and never downloads. Download it elsewhere and "
            f"pass the directory (for example --{role} /path/to/model), or pre-populate the cache.")


def is_gguf(source: object) -> bool:
    """Whether ``source`` names a GGUF file (by its .gguf suffix)."""
    return isinstance(source, (str, Path)) and str(source).lower().endswith(".gguf")


def _gguf_location(source: str, role: str) -> tuple[str, str]:
    """(directory, file name) of an existing GGUF file: from_pretrained's two arguments."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{role} GGUF file {source!r} does not exist; pass the path of an "
                             "existing .gguf file.")
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
    except ModuleNotFoundError:
        raise UnsupportedFeatureError(
            f"loading the {role} from a GGUF file needs the gguf extra (accelerate is not "
            "installed): pip install 'verispec[gguf]'.") from None
    return str(path.parent), path.name


def _location(source: str, role: str, need_config: bool) -> dict[str, str]:
    """from_pretrained's keyword arguments naming ``source``: a GGUF file, a directory or an id."""
    if is_gguf(source):
        directory, file_name = _gguf_location(source, role)
        return {"pretrained_model_name_or_path": directory, "gguf_file": file_name}
    return {"pretrained_model_name_or_path": _local_or_cached(source, role, need_config)}


def _local_or_cached(source: str, role: str, need_config: bool) -> str:
    """The string to hand to from_pretrained; raises ModelLoadError for a missing local path."""
    path = Path(source).expanduser()
    if path.exists():
        if need_config and not (path / "config.json").is_file():
            raise ModelLoadError(f"{role} path {source!r} has no config.json; expected a "
                                 "transformers model directory (config.json + model.safetensors "
                                 "or pytorch_model.bin).")
        return str(path)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ModelLoadError(f"{role} path {source!r} does not exist; pass an existing model "
                             "directory.")
    return source  # maybe a hub id already in the local cache


def _load_failure(source: str, role: str, what: str, exc: Exception) -> ModelLoadError:
    if Path(source).expanduser().exists():
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ModelLoadError(f"could not load the {role} {what} from {source!r}: {first_line}")
    return ModelLoadError(_offline_hint(source, role))


def load_model(source: str | Path | PreTrainedModel, *, device: torch.device, dtype: torch.dtype,
               role: str) -> PreTrainedModel:
    """A causal LM on ``device`` in ``dtype``, in eval mode. ``role`` names it in errors."""
    if isinstance(source, PreTrainedModel):
        return source.to(device=device, dtype=dtype).eval()
    hf_logging.disable_progress_bar()  # loading bars would interleave with streamed CLI output
    location = _location(str(source), role, need_config=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(**location, dtype=dtype,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise _load_failure(str(source), role, "model", exc) from exc
    return model.to(device).eval()


def load_tokenizer(source: str | Path, role: str, model_dir: bool = False
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer at ``source``; ``model_dir`` says it is also a model directory."""
    location = _location(str(source), role, need_config=model_dir)
    try:
        return AutoTokenizer.from_pretrained(**location, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise _load_failure(str(source), role, "tokenizer", exc) from exc


def tokenizer_difference(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase
                         ) -> str | None:
    """Why the two tokenizers do not map text to the same ids, or None where they do."""
    if target.get_vocab() != draft.get_vocab():
        only_target = len(set(target.get_vocab().items()) - set(draft.get_vocab().items()))
        return (f"the draft's tokenizer differs from the target's ({len(target)} vs "
                f"{len(draft)} tokens, {only_target} target entries missing or renumbered in "
                "the draft)")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        target_id, draft_id = getattr(target, name, None), getattr(draft, name, None)
        if target_id != draft_id:
            return f"special token {name} differs: target {target_id}, draft {draft_id}"
    return None


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Raise IncompatibleModelsError unless the two tokenizers map text to the same ids."""
    difference = tokenizer_difference(target, draft)
    if difference is not None:
        raise IncompatibleModelsError(f"{difference}; a draft of the target's own vocabulary "
                                      "shares one tokenizer: pick one from the same family.")


def common_vocab_size(tokenizer: PreTrainedTokenizerBase, *widths: int) -> int:
    """The tokenizer's vocabulary size, checked against every model's output width."""
    vocab_size = len(tokenizer)
    for width in widths:
        if width < vocab_size:
            raise IncompatibleModelsError(
                f"a model produces {width} logits but its tokenizer has {vocab_size} tokens; "
                "expected an output layer at least as wide as the tokenizer.")
    return vocab_size
