"""``verispec bench``: the measurement's structure and its correctness checks, on tiny models.

Timings are not asserted (speed is measured by running the bench, never in tests); what is
asserted is what the table claims: every method ran, greedy outputs of every method (ours and
transformers' assisted generation) equal the plain baseline token for token, the theory column
uses the per-token acceptance a, and the JSON and plot are written.
"""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest
import torch

from verispec import cli
from verispec.sample.theory import theoretical_speedup

from tiny_models import save_untied_pair

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_untied_pair(tmp_path_factory.mktemp("bench_models"))


def test_bench_runs_every_method_and_greedy_outputs_match(model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nfor i in\nclass Point:\n")
    out_json, out_png, out_md = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "b.md"
    rng_before = torch.get_rng_state()
    status = cli.main(["bench", "--target", model_dirs[0], "--draft", model_dirs[1],
                       "--prompts", str(prompts), "--max-new-tokens", "10", "--repeats", "1",
                       "--ks", "1", "3", "--ngram-ks", "2", "--hybrid-ks", "2",
                       "--temperatures", "0", "1",
                       "--threads", "1",
                       "--json", str(out_json), "--plot", str(out_png),
                       "--markdown", str(out_md)])
    assert status == 0
    # transformers samples from the global RNG; the bench seeds it inside a fork only
    assert torch.equal(torch.get_rng_state(), rng_before)
    table = capsys.readouterr().out
    assert "verispec k=3" in table and "hf assisted k=3" in table
    report = json.loads(out_json.read_text())
    assert report["num_prompts"] == 3 and report["environment"]["threads"] == 1
    assert report["matmul"] in ("aten", "onednn")  # the fast path's projection kernel
    greedy, sampled = report["results"]["0.0"], report["results"]["1.0"]
    names = [r["name"] for r in greedy]
    assert names == ["verispec plain", "hf generate (target)", "hf assisted (defaults)",
                     "hf assisted k=1", "hf assisted k=3", "verispec k=1", "verispec k=3",
                     "hf prompt lookup k=2", "verispec ngram k=2", "verispec suffix",
                     "verispec hybrid k=2", "verispec threshold",
                     "verispec goodput", "verispec goodput carry-over"]
    assert [r["name"] for r in sampled] == names
    assert all(r["matches_baseline"] is True for r in greedy), [
        r["name"] for r in greedy if not r["matches_baseline"]]
    for r in greedy + sampled:
        assert r["tokens_per_second"] > 0 and r["speedup"] > 0
        if r["kind"] == "verispec":
            a, k, c = r["token_acceptance"], r["num_draft_tokens"], r["cost_ratio"]
            assert 0.0 <= r["acceptance_rate"] <= a <= 1.0  # accepted/drafted <= accepted/tested
            assert r["theoretical_speedup"] == pytest.approx(theoretical_speedup(a, k, c))
            assert c > 0 and r["verify_cost"] > 0
            assert r["achieved_over_theoretical"] == pytest.approx(
                r["speedup"] / r["theoretical_speedup"])
        if r["kind"] in ("ngram", "hybrid"):  # k varies: measured columns only, no theory
            assert r["theoretical_speedup"] is None and r["mean_accepted_length"] >= 1.0
    assert out_png.stat().st_size > 10_000
    markdown = out_md.read_text()
    assert markdown.count("| verispec k=3 |") == 2 and "**Temperature 0 (greedy)**" in markdown


BAD_ARGS = {  # name -> (argv, with {tmp} for a fresh folder, text the one line must hold)
    "repeats-0": (["--repeats", "0"], "--repeats"),
    "threads-0": (["--threads", "0"], "--threads 0"),
    "ks-0": (["--ks", "1", "0"], "--ks 0"),
    "ks-33": (["--ks", "33"], "--ks 33"),
    "hf-ks-0": (["--hf-ks", "0"], "--hf-ks 0"),
    "ngram-ks-0": (["--ngram-ks", "0"], "--ngram-ks 0"),
    "hybrid-ks-40": (["--hybrid-ks", "40"], "--hybrid-ks 40"),
    "ks-repeated": (["--ks", "1", "2", "1"], "--ks lists 1 twice"),
    "temperature-negative": (["--temperatures", "0", "-1"], "temperature=-1"),
    "temperature-repeated": (["--temperatures", "0", "1", "0"], "--temperatures lists 0"),
    "prompts-missing": (["--prompts", "{tmp}/none.txt"], "cannot be read"),
    "prompts-folder": (["--prompts", "{tmp}"], "cannot be read"),
    "prompts-not-utf8": (["--prompts", "{tmp}/latin1.txt"], "UTF-8"),
    "prompts-empty": (["--prompts", "{tmp}/empty.txt"], "is empty"),
    "prompts-json-not-strings": (["--prompts", "{tmp}/numbers.json"], "JSON list of strings"),
    "prompts-json-empty-string": (["--prompts", "{tmp}/blank.json"], "prompt 1 is empty"),
    "prompts-json-lone-surrogate": (["--prompts", "{tmp}/surrogate.json"], "not valid Unicode"),
    "json-folder-missing": (["--json", "{tmp}/no/such/dir/out.json"], "does not exist"),
    "plot-is-a-folder": (["--plot", "{tmp}"], "is a folder"),
    "markdown-folder-missing": (["--markdown", "{tmp}/no/out.md"], "--markdown"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bench_rejects_bad_arguments_before_loading_in_one_line(case, tmp_path, capsys):
    """Exit 2 with one line, and before the models load: the model paths given do not exist,
    so an error naming the argument (not the path) shows it was checked first. A bad output
    path must not cost a whole run before it is found."""
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "numbers.json").write_text("[1, 2]")
    (tmp_path / "blank.json").write_text('["x = 1", " "]')
    (tmp_path / "surrogate.json").write_text('["x = \\ud800"]')
    argv, expected = BAD_ARGS[case]
    status = cli.main(["bench", "--target", "/nonexistent/t", "--draft", "/nonexistent/d",
                       *(arg.replace("{tmp}", str(tmp_path)) for arg in argv)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err, (status, err)
    assert len(err.splitlines()) == 1 and err.startswith("verispec: error: "), err
    assert expected in err and "/nonexistent" not in err, err


def test_target_gap_script_measures_every_pattern(tmp_path, capsys):
    # benchmarks/target_gap.py on the shipped pair, shortened: every pattern is timed, the
    # ratios are relative to the one-token pass, and the JSON holds what was printed.
    script = Path(__file__).parents[2] / "benchmarks" / "target_gap.py"
    main = runpy.run_path(str(script))["main"]
    out = tmp_path / "gap.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--blocks", "1", "--passes", "2", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    patterns = [row["pattern"] for row in report["rows"]]
    assert len(patterns) == 11 and patterns[0] == "1 token, back to back"
    assert report["rows"][0]["vs_one_token"] == 1.0
    assert all(row["ms"] > 0 for row in report["rows"]) and report["draft_round_ms"] > 0
    assert "3 tokens after the draft's 2 steps" in capsys.readouterr().out


def test_speedup_is_the_median_of_paired_per_repeat_ratios():
    # Five repeats on a drifting machine (the figures of a real run, rounded): the method beats
    # the baseline in four repeats out of five, by 1.11-1.22x, but the medians of the two time
    # lists come from different repeats and their ratio is 0.99. The reported speedup pairs
    # each repeat with itself.
    from verispec.bench.run import MethodResult, _summarise
    from verispec.engine.metrics import GenerationMetrics

    baseline = [3.3, 3.9, 4.5, 3.1, 3.35]
    result = MethodResult("m", "verispec", 1, seconds=[2.9, 3.4, 3.7, 2.8, 3.45])
    _summarise(result, GenerationMetrics(), num_tokens=64, plain_step=0.01,
               baseline_seconds=baseline)
    assert result.speedup_per_repeat == pytest.approx(
        [b / s for b, s in zip(baseline, result.seconds)])
    assert result.speedup == pytest.approx(3.3 / 2.9)  # the median ratio, 1.14
    assert 3.35 / 3.4 < 1.0  # what the ratio of medians would have said
    assert result.tokens_per_second == pytest.approx(64 / 3.4)  # median time, 3.4 s


def test_load_time_split_times_a_real_servers_passes(tmp_path, capsys):
    # benchmarks/load_time_split.py against a real plain demo server, one client, shortened:
    # the target's passes carrying a joining prompt (one per request: it rides the request's
    # first pass) and its 1-token steps are timed, the shares of the wall time (with
    # "outside") add up to one, and the environment the servers inherited is restored.
    script = Path(__file__).parents[2] / "benchmarks" / "load_time_split.py"
    main = runpy.run_path(str(script))["main"]
    before = {name: os.environ.get(name) for name in ("PYTHONPATH", "VERISPEC_TIME_SPLIT")}
    assert main(["--clients", "1", "--requests-per-client", "2", "--min-requests", "2",
                 "--max-tokens", "8", "--modes", "plain", "--out-dir", str(tmp_path)]) == 0
    assert {name: os.environ.get(name) for name in before} == before
    (level,) = json.loads((tmp_path / "load_time_split.json").read_text())["levels"]
    kinds = {(row["model"], row["kind"]): row for row in level["passes"]}
    assert kinds["target", "1 token + joins"]["calls"] == 2  # one per request
    assert ("target", "prefill") not in kinds  # no pass of its own
    assert kinds["target", "1 token"]["calls"] >= 2 * 7  # 8 tokens, the first from that pass
    assert sum(row["share"] for row in level["passes"]) == pytest.approx(1.0)
    assert level["tokens_per_s"] > 0 and "plain, 1 clients" in capsys.readouterr().out


def test_batching_library_script_times_batched_generate(tmp_path, capsys):
    # benchmarks/batching_library.py on the shipped pair, shortened: every mode at every batch
    # size, plain never drafts and k = 2 does, and each greedy row equals its prompt alone (the
    # fast path's guarantee on a CPU, so the share is exactly 1 here)
    main = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks"
                              / "batching_library.py"))["main"]
    assert main(["--batch-sizes", "1,3", "--max-tokens", "6", "--repeats", "1", "--fixed-k",
                 "2", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "batching_library.json").read_text())
    rows = {(row["batch_size"], row["mode"]): row for row in report["rows"]}
    modes = ("plain", "speculative", "k=2")
    assert set(rows) == {(size, mode) for size in (1, 3) for mode in modes}
    for size in (1, 3):
        assert rows[size, "plain"]["mean_k"] == 0 and rows[size, "plain"]["vs_plain"] == 1
        assert 0 < rows[size, "k=2"]["mean_k"] <= 2
    assert all(row["tokens_per_s"] > 0 and row["equal_alone"] == 1 for row in rows.values())
    assert report["table"] in capsys.readouterr().out


def test_batching_ceiling_script_runs_the_workers_loop(tmp_path, capsys):
    # benchmarks/batching_ceiling.py on the shipped pair, shortened: every mode runs every
    # client count, each level completes all its requests, the ratios are within the run, and
    # the JSON holds the rows printed. The load benchmark's clients send different prompts at
    # any moment (common.client_prompt).
    script_dir = Path(__file__).parents[2] / "benchmarks"
    client_prompt = runpy.run_path(str(script_dir / "common.py"))["client_prompt"]
    for request in range(8):
        assert len({client_prompt(client, request, 16) for client in range(16)}) == 16
    main = runpy.run_path(str(script_dir / "batching_ceiling.py"))["main"]
    threads = torch.get_num_threads()
    try:
        assert main(["--clients", "1,3", "--requests", "4", "--max-tokens", "6", "--repeats",
                     "1", "--fixed-k", "2", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "batching_ceiling.json").read_text())
    levels = {(row["mode"], row["clients"]) for row in report["rows"]}
    assert levels == {(mode, clients) for mode in ("speculative", "plain", "k=2")
                      for clients in (1, 3)}
    assert all(row["tokens_per_s"] > 0 and row["vs_1_clients"] > 0 for row in report["rows"])
    mean_k = {(row["mode"], row["clients"]): row["mean_k"] for row in report["rows"]}
    for clients in (1, 3):  # the policy may choose plain rounds (timings); k = 2 drafts
        assert mean_k["plain", clients] == 0 and 0 < mean_k["k=2", clients] <= 2
        assert 0 <= mean_k["speculative", clients] <= 6
    # the passes-alone bound: one per client count, its tok/s from its own timings, the
    # speculative one the decode divided by the best per-round gain (never below 1)
    assert [bound["clients"] for bound in report["bounds"]] == [1, 3]
    for bound in report["bounds"]:
        clients, a = bound["clients"], bound["acceptance"]
        assert bound["prefill_ms"] > 0 and bound["decode_ms"] > 0 and 0 <= a <= 1
        assert bound["plain_tokens_per_s"] == pytest.approx(
            1e3 * clients * 6 / (bound["prefill_ms"] + bound["decode_ms"]))
        target_ms, k = bound["target_pass_ms"], bound["best_k"]
        assert len(target_ms) == 7 and 1 <= k <= 6
        assert bound["best_round_gain"] == pytest.approx(
            sum(a ** i for i in range(k + 1)) * target_ms[0]
            / (target_ms[k] + k * bound["draft_step_ms"]))
        assert bound["speculative_tokens_per_s"] == pytest.approx(
            1e3 * clients * 6 / (bound["prefill_ms"]
                                 + bound["decode_ms"] / max(1.0, bound["best_round_gain"])))
    assert "speculative 3 vs 1" in capsys.readouterr().out


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx fma avx2 bmi2
"""


def test_cpuinfo_reads_whole_keys_and_the_label_names_the_generation(tmp_path, monkeypatch):
    # "model" is its own key, not the start of "model name"; the label tells two VMs that both
    # call themselves "AMD EPYC" apart by family, model and vector width
    from verispec.bench import run as bench
    from verispec.models.fast_llama.matmul import cpuinfo

    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpuinfo("model", path) == "1"
    assert cpuinfo("model name", path) == "AMD EPYC"
    assert cpuinfo("stepping", path) == ""
    monkeypatch.setattr(bench, "cpuinfo", lambda field: cpuinfo(field, path))
    assert bench.cpu_label() == "AMD EPYC (family 25 model 1, AVX2)"
    zen4 = CPUINFO.replace("model\t\t: 1", "model\t\t: 17").replace("avx2", "avx2 avx512f")
    path.write_text(zen4)
    assert bench.cpu_label() == "AMD EPYC (family 25 model 17, AVX-512)"
