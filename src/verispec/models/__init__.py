"""Model adapters behind the small session protocol in :mod:`verispec.models.base`."""

from .base import LanguageModel, LMSession
from .fixtures import FixedDistributionLM, MarkovLM

__all__ = ["LanguageModel", "LMSession", "FixedDistributionLM", "MarkovLM"]
