"""verispec: exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

The public surface is re-exported here; nothing runs at import time. ``__all__`` names what
users call: ``load`` and the text-level ``Decoder``, the configs, the errors, the engine on token
ids with its fixture model, and the pure math the docs show. The other names once exported here
still import from ``verispec``, with a DeprecationWarning naming the module they live in.
"""

from .config import BatchOptions, GenerationConfig, PenaltyConfig, SamplingConfig
from .engine.engine import Engine
from .errors import (
    BackendError,
    ConfigError,
    ConstraintDeadEnd,
    ContextLengthExceeded,
    DraftContractError,
    EmptyPromptError,
    IncompatibleModelsError,
    InputError,
    ModelLoadError,
    NonFiniteError,
    ShapeError,
    TokenOutOfRangeError,
    UnsupportedFeatureError,
    UnsupportedModelError,
    VerispecError,
)
from .models.fixtures import MarkovLM

# llama_cpp itself is imported when a model loads
from .models.llama_cpp.model import LlamaCppConfig
from .policy.goodput import GoodputPolicyConfig
from .policy.threshold import ThresholdPolicyConfig
from .proposers.ngram import NgramDraft
from .proposers.suffix import SuffixDraft
from .sample.block import verify_block_rows
from .sample.rejection import verify
from .sample.theory import (
    expected_tokens_per_step,
    optimal_num_draft_tokens,
    theoretical_speedup,
)

__version__ = "0.1.0"

_LAZY = {  # these pull in transformers; imported on first use so `import verispec` stays light
    "load": "verispec.text.load", "Decoder": "verispec.text.decoder",
    "Completion": "verispec.text.decoder", "ChatTemplateMissing": "verispec.text.chat",
}

# Names exported here before the surface was trimmed -> the module each lives in. They still
# import from verispec, with a DeprecationWarning that names that module.
_MOVED = {
    "demo_pair": "verispec.text.demo",
    "Chunk": "verispec.engine.engine", "DecodingRun": "verispec.engine.engine",
    "GenerationResult": "verispec.engine.engine",
    "GenerationMetrics": "verispec.engine.metrics", "TokenLogprob": "verispec.engine.rows",
    "FixedDistributionLM": "verispec.models.fixtures",
    "DraftModelProposer": "verispec.proposers", "HybridProposer": "verispec.proposers",
    "NgramProposer": "verispec.proposers", "Proposal": "verispec.proposers",
    "SuffixProposer": "verispec.proposers",
    "make_generator": "verispec.sample.sampling",
    "to_probs": "verispec.sample.sampling", "to_logprobs": "verispec.sample.sampling",
    "greedy_tokens": "verispec.sample.sampling",
    "verify_rows": "verispec.sample.rejection", "VerifyResult": "verispec.sample.result",
    "verify_greedy": "verispec.sample.greedy", "verify_greedy_rows": "verispec.sample.greedy",
    "verify_greedy_tokens": "verispec.sample.greedy",
}


# Names renamed -> (the new name, the module that has it). The old name still imports, with a
# DeprecationWarning naming the new one.
_RENAMED = {"SpeculativeDecoder": ("Engine", "verispec")}


def __getattr__(name: str) -> object:
    import importlib

    if name in _RENAMED:
        import warnings

        new_name, module = _RENAMED[name]
        warnings.warn(f"{name} is deprecated: it is now {new_name} (from {module} import "
                      f"{new_name}), the same class.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new_name)
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _MOVED:
        import warnings

        module = _MOVED[name]
        warnings.warn(f"importing {name} from verispec is deprecated: it is no longer part of "
                      f"the public surface; import it from its module: from {module} import "
                      f"{name}.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "BatchOptions",
    "ChatTemplateMissing",
    "Completion",
    "ConfigError",
    "ConstraintDeadEnd",
    "ContextLengthExceeded",
    "Decoder",
    "DraftContractError",
    "EmptyPromptError",
    "Engine",
    "GenerationConfig",
    "GoodputPolicyConfig",
    "IncompatibleModelsError",
    "InputError",
    "LlamaCppConfig",
    "MarkovLM",
    "ModelLoadError",
    "NgramDraft",
    "NonFiniteError",
    "PenaltyConfig",
    "SamplingConfig",
    "ShapeError",
    "SuffixDraft",
    "ThresholdPolicyConfig",
    "TokenOutOfRangeError",
    "UnsupportedFeatureError",
    "UnsupportedModelError",
    "VerispecError",
    "expected_tokens_per_step",
    "load",
    "optimal_num_draft_tokens",
    "theoretical_speedup",
    "verify",
    "verify_block_rows",
]
