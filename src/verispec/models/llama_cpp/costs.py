"""What one row's llama.cpp pass over n tokens costs on this machine, measured on a loaded model
and cached per model file, thread count and kernel set.

What it is: :func:`pass_costs` gives the seconds of a pass over n = 1 .. N new tokens of one
row at a short context, the median of a few repetitions after a warm-up round, the widths in a
shuffled order each repetition (as benchmarks/pass_costs.py measures the pass-cost table). It
measures on a scratch context of its own over the same weights, freed after, so the sessions
that generate are untouched; the measurement only prices how deep to draft (policy/costs.py),
never what is generated. Results are cached as JSON in ``cache_dir().parent / "pass-costs"``
(models/packaged.py: $VERISPEC_CACHE, else ~/.cache/verispec), one file per
:class:`PassCostKey`: the file (path, size, modification time), the threads, the weight
kernels llama.cpp loaded it with, the llama.cpp build and the CPU, and N. A change in any of
them measures again. ``LlamaCppConfig.cost_curve`` chooses: "cached", "measure" (afresh), or
"off".

What it is not: the cost curve of a pair (policy/costs.py builds it; text/assemble.py pairs a
target's passes with a draft's step) or a benchmark: speed claims come from benchmarks/.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..base import LMSession
from ..packaged import cache_dir
from .model import LlamaCppLM, bindings

logger = logging.getLogger("verispec.llama_cpp")

CONTEXT = 64  # prompt tokens before the timed passes
WARMUP_ROUNDS = 1  # rounds over every width whose timings are dropped (first-use costs)
REPETITIONS = 5  # timed rounds: the median of these is the pass's cost


@dataclass(frozen=True)
class PassCostKey:
    """What a model's pass costs depend on: the cache holds one entry per key."""

    path: str
    size: int
    mtime_ns: int
    threads: int
    kernels: str  # the weight buffer types and what the kernel plan left out
    llama_cpp: str  # the llama-cpp-python version (its llama.cpp build)
    cpu: str
    num_tokens: int

    def file_name(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"


def cost_cache_dir() -> Path:
    """Where measured pass costs are cached: beside the packaged models' folder."""
    return cache_dir().parent / "pass-costs"


def pass_key(lm: LlamaCppLM, num_tokens: int) -> PassCostKey:
    """The cache key of ``lm``'s passes over 1 .. num_tokens tokens."""
    file = Path(lm.model.path).resolve()
    stat = file.stat()
    plan = lm.model.kernels
    buffers = ",".join(sorted(lm.model.weight_buffers))
    kernels = f"{buffers}; extra {plan.use_extra_bufts}; without {','.join(plan.left_out)}"
    return PassCostKey(str(file), stat.st_size, stat.st_mtime_ns, lm.config.threads(), kernels,
                       getattr(bindings(), "__version__", "unknown"), _cpu_name(), num_tokens)


def pass_costs(lm: LlamaCppLM, num_tokens: int,
               folder: Path | None = None) -> tuple[float, ...] | None:
    """Seconds of one row's pass over n = 1 .. num_tokens tokens on ``lm``'s model (index
    n - 1), as ``lm.config.cost_curve_mode()`` says: read from the cache in ``folder``
    (default: cost_cache_dir()), or measured and cached; None where the mode is "off"."""
    mode = lm.config.cost_curve_mode()
    if mode == "off":
        return None
    key = pass_key(lm, num_tokens)
    file = (cost_cache_dir() if folder is None else folder) / key.file_name()
    seconds = _read(file, key) if mode == "cached" else None
    source = "cached"
    if seconds is None:
        seconds, source = measure_pass_costs(lm, num_tokens), "measured"
        _write(file, key, seconds)
    logger.info("%s %s, %d threads: pass ms by tokens n (%s): %s", lm.model.role,
                Path(key.path).name, key.threads, source,
                " ".join(f"{n}:{s * 1e3:.2f}" for n, s in enumerate(seconds, start=1)))
    return seconds


def measure_pass_costs(lm: LlamaCppLM, num_tokens: int) -> tuple[float, ...]:
    """Measure the passes on a scratch context over ``lm``'s weights (freed on return), with
    ``lm``'s threads and batch size."""
    scratch = LlamaCppLM(lm.model, lm.vocab_size,
                         replace(lm.config, context_size=CONTEXT + num_tokens))
    try:
        return time_passes(scratch.new_session(), num_tokens, lm.vocab_size)
    finally:
        scratch.close()


def time_passes(session: LMSession, num_tokens: int, vocab_size: int) -> tuple[float, ...]:
    """Median seconds of one row's pass over n = 1 .. num_tokens new tokens after a
    CONTEXT-token prompt, each pass rewound; the widths in a seeded shuffled order each round,
    the first WARMUP_ROUNDS rounds not counted."""
    session.start([[(10 + i) % vocab_size for i in range(CONTEXT)]])
    token = min(11, vocab_size - 1)
    samples: list[list[float]] = [[] for _ in range(num_tokens)]
    order = random.Random(0)
    for repetition in range(WARMUP_ROUNDS + REPETITIONS):
        widths = list(range(1, num_tokens + 1))
        order.shuffle(widths)
        for n in widths:
            tokens = torch.full((1, n), token, dtype=torch.int64)
            start = time.perf_counter()
            session.extend(tokens)
            elapsed = time.perf_counter() - start
            session.rewind([n])
            if repetition >= WARMUP_ROUNDS:
                samples[n - 1].append(elapsed)
    return tuple(statistics.median(values) for values in samples)


def _read(file: Path, key: PassCostKey) -> tuple[float, ...] | None:
    """The cached seconds for ``key``, or None where the file is absent, unreadable or for
    another key (a changed file or setting measures again)."""
    try:
        entry = json.loads(file.read_text())
        seconds = tuple(float(s) for s in entry["seconds"])
        same = entry["key"] == asdict(key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("pass-cost cache %s is unreadable (%s); measuring again", file, exc)
        return None
    if not same or len(seconds) != key.num_tokens or not all(s > 0 for s in seconds):
        return None
    return seconds


def _write(file: Path, key: PassCostKey, seconds: tuple[float, ...]) -> None:
    """Cache ``seconds`` under ``key``: a temporary file renamed into place, so a reader
    never sees half an entry. A folder that cannot be written is logged, not raised: the
    measurement still prices this process's rounds."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp",
                                         delete=False) as handle:
            json.dump({"key": asdict(key), "seconds": list(seconds)}, handle, indent=1)
        os.replace(handle.name, file)
    except OSError as exc:
        logger.warning("cannot cache pass costs in %s (%s); they are measured again at the "
                       "next load", file.parent, exc)


def _cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), so that a cache folder
    shared between machines keeps each machine's costs apart."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
