"""The fast path's decoding steps at static shapes, captured once as CUDA graphs and replayed.

Legend: B rows, R rows of the bucket (B <= R), n fed tokens a row, T cache capacity,
P keys a step attends to (the bucket of the longest row's length + n), V vocabulary.

Why: at small batch sizes a GPU forward of a small model is bound by kernel launches and the
Python that issues them, not by arithmetic (a demo-pair step issues ~20 ops a layer). A CUDA
graph records a step's kernels once and replays them with one launch, so the host pays one
call a step (dev/LOG.md has the step costs, eager and replayed).

What a graph needs, and how a step gets it (:meth:`StepGraphs.forward`):
  * static shapes: rows are padded to a power of two R (the pad rows write keys and values
    into free cache slots, past the live rows, which every later pass overwrites or masks), and
    the keys a step attends to to a power of two P >= MIN_KEYS (positions past a row's length
    are masked, so padding changes which keys are read, not what a row sees);
  * static addresses: a graph writes the cache storage it was captured over, so it is keyed by
    that storage's layout (KVCache.layout: its tensors' addresses and shapes) and by the rotary
    table's; a cache that grows, or a new session's cache elsewhere in memory, gets graphs of
    its own. Inputs (tokens [R, n], row lengths [R]) are copied into the graph's own buffers;
    positions and the attention mask are computed inside it from the lengths;
  * every step is the ragged path of FastLlamaLM.forward (positions given), so plain steps,
    draft steps and verification passes all run one code path whatever the rows' lengths.
Not graphed: passes that prefill (feed, joins riding a pass: packed.py), which vary in shape
with every prompt. A step's logits are copied out of the graph's output before it is replayed
again. ``capture=False`` runs the same static-shape step eagerly: what a graph replays, on any
device (the CPU tests check it against the eager path).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import attention_kernels
from .kv_cache import KVCache
from .protocol import FastLlama

# the fewest keys a step attends to: shorter caches share one graph per (rows, tokens)
MIN_KEYS = 128
# graphs kept per model, least recently used out first (each holds its buffers and output; the
# intermediates share one memory pool); and the most bytes their outputs may hold together (a
# 256-row, 9-token step over a 32,000-token vocabulary in bfloat16 outputs 147 MB)
MAX_GRAPHS = 256
MAX_OUTPUT_BYTES = 1 << 30


def bucket_rows(num_rows: int) -> int:
    """The padded row count of a step: the next power of two."""
    return 1 << (num_rows - 1).bit_length()


def bucket_keys(num_keys: int, max_positions: int | None) -> int:
    """The keys a step attends to: the next power of two >= MIN_KEYS, but never more than the
    model's context where that covers ``num_keys``."""
    keys = max(MIN_KEYS, 1 << (num_keys - 1).bit_length())
    return keys if max_positions is None or num_keys > max_positions else min(
        keys, max_positions)


