"""What the command line's and the server's flags name, as ``load()`` takes it: the depth policy
of ``--adaptive NAME`` (policy.named_policy), the model-free draft of ``--suffix`` (the suffix
drafter) and the lookup of ``--hybrid-lookup NAME``. The entry points reach the engine's parts
through here, not around the text layer.
"""

from __future__ import annotations

from ..policy import named_policy
from ..policy.base import AdaptivePolicyConfig
from ..proposers.hybrid import lookup_named
from ..proposers.ngram import NgramDraft
from ..proposers.suffix import SuffixDraft

__all__ = ["AdaptivePolicyConfig", "hybrid_lookup", "named_policy", "suffix_draft"]


def suffix_draft() -> SuffixDraft:
    """The model-free draft ``--suffix`` runs: the suffix drafter with its defaults."""
    return SuffixDraft()


def hybrid_lookup(name: str) -> NgramDraft | SuffixDraft:
    """What a hybrid looks up before its draft model, by ``--hybrid-lookup NAME``
    (config.HYBRID_LOOKUPS): ConfigError for another name."""
    return lookup_named(name)
