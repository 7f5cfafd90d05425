"""Which kernel multiplies activations by weights in the fast path: ATen's (MKL on x86 CPUs) or
oneDNN's inner product.

Legend: n rows fed in one pass (batch x tokens), E input width, O output width.

Why a choice at all: on x86 CPUs that are not Intel's, MKL (which ATen's fp32 ``F.linear`` calls
on a CPU) takes slow generic code paths: there oneDNN's product is much faster on a large
weight, and a whole target pass is faster with it (dev/LOG.md: matmul kernels).

oneDNN picks its kernels by instruction set, not by vendor, so it runs the CPU's widest vector
code; its cost also grows far more slowly with the number of rows, which is what a verification
pass over k + 1 tokens needs. On Intel CPUs MKL is already fast (a pass over 1-3 rows costs
about what one row does), so "auto" keeps ATen there; it keeps ATen on GPUs and for half
precisions too, where ATen already dispatches well.

oneDNN's weights are packed once (``prepare``): reordered into the blocked layout its matrix
kernels read, a copy held beside the model's own weights (which the transformers forward still
uses), so the projections' memory is held twice. Unpacked, every call over 2 or more rows
packs the weight again, so a few-token pass costs well over a plain step; packed, a pass over
1-9 rows costs about what 1 row does, and decoding, plain and speculative, gets faster end to
end with identical tokens (dev/LOG.md: matmul kernels).

Small weights stay with ATen even under "onednn". oneDNN pays a fixed cost a call, which is
more than a small product's whole time with MKL at one row (the measured table: dev/LOG.md,
SMALL_WEIGHT_ELEMENTS), so a weight under SMALL_WEIGHT_ELEMENTS (2^18) is left dense and
multiplied by ATen, whatever the number of rows: the kernel is fixed per weight, so plain steps
and verification passes use the same one. That covers a small draft's layers (which run one row
at a time, and so step faster) and none of the demo target's projections, which keep oneDNN's
flat cost over k + 1 rows.

A draft may take both (``linear_kernel(name, by_rows=True)``): its small weights are also packed,
and each call picks oneDNN over 2 or more rows and ATen over one. A draft's numbers need not be
the same at every batch size: exactness needs only that the probabilities it reports are those
it drew from, which holds whatever kernel computed them (a target's kernel is fixed per weight,
see below). Over several rows the demo draft's step is a little faster so; its 1-row step is
unchanged (ATen) (dev/LOG.md: matmul kernels).

Both kernels compute the same products in a different summation order, so logits agree to
~1e-6 relative, not bit for bit; within one kernel a given input always gives the same output.
Exactness is with respect to the target as run: plain and speculative decoding of one loaded
model use one kernel, and tests check greedy equality under each.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...errors import ConfigError, UnsupportedFeatureError

MATMULS = ("auto", "aten", "onednn")

# x [..., E], weight (as prepared) [O, E], bias [O] or None -> [..., O]
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# the number of rows oneDNN's packed layout is chosen for: with it, passes over 1-9 rows all
# cost about one row's time (dev/LOG.md, 2026-11-27, PACK_ROWS)
PACK_ROWS = 4

# under "onednn", weights with fewer elements than this stay dense, for ATen (see the docstring)
SMALL_WEIGHT_ELEMENTS = 1 << 18


# how many compiled products oneDNN's primitive cache and ideep's (torch's oneDNN wrapper) keep,
# unless the environment says otherwise: enough for a server's usual shapes, few enough that
# its memory stays flat (bound_onednn_caches; dev/LOG.md: ONEDNN_CACHE_CAPACITY)
ONEDNN_CACHE_CAPACITY = 256
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


class LinearKernel(NamedTuple):
    """A resolved projection kernel: the weight layout it reads, and the product."""

    prepare: Callable[[torch.Tensor], torch.Tensor]  # weight [O, E] -> what ``linear`` reads
    linear: Linear


def cpuinfo(field: str, path: Path = Path("/proc/cpuinfo")) -> str:
    """A field of the first CPU in /proc/cpuinfo (e.g. "vendor_id", "model name"), or "" where
    there is none (not Linux, or no such field)."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:  # the whole key: "model" is not "model name"
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (e.g. "GenuineIntel", "AuthenticAMD"), or "" if unknown."""
    return cpuinfo("vendor_id")


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def resolve_matmul(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """"aten" or "onednn" for ``choice`` ("auto" decides by device, dtype and CPU vendor)."""
    if choice not in MATMULS:
        raise ConfigError(f"matmul={choice!r} is invalid: expected one of {', '.join(MATMULS)}.")
    if choice == "aten":
        return "aten"
    usable = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
              and onednn_available())
    if choice == "onednn":
        if not usable:
            raise UnsupportedFeatureError(
                f"matmul='onednn' needs a CPU model in float32 or bfloat16 and a torch built "
                f"with oneDNN; got device={device.type}, dtype={dtype}, oneDNN "
                f"{'available' if onednn_available() else 'not available'}. Use matmul='aten'.")
        return "onednn"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    slow_mkl = x86 and cpu_vendor() not in ("GenuineIntel", "")
    return "onednn" if usable and dtype == torch.float32 and slow_mkl else "aten"


def linear_kernel(name: str, by_rows: bool = False) -> LinearKernel:
    """The kernel for a resolved name ("aten" or "onednn"); ``by_rows`` (a draft's, "onednn"
    only): small weights kept in both layouts and the kernel picked by each call's row count
    (see the module docstring)."""
    if name == "onednn":
        bound_onednn_caches()
        if by_rows:
            return LinearKernel(_pack_both, _linear_by_rows)
        return LinearKernel(_pack_for_onednn, _onednn_linear)
    return LinearKernel(_unchanged, F.linear)


def bound_onednn_caches() -> None:
    """Caps oneDNN's primitive cache and ideep's at ONEDNN_CACHE_CAPACITY entries each, where
    the environment does not set them. Takes effect only before this process's first oneDNN
    product (both caches read their variable once, when first used), which is why it runs
    before any weight is packed.

    Why: each cache keeps a compiled product per shape, (rows, weight) here, by default 1024 of
    them, each with its kernels, and a primitive that ideep still holds stays alive when
    oneDNN's own cache drops it. A server under varied traffic meets a new number of rows in
    most passes that carry prompts, so its memory grows for many minutes on default capacities,
    still grows with only oneDNN's capped, and stays flat with both capped, at the same request
    rate (dev/LOG.md: ONEDNN_CACHE_CAPACITY). A product met again after its primitive was
    dropped is compiled afresh, a small cost against that growth.
    """
    for variable in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(variable, str(ONEDNN_CACHE_CAPACITY))


def _unchanged(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """weight [O, E] -> a copy in oneDNN's blocked layout (an opaque tensor only
    ``_onednn_linear`` reads); a weight under SMALL_WEIGHT_ELEMENTS stays as it is, for ATen."""
    if weight.numel() < SMALL_WEIGHT_ELEMENTS:
        return weight
    return _reorder(weight)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """weight [O, E] -> a packed copy in oneDNN's blocked layout for PACK_ROWS rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


