"""Proposers: what drafts the k tokens the target verifies."""

from .base import Proposal, Proposer, ProposerSession
from .draft_model import DraftModelProposer
from .hybrid import HybridProposer
from .ngram import NgramDraft, NgramProposer

__all__ = ["Proposal", "Proposer", "ProposerSession", "DraftModelProposer", "HybridProposer",
           "NgramDraft", "NgramProposer"]
