"""The README's list of supported and refused architectures, generated from the test matrix.

tests/helpers/arch_specs.py is the one table tests/models/test_architectures.py runs; this
script renders it into README.md and docs/architectures.md between the ``<!-- architectures -->``
markers, and tests/models/test_architectures.py fails when the files and the table differ. Usage:

    python scripts/arch_table.py          # rewrite both files
    python scripts/arch_table.py --check  # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from arch_specs import REFUSED, SUPPORTED, WINDOW  # noqa: E402

BEGIN, END = "<!-- architectures: begin (scripts/arch_table.py) -->", "<!-- architectures: end -->"


def readme_block() -> str:
    names = sorted({arch.name.split(",")[0] for arch in SUPPORTED})
    by_reason: dict[str, list[str]] = {}
    for refused in REFUSED:
        by_reason.setdefault(refused.why, []).append(refused.name)
    exact = (f"Exact (tested, see below) on {len(names)} transformers architectures: "
             f"{', '.join(names)}; sliding windows (also mixed local and global layers), chunked "
             "attention, ALiBi, partial rotary, multi-query and latent attention included.")
    refusals = [f"- {', '.join(names_)} ({why})" for why, names_ in by_reason.items()]
    return "\n".join([
        wrap(exact), "",
        "Refused at load with `UnsupportedModelError`, never run inexactly:", "",
        *(wrap(line, indent="  ") for line in refusals), "",
        "What each case exercises: [docs/architectures.md](docs/architectures.md)."])


def wrap(text: str, indent: str = "") -> str:
    """One paragraph or list item in lines of at most 100 characters."""
    return textwrap.fill(text, 100, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def docs_block() -> str:
    lines = ["Every row runs in tests/models/test_architectures.py (tiny random-init models; "
             f"windows and chunks of {WINDOW} tokens, generations of {4 * WINDOW}).", "",
             "| architecture | `model_type` | what the case exercises |", "|---|---|---|"]
    lines += [f"| {a.name} | `{a.model_type}` | {a.feature} |" for a in SUPPORTED]
    lines += ["", "Refused at load (`UnsupportedModelError`, raised when the model is loaded):", "",
              "| architecture | `model_type` | why |", "|---|---|---|"]
    lines += [f"| {r.name} | `{r.arch.model_type}` | {r.why} |" for r in REFUSED]
    return "\n".join(lines)


def render(text: str, block: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    assert pattern.search(text), f"no {BEGIN} ... {END} markers"
    return pattern.sub(lambda _: f"{BEGIN}\n{block}\n{END}", text)


TARGETS = {ROOT / "README.md": readme_block, ROOT / "docs" / "architectures.md": docs_block}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = parser.parse_args()
    stale = []
    for path, block in TARGETS.items():
        text = path.read_text()
        new = render(text, block())
        if new != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/arch_table.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
