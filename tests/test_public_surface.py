"""verispec's public surface: ``__all__`` names what users call, and nothing that left it broke.

Three checks: every name ``verispec`` exported before its ``__all__`` was trimmed still imports
from it, the ones that left with a DeprecationWarning naming a module that has them; the names
in ``__all__`` import without one; every import and every ``verispec.name`` that the README, the
docs and the examples show still resolves, without a warning (a documented name is public).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import warnings
from pathlib import Path

import pytest

import verispec

ROOT = Path(__file__).resolve().parent.parent

# verispec.__all__ before it was trimmed to what users call
EXPORTED_BEFORE = (
    "load", "Decoder", "Completion", "demo_pair", "LlamaCppConfig", "BackendError",
    "ConfigError", "ConstraintDeadEnd", "ContextLengthExceeded", "DraftContractError",
    "EmptyPromptError", "IncompatibleModelsError", "InputError", "ModelLoadError",
    "NonFiniteError", "ShapeError", "TokenOutOfRangeError", "UnsupportedFeatureError",
    "UnsupportedModelError", "VerispecError", "GenerationConfig", "SamplingConfig",
    "PenaltyConfig", "TokenLogprob", "ThresholdPolicyConfig", "GoodputPolicyConfig",
    "Engine", "DecodingRun", "GenerationResult", "Chunk", "GenerationMetrics",
    "FixedDistributionLM", "MarkovLM", "DraftModelProposer", "HybridProposer", "NgramDraft",
    "NgramProposer", "Proposal", "SuffixDraft", "SuffixProposer", "ChatTemplateMissing",
    "make_generator", "sample", "to_probs", "to_logprobs", "greedy_tokens", "verify",
    "verify_rows", "verify_block_rows", "verify_greedy", "verify_greedy_rows",
    "verify_greedy_tokens", "VerifyResult", "expected_tokens_per_step", "theoretical_speedup",
    "optimal_num_draft_tokens",
)
RENAMED = {"SpeculativeDecoder": "Engine"}
# `sample` was a function; verispec.sample is now the package of the rules (vLLM's name), and the
# function lives on in it: verispec.sample.sampling.sample
LEFT = sorted(set(EXPORTED_BEFORE) - set(verispec.__all__) - set(RENAMED) - {"sample"})
# modules renamed -> their new names: the old import still works, with a DeprecationWarning
MOVED_MODULES = {"verispec.spec.sampling": "verispec.sample.sampling",
                 "verispec.spec.rejection": "verispec.sample.rejection",
                 "verispec.spec.theory": "verispec.sample.theory",
                 "verispec.engine.decoder": "verispec.engine.engine"}
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                    *(ROOT / "examples").glob("*.py")])
# `verispec.name` in prose or code; a logger's name (logger `verispec.llama_cpp`) is no import
DOTTED = re.compile(r"(?<!logger `)\bverispec((?:\.[A-Za-z_]\w*)+)")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("name", LEFT)
def test_a_name_that_left_all_imports_with_a_deprecation_warning(name):
    with pytest.warns(DeprecationWarning, match=rf"\b{name}\b") as caught:
        value = getattr(verispec, name)  # what `from verispec import name` calls
    module = re.search(rf"from (verispec[\w.]*) import {name}\b", str(caught[0].message))
    assert module, f"the warning names no module to import {name} from: {caught[0].message}"
    assert value is getattr(importlib.import_module(module.group(1)), name)


@pytest.mark.parametrize("name", sorted(verispec.__all__))
def test_a_public_name_imports_without_a_warning(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(verispec, name)


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_a_renamed_name_imports_with_a_warning_naming_the_new_one(old, new):
    with pytest.warns(DeprecationWarning, match=rf"\b{old}\b.*\bnow {new}\b"):
        value = getattr(verispec, old)
    assert value is getattr(verispec, new)


def test_the_former_sample_function_lives_in_the_sample_package():
    from verispec.sample.sampling import sample

    assert verispec.sample.__name__ == "verispec.sample" and callable(sample)


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_a_moved_module_imports_under_its_old_name_with_a_warning(old, new, monkeypatch):
    import sys

    package = old.rsplit(".", 1)[0]
    for name in (old, package if package.endswith(".spec") else old):
        monkeypatch.delitem(sys.modules, name, raising=False)  # the warning is issued again
    with pytest.warns(DeprecationWarning, match=re.escape(new.rsplit(".", 1)[0])):
        module = importlib.import_module(old)
    new_module = importlib.import_module(new)
    names = getattr(module, "__all__", None) or [name for name in vars(new_module)
                                                 if not name.startswith("_")]
    assert names and all(getattr(module, name) is getattr(new_module, name) for name in names
                         if name != "SpeculativeDecoder")


def test_the_old_engine_name_stays_the_same_class(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "verispec.engine.decoder", raising=False)
    with pytest.warns(DeprecationWarning):
        from verispec.engine.decoder import SpeculativeDecoder
    assert SpeculativeDecoder is verispec.Engine


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        verispec.no_such_name  # noqa: B018


def _python_sources() -> list[tuple[Path, str]]:
    """The Python the documents show: each python block of a Markdown file, each example."""
    sources = []
    for path in DOCUMENTS:
        text = path.read_text()
        blocks = [text] if path.suffix == ".py" else PYTHON_BLOCK.findall(text)
        sources += [(path, block) for block in blocks]
    return sources


def test_the_documents_hold_python_to_check():
    # the scans below must find something: README's blocks and examples/fixture_models.py
    assert LEFT, "no name left __all__: the deprecation test would check nothing"
    imports = [node for _, source in _python_sources() for node in ast.walk(ast.parse(source))
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert len(imports) >= 3
    assert len({match.group(1) for path in DOCUMENTS
                for match in DOTTED.finditer(path.read_text())}) >= 8


@pytest.mark.parametrize("path, source", _python_sources(),
                         ids=[f"{path.name}-{i}" for i, (path, _) in enumerate(_python_sources())])
def test_every_documented_import_works_without_a_warning(path, source):
    for node in ast.walk(ast.parse(source)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("verispec"):
                module = importlib.import_module(node.module)
                for alias in node.names:  # raises where a name is gone or deprecated
                    assert hasattr(module, alias.name) or _is_module(
                        f"{node.module}.{alias.name}"), f"{path.name}: {ast.unparse(node)}"


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module (found, not run); inside a module it is an attribute."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is a module, not a package
        return False


def _resolve(dotted: str) -> object:
    """verispec.a.b.c: modules while they are modules (found, not run), then attributes."""
    path, parts = "verispec", dotted.strip(".").split(".")
    while parts and _is_module(f"{path}.{parts[0]}"):
        path = f"{path}.{parts.pop(0)}"
    value = importlib.import_module(path) if parts else None
    for part in parts:
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_every_documented_name_resolves_without_a_warning(path):
    for match in DOTTED.finditer(path.read_text()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            try:
                _resolve(match.group(1))
            except (AttributeError, ImportError) as exc:
                pytest.fail(f"{path.name}: verispec{match.group(1)} does not resolve: {exc}")
