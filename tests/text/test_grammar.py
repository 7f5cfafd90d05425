"""Grammar compilation (text/grammar.py): bad constraints are typed errors naming the problem,
no constraint compiles to nothing, and llguidance is imported only for a constraint."""

from __future__ import annotations

import sys

import pytest

from verispec.text.grammar import InvalidConstraintError, compile_response_format


@pytest.mark.parametrize("response_format, match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"required": ["a"]}, "then": {}}}}, "Unimplemented keys"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema"),
    ({"type": "regex", "regex": "a("}, "unclosed group"),
    ({"type": "regex", "regex": ""}, "non-empty"),
    ({"type": "grammar", "grammar": "start: 'a' missing_rule"}, "does not compile"),
    ({"type": "yaml"}, "expected a dict whose type is one of"),
    ("json", "expected a dict"),
])
def test_bad_constraints_are_typed_errors(response_format, match):
    with pytest.raises(InvalidConstraintError, match=match):
        compile_response_format(response_format)


def test_text_and_none_are_unconstrained():
    assert compile_response_format(None) is None
    assert compile_response_format({"type": "text"}) is None


def test_unconstrained_text_never_imports_the_grammar_engine(monkeypatch):
    """A request without response_format works where llguidance cannot be imported (a GPU
    image without it ran the library this way): the engine is imported only for a constraint."""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # any `import llguidance` now fails
    assert compile_response_format(None) is None
    with pytest.raises(ImportError):
        compile_response_format({"type": "regex", "regex": "[0-9]+"})
