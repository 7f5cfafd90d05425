"""The ``verispec`` command line: output streams, --json, stdin, and one-line errors (exit 2).

Most cases call ``verispec.cli.main(argv)`` in-process (capsys), on tiny saved models. A few
run the installed console script as a real subprocess, because only there is stderr complete
(library warnings, tracebacks) and the entry point itself exercised; those are started together
by one module fixture since each pays 5+ s of interpreter and torch start-up. OMP_NUM_THREADS=1
keeps them from fighting over the shared cores (the output does not depend on it).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import verispec
from verispec import cli
from verispec.text.demo import DemoAssetsMissingError, demo_pair

from tiny_models import save_untied_pair

pytestmark = pytest.mark.usefixtures("single_thread_torch")

CONSOLE_SCRIPT = Path(sys.executable).with_name("verispec")
PROMPT = "def add(a, b):"
SUBPROCESS_TIMEOUT_S = 400  # all of them together; each takes ~5 s on an idle machine
METRIC_KEYS = ("acceptance_rate", "mean_accepted_length", "draft_time", "target_time")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    return save_untied_pair(tmp_path_factory.mktemp("cli_models"))


@pytest.fixture(scope="module")
def expected_completion(model_dirs):
    """What the library itself returns for PROMPT (greedy, 12 tokens, k = 4)."""
    return verispec.load(*model_dirs).generate(PROMPT, max_new_tokens=12)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """cli.main in-process -> (exit status, stdout, stderr); argparse errors exit via SystemExit."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def models(model_dirs) -> list[str]:
    return ["--target", model_dirs[0], "--draft", model_dirs[1]]


# ---------------------------------------------------------------------------------------------
# successful runs, in-process


def test_generate_prints_text_to_stdout_and_metrics_to_stderr(model_dirs, expected_completion,
                                                              capsys):
    status, out, err = run_main(["generate", PROMPT, *models(model_dirs),
                                 "--max-new-tokens", "12"], capsys)
    assert status == 0
    assert out == expected_completion.text + "\n"
    assert len(err.splitlines()) == 1
    assert "acceptance rate" in err and "12 tokens" in err


def test_summary_of_a_generation_that_drafted_nothing(model_dirs, capsys):
    """max_new_tokens=1 leaves no room for a draft token: the summary says so instead of an
    acceptance rate of 0 over nothing, and counts one token in the singular."""
    status, out, err = run_main(["generate", PROMPT, *models(model_dirs),
                                 "--max-new-tokens", "1"], capsys)
    assert status == 0 and len(err.splitlines()) == 1
    assert err.startswith("[1 token in ") and "no draft tokens tested" in err
    assert "acceptance rate" not in err


def test_json_output(model_dirs, expected_completion, capsys):
    status, out, err = run_main(["generate", PROMPT, *models(model_dirs),
                                 "--max-new-tokens", "12", "--json"], capsys)
    assert status == 0 and err == ""
    assert len(out.splitlines()) == 1
    payload = json.loads(out)
    assert payload["text"] == expected_completion.text
    assert payload["token_ids"] == expected_completion.token_ids
    for key in METRIC_KEYS:
        assert key in payload["metrics"], key
    assert payload["metrics"]["draft_time"] > 0


def test_compare_measures_against_plain_decoding(model_dirs, expected_completion, capsys):
    status, out, err = run_main(["generate", PROMPT, *models(model_dirs),
                                 "--max-new-tokens", "12", "--compare"], capsys)
    assert status == 0 and out == expected_completion.text + "\n"
    summary, measured = err.splitlines()
    assert "modelled speedup" in summary
    assert measured.startswith("[measured on this prompt, 5 interleaved runs each (medians): "
                               "speculative ")
    assert re.search(r"speedup \d+\.\d\dx \(runs \d+\.\d\d-\d+\.\d\d\)", measured)
    assert "same tokens as plain decoding: yes" in measured
    status, out, _ = run_main(["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12",
                               "--compare", "--json"], capsys)
    comparison = json.loads(out)["comparison"]
    assert comparison["same_tokens"] is True
    # the median of 5 interleaved pairs' ratios, inside their range
    assert comparison["repeats"] == cli.COMPARE_REPEATS == 5
    low, high = comparison["speedup_range"]
    assert 0 < low <= comparison["measured_speedup"] <= high
    assert comparison["speculative_tok_s"] > 0 and comparison["plain_tok_s"] > 0
    status, out, _ = run_main(["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12",
                               "--compare", "--json", "--temperature", "1", "--seed", "3"], capsys)
    assert json.loads(out)["comparison"]["same_tokens"] is True  # a seed fixes the text
    status, out, _ = run_main(["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12",
                               "--compare", "--json", "--temperature", "1"], capsys)
    assert json.loads(out)["comparison"]["same_tokens"] is None  # unseeded: not comparable


