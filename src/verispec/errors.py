"""The verispec exception hierarchy.

Every error a user can cause is a subclass of :class:`VerispecError`, so one ``except`` catches
them all, and each also subclasses the builtin it refines (``ValueError`` for bad values), so code
written against the builtins keeps working. Messages say what was expected, what came, and the
fix. The HTTP server maps these types (never message text) to status codes in one table.

An error about one setting or input names it in ``field`` too (the library's name:
"repetition_penalty", "prompt"), set where the value is checked; the server reports it as the
error's ``param`` (server/errors.py translates names its API spells otherwise).
"""

from __future__ import annotations


class VerispecError(Exception):
    """Base class of every error raised by verispec. ``field``: the setting or input the error
    is about (a keyword of generate, a config's field, "prompt"), or None."""

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self.field = field


class ConfigError(VerispecError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class InputError(VerispecError, ValueError):
    """A request's inputs (prompt, token ids) are unusable."""


class EmptyPromptError(InputError):
    """A prompt with no tokens: there is nothing to condition on."""


class TokenOutOfRangeError(InputError):
    """A token id is negative or not below the vocabulary size."""


class ShapeError(VerispecError, ValueError):
    """A tensor has the wrong rank, size, dtype or device for the operation."""


class NonFiniteError(VerispecError, ArithmeticError):
    """NaN or +inf logits, or NaN/inf probabilities: never sampled from silently."""


class ConstraintDeadEnd(ConfigError):
    """A row's response_format admits no continuation of the text generated so far (an empty
    language, or a rule that can never end): the grammar engine allows no next token. The row
    fails with it alone; its batch mates go on."""


class DraftContractError(VerispecError, RuntimeError):
    """A proposer broke its contract: it proposed a token its reported distribution gives p = 0."""


class IncompatibleModelsError(VerispecError, ValueError):
    """The draft and the target do not share a vocabulary / tokenizer."""


class ModelLoadError(VerispecError, OSError):
    """A model or tokenizer could not be loaded (missing path, offline hub id, bad files)."""


class ContextLengthExceeded(VerispecError, ValueError):
    """prompt + max_new_tokens + draft depth does not fit in a model's context window."""


class UnsupportedFeatureError(VerispecError, NotImplementedError):
    """The request asks for something verispec does not do (yet)."""


class UnsupportedModelError(UnsupportedFeatureError):
    """A model whose layers verispec cannot run exactly (recurrent or state-space layers, an
    attention kind it does not mask): raised when the model is loaded, never at generation."""


class BackendError(VerispecError, RuntimeError):
    """A model backend (llama.cpp) failed at run time: a decode or cache operation."""
