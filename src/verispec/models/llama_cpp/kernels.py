"""Which of llama.cpp's CPU weight kernels a GGUF model gets: AMX, repacked, or plain.

ggml's CPU backend offers "extra buffer types" for weights: AMX (Intel's tile matmul, which
takes Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS matrices) and CPU_REPACK (Q4_0, Q4_K,
IQ4_NL, ... interleaved eight rows at a time, so that a pass over several tokens runs as a
GEMM). A weight goes to the first of them that takes it, else to the plain CPU buffer (mapped
from the file, row-by-row kernels). ``LlamaCppConfig.repack`` chooses among them:

    auto  every extra buffer type, but AMX only where llama.cpp's AMX kernel runs on this
          machine (a probe in a child process, amx_probe.py, once per process)
    on    every extra buffer type llama.cpp offers, AMX unprobed (llama.cpp's own default)
    off   none: plain kernels only (llama-server --no-repack)

Why a probe: some KVM guests grant the tile permission (ARCH_REQ_XCOMP_PERM succeeds, the CPU
flags list amx_tile) but fault inside ggml's AMX matmul (SIGILL on ``tilezero``), which would
kill the whole process at the first decode. The probe runs that kernel where a fault costs
nothing. Where it faults (or dies in any other way), ``auto`` leaves AMX out and keeps the
repacked kernels, which run on any x86 with AVX2.

The lever: llama.cpp builds each model's list of buffer types from the array that the CPU
backend's ``ggml_backend_dev_get_extra_bufts`` returns (a null-terminated array that ggml owns
for the life of the process). ``load_with_kernels`` writes the chosen entries into that array
for the duration of one model load, under a lock, and restores it. llama.cpp has no parameter
for "all but AMX": ``use_extra_bufts = false`` drops repacking too, and
``tensor_buft_overrides`` bypasses the check of whether a buffer type can hold a tensor.

What this is not: a kernel. Nothing here runs a matmul; the probe's model is random.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...config import REPACK_MODES

AMX = "AMX"
_GGML_BACKEND_DEVICE_TYPE_CPU = 0
_PROBE_TIMEOUT_S = 180


@dataclass(frozen=True)
class AmxProbe:
    """What the probe found: ``runs`` whether AMX may be used; ``reason`` in words."""

    runs: bool
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    """How one model loads: with extra buffer types or not, and which of them are left out."""

    use_extra_bufts: bool
    left_out: tuple[str, ...]
    reason: str


class _ProbeCache:
    result: AmxProbe | None = None
    lock = threading.Lock()


_PROBE = _ProbeCache()
_LOAD_LOCK = threading.Lock()


class ExtraBufferTypes:
    """The CPU backend's array of extra buffer types, as llama.cpp's model loader reads it."""

    def __init__(self, llama_cpp) -> None:
        from llama_cpp import _ggml

        lib = _ggml.libggml
        lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
        lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
        lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
        lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.ggml_backend_buft_name.restype = ctypes.c_char_p
        lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
        device = lib.ggml_backend_dev_by_type(_GGML_BACKEND_DEVICE_TYPE_CPU)
        address = lib.ggml_backend_reg_get_proc_address(
            lib.ggml_backend_dev_backend_reg(device), b"ggml_backend_dev_get_extra_bufts")
        self.array = None
        self.entries: list[tuple[str, int]] = []  # (name, buffer type) in llama.cpp's order
        if address:
            getter = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
            self.array = getter(device)
            index = 0
            while self.array and self.array[index]:
                pointer = self.array[index]
                self.entries.append((lib.ggml_backend_buft_name(pointer).decode(), pointer))
                index += 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    def write(self, left_out: Sequence[str]) -> None:
        """Let the next model load see every entry but ``left_out`` (in the same order)."""
        kept = [pointer for name, pointer in self.entries if name not in left_out]
        for index, pointer in enumerate(kept + [None] * (len(self.entries) - len(kept))):
            self.array[index] = pointer


@functools.cache
def extra_buffer_types(llama_cpp) -> ExtraBufferTypes:
    """The CPU backend's extra buffer types (read once per process)."""
    return ExtraBufferTypes(llama_cpp)


def probe_amx(command: Sequence[str] | None = None) -> AmxProbe:
    """Run the AMX probe in a child process (``command``: the probe's command line, for tests
    that simulate a fault) and keep its answer as this process's."""
    with _PROBE.lock:
        _PROBE.result = _run_probe(command)
        return _PROBE.result


def amx_probe() -> AmxProbe:
    """This process's probe answer, probing on first use."""
    with _PROBE.lock:
        if _PROBE.result is None:
            _PROBE.result = _run_probe(None)
        return _PROBE.result


def _run_probe(command: Sequence[str] | None) -> AmxProbe:
    with tempfile.TemporaryDirectory(prefix="verispec-amx-") as folder:
        command = list(command) if command is not None else [
            sys.executable, os.path.join(os.path.dirname(__file__), "amx_probe.py"), folder]
        try:
            done = subprocess.run(command, check=False, capture_output=True, text=True,
                                  timeout=_PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return AmxProbe(False, f"the AMX probe did not finish ({type(exc).__name__})")
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return AmxProbe(False, f"llama.cpp's AMX kernel faults on this machine (the probe "
                               f"died of {name})")
    answer = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode == 0 and answer[0] == "amx-ok":
        return AmxProbe(True, "llama.cpp's AMX kernel runs on this machine (probed)")
    if done.returncode == 0 and answer[0] == "amx-unused":
        return AmxProbe(False, "llama.cpp gave the probe's weights no AMX buffer")
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return AmxProbe(False, f"the AMX probe failed (exit {done.returncode}: {tail[0][:200]})")


def plan_kernels(repack: str, types: ExtraBufferTypes) -> KernelPlan:
    """The load plan of ``repack`` (one of REPACK_MODES) on this machine."""
    assert repack in REPACK_MODES, repack
    if repack == "off":
        return KernelPlan(False, (), "repack=off: plain kernels")
    if repack == "on":
        return KernelPlan(True, (), "repack=on: every extra buffer type, AMX unprobed")
    if types.array is None and not _cpu_has_amx():
        return KernelPlan(True, (), "repack=auto: no AMX on this CPU")
    if types.array is not None and AMX not in types.names:
        return KernelPlan(True, (), "repack=auto: this llama.cpp offers no AMX buffer type here")
    probe = amx_probe()
    if probe.runs:
        return KernelPlan(True, (), f"repack=auto: {probe.reason}")
    if types.array is None:  # no list to edit: the only way around AMX drops repacking too
        return KernelPlan(False, (), f"repack=auto: extra buffer types off (this llama.cpp "
                                     f"cannot leave AMX out alone), {probe.reason}")
    return KernelPlan(True, (AMX,), f"repack=auto: AMX left out, {probe.reason}")


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return any(line.startswith("flags") and " amx_tile" in line for line in handle)
    except OSError:
        return False


def load_with_kernels(llama_cpp, repack: str, load: Callable[[bool], object]
                      ) -> tuple[object, KernelPlan]:
    """Call ``load(use_extra_bufts)`` with llama.cpp seeing the extra buffer types that
    ``repack`` allows; returns what it returned and the plan."""
    types = extra_buffer_types(llama_cpp)
    plan = plan_kernels(repack, types)
    with _LOAD_LOCK:
        if plan.left_out:
            types.write(plan.left_out)
        try:
            return load(plan.use_extra_bufts), plan
        finally:
            if plan.left_out:
                types.write(())
