"""The library on a CUDA device: the guarantees of the CPU suite, checked where GPU users run.

Marked ``gpu`` and skipped on machines without CUDA (CI has none; `pytest -m gpu` on a GPU machine
runs them). What is checked here and not on the CPU:
  * verification on CUDA tensors (both the host-rows path and the batched tensor path) gives the
    same tokens as on the CPU for the same random numbers, and a CUDA Generator is reproducible;
  * the engine on CUDA: greedy output equals the target's own greedy decoding (fresh forwards) on
    the same device for every proposer (draft model, n-gram, hybrid), both backends,
    k in {1, 2, 4, 8}, batch 1 and 3; sampled output is reproducible per seed, leaves the global
    RNGs (CPU and CUDA) alone, and drafts and target meet on one device (a mismatch is refused at
    construction);
  * bfloat16 on the GPU through the public API, the CLI and the bench;
  * the fast path's steps captured as CUDA graphs (models/fast_llama/step_graphs.py, on by default):
    the demo pair's greedy speculative output equals its plain output at k in {1, 2, 4, 8}, batch 1
    and 8, in bfloat16; replays stay exact as rows join and leave and the cache grows; the law
    of the first two sampled tokens passes a G-test whose negative control fails.
The law of sampled output on CUDA is also tested in test_real_losslessness.py (its cuda cases).

Legend: B batch, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch

import verispec
from verispec import Engine, GenerationConfig, SamplingConfig
from verispec.bench.run import BenchSettings, run_bench
from verispec.cli import main
from verispec.errors import IncompatibleModelsError, ShapeError
from verispec.models.fast_llama.model import FastLlamaLM
from verispec.models.hf.adapter import TransformersLM
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.hybrid import HybridProposer
from verispec.proposers.ngram import NgramProposer
from verispec.sample.rejection import verify, verify_with_randomness
from verispec.text.demo import heldout_prompts

from fast_llama_pair import check_logits_after_random_extend_and_rewind
from tiny_models import layer_dropped_draft, save_untied_pair, untied_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
VOCAB = 97
# repetitive prompts, so the n-gram lookup finds matches too
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6], [7, 8, 9, 10, 11, 7, 8, 9], [20], [30, 31, 32, 30, 31]]
NUM_NEW = 40


def _random_case(seed: int, batch_size: int, k: int, point_mass: bool):
    """A verification case on the CPU: tokens drawn from the draft rows, so most are plausible."""
    generator = torch.Generator().manual_seed(seed)
    target_probs = torch.softmax(3 * torch.randn(batch_size, k + 1, VOCAB, generator=generator), -1)
    draft_probs = torch.softmax(3 * torch.randn(batch_size, k, VOCAB, generator=generator), -1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1,
                                     generator=generator).reshape(batch_size, k)
    uniforms = torch.rand(batch_size, k, generator=generator)
    next_uniforms = torch.rand(batch_size, generator=generator, dtype=torch.float64)
    return (draft_tokens, None if point_mass else draft_probs, target_probs, uniforms,
            next_uniforms)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("batch_size", [1, 3, 64])  # 64: the batched tensor path
def test_verify_on_cuda_equals_verify_on_cpu(batch_size, point_mass):
    for seed in range(5):
        case = _random_case(seed, batch_size, 4, point_mass)
        on_cpu = verify_with_randomness(*case)
        on_cuda = verify_with_randomness(*(None if t is None else t.to(CUDA) for t in case))
        assert on_cuda.output_tokens.device.type == "cuda"
        assert torch.equal(on_cuda.num_accepted.cpu(), on_cpu.num_accepted)
        assert torch.equal(on_cuda.output_tokens.cpu(), on_cpu.output_tokens)


def test_verify_with_a_cuda_generator_is_reproducible_and_leaves_global_rngs_alone():
    draft_tokens, draft_probs, target_probs, _, _ = (
        t.to(CUDA) for t in _random_case(0, 16, 3, point_mass=False))
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    runs = [verify(draft_tokens, draft_probs, target_probs,
                   torch.Generator(CUDA).manual_seed(seed)).output_tokens for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)


def test_verify_refuses_inputs_on_two_devices():
    draft_tokens, draft_probs, target_probs, _, _ = _random_case(0, 2, 3, point_mass=False)
    with pytest.raises(ShapeError, match="draft_probs is on cpu but target_probs on cuda"):
        verify(draft_tokens.to(CUDA), draft_probs, target_probs.to(CUDA),
               torch.Generator(CUDA).manual_seed(0))


# ---------------------------------------------------------------------------------------------
# The engine on CUDA, with real (tiny) transformers models


# random init gives near-uniform logits whose top two can sit within float noise of each other
# (kernels differ between a 1-token and a (k+1)-token pass); scaled, they are decisive
LM_HEAD_SCALE = 20.0


@pytest.fixture(scope="module")
def models():
    target = untied_llama(VOCAB, seed=11, hidden=64, layers=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(LM_HEAD_SCALE)
    return target.to(CUDA), layer_dropped_draft(target, num_layers=1).to(CUDA)


def _first_divergence(model, prompt: list[int], got: list[int], expected: list[int]) -> str:
    """Where two greedy continuations part, and the target's top-2 logit gap there."""
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + expected[:i]], device=CUDA)).logits[0, -1]
    top = logits.float().topk(2).values
    return (f"prompt {prompt}: position {i}, {got[i]} vs {expected[i]}, "
            f"top-2 gap {top[0] - top[1]:.3g}")


