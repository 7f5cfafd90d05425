"""GGUF models on llama.cpp's own forward pass, through llama-cpp-python's low-level bindings.

Legend: B batch (llama.cpp sequences), n tokens fed per row in one call, V vocabulary.

What this is: a :class:`~verispec.models.base.LanguageModel` whose sessions keep llama.cpp's KV
cache. ``extend`` decodes one ``llama_batch`` holding every row's new tokens (row b is llama.cpp
sequence b, at positions length[b] .. length[b] + n - 1) with logits requested at every fed
position; ``rewind`` removes the dropped positions of each row (``llama_memory_seq_rm``), so the
engine's ragged acceptance works unchanged (the sessions: session.py). Prompts
are prefilled without logits. Quantized files (Q8_0, Q4_K_M, ...) run natively, so exactness is
with respect to llama.cpp's own forward of that file: verispec verifies the distributions
llama.cpp computes, whatever its kernels are.

What this is not: a sampler or a server. llama.cpp only computes logits here; temperature,
top-k/top-p, acceptance and every random draw stay in verispec (sample/sampling.py,
sample/rejection.py), with an explicit torch.Generator. The tokenizer adapter is in tokenizer.py.

Refused at load (UnsupportedModelError): models whose memory cannot drop a suffix of a
sequence exactly (recurrent and hybrid state-space models such as Mamba or RWKV, whose state
has no per-position entries) and encoder-decoder models. Sliding-window models keep a full-size
cache (``swa_full``) so that a rewind never needs a position the window already evicted.

Threads: each model's context takes ``LlamaCppConfig.num_threads`` (default: the cores this
process may run on). A draft and a target decode in turn, never at once, so both use the same
cores; llama.cpp's worker threads sleep between calls.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...config import COST_CURVE_MODES, REPACK_MODES, check_bool, check_int, require
from ...errors import (
    BackendError,
    ConfigError,
    ContextLengthExceeded,
    ModelLoadError,
    UnsupportedFeatureError,
    UnsupportedModelError,
)
from .kernels import KernelPlan, load_with_kernels
from .session import MAX_ROWS, UNIFORM_PASS_WIDTH, LlamaCppSession

logger = logging.getLogger("verispec.llama_cpp")

INSTALL_HINT = ("pip install 'verispec[llamacpp]' (it builds llama.cpp from source: several "
                "minutes on a small machine)")
DEFAULT_MAX_CONTEXT = 4096  # n_ctx when none is set: the model's trained window, capped here
ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"  # GGUF key: a space before the first word


def is_available() -> bool:
    """Whether llama-cpp-python can be imported (the ``llamacpp`` extra is installed)."""
    try:
        bindings()
    except UnsupportedFeatureError:
        return False
    return True


def bindings():
    """The ``llama_cpp`` module, initialised once, with llama.cpp's logging routed to Python's."""
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:  # OSError: the package is there, its library is not
        raise UnsupportedFeatureError(
            f"the llama.cpp backend needs llama-cpp-python ({type(exc).__name__}: {exc}); "
            f"install it with {INSTALL_HINT}, or pass backend='transformers'.") from None
    if not _LOG.installed:
        llama_cpp.llama_backend_init()
        _LOG.callback = llama_cpp.llama_log_callback(_on_log)  # kept alive: C holds the pointer
        llama_cpp.llama_log_set(_LOG.callback, ctypes.c_void_p(0))
        _LOG.installed = True
    return llama_cpp


class _LogState:
    """llama.cpp's log lines go to the ``verispec.llama_cpp`` logger at DEBUG (nothing is
    printed unless a handler asks for it); the latest error lines are kept to explain a failed
    load or context in the error verispec raises."""

    installed = False
    callback = None
    errors: list[str] = []
    buffers: dict[str, float] | None = None  # while a model loads: MiB per weight buffer type


_LOG = _LogState()
_GGML_LOG_ERROR = 4
# llama.cpp's load log: "load_tensors:   CPU_REPACK model buffer size =    45.00 MiB"
_MODEL_BUFFER = re.compile(r"^\w+: +(\S+) model buffer size = +([\d.]+) MiB")


def _on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", errors="replace").rstrip()
    if not line:
        return
    if level == _GGML_LOG_ERROR:
        _LOG.errors = (_LOG.errors + [line])[-5:]
    buffer = _MODEL_BUFFER.match(line)
    if buffer is not None and _LOG.buffers is not None:
        _LOG.buffers[buffer.group(1)] = float(buffer.group(2))
    logger.debug(line)


@dataclass(frozen=True)
class LlamaCppConfig:
    """llama.cpp's settings for one model.

    num_threads: threads for decoding (None: the cores this process may run on). A draft and a
        target run in turn and may both use all of them.
    context_size: tokens per sequence (row) in the KV cache (None: the model's trained context,
        at most 4096). A prompt + max_new_tokens + k that does not fit is refused up front.
    batch_size: most tokens submitted in one llama_decode call; longer prompts are fed in
        chunks of this size.
    repack: which weight kernels llama.cpp may use (kernels.py): "auto" (repacked kernels, and
        AMX only where a probe shows llama.cpp's AMX kernel runs here), "on" (everything
        llama.cpp offers, AMX unprobed) or "off" (plain kernels, as llama-server --no-repack).
    cost_curve: whether the pass costs that price the depth policy are measured at load
        (costs.py): "cached" measures them once per model file, thread count and kernel set and
        reads them back after, "measure" measures afresh (and caches), "off" measures nothing
        (the policy learns from its rounds). None: $VERISPEC_COST_CURVE, else "cached".
    uniform_passes: the target decodes every token after a prompt in a pass of exactly
        UNIFORM_PASS_WIDTH tokens of one row (padded), so that a position's logits do not depend
        on how many tokens were verified with it: greedy speculative == greedy plain token for
        token on quantized files (session.py, docs/exactness.md). A one-token pass then costs a
        4-token one; a draft model's passes are left as they are.
    """

    num_threads: int | None = None
    context_size: int | None = None
    batch_size: int = 512
    repack: str = "auto"
    cost_curve: str | None = None
    uniform_passes: bool = False

    def __post_init__(self) -> None:
        for name in ("num_threads", "context_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, note=", or None for the default")
        check_int("batch_size", self.batch_size, 16, note=" (tokens per llama_decode call)")
        require(self.repack in REPACK_MODES, "repack", self.repack,
                f"one of {', '.join(map(repr, REPACK_MODES))}")
        require(self.cost_curve is None or self.cost_curve in COST_CURVE_MODES, "cost_curve",
                self.cost_curve, f"one of {', '.join(map(repr, COST_CURVE_MODES))}, or None")
        check_bool("uniform_passes", self.uniform_passes)

    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

    def cost_curve_mode(self) -> str:
        """cost_curve, or where None the environment's VERISPEC_COST_CURVE, else "cached"."""
        mode = self.cost_curve or os.environ.get("VERISPEC_COST_CURVE") or "cached"
        if mode not in COST_CURVE_MODES:
            raise ConfigError(f"VERISPEC_COST_CURVE={mode!r} is invalid: expected one of "
                              f"{', '.join(COST_CURVE_MODES)}; unset it for the default.")
        return mode


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp (weights and vocabulary); freed with the object."""

    def __init__(self, path: str | Path, role: str = "target",
                 config: LlamaCppConfig | None = None, vocab_only: bool = False,
                 add_space_prefix: bool | None = None) -> None:
        """``vocab_only``: load the vocabulary and metadata, no weights (a tokenizer only: it
        cannot open a context). ``add_space_prefix``: override the file's
        tokenizer.ggml.add_space_prefix (a SentencePiece vocabulary's space before the first
        word); None keeps the file's."""
        config = LlamaCppConfig() if config is None else config
        llama_cpp = bindings()
        file = Path(path).expanduser()
        if not file.is_file():
            raise ModelLoadError(f"{role} GGUF file {str(path)!r} does not exist; pass the path "
                                 "of an existing .gguf file.")
        _check_magic(file, role)
        overrides = {} if add_space_prefix is None else {ADD_SPACE_PREFIX: add_space_prefix}
        handle, self.kernels, self.weight_buffers = _load_model(llama_cpp, file, config.repack,
                                                                vocab_only, overrides)
        if not handle:
            reason = "; ".join(_LOG.errors) or "llama.cpp could not read it"
            raise ModelLoadError(f"llama.cpp could not load the {role} from {str(path)!r}: "
                                 f"{reason}. Expected a GGUF file of an architecture this "
                                 "llama.cpp build supports.")
        self.handle = handle
        self._finalizer = weakref.finalize(self, llama_cpp.llama_model_free, handle)
        self.path = str(file)
        self.role = role
        logger.info("%s %s: weights in %s (%s)", role, file.name, ", ".join(
            f"{name} {size:.1f} MiB" for name, size in self.weight_buffers.items()) or "?",
            self.kernels.reason)
        self.vocab = llama_cpp.llama_model_get_vocab(handle)
        self.num_logits = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.trained_context = llama_cpp.llama_model_n_ctx_train(handle)
        self.architecture = self.metadata("general.architecture") or "unknown"
        if llama_cpp.llama_model_is_recurrent(handle) or llama_cpp.llama_model_is_hybrid(handle):
            raise UnsupportedModelError(
                f"the {role} {str(path)!r} is a recurrent or hybrid state-space model "
                f"({self.architecture}): its state cannot drop rejected draft tokens exactly, "
                "so verispec cannot verify it; use a transformer model.")
        if llama_cpp.llama_model_is_diffusion(handle):
            raise UnsupportedModelError(
                f"the {role} {str(path)!r} is a diffusion language model ({self.architecture}); "
                "verispec decodes autoregressive models.")
        if llama_cpp.llama_model_has_encoder(handle):
            raise UnsupportedModelError(
                f"the {role} {str(path)!r} is an encoder-decoder model ({self.architecture}); "
                "verispec decodes causal (decoder-only) models.")

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the file has no such key."""
        llama_cpp = bindings()
        size = 256
        while True:
            buffer = ctypes.create_string_buffer(size)
            length = llama_cpp.llama_model_meta_val_str(self.handle, key.encode(), buffer, size)
            if length < 0:
                return None
            if length < size:
                return buffer.value.decode("utf-8", errors="replace")
            size = length + 1


def _load_model(llama_cpp, file: Path, repack: str, vocab_only: bool = False,
                overrides: dict[str, bool] | None = None
                ) -> tuple[object, KernelPlan, dict[str, float]]:
    """llama.cpp's model handle (None when it could not load), the kernel plan it loaded under,
    and the MiB of weights each buffer type holds (read from llama.cpp's load log).
    ``overrides``: GGUF metadata keys read as these booleans instead of the file's values."""
    buffers: dict[str, float] = {}
    kv_overrides = _bool_overrides(llama_cpp, overrides or {})  # alive until the load returns

    def load(use_extra_bufts: bool):
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0  # CPU: the build this package installs has no GPU backend
        params.use_extra_bufts = use_extra_bufts
        params.vocab_only = vocab_only
        if kv_overrides is not None:
            params.kv_overrides = ctypes.cast(
                kv_overrides, ctypes.POINTER(llama_cpp.llama_model_kv_override))
        _LOG.errors, _LOG.buffers = [], buffers
        try:
            return llama_cpp.llama_model_load_from_file(str(file).encode(), params)
        finally:
            _LOG.buffers = None

    if vocab_only:  # no weights, so no kernels to choose
        return load(False), KernelPlan(False, (), "vocabulary only: no weights"), buffers
    handle, plan = load_with_kernels(llama_cpp, repack, load)
    return handle, plan, buffers


def _bool_overrides(llama_cpp, overrides: dict[str, bool]):
    """llama.cpp's override array for ``overrides`` (ended by an entry with an empty key), or
    None when there are none."""
    if not overrides:
        return None
    array = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for entry, (key, value) in zip(array, overrides.items()):
        entry.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL
        entry.key = key.encode()
        entry.value.val_bool = value
    return array


def _check_magic(file: Path, role: str) -> None:
    """A readable file that starts with GGUF's magic, so a wrong file gets a clear error."""
    try:
        with file.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{role} GGUF file {str(file)!r} cannot be read: {exc}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{role} file {str(file)!r} is not a GGUF file (it starts with "
                             f"{magic!r}, expected b'GGUF'); pass a .gguf file written by "
                             "llama.cpp's converter or `verispec export-gguf`.")


class LlamaCppLM:
    """A :class:`LanguageModel` on llama.cpp. One session is live at a time: opening a new one
    resets the context, and the old session raises if it is used again."""

    matmul = "llama.cpp"  # names the kernel, as FastLlamaLM.matmul does
    # the deeper default depth (policy.default_num_draft_tokens) where no cost curve was
    # measured (cost_curve "off"): a model whose weights outgrow the CPU's cache reads them once
    # for all of a pass's tokens where its kernels run as a GEMM, row-by-row kernels pay per
    # token (docs/performance.md's pass-cost table); a measured curve decides instead
    flat_verify = True

    def __init__(self, model: LlamaCppModel, vocab_size: int | None = None,
                 config: LlamaCppConfig | None = None, draft: bool = False) -> None:
        """``draft``: the model only drafts, so its passes keep their natural widths
        (LlamaCppConfig.uniform_passes is about the target's logits)."""
        config = LlamaCppConfig() if config is None else config
        if not isinstance(config, LlamaCppConfig):
            raise ConfigError(f"llama_cpp={config!r:.60} is invalid: expected a "
                              "verispec.LlamaCppConfig.")
        vocab_size = model.num_logits if vocab_size is None else vocab_size
        if not 1 <= vocab_size <= model.num_logits:
            raise ConfigError(f"vocab_size={vocab_size} is invalid for a model with "
                              f"{model.num_logits} logits: expected 1 <= vocab_size <= that.")
        self.model = model
        self.config = config
        self.draft = draft
        self.uniform_passes = config.uniform_passes and not draft
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.max_positions = config.context_size or min(model.trained_context,
                                                        DEFAULT_MAX_CONTEXT)
        self._context: _Context | None = None
        self._live: LlamaCppSession | None = None
        self._scorer: LlamaCppLM | None = None  # scoring_session's model, built on first use

    def new_session(self) -> LlamaCppSession:
        session = LlamaCppSession(self)
        self._live = session
        return session

    def scoring_session(self) -> LlamaCppSession:
        """A session on a context of its own over the same weights (models.base.ScoresApart):
        a new session here would end the live one, the running batch's. Its prompt passes
        keep their natural widths: no other pass's logits are compared with theirs."""
        if self._scorer is None:
            self._scorer = LlamaCppLM(self.model, self.vocab_size,
                                      replace(self.config, uniform_passes=False))
        return self._scorer.new_session()

    def context(self, session: LlamaCppSession, num_rows: int) -> _Context:
        """The context for ``session``'s ``num_rows`` rows, emptied (grown when too small)."""
        self.check_live(session)
        if not 1 <= num_rows <= MAX_ROWS:
            raise ConfigError(f"a batch of {num_rows} rows is invalid on llama.cpp: a context "
                              f"holds 1 to {MAX_ROWS} sequences; split the batch.")
        if self._context is None or self._context.num_rows < num_rows:
            self._context = None  # free the old one before allocating the new
            self._context = _Context(self, num_rows)
        self._context.clear()
        return self._context

    def close(self) -> None:
        """Free this adapter's context now (its session cannot be used again)."""
        self._context, self._live = None, None

    def check_live(self, session: LlamaCppSession) -> None:
        if session is not self._live:
            raise BackendError("this llama.cpp session was replaced by a newer one on the same "
                               "model; a model serves one generation at a time.")


class _Context:
    """A llama_context with room for ``num_rows`` sequences and a reusable llama_batch."""

    def __init__(self, lm: LlamaCppLM, num_rows: int) -> None:
        llama_cpp = bindings()
        params = llama_cpp.llama_context_default_params()
        # a uniform pass may reach UNIFORM_PASS_WIDTH - 1 positions past a row's last token
        padding = UNIFORM_PASS_WIDTH - 1 if lm.uniform_passes else 0
        params.n_ctx = (lm.max_positions + padding) * num_rows
        params.n_seq_max = num_rows
        params.n_batch = params.n_ubatch = lm.config.batch_size
        params.n_threads = params.n_threads_batch = lm.config.threads()
        params.kv_unified = False  # a cache stream per sequence: rows never attend across
        params.swa_full = True  # sliding-window layers keep every position, so rewind is exact
        params.no_perf = True
        _LOG.errors = []
        handle = llama_cpp.llama_init_from_model(lm.model.handle, params)
        if not handle:
            reason = "; ".join(_LOG.errors) or "out of memory?"
            raise BackendError(f"llama.cpp could not create a context of {params.n_ctx} tokens "
                               f"for {num_rows} rows ({reason}); lower context_size.")
        self.handle = handle
        self.model = lm.model  # freed after this context, never before
        self.num_rows = num_rows
        self.capacity = lm.config.batch_size  # tokens per llama_decode call
        self.memory = llama_cpp.llama_get_memory(handle)
        self.num_logits = lm.model.num_logits
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self._finalizer = weakref.finalize(self, _free_context, llama_cpp, handle, self.batch)
        # numpy views of the batch's arrays: filled in place, no per-token ctypes calls
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.capacity,))
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(self.capacity,))
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(self.capacity,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.capacity,))[:] = 1
        self._seq_rows = np.full(self.capacity, -1, dtype=np.int64)  # seq id written per slot

    def clear(self) -> None:
        bindings().llama_memory_clear(self.memory, True)

    def decode(self, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray,
               logits: np.ndarray) -> torch.Tensor | None:
        """Decode one batch: rows, tokens, positions [N] (N <= capacity). Returns the logits
        [M, num_logits] fp32 (a copy) at the M positions the mask ``logits`` [N] bool sets, in
        order; None where it sets none."""
        llama_cpp = bindings()
        count = len(tokens)
        self.tokens[:count] = tokens
        self.positions[:count] = positions
        self.wants_logits[:count] = logits
        changed = np.nonzero(self._seq_rows[:count] != rows)[0]
        for slot in changed.tolist():  # seq ids live behind per-token pointers
            self.batch.seq_id[slot][0] = int(rows[slot])
        self._seq_rows[changed] = rows[changed]
        self.batch.n_tokens = count
        status = llama_cpp.llama_decode(self.handle, self.batch)
        if status == 1:
            raise ContextLengthExceeded(
                f"llama.cpp found no room in its KV cache for {count} more tokens; raise "
                "context_size (LlamaCppConfig, --context-size) or shorten the request.")
        if status != 0:
            raise BackendError(f"llama_decode failed with status {status} on a batch of "
                               f"{count} tokens.")
        num_outputs = int(np.count_nonzero(logits))
        if not num_outputs:
            return None
        pointer = llama_cpp.llama_get_logits(self.handle)
        array = np.ctypeslib.as_array(pointer, shape=(num_outputs, self.num_logits))
        return torch.from_numpy(array.copy())

    def remove(self, row: int, start: int) -> None:
        """Drop positions start.. of sequence ``row``."""
        if not bindings().llama_memory_seq_rm(self.memory, row, start, -1):
            raise BackendError(f"llama.cpp could not remove positions {start}.. of sequence "
                               f"{row}; this model's memory cannot rewind.")


def _free_context(llama_cpp, handle, batch) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(handle)