@dataclass
class _Step:
    """One static-shape step: its input buffers, its output, and how to run it."""

    tokens: torch.Tensor  # [R, n] int64
    lengths: torch.Tensor  # [R] int64: tokens each row holds before the step
    # runs the step eagerly over a cache's first R slots -> logits [R, n, V]; it holds every
    # tensor of its own that a captured graph reads (the positions' offsets), so they live as
    # long as the graph. It holds no cache: a graph is replayed only over a live cache of its
    # layout, and a freed cache's memory may go to a new cache of the same layout (which then
    # replays the same graphs)
    eager: Callable[[_RowsView], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the captured graph's output [R, n, V]

    @property
    def output_bytes(self) -> int:
        """What the captured graph's output holds (0 for a step run eagerly)."""
        return 0 if self.logits is None else self.logits.numel() * self.logits.element_size()

    def run(self, cache: KVCache) -> torch.Tensor:
        """The step over ``cache`` (the layout it was built for) -> logits [R, n, V]."""
        if self.graph is None:
            return self.eager(_RowsView(cache, self.tokens.shape[0]))
        self.graph.replay()
        return self.logits


class _RowsView:
    """The first R slots of a cache's storage, as FastLlamaLM.forward reads a cache."""

    def __init__(self, cache: KVCache, num_rows: int) -> None:
        self.keys, self.values = cache.slot_views(num_rows)  # [R, Hkv, T, D] each


class StepGraphs:
    """A model's decoding steps at static shapes, keyed by (cache layout, rotary table, R, n,
    P); captured as CUDA graphs when ``capture``. See the module docstring."""

    def __init__(self, lm: FastLlama, capture: bool) -> None:
        self.lm = lm
        self.capture = capture
        self._steps: OrderedDict[tuple, _Step] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_captured = 0  # graphs captured so far (a new shape or cache layout each)
        self._output_bytes = 0  # what the kept graphs' outputs hold

    def forward(self, tokens: torch.Tensor, lengths: list[int], cache: KVCache) -> torch.Tensor:
        """tokens [B, n] on the model's device, row b holding lengths[b] tokens -> logits
        [B, n, V], a tensor of the caller's own; writes the cache at lengths[b] ..
        lengths[b] + n - 1 (FastLlamaLM.forward)."""
        batch, num_new = tokens.shape
        num_rows = bucket_rows(batch)
        num_keys = bucket_keys(max(lengths) + num_new, self.lm.max_positions)
        cache.ensure(num_keys)
        cache.ensure_rows(num_rows)
        self.lm.rotary.ensure(num_keys)
        key = (cache.layout, self.lm.rotary.layout, num_rows, num_new, num_keys)
        step = self._steps.get(key)
        fresh = step is None
        if fresh:
            step = self._new_step(num_rows, num_new, num_keys)
        # pad rows hold no tokens: their writes land at 0 .. n - 1 of free slots
        step.tokens[:batch].copy_(tokens, non_blocking=True)
        step.lengths.copy_(torch.tensor(lengths + [0] * (num_rows - batch), dtype=torch.int64),
                           non_blocking=True)
        if fresh:
            if self.capture:
                self._capture(step, cache)
            self._keep(key, step)
        else:
            self._steps.move_to_end(key)
        return step.run(cache)[:batch].clone()

    def _keep(self, key: tuple, step: _Step) -> None:
        """Keep a new step; the least recently used go while more than MAX_GRAPHS are kept or
        their outputs hold more than MAX_OUTPUT_BYTES (the newest always stays)."""
        self._steps[key] = step
        self._output_bytes += step.output_bytes
        while len(self._steps) > 1 and (len(self._steps) > MAX_GRAPHS
                                        or self._output_bytes > MAX_OUTPUT_BYTES):
            _, oldest = self._steps.popitem(last=False)
            self._output_bytes -= oldest.output_bytes

    def _new_step(self, num_rows: int, num_new: int, num_keys: int) -> _Step:
        device = self.lm.device
        # ordinary tensors even when built under inference mode: later calls copy into them
        # outside it too
        with torch.inference_mode(False):
            tokens = torch.zeros((num_rows, num_new), dtype=torch.int64, device=device)
            lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)
        offsets = torch.arange(num_new, device=device)
        lm = self.lm

        def eager(view: _RowsView) -> torch.Tensor:
            positions = lengths[:, None] + offsets  # [R, n]
            with torch.inference_mode(), attention_kernels(device):
                return lm.forward(tokens, positions, 0, view, num_keys)

        return _Step(tokens, lengths, eager)

    def _capture(self, step: _Step, cache: KVCache) -> None:
        """Warm the step up on a side stream (torch's rule for capture), then capture it over
        ``cache``. The buffers already hold this step's real inputs, so the warm-up writes the
        very keys and values the replay writes."""
        view = _RowsView(cache, step.tokens.shape[0])
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step.eager(view)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a server's other threads may use the device while this one captures.
        # No garbage collection inside: it may free an unreachable model's graphs, and a graph
        # cannot be destroyed while a stream captures (CUDA refuses, and the graph leaks)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step.logits = step.eager(view)
        finally:
            if collecting:
                gc.enable()
        step.graph = graph
        self.num_captured += 1
