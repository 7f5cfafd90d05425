"""Real clients against a real server on the demo pair: lm-evaluation-harness and simonw's llm.

lm-evaluation-harness 0.4.13's ``local-completions`` model, as its users run it: batches of
token-id prompts to /v1/completions, ``echo: true, logprobs: 1, max_tokens: 1`` for
loglikelihood, ``stop``, ``max_tokens``, ``seed`` and ``temperature: 0`` for generation. Two tasks
from YAML files and JSONL data written here (no hub: ``dataset_path: json``): a generate_until
task, whose answers must be the library's greedy text, and a multiple-choice task, whose
loglikelihoods must equal log-probabilities computed from the target's transformers forward
(to 1e-4) and whose is_greedy flags must be the forward's. Then the ``llm`` command pointed at
the server by an extra-openai-models.yaml: one streamed chat reply, the library's greedy text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import verispec
from verispec.server import ServerSettings, create_app
from verispec.text.demo import demo_pair

from direct_logprobs import direct_logprobs, load_demo_target
from live_server import ServerThread

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "demo"
GEN_DOCS = [{"question": "def add(a, b):", "answer": "return a + b"},
            {"question": "import os\nimport", "answer": "sys"},
            {"question": "class Point:", "answer": "pass"}]
MAX_GEN_TOKENS = 16
UNTIL = "\n\n"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def decoder():
    return verispec.load()


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(model_name=MODEL, max_batch_size=4)
    with ServerThread(create_app(verispec.load(), settings)) as running:
        yield running


def mc_docs(decoder) -> list[dict]:
    """Multiple-choice questions; each first choice is the target's greedy continuation, so
    one is_greedy is true (lm-eval puts its target_delimiter, a space, before each choice)."""
    docs = []
    for query, others in (("import os\nimport", ["banana", "while"]),
                          ("def add(a, b):\n    return", ["a - b", "None"])):
        greedy = decoder.generate(query, max_new_tokens=2).text
        assert greedy.startswith(" ") and not greedy.startswith("  ")
        docs.append({"query": query, "choices": [greedy[1:], *others], "gold": 0})
    return docs


def write_tasks(root: Path, decoder) -> None:
    """Two task YAML files and their JSONL data under ``root``."""
    for name, docs in (("gen", GEN_DOCS), ("mc", mc_docs(decoder))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    data = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
            f"  cache_dir: {root / 'datasets'}\ntest_split: test\n")
    (root / "gen.yaml").write_text(
        "task: verispec_gen\n" + data.format(path=root / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n"
        f"  until: [{json.dumps(UNTIL)}]\n  max_gen_toks: {MAX_GEN_TOKENS}\n"
        "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    (root / "mc.yaml").write_text(
        "task: verispec_mc\n" + data.format(path=root / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{query}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        "metric_list:\n  - metric: acc\n")


def direct_loglikelihood(target, tokenizer, context: str, continuation: str
                         ) -> tuple[float, bool]:
    """The continuation's log-probability after the context and whether each of its tokens is
    the argmax, from the transformers forward, split into tokens as lm-eval splits them
    (TemplateLM._encode_pair: the whole encoded, the context's tokens first)."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    logprobs = direct_logprobs(target, whole)[start - 1 : len(whole) - 1]  # [C, V]
    continuation_ids = whole[start:]
    total = sum(logprobs[j, token].item() for j, token in enumerate(continuation_ids))
    greedy = logprobs.argmax(-1).tolist() == continuation_ids
    return total, greedy


def test_lm_eval_harness_generates_and_scores_as_the_target(tmp_path, server, decoder,
                                                           monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="the dev extra installs lm-eval[api]")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path, decoder)
    tokenizer_dir = demo_pair().target
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={server.url}/v1/completions,"
                   f"tokenizer={tokenizer_dir},tokenizer_backend=huggingface,"
                   "tokenized_requests=True,batch_size=2,max_retries=1,max_length=512",
        tasks=["verispec_gen", "verispec_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    generated = out["samples"]["verispec_gen"]
    assert len(generated) == len(GEN_DOCS)
    for sample in generated:
        context = sample["arguments"][0][0]
        expected = decoder.generate(tokenizer(context, add_special_tokens=False).input_ids,
                                    max_new_tokens=MAX_GEN_TOKENS, stop=UNTIL)
        assert sample["resps"][0][0] == expected.text
    target = load_demo_target()
    scored = out["samples"]["verispec_mc"]
    flags, correct = [], []
    for sample in scored:
        direct = [direct_loglikelihood(target, tokenizer, context, continuation)
                  for context, continuation in sample["arguments"]]
        for response, (loglikelihood, greedy) in zip(sample["filtered_resps"], direct):
            assert response[0] == pytest.approx(loglikelihood, abs=TOLERANCE)
            assert response[1] == greedy
            flags.append(greedy)
        correct.append(max(range(len(direct)), key=lambda i: direct[i][0]) == 0)
    assert flags == [True, False, False] * 2  # each greedy first choice, only those
    assert out["results"]["verispec_mc"]["acc,none"] == sum(correct) / len(correct)


def test_llm_cli_streams_the_greedy_reply(tmp_path, server, decoder):
    command = Path(sys.executable).with_name("llm")
    assert command.exists(), (
        f"{command} is missing: the dev extra installs llm (pip install -e '.[dev]')")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: verispec-demo\n  model_name: {MODEL}\n  api_base: {server.url}/v1\n")
    message = "Write a function that adds two numbers."
    # LLM_OPENAI_SHOW_RESPONSES: llm writes the HTTP exchange to stderr (the stream's events)
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_OPENAI_SHOW_RESPONSES": "1",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(command), "prompt", "-m", "verispec-demo", "-o", "temperature", "0",
                          "-o", "max_tokens", "16", "--no-log", message],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = decoder.chat([{"role": "user", "content": message}], max_new_tokens=16)
    assert run.stdout == expected.text + "\n"
    assert "text/event-stream" in run.stderr
    assert run.stderr.count('"delta":{"content":') >= 2 and "data: [DONE]" in run.stderr