@pytest.fixture(scope="module")
def greedy_reference(models):
    """The target's greedy continuations of PROMPTS on the GPU, by definition: the argmax of a
    fresh full forward, one token at a time (no cache; generate()'s min_new_tokens would mask
    EOS, which is an ordinary token here)."""
    target, _ = models
    outputs = []
    for prompt in PROMPTS:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(NUM_NEW):
                ids.append(int(target(torch.tensor([ids], device=CUDA)).logits[0, -1].argmax()))
        outputs.append(ids[len(prompt):])
    return outputs


BACKENDS = {"fast": FastLlamaLM, "transformers": TransformersLM}


def _proposer(kind: str, draft_lm):
    if kind == "ngram":
        return NgramProposer(VOCAB)
    draft = DraftModelProposer(draft_lm)
    return draft if kind == "draft" else HybridProposer(draft)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_on_cuda_equals_the_targets_greedy_output(models, greedy_reference, backend,
                                                          proposer, k):
    target, draft = models
    lm = BACKENDS[backend]
    engine = Engine(lm(target), _proposer(proposer, lm(draft)))
    config = GenerationConfig(max_new_tokens=NUM_NEW, num_draft_tokens=k,
                              sampling=SamplingConfig(temperature=0.0))
    result = engine.generate(PROMPTS[:3], config)  # one ragged batch of 3
    outputs = result.token_ids + [engine.generate([prompt], config).token_ids[0]  # batch 1
                                  for prompt in PROMPTS[3:]]
    assert result.metrics.num_drafted > 0
    mismatches = [_first_divergence(target, prompt, got, expected) for prompt, got, expected
                  in zip(PROMPTS, outputs, greedy_reference) if got != expected]
    assert not mismatches, mismatches


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid"])
def test_sampled_on_cuda_is_reproducible_and_leaves_global_rngs_alone(models, backend,
                                                                        proposer):
    target, draft = models
    lm = BACKENDS[backend]
    engine = Engine(lm(target), _proposer(proposer, lm(draft)))

    def sampled(seed: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=NUM_NEW, num_draft_tokens=3, seed=seed,
                                  sampling=SamplingConfig(temperature=1.0, top_p=0.95))
        return engine.generate(PROMPTS[:3], config).token_ids

    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    first = sampled(3)
    assert first == sampled(3) and first != sampled(4)
    assert all(len(row) == NUM_NEW and all(0 <= t < VOCAB for t in row) for row in first)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)


def test_sampled_output_is_the_same_with_either_backend(models):
    target, draft = models
    config = GenerationConfig(max_new_tokens=NUM_NEW, num_draft_tokens=3, seed=5,
                              sampling=SamplingConfig(temperature=1.0))
    outputs = [Engine.from_draft_model(lm(target), lm(draft)).generate(
        PROMPTS[:3], config).token_ids for lm in (FastLlamaLM, TransformersLM)]
    assert outputs[0] == outputs[1]


def test_a_draft_on_another_device_is_refused_at_construction(models):
    target, draft = models
    cpu_draft = TransformersLM(layer_dropped_draft(target, num_layers=1).cpu())
    with pytest.raises(IncompatibleModelsError, match="draft is on cpu but the target on cuda"):
        Engine.from_draft_model(TransformersLM(target), cpu_draft)
    Engine(TransformersLM(target), NgramProposer(VOCAB))  # no model: no device


