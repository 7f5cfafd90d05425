"""verispec: exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

The public surface is re-exported here; nothing runs at import time. ``__all__`` names what
users call: ``load`` and the text-level ``Decoder``, the configs, the errors, the engine on token
ids with its fixture model, and the pure math the docs show. The other names once exported here
still import from ``verispec``, with a DeprecationWarning naming the module they live in.
"""

from .config import BatchOptions, GenerationConfig, PenaltyConfig, SamplingConfig
from .engine.decoder import SpeculativeDecoder
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
from .spec.block import verify_block_rows
from .spec.rejection import verify
from .spec.theory import (
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
    "Chunk": "verispec.engine.decoder", "DecodingRun": "verispec.engine.decoder",
    "GenerationResult": "verispec.engine.decoder",
    "GenerationMetrics": "verispec.engine.metrics", "TokenLogprob": "verispec.engine.rows",
    "FixedDistributionLM": "verispec.models.fixtures",
    "DraftModelProposer": "verispec.proposers", "HybridProposer": "verispec.proposers",
    "NgramProposer": "verispec.proposers", "Proposal": "verispec.proposers",
    "SuffixProposer": "verispec.proposers",
    "make_generator": "verispec.spec.sampling", "sample": "verispec.spec.sampling",
    "to_probs": "verispec.spec.sampling", "to_logprobs": "verispec.spec.sampling",
    "greedy_tokens": "verispec.spec.sampling",
    "verify_rows": "verispec.spec.rejection", "VerifyResult": "verispec.spec.result",
    "verify_greedy": "verispec.spec.greedy", "verify_greedy_rows": "verispec.spec.greedy",
    "verify_greedy_tokens": "verispec.spec.greedy",
}


def __getattr__(name: str) -> object:
    import importlib

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
    "SpeculativeDecoder",
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
