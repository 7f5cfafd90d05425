"""llama.cpp's weight kernels: AMX only where its kernel runs, repacking kept, --repack.

A KVM guest can grant the AMX tile permission and still fault inside ggml's AMX matmul, which
kills the process at the first decode (models/llama_cpp/kernels.py). These tests load small
quantized GGUF files written by the probe's own writer (Q4_0: a type both AMX and the
repacked kernels take) and read which buffer type holds the weights from llama.cpp's load log.
A fault is simulated with a probe command that dies of SIGILL, as the real probe does on such
a machine; the real probe runs too, and whatever it answers must hold for a model loaded here.
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch

pytest.importorskip("llama_cpp")

from verispec import ConfigError
from verispec.models.llama_cpp import kernels
from verispec.models.llama_cpp.amx_probe import write_probe_model
from verispec.models.llama_cpp.model import (
    LlamaCppConfig,
    LlamaCppLM,
    LlamaCppModel,
    bindings,
)

FAULTING_PROBE = [sys.executable, "-c",
                  "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels") / "q4_0.gguf"
    write_probe_model(path, "Q4_0")
    return path


@pytest.fixture
def probe_answer(monkeypatch):
    """This process's probe answer, restored after the test."""
    monkeypatch.setattr(kernels._PROBE, "result", kernels._PROBE.result)


def _decodes(model: LlamaCppModel) -> torch.Tensor:
    session = LlamaCppLM(model).new_session()
    session.start([list(range(3, 43))])
    return session.extend(torch.tensor([[5, 6, 7, 8]]))


def test_a_faulting_probe_leaves_amx_out_and_keeps_repacking(q4_0_file, probe_answer):
    probe = kernels.probe_amx(FAULTING_PROBE)
    assert not probe.runs and "SIGILL" in probe.reason
    model = LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="auto"))
    assert "AMX" not in model.weight_buffers, model.weight_buffers
    assert model.weight_buffers.get("CPU_REPACK", 0) > 0, model.weight_buffers
    assert "SIGILL" in model.kernels.reason
    assert torch.isfinite(_decodes(model)).all()
    # the list llama.cpp reads is whole again after the load
    types = kernels.extra_buffer_types(bindings())
    assert [types.array[index] for index in range(len(types.entries) + 1)] == [
        pointer for _, pointer in types.entries] + [None]


def test_the_real_probe_decides_and_the_model_it_allows_decodes(q4_0_file, probe_answer):
    """On a machine whose AMX runs, auto gives the weights to AMX as llama.cpp's default does;
    where it faults or is absent, to the repacked kernels. Either way the model decodes."""
    types = kernels.extra_buffer_types(bindings())
    probe = kernels.probe_amx()
    model = LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="auto"))
    gets_amx = "AMX" in types.names and probe.runs
    assert ("AMX" in model.weight_buffers) == gets_amx, (model.weight_buffers, probe)
    if not gets_amx and "CPU_REPACK" in types.names:
        assert model.weight_buffers.get("CPU_REPACK", 0) > 0, model.weight_buffers
    assert torch.isfinite(_decodes(model)).all()


def test_repack_on_offers_every_extra_buffer_type_and_off_none(q4_0_file):
    types = kernels.extra_buffer_types(bindings())
    loaded = LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="on"))  # loads, no decode
    assert set(loaded.weight_buffers) - {"CPU_Mapped", "CPU"} == {types.names[0]}
    plain = LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="off"))
    assert set(plain.weight_buffers) <= {"CPU_Mapped", "CPU"}, plain.weight_buffers
    assert "extra buffer types" not in plain.kernels.reason and "off" in plain.kernels.reason


def test_plain_and_repacked_kernels_agree_within_quantization_noise(q4_0_file, probe_answer):
    kernels.probe_amx(FAULTING_PROBE)  # repacked, never AMX: comparable on every machine
    repacked = _decodes(LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="auto")))
    plain = _decodes(LlamaCppModel(q4_0_file, config=LlamaCppConfig(repack="off")))
    assert torch.allclose(repacked, plain, atol=0.05), (repacked - plain).abs().max()


@pytest.mark.parametrize("value", ["maybe", "", None, True])
def test_repack_outside_its_choices_is_a_config_error(value):
    with pytest.raises(ConfigError, match="repack=.*auto"):
        LlamaCppConfig(repack=value)


def test_a_probe_that_fails_without_a_signal_also_leaves_amx_out(probe_answer):
    probe = kernels.probe_amx([sys.executable, "-c", "raise SystemExit(3)"])
    assert not probe.runs and "exit 3" in probe.reason
    assert signal.SIGILL.name not in probe.reason