@pytest.mark.parametrize("policy", ["goodput", "goodput-plain", "threshold"])
def test_adaptive_depth_keeps_the_greedy_output(model_dirs, expected_completion, policy, capsys):
    status, out, _ = run_main(["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12",
                               "--adaptive", policy, "--k", "2", "--json"], capsys)
    assert status == 0
    payload = json.loads(out)
    assert payload["token_ids"] == expected_completion.token_ids
    assert payload["metrics"]["num_drafted"] > 0


def test_no_draft_plain_decoding(model_dirs, expected_completion, capsys):
    status, out, err = run_main(["generate", PROMPT, "--target", model_dirs[0], "--no-draft",
                                 "--max-new-tokens", "12"], capsys)
    assert status == 0
    assert out == expected_completion.text + "\n"  # greedy: the same tokens without a draft
    assert len(err.splitlines()) == 1 and "plain decoding" in err


def test_prompt_dash_reads_stdin(model_dirs, expected_completion, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    status, out, err = run_main(["generate", "-", *models(model_dirs), "--max-new-tokens", "12",
                                 "--quiet"], capsys)
    assert status == 0 and err == ""
    assert out == expected_completion.text + "\n"


def test_sampling_options_reach_the_decoder(model_dirs, capsys):
    argv = ["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12", "--json",
            "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9", "--seed", "7", "--k", "2"]
    first = json.loads(run_main(argv, capsys)[1])
    again = json.loads(run_main(argv, capsys)[1])
    assert first["token_ids"] == again["token_ids"]  # seeded
    expected = verispec.load(*model_dirs).generate(
        PROMPT, max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7,
        num_draft_tokens=2)
    assert first["token_ids"] == expected.token_ids
    assert len(first["metrics"]["per_position_acceptance"]) <= 2  # k = 2 was used


def test_penalties_and_logprobs_reach_the_decoder(model_dirs, capsys):
    argv = ["generate", PROMPT, *models(model_dirs), "--max-new-tokens", "12",
            "--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty",
            "1.2", "--min-p", "0.05", "--logit-bias", '{"7": 3, "9": -100}', "--logprobs", "2"]
    expected = verispec.load(*model_dirs).generate(
        PROMPT, max_new_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
        repetition_penalty=1.2, min_p=0.05, logit_bias={7: 3.0, 9: -100.0}, logprobs=2)
    assert 9 not in expected.token_ids
    payload = json.loads(run_main([*argv, "--json"], capsys)[1])
    assert payload["token_ids"] == expected.token_ids
    assert [lp["logprob"] for lp in payload["logprobs"]] == [
        lp.logprob for lp in expected.logprobs]
    status, out, _ = run_main([*argv, "--logit-bias", "7:3,9:-100"], capsys)
    # the text, then one line per token: its text, logprob and the 2 alternatives
    lines = out[len(expected.text) + 1:].splitlines()
    assert status == 0 and out.startswith(expected.text + "\n")
    assert len(lines) == len(expected.token_ids)
    for line, lp in zip(lines, expected.logprobs):
        assert f"{lp.logprob:9.4f}" in line and line.count(f"{lp.top[1][1]:.4f}") == 1


# ---------------------------------------------------------------------------------------------
# bad inputs, in-process: exit 2, one line on stderr, nothing on stdout

NO_GPU = not torch.cuda.is_available()
BAD_INPUTS = {  # name -> (argv after "generate", with {models} for the tiny dirs, expected text)
    "unknown-option": (["x", "--bogus"], "unrecognized arguments: --bogus"),
    "k-0": (["x", "{models}", "--k", "0"], "num_draft_tokens=0"),
    "k-33": (["x", "{models}", "--k", "33"], "num_draft_tokens=33"),
    "k-not-int": (["x", "{models}", "--k", "abc"], "'abc'"),
    "temperature-neg": (["x", "{models}", "--temperature", "-1"], "temperature=-1"),
    "top-p-0": (["x", "{models}", "--top-p", "0"], "top_p=0"),
    "presence-penalty-3": (["x", "{models}", "--presence-penalty", "3"], "presence_penalty=3"),
    "frequency-penalty-nan": (["x", "{models}", "--frequency-penalty", "nan"],
                              "frequency_penalty=nan"),
    "repetition-penalty-0": (["x", "{models}", "--repetition-penalty", "0"],
                             "repetition_penalty=0"),
    "min-p-2": (["x", "{models}", "--min-p", "2"], "min_p=2"),
    "logprobs-21": (["x", "{models}", "--logprobs", "21"], "logprobs=21"),
    "logit-bias-not-pairs": (["x", "{models}", "--logit-bias", "5"], "expected ID:BIAS pairs"),
    "logit-bias-bad-json": (["x", "{models}", "--logit-bias", "{5: 1}"], "expected ID:BIAS"),
    "logit-bias-200": (["x", "{models}", "--logit-bias", "5:200"], "logit_bias"),
    "logit-bias-id-beyond-vocab": (["x", "{models}", "--logit-bias", "99999:1"],
                                   "(99999 is not)"),
    # a token id given twice: refused as the server refuses it, not the last value kept
    "logit-bias-id-twice": (["x", "{models}", "--logit-bias", "5:1,5:2"],
                            "token id 5 is given twice"),
    "logit-bias-id-twice-spelled-apart": (["x", "{models}", "--logit-bias", "5:1,05:2"],
                                          "token id 5 is given twice"),
    "logit-bias-json-key-twice": (["x", "{models}", "--logit-bias", '{"5": 1, "5": 2}'],
                                  "token id 5 is given twice"),
    "repetition-penalty-tiny": (["x", "{models}", "--repetition-penalty", "1e-40"],
                                "repetition_penalty=1e-40"),
    "temperature-huge": (["x", "{models}", "--temperature", "1e39"], "temperature=1e+39"),
    "top-p-1.5": (["x", "{models}", "--top-p", "1.5"], "top_p=1.5"),
    "top-k-0": (["x", "{models}", "--top-k", "0"], "top_k=0"),
    "max-new-tokens-0": (["x", "{models}", "--max-new-tokens", "0"], "max_new_tokens=0"),
    "target-missing-path": (["x", "--target", "/nonexistent/verispec-model", "--draft",
                             "{draft}"], "does not exist"),
    "hub-id-not-cached": (["x", "--target", "verispec-tests/not-cached", "--draft",
                           "verispec-tests/not-cached-draft"], "offline"),
    "draft-without-target": (["x", "--draft", "{draft}"], "--draft was given without --target"),
    "target-without-draft": (["x", "--target", "{target}"], "--no-draft"),
    "empty-prompt": (["", "{models}"], "prompt"),
    "no-prompt": (["{models}"], "prompt"),
    "dtype-bogus": (["x", "{models}", "--dtype", "bogus"], "invalid choice: 'bogus'"),
    "repack-bogus": (["x", "{models}", "--repack", "maybe"], "invalid choice: 'maybe'"),
    "device-bogus": (["x", "{models}", "--device", "tpu"], "device='tpu'"),
    "context-overflow": (["x", "{models}", "--max-new-tokens", "100000"], "context window"),
    "stop-empty": (["x", "{models}", "--stop", ""], "stop="),
    # argv bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
    "prompt-not-utf8": (["ab\udcffc", "{models}"], "not valid Unicode"),
    "compare-without-draft": (["x", "--target", "{target}", "--no-draft", "--compare"],
                              "--compare"),
    "adaptive-without-draft": (["x", "--target", "{target}", "--no-draft", "--adaptive",
                                "goodput"], "--adaptive"),
    "adaptive-bogus": (["x", "{models}", "--adaptive", "fastest"], "invalid choice: 'fastest'"),
}


def expand(argv: list[str], model_dirs) -> list[str]:
    expanded = []
    for arg in argv:
        if arg == "{models}":
            expanded += models(model_dirs)
        else:
            expanded.append(arg.replace("{target}", model_dirs[0])
                            .replace("{draft}", model_dirs[1]))
    return expanded


def assert_one_line_error(status, out: str, err: str, expected: str) -> None:
    assert status == 2, (status, err)
    assert out == ""
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), repr(err)
    assert err.startswith("verispec: error: "), err
    assert expected in err, err


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, model_dirs, capsys):
    argv, expected = BAD_INPUTS[case]
    status, out, err = run_main(["generate", *expand(argv, model_dirs)], capsys)
    assert_one_line_error(status, out, err, expected)


