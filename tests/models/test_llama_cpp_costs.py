"""models/llama_cpp/costs.py and the pair's cost curve at load: measured on a real (tiny) GGUF
model on a scratch context, cached per file, thread count and kernel set, named by the CLI,
the server's startup line and `verispec bench`, and exact: with or without the curve, greedy
output is the target's own.

No timing is asserted (speed is measured in benchmarks/): only that every width has a positive
cost, when the cache is read and when it is measured again.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil

import pytest
import torch
from rich.console import Console

import verispec
from verispec import BatchOptions, GenerationConfig, GoodputPolicyConfig, SamplingConfig, cli
from verispec.bench.run import BenchSettings
from verispec.cli.bench import _print_header
from verispec.cli.options import llama_cpp_config
from verispec.errors import ConfigError
from verispec.models.gguf_export import save_gguf
from verispec.models.llama_cpp import costs
from verispec.models.llama_cpp.model import LlamaCppConfig, LlamaCppLM, LlamaCppModel
from verispec.policy.costs import CURVE_DEPTH
from verispec.server.run import describe_decoding
from verispec.server.settings import ServerSettings

from tiny_models import build_tokenizer, layer_dropped_draft, untied_llama

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny F32 target and its one-layer draft as GGUF files (peaky logits, so that
    acceptance is neither ~0 nor ~1)."""
    root = tmp_path_factory.mktemp("llama_cpp_costs")
    tokenizer = build_tokenizer(vocab_size=300)  # GGUF's BPE needs merges: > 256 tokens
    target = untied_llama(len(tokenizer), seed=7, hidden=32, layers=2, max_positions=128)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    draft = layer_dropped_draft(target, num_layers=1)
    return {"target": str(save_gguf(target, tokenizer, root / "target.gguf")),
            "draft": str(save_gguf(draft, tokenizer, root / "draft.gguf"))}


@pytest.fixture
def measured(monkeypatch):
    """Counts the measurements pass_costs makes (each still runs)."""
    calls = []
    measure = costs.measure_pass_costs

    def counting(lm, num_tokens):
        calls.append(num_tokens)
        return measure(lm, num_tokens)

    monkeypatch.setattr(costs, "measure_pass_costs", counting)
    return calls


def _lm(path: str, **config) -> LlamaCppLM:
    """One thread unless asked: on a busy shared machine a tiny model's pass is mostly the
    wait at llama.cpp's thread barrier, which makes a measurement slow, not wrong."""
    return LlamaCppLM(LlamaCppModel(path), config=LlamaCppConfig(**{"num_threads": 1,
                                                                    **config}))


def test_a_tiny_model_has_a_positive_cost_for_every_width(tiny, tmp_path):
    seconds = costs.pass_costs(_lm(tiny["target"], cost_curve="measure"), 9, folder=tmp_path)
    assert len(seconds) == 9 and all(s > 0 for s in seconds)
    (entry,) = [json.loads(f.read_text()) for f in tmp_path.iterdir()]
    assert entry["seconds"] == list(seconds) and entry["key"]["num_tokens"] == 9
    assert entry["key"]["path"] == os.path.realpath(tiny["target"])


def test_a_second_load_reads_the_cache_and_a_change_measures_again(tiny, tmp_path, measured):
    path = str(shutil.copy(tiny["target"], tmp_path / "target.gguf"))
    folder = tmp_path / "pass-costs"
    first = costs.pass_costs(_lm(path, cost_curve="cached"), 4, folder=folder)
    assert measured == [4]
    assert costs.pass_costs(_lm(path, cost_curve="cached"), 4, folder=folder) == first
    assert measured == [4]  # read back: not measured
    costs.pass_costs(_lm(path, cost_curve="cached", num_threads=2), 4, folder=folder)
    assert measured == [4, 4]  # another thread count
    costs.pass_costs(_lm(path, cost_curve="cached"), 5, folder=folder)
    assert measured == [4, 4, 5]  # more widths
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    costs.pass_costs(_lm(path, cost_curve="cached"), 4, folder=folder)
    assert measured == [4, 4, 5, 4]  # a changed file
    costs.pass_costs(_lm(path, cost_curve="measure"), 4, folder=folder)
    assert measured == [4, 4, 5, 4, 4]  # asked afresh
    assert costs.pass_costs(_lm(path, cost_curve="off"), 4, folder=folder) is None
    for entry in folder.iterdir():
        entry.write_text("{not json")
    costs.pass_costs(_lm(path, cost_curve="cached"), 4, folder=folder)
    assert measured == [4, 4, 5, 4, 4, 4]  # an unreadable entry is measured again
    assert len(list(folder.iterdir())) == 4  # one entry per key, no temporary files left


