"""Deprecated: this module is now :mod:`verispec.engine.engine`, and its SpeculativeDecoder is
:class:`~verispec.engine.engine.Engine` (the text layer's decoder is verispec.text.decoder).

The old imports keep working, with a DeprecationWarning; they give the same objects.
"""

import warnings

from .engine import Chunk, DecodingRun, Engine, GenerationResult

warnings.warn("verispec.engine.decoder is deprecated: import verispec.engine.engine (its "
              "SpeculativeDecoder is now Engine)", DeprecationWarning, stacklevel=2)

SpeculativeDecoder = Engine

__all__ = ["Chunk", "DecodingRun", "Engine", "GenerationResult", "SpeculativeDecoder"]
