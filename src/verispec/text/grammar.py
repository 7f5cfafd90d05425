"""Grammar compilation: an OpenAI-style response_format -> a grammar llguidance can run.

compile_response_format turns a JSON schema, "any JSON object", a regular expression or a Lark
grammar into llguidance's grammar text (a Grammar), with typed errors for what does not compile;
TokenizerIndex is llguidance's view of a Hugging Face tokenizer, which makes each row's grammar
state. llguidance is imported only when a constraint is asked for. What this is not: the masks,
the per-round advance and the rollback to the accepted prefix (engine/constraints.py's
ConstraintSet, which sees only token ids).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, UnsupportedFeatureError


class InvalidConstraintError(ConfigError):
    """A response_format that cannot be compiled: a bad schema, a regex that does not compile,
    a grammar with a syntax error, a keyword the grammar engine does not support. Its field is
    response_format unless another is named."""

    def __init__(self, *args: object, field: str | None = "response_format") -> None:
        super().__init__(*args, field=field)


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text, and the kind it was made from."""

    text: str
    kind: str  # "json_schema", "json_object", "regex", "grammar"


FORMAT_KINDS = ("json_schema", "json_object", "regex", "grammar", "text")


def compile_response_format(response_format: Mapping[str, object] | None) -> Grammar | None:
    """A grammar from an OpenAI-style response_format, or None for unconstrained text.

        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
        {"type": "json_object"}                      any JSON object
        {"type": "regex", "regex": "[0-9]{3}"}       extension: the whole output matches
        {"type": "grammar", "grammar": "start: ..."} extension: a Lark grammar (llguidance's)
        {"type": "text"} or None                     no constraint

    Raises InvalidConstraintError naming what is wrong (the engine's own message included).
    """
    if response_format is None:
        return None  # unconstrained: the grammar engine is not even imported
    import llguidance

    if not isinstance(response_format, Mapping) or response_format.get("type") not in FORMAT_KINDS:
        raise InvalidConstraintError(
            f"response_format={response_format!r:.100} is invalid: expected a dict whose type is "
            f"one of {', '.join(FORMAT_KINDS)}.")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        source = _with_layout({"type": "object"})
        text = llguidance.grammar_from("json_schema", source)
    elif kind == "json_schema":
        source = _schema_text(response_format.get("json_schema"))
        text = llguidance.grammar_from("json_schema", source)
    else:
        source = response_format.get(kind)
        if not isinstance(source, str) or not source:
            raise InvalidConstraintError(f"response_format of type {kind!r} needs a non-empty "
                                         f"string field {kind!r}.")
        text = llguidance.grammar_from("regex" if kind == "regex" else "lark", source)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise InvalidConstraintError(f"response_format ({kind}) does not compile: "
                                     f"{_first_lines(error)}")
    return Grammar(text, kind)


# JSON with fixed separators and no free whitespace, as OpenAI's own output: a model cannot loop
# on newlines between the tokens the schema forces (llguidance's JSON options, docs/json_schema.md)
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _with_layout(schema: Mapping[str, object]) -> str:
    options = dict(schema.get("x-guidance") or {}) if isinstance(schema, Mapping) else {}
    return json.dumps({**schema, "x-guidance": {**_JSON_LAYOUT, **options}})


def _schema_text(json_schema: object) -> str:
    if not isinstance(json_schema, Mapping) or not isinstance(json_schema.get("schema"), Mapping):
        raise InvalidConstraintError(
            "response_format of type 'json_schema' needs json_schema: {\"name\": ..., "
            "\"schema\": {...}} with the schema as an object.")
    return _with_layout(json_schema["schema"])


def _first_lines(message: str, limit: int = 6) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:limit])


class TokenizerIndex:
    """llguidance's view of one Hugging Face tokenizer (built once: about a second for a large
    vocabulary), over ``vocab_size`` ids, with the ids that end a generation."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise UnsupportedFeatureError(
                "response_format needs a Hugging Face fast tokenizer (llguidance reads its "
                f"vocabulary); this decoder's is {type(tokenizer).__name__}.")
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        eos = self.stop_token_ids or None
        self.llg = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()  # fills a batch's masks in one call

    def matcher(self, grammar: Grammar):
        import llguidance

        matcher = llguidance.LLMatcher(self.llg, grammar.text)
        if matcher.is_error():
            raise InvalidConstraintError(f"response_format ({grammar.kind}) does not compile: "
                                         f"{_first_lines(matcher.get_error())}")
        return matcher