def test_measuring_leaves_the_generating_session_as_it_was(tiny):
    lm = _lm(tiny["target"])
    session = lm.new_session()
    session.start([[1, 2, 3]])
    costs.measure_pass_costs(lm, 3)
    logits = session.extend(torch.tensor([[4, 5]]))  # the session is still live, its rows kept
    fresh = _lm(tiny["target"]).new_session()
    fresh.start([[1, 2, 3]])
    torch.testing.assert_close(logits, fresh.extend(torch.tensor([[4, 5]])))


def test_the_mode_is_checked_and_named_from_the_cli_to_the_config(monkeypatch):
    with pytest.raises(ConfigError, match="cost_curve='sometimes'"):
        LlamaCppConfig(cost_curve="sometimes")
    monkeypatch.setenv("VERISPEC_COST_CURVE", "never")
    with pytest.raises(ConfigError, match="VERISPEC_COST_CURVE='never'"):
        LlamaCppConfig().cost_curve_mode()
    monkeypatch.delenv("VERISPEC_COST_CURVE")
    assert LlamaCppConfig().cost_curve_mode() == "cached"
    assert LlamaCppConfig(cost_curve="off").cost_curve_mode() == "off"
    parser = cli.build_parser()
    for command in (["generate", "x"], ["bench"]):
        args = parser.parse_args(command + ["--cost-curve", "measure"])
        assert llama_cpp_config(args).cost_curve == "measure"
    args = parser.parse_args(["serve", "--cost-curve", "off"])
    assert ServerSettings.from_args(args).cost_curve == "off"


@pytest.fixture(scope="module")
def curve_decoders(tiny, tmp_path_factory):
    """The tiny pair loaded with a measured curve (cached in a folder of the test's) and
    without one."""
    previous = os.environ.get("VERISPEC_CACHE")
    os.environ["VERISPEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return {mode: verispec.load(tiny["target"], tiny["draft"], backend="llama.cpp",
                                    llama_cpp_config=LlamaCppConfig(
                                        cost_curve=mode, context_size=512, num_threads=1))
                for mode in ("measure", "off")}
    finally:
        if previous is None:
            os.environ.pop("VERISPEC_CACHE")
        else:
            os.environ["VERISPEC_CACHE"] = previous


def test_a_load_measures_the_pair_and_the_default_depth_follows_it(curve_decoders):
    decoder, unmeasured = curve_decoders["measure"], curve_decoders["off"]
    curve = decoder.cost_curve
    assert len(curve.target_pass) == CURVE_DEPTH + 1 and all(s > 0 for s in curve.target_pass)
    assert curve.draft_step > 0 and decoder.engine.cost_curve is curve
    assert decoder.num_draft_tokens == curve.best_depth(GoodputPolicyConfig.prior_acceptance)
    assert unmeasured.cost_curve is None and unmeasured.engine.cost_curve is None
    assert unmeasured.num_draft_tokens == 4  # llama.cpp's flat_verify default, as before


@pytest.mark.parametrize("adaptive", [None, GoodputPolicyConfig(min_num_draft_tokens=0)])
def test_greedy_output_is_the_targets_with_and_without_the_curve(curve_decoders, adaptive):
    plain = curve_decoders["off"].engine.generate(
        PROMPTS, GenerationConfig(max_new_tokens=40, sampling=GREEDY), speculative=False)
    for mode, decoder in curve_decoders.items():
        config = GenerationConfig(max_new_tokens=40, sampling=GREEDY)
        options = BatchOptions(adaptive=adaptive, num_draft_tokens=decoder.num_draft_tokens)
        assert decoder.engine.generate(PROMPTS, config,
                                       options=options).token_ids == plain.token_ids, mode
        for prompt, expected in zip(PROMPTS, plain.token_ids):  # one row: the curve's bucket
            run = decoder.engine.stream([prompt], config, options=options)
            for _ in run:
                pass
            assert run.result().token_ids == [expected], mode
            if adaptive is not None:
                assert run.batch.last_policy.costs is decoder.cost_curve


def test_the_startup_line_and_the_bench_header_name_the_curve(curve_decoders, tiny):
    decoder = curve_decoders["measure"]
    settings = ServerSettings(target=tiny["target"], draft=tiny["draft"])
    line = describe_decoding(decoder, settings)
    assert line.startswith("draft model, goodput-plain depth from k = ")
    assert "by the cost curve; cost curve target pass ms n=1..9: " in line
    assert "; draft step " in line and "(c = " in line
    assert "cost curve" not in describe_decoding(curve_decoders["off"], settings)
    output = io.StringIO()
    _print_header(Console(file=output, width=300), argparse.Namespace(device="cpu",
                  dtype="float32"), decoder, 3, BenchSettings())
    assert f"cost curve: {decoder.cost_curve.describe()}" in output.getvalue()