class BothLayouts(NamedTuple):
    """A small weight held dense [O, E] for ATen and packed for oneDNN (a draft's, by rows)."""

    dense: torch.Tensor
    packed: torch.Tensor


def _pack_both(weight: torch.Tensor) -> torch.Tensor | BothLayouts:
    """weight [O, E] -> packed for oneDNN; a weight under SMALL_WEIGHT_ELEMENTS in both
    layouts (ATen is the faster over one row, oneDNN over more: the docstring's table)."""
    if weight.numel() >= SMALL_WEIGHT_ELEMENTS:
        return _reorder(weight)
    return BothLayouts(weight, _reorder(weight))


def _linear_by_rows(x: torch.Tensor, weight: torch.Tensor | BothLayouts,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., E] @ weight.T + bias for a weight prepared by ``_pack_both``: a weight in both
    layouts by ATen over one row, by oneDNN over more; a large one always by oneDNN."""
    if isinstance(weight, BothLayouts):
        weight = weight.dense if x.numel() == x.shape[-1] else weight.packed  # one row: ATen
    return _onednn_linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """x [..., E] @ weight [O, E].T + bias: oneDNN's inner product (no fused activation) for a
    weight packed by ``_pack_for_onednn``, ATen's for one it left dense (a small one). Which is
    fixed per weight when the model loads, never by the number of rows, so a plain step and a
    verification pass multiply every weight by the same kernel."""
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
