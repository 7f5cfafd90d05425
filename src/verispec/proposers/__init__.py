"""Proposers: what drafts the k tokens the target verifies."""

from .base import Proposal, Proposer, ProposerSession
from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NgramDraft, NgramProposer
from .suffix import SuffixDraft, SuffixProposer

# settings of a proposer with no model (a Decoder's draft may be one of these instead of a model)
ModelFreeDraft = NgramDraft | SuffixDraft


def model_free_proposer(vocab_size: int,
                        settings: ModelFreeDraft) -> NgramProposer | SuffixProposer:
    """The proposer ``settings`` describe, over a vocabulary of ``vocab_size`` ids."""
    if isinstance(settings, SuffixDraft):
        return SuffixProposer(vocab_size, settings)
    return NgramProposer(vocab_size, settings)


__all__ = ["Proposal", "Proposer", "ProposerSession", "DraftModelProposer", "HybridProposer",
           "ModelFreeDraft", "NgramDraft", "NgramProposer", "SuffixDraft", "SuffixProposer",
           "model_free_proposer"]