def test_fast_cache_rewind_gives_the_logits_of_a_fresh_forward(models):
    target, _ = models
    check_logits_after_random_extend_and_rewind(target, FastLlamaLM(target).new_session(), VOCAB)


# ---------------------------------------------------------------------------------------------
# bfloat16 on the GPU through the entry points


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_untied_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_api_on_cuda_in_bfloat16(model_dirs, backend):
    decoder = verispec.load(*model_dirs, device="cuda", dtype="bfloat16", backend=backend)
    assert decoder.target.device.type == "cuda"
    assert next(decoder.target.model.parameters()).dtype == torch.bfloat16
    assert decoder.num_draft_tokens == 4  # the GPU default
    greedy = decoder.generate("def add(a, b):", max_new_tokens=24)
    plain = decoder.generate("def add(a, b):", max_new_tokens=24, speculative=False)
    assert greedy.token_ids == plain.token_ids and len(greedy.token_ids) > 0
    sampled = [decoder.generate("for i in", max_new_tokens=24, temperature=1.0, seed=s).token_ids
               for s in (1, 1)]
    assert sampled[0] == sampled[1]


def test_cli_generate_on_cuda_in_bfloat16(model_dirs, capsys):
    target, draft = model_dirs
    status = main(["generate", "def add(a, b):", "--target", target, "--draft", draft,
                   "--device", "cuda", "--dtype", "bfloat16", "--max-new-tokens", "16",
                   "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0 and len(out["token_ids"]) > 0


def test_bench_on_cuda_reports_gpu_memory_and_plain_equality(model_dirs):
    decoder = verispec.load(*model_dirs, device="cuda", dtype="bfloat16")
    prompts = [decoder.tokenizer.encode(p) for p in ("def add(a, b):", "for i in")]
    settings = BenchSettings(max_new_tokens=16, repeats=1, ks=(2,), hf_ks=(2,),
                             temperatures=(0.0,), ngram_ks=(2,), hybrid_ks=(2,))
    with torch.inference_mode():
        results = run_bench(decoder, prompts, settings, temperature=0.0)
    assert all(r.peak_gpu_mb is not None and r.peak_gpu_mb > 0 for r in results)
    assert all(r.tokens_per_second > 0 for r in results)
    verispec_rows = [r for r in results if r.name.startswith("verispec")]
    assert all(r.matches_baseline for r in verispec_rows), [
        r.name for r in verispec_rows if not r.matches_baseline]


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_a_long_prompt_prefilled_in_chunks_on_cuda_joins_as_if_whole(model_dirs, backend):
    # engine/prefill.py on CUDA: the long prompt goes in 9 tokens a round while a row decodes,
    # its cache is copied into the batch's (adopt_rows); both greedy texts equal each alone
    decoder = verispec.load(*model_dirs, device="cuda", backend=backend)
    long_prompt = [5, 6, 7, 8, 9] * 20
    batch = decoder.open_batch(True)
    short = batch.add("def add(a, b):", max_new_tokens=60, ignore_eos=True)
    pending = batch.prepare(long_prompt, max_new_tokens=8, ignore_eos=True)
    chunked = batch.start_prefill(pending)
    while not chunked.done:
        chunked.advance(9)
        if len(batch):  # the short row may finish first
            batch.step()
    (joined,) = batch.add_rows([pending], prefilled=[chunked])
    while short.completion is None or joined.completion is None:
        batch.step()
    assert joined.completion.text == decoder.generate(long_prompt, max_new_tokens=8,
                                                      ignore_eos=True).text
    assert short.completion.text == decoder.generate("def add(a, b):", max_new_tokens=60,
                                                     ignore_eos=True).text


def test_cuda_graph_steps_times_each_step_eager_and_graphed(tmp_path):
    # benchmarks/cuda_graph_steps.py, shortened: every case runs through an eager session and a
    # graphed one, and both give every row the same greedy token
    import runpy
    from pathlib import Path
    script = Path(__file__).parents[2] / "benchmarks" / "cuda_graph_steps.py"
    main = runpy.run_path(str(script))["main"]
    assert main(["--repeats", "5", "--out-dir", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "cuda_graph_steps.json").read_text())["cases"]
    assert len(cases) == 14 and all(case["same_argmax"] for case in cases)
    assert all(case["graph_ms"] > 0 and case["eager_ms"] > 0 for case in cases)


# ---------------------------------------------------------------------------------------------
# CUDA graphs (models/fast_llama/step_graphs.py)


@pytest.fixture(scope="module")
def demo_bf16():
    decoder = verispec.load(device="cuda", dtype="bfloat16")
    assert decoder.target.step_graphs.capture and decoder.draft.step_graphs.capture
    return decoder


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_graphed_greedy_speculative_equals_plain_on_the_demo_pair(demo_bf16, rows, k):
    prompts = heldout_prompts()[:rows]
    settings = {"max_new_tokens": 48, "ignore_eos": True, "adaptive": None}
    plain = demo_bf16.generate(prompts, speculative=False, **settings)
    speculative = demo_bf16.generate(prompts, num_draft_tokens=k, **settings)
    assert [c.token_ids for c in speculative] == [c.token_ids for c in plain]
    assert sum(c.metrics.num_accepted for c in speculative) > 0
    assert demo_bf16.target.step_graphs.num_captured > 0


def test_graphed_steps_stay_exact_as_rows_join_and_leave(models):
    """Random extends and rewinds over rows that join (packed, riding a pass, eagerly) and
    leave, and a cache that grows past its first key bucket: every replayed step's last logits
    equal a fresh forward's."""
    target, _ = models
    lm = FastLlamaLM(target)
    session = lm.new_session()
    session.start([[1, 2, 3]])
    history = [[1, 2, 3]]
    generator = torch.Generator().manual_seed(0)
    for round_ in range(45):
        if round_ in (3, 9, 15):
            joining = [[5 + round_] * (2 + round_), [40 + round_]]
            session.add_rows(joining, ride=round_ != 9)
            history += [list(p) for p in joining]
        if round_ in (12, 20):
            kept = list(range(1, len(history)))[::-1]
            session.keep_rows(kept)
            history = [history[i] for i in kept]
        width = int(torch.randint(1, 10, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (len(history), width), generator=generator)
        logits = session.extend(tokens.to(CUDA))
        for row, ids in enumerate(history):
            ids.extend(tokens[row].tolist())
            with torch.inference_mode():
                fresh = target(torch.tensor([ids], device=CUDA)).logits[0, -1]
            torch.testing.assert_close(logits[row, -1], fresh, atol=1e-3, rtol=1e-3)
        rewind = [int(torch.randint(0, width // 2 + 1, (1,), generator=generator))
                  for _ in history]
        session.rewind(rewind)
        for ids, n in zip(history, rewind):
            del ids[len(ids) - n:]
    assert max(map(len, history)) > 128  # the steps outgrew the first key bucket
    assert lm.step_graphs.num_captured > 0


def test_graphed_first_two_tokens_follow_the_target_law_and_the_control_fails(monkeypatch):
    from helpers_stats import g_test, pair_counts
    from injected_rules import accept_every_draft_token, inject_verify
    from real_law import (
        CONTROL_P_THRESHOLD,
        P_THRESHOLD,
        VOCAB_SIZE,
        exact_first_two_law,
        first_two_tokens,
    )
    from real_law import LM_HEAD_SCALE as LAW_HEAD_SCALE
    target = untied_llama(VOCAB_SIZE, seed=11, hidden=32, layers=2, max_positions=64)
    # the law test's pair (real_law.py, test_real_losslessness.models), on CUDA
    with torch.no_grad():
        target.lm_head.weight.mul_(LAW_HEAD_SCALE)
    target, draft = target.to(CUDA), layer_dropped_draft(target, num_layers=1).to(CUDA)
    engine = Engine.from_draft_model(FastLlamaLM(target), FastLlamaLM(draft))
    assert engine.target.step_graphs.capture
    sampling = SamplingConfig(temperature=1.0)
    law = exact_first_two_law(target, sampling)
    tokens, acceptance_rate = first_two_tokens(engine, sampling, 2, seed=7,
                                               verification="token")
    result = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    assert 0.2 < acceptance_rate < 0.95 and result.num_impossible_hits == 0
    assert result.p_value > P_THRESHOLD, result
    inject_verify(monkeypatch, accept_every_draft_token)
    tokens, acceptance_rate = first_two_tokens(engine, sampling, 2, seed=99,
                                               verification="token")
    control = g_test(pair_counts(tokens, 0, VOCAB_SIZE), law)
    assert acceptance_rate == 1.0 and control.p_value < CONTROL_P_THRESHOLD, control
