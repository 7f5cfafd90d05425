"""verispec: exact speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

The public surface is re-exported here; nothing runs at import time.
"""

from .policy.threshold import ThresholdPolicyConfig
from .config import BatchOptions, GenerationConfig, PenaltyConfig, SamplingConfig
from .engine.decoder import Chunk, DecodingRun, GenerationResult, SpeculativeDecoder
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
from .spec.theory import expected_tokens_per_step, optimal_num_draft_tokens, theoretical_speedup
from .policy.goodput import GoodputPolicyConfig
from .engine.metrics import GenerationMetrics
from .engine.rows import TokenLogprob
from .models import FixedDistributionLM, MarkovLM
# llama_cpp itself is imported when a model loads
from .models.llama_cpp.model import LlamaCppConfig
from .proposers import (DraftModelProposer, HybridProposer, NgramDraft, NgramProposer, Proposal,
                        SuffixDraft, SuffixProposer)
from .spec.sampling import greedy_tokens, make_generator, sample, to_logprobs, to_probs
from .spec.rejection import verify, verify_rows
from .spec.result import VerifyResult
from .spec.block import verify_block_rows
from .spec.greedy import verify_greedy, verify_greedy_rows, verify_greedy_tokens

__version__ = "0.1.0"

_LAZY = {  # these pull in transformers; imported on first use so `import verispec` stays light
    "load": ("text.load", "load"), "Decoder": ("text.decoder", "Decoder"),
    "Completion": ("text.decoder", "Completion"), "demo_pair": ("text.demo", "demo_pair"),
    "ChatTemplateMissing": ("text.chat", "ChatTemplateMissing"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(f".{module_name}", __name__), attribute)
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")

__all__ = [
    "load", "Decoder", "Completion", "demo_pair",
    "LlamaCppConfig", "BackendError",
    "ConfigError", "ConstraintDeadEnd", "ContextLengthExceeded", "DraftContractError",
    "EmptyPromptError",
    "IncompatibleModelsError", "InputError", "ModelLoadError", "NonFiniteError", "ShapeError",
    "TokenOutOfRangeError", "UnsupportedFeatureError", "UnsupportedModelError", "VerispecError",
    "GenerationConfig", "SamplingConfig", "PenaltyConfig", "BatchOptions", "TokenLogprob",
    "ThresholdPolicyConfig", "GoodputPolicyConfig",
    "SpeculativeDecoder", "DecodingRun", "GenerationResult", "Chunk", "GenerationMetrics",
    "FixedDistributionLM", "MarkovLM", "DraftModelProposer", "HybridProposer", "NgramDraft",
    "NgramProposer", "Proposal", "SuffixDraft", "SuffixProposer", "ChatTemplateMissing",
    "make_generator", "sample", "to_probs", "to_logprobs", "greedy_tokens", "verify", "verify_rows",
    "verify_block_rows", "verify_greedy", "verify_greedy_rows", "verify_greedy_tokens", "VerifyResult",
    "expected_tokens_per_step", "theoretical_speedup", "optimal_num_draft_tokens",
]
