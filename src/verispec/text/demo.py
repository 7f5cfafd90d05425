"""The demo draft/target pair shipped inside the package (verispec/assets/demo).

What this is: a path accessor. ``demo_pair()`` returns the directories of two small
LlamaForCausalLM models trained on the Python standard library (a ~17M target and a ~2.5M draft
sharing one byte-level BPE tokenizer), each loadable offline with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``;
``heldout_prompts()`` returns code snippets cut from stdlib modules the models never saw.

What this is not: a loader. It imports neither torch nor transformers and does no work at import
time; loading the models is the caller's (or an adapter's) job. The assets' model card is
assets/demo/README.md, their measurements assets/demo/report.json, and the script that made them
scripts/train_demo_pair.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ModelLoadError

# files each model dir must hold to load offline with transformers
REQUIRED_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json")
HELDOUT_PROMPTS_FILE = "heldout_prompts.json"


class DemoAssetsMissingError(ModelLoadError, FileNotFoundError):
    """The demo model assets are not where they should be (a partial install or a bad root)."""


@dataclass(frozen=True)
class DemoPair:
    """Directories of the demo target and draft; each holds weights, config and tokenizer."""

    target: Path
    draft: Path


def demo_dir(root: str | Path | None = None) -> Path:
    """The demo assets directory: root if given, else verispec/assets/demo inside the package."""
    if root is not None:
        return Path(root)
    package_dir = resources.files("verispec")
    if not isinstance(package_dir, Path):
        raise DemoAssetsMissingError(
            f"expected verispec to be installed as files on disk, got {package_dir!r} (a zip or "
            "other non-file loader); reinstall verispec unpacked (pip install verispec) to use "
            "the demo models")
    return package_dir / "assets" / "demo"


def demo_pair(root: str | Path | None = None) -> DemoPair:
    """Paths of the shipped demo target and draft, checked to exist.

    root overrides the assets directory (a dir holding target/ and draft/), e.g. a retrained pair
    written by scripts/train_demo_pair.py --out-dir. Raises DemoAssetsMissingError if a model dir
    or one of its required files is missing.
    """
    base = demo_dir(root)
    pair = DemoPair(target=base / "target", draft=base / "draft")
    for role, path in (("target", pair.target), ("draft", pair.draft)):
        missing = [name for name in REQUIRED_MODEL_FILES if not (path / name).is_file()]
        if missing:
            raise DemoAssetsMissingError(
                f"demo {role} model incomplete: expected {', '.join(missing)} in {path}; "
                "reinstall verispec, or regenerate the assets with "
                "`python scripts/train_demo_pair.py --stage all` (see assets/demo/README.md)")
    return pair


def heldout_prompts(root: str | Path | None = None) -> list[str]:
    """Prompts cut from held-out stdlib modules (never trained on), in a fixed order.

    Each ends at the end of a line without the trailing newline: the demo tokenizer merges a
    newline with the next line's indentation, so continuing after a bare newline token is out of
    distribution for the demo models.
    """
    path = demo_dir(root) / HELDOUT_PROMPTS_FILE
    if not path.is_file():
        raise DemoAssetsMissingError(
            f"expected the held-out prompts at {path}, found nothing; reinstall verispec or "
            "regenerate with `python scripts/train_demo_pair.py --stage eval`")
    prompts = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(prompts, list) and all(isinstance(p, str) for p in prompts), path
    return prompts