def test_empty_stdin_prompt(model_dirs, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    status, out, err = run_main(["generate", "-", *models(model_dirs)], capsys)
    assert_one_line_error(status, out, err, "prompt")


def test_stdin_that_is_not_utf8(model_dirs, capsys, monkeypatch):
    """A strict locale's stdin raises on bytes that are not UTF-8 (others hand over surrogates,
    the prompt-not-utf8 case above)."""
    strict = io.TextIOWrapper(io.BytesIO(b"x = '\xff'\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", strict)
    status, out, err = run_main(["generate", "-", *models(model_dirs)], capsys)
    assert_one_line_error(status, out, err, "stdin is not UTF-8")


def test_no_command(capsys):
    status, out, err = run_main([], capsys)
    assert_one_line_error(status, out, err, "required")


@pytest.mark.skipif(not NO_GPU, reason="this machine has CUDA")
def test_cuda_without_gpu(model_dirs, capsys):
    status, out, err = run_main(["generate", "x", *models(model_dirs), "--device", "cuda"],
                                capsys)
    assert_one_line_error(status, out, err, "CUDA is not available")


# ---------------------------------------------------------------------------------------------
# the real console script, as subprocesses started together


def demo_available() -> str | None:
    """None when the demo assets are in place, else why not."""
    try:
        demo_pair()
    except DemoAssetsMissingError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def console_runs(model_dirs) -> dict[str, subprocess.CompletedProcess]:
    assert CONSOLE_SCRIPT.is_file(), f"the console script is not installed at {CONSOLE_SCRIPT}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    tiny = models(model_dirs)
    script, module = [str(CONSOLE_SCRIPT)], [sys.executable, "-m", "verispec"]
    commands = {  # name -> (argv, stdin)
        "stdin-json": ([*script, "generate", "-", *tiny, "--max-new-tokens", "12", "--json"],
                       PROMPT),
        "context-overflow": ([*script, "generate", "x", *tiny, "--max-new-tokens", "100000"], ""),
        "version": ([*script, "--version"], ""),
        "module": ([*module, "generate", "-", *tiny, "--max-new-tokens", "12", "--json"], PROMPT),
        "module-version": ([*module, "--version"], ""),
    }
    if demo_available() is None:
        commands["demo"] = ([*script, "generate", "def fibonacci(n):", "--max-new-tokens", "16"],
                            "")
    processes = {name: (subprocess.Popen(argv, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=env), stdin)
                 for name, (argv, stdin) in commands.items()}
    runs = {}
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    try:
        for name, (process, stdin) in processes.items():
            out, err = process.communicate(stdin, timeout=max(1.0, deadline - time.monotonic()))
            runs[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    finally:
        for process, _ in processes.values():
            if process.poll() is None:  # timed out: end only the processes started here
                process.kill()
                process.wait()
    return runs


def test_console_script_stdin_and_json(console_runs, expected_completion):
    run = console_runs["stdin-json"]
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    payload = json.loads(run.stdout)
    assert set(payload) >= {"text", "token_ids", "metrics"}
    for key in METRIC_KEYS:
        assert key in payload["metrics"], key
    assert payload["text"] == expected_completion.text
    assert payload["token_ids"] == expected_completion.token_ids


def test_python_dash_m_is_the_console_script(console_runs):
    run, script_run = console_runs["module"], console_runs["stdin-json"]
    assert run.returncode == 0, run.stderr
    payload, expected = json.loads(run.stdout), json.loads(script_run.stdout)
    # the same tokens and text; the metrics hold timings, which differ between runs
    assert (payload["text"], payload["token_ids"]) == (expected["text"], expected["token_ids"])


def test_version(console_runs):
    for name in ("version", "module-version"):
        run = console_runs[name]
        assert (run.returncode, run.stdout, run.stderr) == (
            0, f"verispec {verispec.__version__}\n", ""), name


def test_console_script_error_after_loading_is_one_line(console_runs):
    """The models load (any library warning would show here), then the request is refused."""
    run = console_runs["context-overflow"]
    assert_one_line_error(run.returncode, run.stdout, run.stderr, "100000")


def test_console_script_on_demo_pair(console_runs):
    """Needs the shipped demo assets (src/verispec/assets/demo)."""
    missing = demo_available()
    if missing is not None:
        pytest.fail(f"the demo pair assets are missing, so the CLI demo run cannot be tested: "
                    f"{missing}")
    run = console_runs["demo"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "Traceback" not in run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert "16 tokens" in run.stderr or "tokens in" in run.stderr
    assert "acceptance rate" in run.stderr


def test_console_script_stops_quietly_when_the_reader_goes_away(model_dirs):
    """`verispec generate ... | head -c 5`: once the pipe's reader has gone, the next write
    fails; the command stops there with 141 (128 + SIGPIPE, as a shell reports for
    `yes | head`) and no traceback. The read end is closed before the models even load, so the
    first write always meets a closed pipe."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    process = subprocess.Popen([str(CONSOLE_SCRIPT), "generate", PROMPT, *models(model_dirs),
                                "--max-new-tokens", "12"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    process.stdout.close()
    try:
        err = process.stderr.read().decode()
        assert process.wait(timeout=SUBPROCESS_TIMEOUT_S) == cli.EXIT_BROKEN_PIPE, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
