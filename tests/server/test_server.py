"""The HTTP server end to end: a real uvicorn on 127.0.0.1, the official openai client, raw httpx
for what the client hides (server-sent event framing, error bodies, disconnects).

Tiny random models saved to a temporary directory keep it fast; the greedy comparison with
``verispec generate`` also runs on the shipped demo pair when its assets are present.
"""
# ruff: noqa: F811 (the tests take live_server's module fixture model_dirs by name)

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

import verispec
from verispec import cli
from verispec.errors import ConfigError
from verispec.models.fast_llama.matmul import resolve_matmul
from verispec.policy import default_num_draft_tokens
from verispec.server import ServerSettings, create_app
from verispec.server.errors import ERROR_TABLE, ServerOverloaded, error_kind
from verispec.server.prompts import ChatMessage, ChatPrompt
from verispec.server.run import adaptive_policy
from verispec.server.settings import add_settings_arguments
from verispec.text.chat import ChatTemplateMissing

from live_server import (  # noqa: F401 (model_dirs: a fixture)
    ServerThread,
    metric_values,
    model_dirs,
    wait_for,
)
from tiny_models import build_tokenizer, save_model, tiny_llama

# the depth a server on this machine's CPU uses when --k is not given (4 where the fast path
# multiplies by packed oneDNN weights, 2 with MKL; policy.default_num_draft_tokens)
CPU_DEFAULT_K = default_num_draft_tokens(
    "cpu", flat_verify=resolve_matmul("auto", torch.device("cpu"), torch.float32) == "onednn")

pytestmark = pytest.mark.usefixtures("single_thread_torch")

API_KEY = "test-key"
MODEL = "tiny"
PROMPT = "def add(a, b):"
LONG = 1500  # tokens: several seconds of generation, for the aborted and the blocking requests
SETTINGS = ServerSettings(api_key=API_KEY, model_name=MODEL, max_tokens_limit=2000,
                          max_prompt_tokens=64, max_queue=2, max_body_bytes=16_384,
                          max_batch_size=1,  # one row at a time: the queue tests below fill it
                          chat_template="plain")  # the tiny tokenizer has no template of its own


@pytest.fixture(scope="module")
def reference(model_dirs):
    """A decoder of its own for expected outputs (the server's runs on the server's thread)."""
    return verispec.load(*model_dirs, chat_template=SETTINGS.chat_template)


@pytest.fixture(scope="module")
def server(model_dirs):
    with ServerThread(create_app(verispec.load(*model_dirs, chat_template=SETTINGS.chat_template),
                                 SETTINGS)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}",
                               "Content-Type": "application/json"}) as session:
        yield session


def assert_serving(client) -> None:
    """A normal request succeeds (after an error, a disconnect, an overload)."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1


# --- completions and chat: outputs equal the library's -------------------------------------


def test_completion_greedy_equals_decoder(client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    expected = reference.generate(PROMPT, max_new_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == expected.num_prompt_tokens
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == expected.num_prompt_tokens + len(expected.token_ids)
    summary = out.model_extra["speculation"]
    assert summary["num_draft_tokens"] == CPU_DEFAULT_K  # no --k: the CPU's default depth
    assert summary["drafted"] == expected.metrics.num_drafted
    assert summary["accepted"] == expected.metrics.num_accepted
    assert summary["acceptance_rate"] == pytest.approx(expected.metrics.acceptance_rate)
    assert summary["mean_accepted_length"] == pytest.approx(expected.metrics.mean_accepted_length)


def test_seeded_sampling_equals_decoder(client, reference):
    """temperature 1 with a seed: the same tokens as Decoder.generate with that seed (the greedy
    continuation of a random tiny model repeats one token; sampling exercises real text)."""
    kwargs = dict(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32,
                                    temperature=1.0, top_p=0.95, seed=11,
                                    extra_body={"top_k": 50})
    expected = reference.generate(PROMPT, max_new_tokens=32, **kwargs)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_token_id_prompt_equals_text_prompt(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=1,
                                       seed=3)
    by_text = client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=8,
                                        temperature=1, seed=3)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_string_cuts_the_text(client, reference):
    sampled = reference.generate(PROMPT, max_new_tokens=32, temperature=1.0, seed=5).text
    assert len(sampled) >= 4, sampled
    stop = sampled[len(sampled) // 2: len(sampled) // 2 + 2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=1.0,
                                    seed=5, stop=[stop, "never-appears"])
    expected = reference.generate(PROMPT, max_new_tokens=32, temperature=1.0, seed=5,
                                  stop=[stop, "never-appears"])
    assert out.choices[0].text == expected.text == sampled[: sampled.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_streamed_completion_equals_the_whole(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=1.0, seed=9, stream=True,
                                            stream_options={"include_usage": True}))
    expected = reference.generate(PROMPT, max_new_tokens=24, temperature=1.0, seed=9)
    *content, usage_chunk = chunks  # include_usage: a last chunk with no choices, the usage
    assert len(content) >= 2 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content[:-1]] == [None] * (len(content) - 1)
    finishing = content[-1]
    assert finishing.choices[0].finish_reason == expected.finish_reason
    assert finishing.model_extra["speculation"]["drafted"] == expected.metrics.num_drafted
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(
        expected.token_ids)
    assert all(c.usage is None for c in content)


def test_stream_framing_ends_with_done(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    # OpenAI's shape: no usage unless stream_options.include_usage asks for it (defect 9)
    assert "speculation" in payloads[-1] and payloads[-1]["choices"][0]["finish_reason"]
    assert all("usage" not in p for p in payloads)


def test_chat_greedy_equals_decoder_on_the_plain_template(client, reference):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         temperature=0)
    prompt = "system: You write Python.\nuser: def add(a, b):\nassistant:"
    assert reference.chat_prompt_ids(messages) == reference.tokenizer.encode(
        prompt, add_special_tokens=False)
    expected = reference.generate(prompt, max_new_tokens=16, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == expected.num_prompt_tokens
    assert "speculation" in out.model_extra


def test_chat_uses_the_tokenizers_template_and_refuses_a_model_without_one():
    """ChatPrompt.encode renders with the decoder's template (text/chat.py): the tokenizer's own;
    a tokenizer with none, and no template named, gets ChatTemplateMissing (a 400)."""
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "hi"))
    tokenizer = build_tokenizer()
    model = tiny_llama(len(tokenizer), seed=1)
    with pytest.raises(ChatTemplateMissing, match="--chat-template"):
        ChatPrompt(messages).encode(verispec.Decoder(model, tokenizer))
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert ChatPrompt(messages).encode(verispec.Decoder(model, tokenizer)) == tokenizer.encode(
        "<system>Be brief.<user>hi<assistant>", add_special_tokens=False)


def test_chat_stream(client, reference):
    messages = [{"role": "user", "content": [{"type": "text", "text": "for i in"}]}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                 temperature=1.0, seed=2, stream=True))
    expected = reference.generate("user: for i in\nassistant:", max_new_tokens=16,
                                  temperature=1.0, seed=2)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage is None  # not asked for


@pytest.fixture(scope="module")
def small_window_url(tmp_path_factory):
    """A second server: 96-token windows, --max-tokens-limit 50, no API key, plain decoding."""
    tokenizer = build_tokenizer()
    target = save_model(tiny_llama(len(tokenizer), seed=1, max_positions=96), tokenizer,
                        tmp_path_factory.mktemp("small_window"))
    settings = ServerSettings(target=str(target), no_draft=True, max_tokens_limit=50)
    with ServerThread(create_app(verispec.load(target), settings)) as running:
        yield running.url


@pytest.mark.parametrize("num_prompt_tokens, expected", [(10, 50), (60, 96 - 60)])
def test_max_tokens_omitted_fills_the_window_up_to_the_limit(small_window_url,
                                                             num_prompt_tokens, expected):
    body = {"prompt": [5] * num_prompt_tokens, "temperature": 0}  # model omitted: the served one
    out = httpx.post(small_window_url + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["finish_reason"] == "length"
    assert out.json()["usage"]["completion_tokens"] == expected
    assert out.json()["speculation"]["num_draft_tokens"] == 0  # plain decoding: no draft


def test_chat_without_a_template_is_a_400_naming_the_option(small_window_url):
    """The small-window server's model has no chat template and none was named: its chat route
    refuses (text.chat.ChatTemplateMissing) rather than guessing a format; completions still
    work."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = httpx.post(small_window_url + "/v1/chat/completions", json=body, timeout=60)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["code"] == "unsupported_parameter"
    assert "--chat-template" in out.json()["error"]["message"]


# --- the CLI and the server agree ---------------------------------------------------------


def _cli_greedy(capsys, prompt: str, max_new_tokens: int, *model_args: str) -> dict:
    capsys.readouterr()
    status = cli.main(["generate", prompt, *model_args, "--temperature", "0",
                       "--max-new-tokens", str(max_new_tokens), "--json"])
    assert status == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_equals_cli_on_tiny_models(client, model_dirs, capsys):
    target, draft = model_dirs
    expected = _cli_greedy(capsys, PROMPT, 24, "--target", str(target), "--draft", str(draft))
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.usage.completion_tokens == len(expected["token_ids"])


@pytest.mark.slow
def test_greedy_equals_cli_on_the_demo_pair(capsys):
    # the pair ships in the package: a missing asset fails here (DemoAssetsMissingError)
    prompt = "import os\n\n\ndef read_lines(path):\n"
    expected = _cli_greedy(capsys, prompt, 32)
    with ServerThread(create_app(verispec.load(), ServerSettings())) as running:
        demo = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        out = demo.completions.create(model="verispec", prompt=prompt, max_tokens=32,
                                      temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.usage.completion_tokens == len(expected["token_ids"])
    assert out.model_extra["speculation"]["accepted"] == expected["metrics"]["num_accepted"]


# --- models, health, metrics --------------------------------------------------------------


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_openapi_documents_the_request_bodies(server):
    document = httpx.get(server.url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "max_tokens" in document["components"]["schemas"][model]["properties"]
    assert "ResponseFormat" in document["components"]["schemas"]  # a nested model, moved


def test_health_needs_no_key(server):
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["model"] == MODEL and body["speculative"] is True


def test_metrics(client, server):
    assert_serving(client)
    text = httpx.get(server.url + "/metrics").text
    values = metric_values(text)
    assert values['verispec_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    for name in ("verispec_generated_tokens_total", "verispec_prompt_tokens_total",
                 "verispec_drafted_tokens_total", "verispec_accepted_tokens_total",
                 'verispec_generations_total{outcome="completed"}',
                 'verispec_request_latency_seconds_count{endpoint="/v1/completions"}',
                 'verispec_time_to_first_token_seconds_count{endpoint="/v1/completions"}'):
        assert values[name] > 0, name
    assert 0 <= values["verispec_acceptance_rate"] <= 1
    assert 0 <= values['verispec_position_acceptance_rate{position="1"}'] <= 1
    assert "verispec_queue_depth" in values
    assert values["verispec_running_requests"] == 0  # nothing in flight between requests
    assert sum(v for name, v in values.items() if name.startswith("verispec_rounds_total")) > 0


# --- errors: the documented status and OpenAI error JSON, and the server keeps serving ------

GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_REQUESTS = {
    # name: (path, body (dict: JSON, bytes: raw), headers, status, code)
    "malformed_json": ("/v1/completions", b'{"prompt": "x",', None, 400, "invalid_json"),
    "nan_is_not_json": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, 400,
                        "invalid_json"),
    "wrong_type": ("/v1/completions", {**GOOD, "max_tokens": "lots"}, None, 422,
                   "validation_error"),
    "missing_prompt": ("/v1/completions", {"model": MODEL}, None, 422, "validation_error"),
    "body_not_an_object": ("/v1/completions", b"[1, 2]", None, 422, "validation_error"),
    "bad_role": ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot"}]}, None, 422,
                 "validation_error"),
    "negative_max_tokens": ("/v1/completions", {**GOOD, "max_tokens": -1}, None, 400,
                            "invalid_value"),
    "max_tokens_over_limit": ("/v1/completions", {**GOOD, "max_tokens": 2001}, None, 400,
                              "invalid_value"),
    "negative_temperature": ("/v1/completions", {**GOOD, "temperature": -0.5}, None, 400,
                             "invalid_value"),
    "top_p_zero": ("/v1/completions", {**GOOD, "top_p": 0}, None, 400, "invalid_value"),
    "top_p_above_one": ("/v1/completions", {**GOOD, "top_p": 1.5}, None, 400, "invalid_value"),
    "top_k_zero": ("/v1/completions", {**GOOD, "top_k": 0}, None, 400, "invalid_value"),
    "empty_stop": ("/v1/completions", {**GOOD, "stop": [""]}, None, 400, "invalid_value"),
    "n_zero": ("/v1/completions", {**GOOD, "n": 0}, None, 400, "invalid_value"),
    # max_batch_size=1 here: a request's choices (prompts x n) must fit in the batch together
    "n_two": ("/v1/completions", {**GOOD, "n": 2}, None, 400, "invalid_value"),
    "logprobs_over_20": ("/v1/completions", {**GOOD, "logprobs": 21}, None, 400,
                         "invalid_value"),
    "logprobs_not_an_integer": ("/v1/completions", {**GOOD, "logprobs": 2.5}, None, 400,
                                "invalid_value"),
    "logprobs_true_in_completions": ("/v1/completions", {**GOOD, "logprobs": True}, None, 400,
                                     "invalid_value"),
    "top_logprobs_over_20": ("/v1/chat/completions",
                             {**CHAT, "logprobs": True, "top_logprobs": 21}, None, 400,
                             "invalid_value"),
    "top_logprobs_without_logprobs": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2},
                                      None, 400, "invalid_value"),
    "presence_penalty_over_2": ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, None,
                                400, "invalid_value"),
    "frequency_penalty_under_minus_2": ("/v1/chat/completions",
                                        {**CHAT, "frequency_penalty": -3}, None, 400,
                                        "invalid_value"),
    "repetition_penalty_zero": ("/v1/completions", {**GOOD, "repetition_penalty": 0}, None,
                                400, "invalid_value"),
    "min_p_over_1": ("/v1/completions", {**GOOD, "min_p": 1.5}, None, 400, "invalid_value"),
    "logit_bias_key_not_an_id": ("/v1/completions", {**GOOD, "logit_bias": {"the": 5}}, None,
                                 400, "invalid_value"),
    "logit_bias_id_beyond_vocabulary": ("/v1/completions",
                                        {**GOOD, "logit_bias": {"99999": 5}}, None, 400,
                                        "invalid_value"),
    "logit_bias_over_100": ("/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, None, 400,
                            "invalid_value"),
    "max_tokens_zero_without_echo": ("/v1/completions", {**GOOD, "max_tokens": 0}, None, 400,
                                     "invalid_value"),
    "two_prompts": ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, None, 400,
                    "invalid_value"),
    "an_empty_prompt_among_several": ("/v1/completions", {**GOOD, "prompt": [[5], []]}, None,
                                      400, "empty_prompt"),
    "empty_prompt": ("/v1/completions", {**GOOD, "prompt": ""}, None, 400, "empty_prompt"),
    "empty_messages": ("/v1/chat/completions", {**CHAT, "messages": []}, None, 400,
                       "empty_prompt"),
    # a JSON \\ud800 escape decodes to a lone surrogate, which tokenizers reject (was a 500)
    "lone_surrogate_prompt": ("/v1/completions", b'{"prompt": "x\\ud800y", "max_tokens": 2}',
                              None, 400, "invalid_input"),
    "lone_surrogate_message": ("/v1/chat/completions",
                               b'{"messages": [{"role": "user", "content": "\\udcff"}]}', None,
                               400, "invalid_input"),
    "token_out_of_range": ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, None, 400,
                           "invalid_input"),
    "context_overflow": ("/v1/completions", {**GOOD, "prompt": [5] * 60, "max_tokens": 2000},
                         None, 400, "context_length_exceeded"),
    "unknown_model": ("/v1/completions", {**GOOD, "model": "gpt-4"}, None, 404,
                      "model_not_found"),
    "unknown_route": ("/v1/engines", GOOD, None, 404, "invalid_route"),
    "missing_api_key": ("/v1/completions", GOOD, {"Authorization": ""}, 401, "invalid_api_key"),
    "wrong_api_key": ("/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401,
                      "invalid_api_key"),
    "oversize_prompt": ("/v1/completions", {**GOOD, "prompt": "x = 1\n" * 60}, None, 413,
                        "prompt_too_large"),
    "oversize_token_prompt": ("/v1/completions", {**GOOD, "prompt": [5] * 65}, None, 413,
                              "prompt_too_large"),
    "oversize_body": ("/v1/completions", {**GOOD, "prompt": "x" * 20_000}, None, 413,
                      "request_too_large"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_error_json(name, http, client):
    path, body, headers, status, code = BAD_REQUESTS[name]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers=headers or {})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert_serving(client)


LONG_CHAT = {**CHAT, "messages": [{"role": "user", "content": "z " * 20}], "max_tokens": 2000}
# the values the library refuses (its configs, prompt and context checks): each a 400 whose
# param is the request's own field, as the library's error names it (ConfigError.field)
VALUE_ERRORS = {
    # name: (path, body, param)
    "presence_penalty": ("/v1/completions", {**GOOD, "presence_penalty": 2.5},
                         "presence_penalty"),
    "frequency_penalty": ("/v1/chat/completions", {**CHAT, "frequency_penalty": -3},
                          "frequency_penalty"),
    "min_p": ("/v1/completions", {**GOOD, "min_p": 1.5}, "min_p"),
    "top_k": ("/v1/completions", {**GOOD, "top_k": 0}, "top_k"),
    "top_p": ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    "temperature_negative": ("/v1/completions", {**GOOD, "temperature": -0.5}, "temperature"),
    "temperature_past_fp32": ("/v1/completions",
                              {**GOOD, "temperature": 1e39, "min_tokens": 2}, "temperature"),
    "seed_negative": ("/v1/completions", {**GOOD, "seed": -1}, "seed"),
    "seed_2_63": ("/v1/chat/completions", {**CHAT, "seed": 2**63}, "seed"),
    "repetition_penalty_zero": ("/v1/completions", {**GOOD, "repetition_penalty": 0},
                                "repetition_penalty"),
    "repetition_penalty_tiny": ("/v1/completions",  # a seen logit / 1e-40 was +inf: a 500
                                {**GOOD, "repetition_penalty": 1e-40, "temperature": 0},
                                "repetition_penalty"),
    "num_draft_tokens_zero": ("/v1/completions", {**GOOD, "num_draft_tokens": 0},
                              "num_draft_tokens"),
    "num_draft_tokens_33": ("/v1/chat/completions", {**CHAT, "num_draft_tokens": 33},
                            "num_draft_tokens"),
    "logit_bias_id_beyond_vocabulary": ("/v1/completions",
                                        {**GOOD, "logit_bias": {"99999": 5}}, "logit_bias"),
    "logit_bias_id_twice": ("/v1/completions", {**GOOD, "logit_bias": {"5": 1, "05": 2}},
                            "logit_bias"),
    "prompt_id_beyond_vocabulary": ("/v1/completions", {**GOOD, "prompt": [1, 99999]},
                                    "prompt"),
    "prompt_id_negative": ("/v1/completions", {**GOOD, "prompt": [1, -1]}, "prompt"),
    "echoed_prompt_id_beyond_vocabulary": ("/v1/completions",
                                           {**GOOD, "prompt": [1, 99999], "echo": True},
                                           "prompt"),
    "context_overflow": ("/v1/completions", {**GOOD, "prompt": [5] * 60, "max_tokens": 2000},
                         "prompt"),
    "chat_context_overflow": ("/v1/chat/completions", LONG_CHAT, "messages"),
    "min_tokens_with_a_grammar": ("/v1/completions", {**GOOD, "min_tokens": 1, "response_format":
                                                      {"type": "json_object"}}, "min_tokens"),
    "empty_prompt": ("/v1/completions", {**GOOD, "prompt": ""}, "prompt"),
    "empty_messages": ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
}


@pytest.mark.parametrize("name", list(VALUE_ERRORS))
def test_a_refused_value_names_its_request_field(name, http, client, reference):
    path, body, param = VALUE_ERRORS[name]
    if name == "chat_context_overflow":  # within --max-prompt-tokens, past the window with k
        num_prompt = len(reference.chat_prompt_ids(body["messages"]))
        assert 2048 - 2000 - CPU_DEFAULT_K < num_prompt <= SETTINGS.max_prompt_tokens
    for stream in (False, True):
        response = http.post(path, json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert_serving(client)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0
                      ).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"temperature": "hot"})
    assert_serving(client)


def test_every_table_row_is_an_openai_error():
    for cls, kind in ERROR_TABLE.items():
        assert kind.status is None or 400 <= kind.status < 600, cls
        assert kind.type and kind.code, cls
    assert error_kind(ServerOverloaded("busy")).status == 503


# --- disconnects and overload ---------------------------------------------------------------


def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "stream": stream}


def _cancelled_generations(server) -> float:
    values = metric_values(httpx.get(server.url + "/metrics").text)
    return values.get('verispec_generations_total{outcome="cancelled"}', 0.0)


def test_disconnect_mid_stream_frees_the_worker(server, http, client):
    cancelled_before = _cancelled_generations(server)
    with http.stream("POST", "/v1/completions", json=_long_body(stream=True)) as response:
        assert response.status_code == 200
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    # the connection is closed: the next request starts within a second and completes
    started = time.monotonic()
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True)
    next(iter(chunks))
    assert time.monotonic() - started < 1.0
    assert list(chunks)[-1].choices[0].finish_reason == "length"
    assert _cancelled_generations(server) == cancelled_before + 1


def test_disconnect_while_waiting_for_a_whole_response(server, client):
    cancelled_before = _cancelled_generations(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=_long_body(stream=False),
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3)
    started = time.monotonic()
    assert_serving(client)
    assert time.monotonic() - started < 1.5
    assert _cancelled_generations(server) == cancelled_before + 1


def test_queue_overflow_gets_503_and_the_queue_drains(server, http, client):
    """max_batch_size=1, max_queue=2: one running (a long stream), two waiting, the next one
    refused."""
    with http.stream("POST", "/v1/completions", json=_long_body(stream=True)) as running:
        lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)  # the long generation is on the worker now
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(httpx.post, server.url + "/v1/completions", json=GOOD,
                                   headers=http.headers, timeout=60) for _ in range(2)]
            wait_for(lambda: http.get("/health").json()["queue_depth"] == 2)
            refused = http.post("/v1/completions", json=GOOD)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            running.close()  # the client goes away: the waiting requests run
            assert [w.result(timeout=30).status_code for w in waiting] == [200, 200]
    assert_serving(client)


# --- settings and the serve command ---------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "seed": 3, "temperature": 0.5,
                         "logit_bias": {"7": 1.5}, "num_draft_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),  # max_tokens:
])  # what fits
def test_a_requests_settings_are_built_once_at_the_http_boundary(model_dirs, monkeypatch, path,
                                                                 body):
    # one RequestSettings a request, built on the event loop's side before the request is
    # queued (schemas: the library's own checks, a 400 before any work), and the very object
    # the decoder prepares the row from on the worker thread: no keyword list copied between
    # layers, no second construction
    from verispec.text.inputs import RequestSettings

    built, prepared = [], []
    post_init = RequestSettings.__post_init__

    def counted(self):
        built.append((self, threading.current_thread().name))
        post_init(self)

    monkeypatch.setattr(RequestSettings, "__post_init__", counted)
    decoder = verispec.load(*model_dirs, chat_template="plain")
    prepare = decoder.prepare

    def recorded(prompt, settings, *rest):
        prepared.append(settings)
        return prepare(prompt, settings, *rest)

    monkeypatch.setattr(decoder, "prepare", recorded)
    settings = ServerSettings(model_name=MODEL, chat_template="plain", max_tokens_limit=16)
    with ServerThread(create_app(decoder, settings)) as running:
        out = httpx.post(running.url + path, json=dict(body, model=MODEL), timeout=60)
    assert out.status_code == 200, out.text
    assert len(built) == 1 and built[0][1] != "verispec-generation"
    assert len(prepared) == 1 and prepared[0] is built[0][0]


def test_serve_flags_come_from_the_settings():
    args = cli.build_parser().parse_args(
        ["serve", "--target", "t", "--draft", "d", "--port", "0", "--k", "3", "--api-key", "s",
         "--max-queue", "5", "--max-tokens-limit", "7", "--model-name", "m",
         "--adaptive", "goodput", "--carry-over"])
    settings = ServerSettings.from_args(args)
    assert settings.adaptive == "goodput" and settings.carry_over
    assert adaptive_policy(settings) == verispec.GoodputPolicyConfig(carry_over=True)
    assert (settings.num_draft_tokens, settings.port, settings.api_key, settings.max_queue,
            settings.max_tokens_limit, settings.model_name) == (3, 0, "s", 5, 7, "m")
    assert settings.host == "127.0.0.1"
    assert args.handler.__name__ == "_serve"


def test_the_server_adapts_the_depth_by_default_and_fixed_keeps_k():
    assert ServerSettings().depth_policy == "goodput-plain"
    assert adaptive_policy(ServerSettings()) == verispec.GoodputPolicyConfig(
        min_num_draft_tokens=0)
    assert ServerSettings(adaptive="fixed").depth_policy is None
    assert adaptive_policy(ServerSettings(adaptive="fixed")) is None
    assert ServerSettings(target="t", no_draft=True).depth_policy is None
    assert ServerSettings(adaptive="threshold").depth_policy == "threshold"


@pytest.mark.parametrize("kwargs", [dict(draft="d"), dict(target="t"), dict(max_queue=0),
                                    dict(num_draft_tokens=0), dict(num_draft_tokens=33),
                                    dict(port=70000),
                                    dict(api_key=""), dict(adaptive="fastest"),
                                    dict(target="t", no_draft=True, adaptive="goodput"),
                                    dict(carry_over=True, adaptive="fixed"),
                                    dict(suffix=True, no_draft=True),
                                    dict(target="t", draft="d", suffix=True),
                                    dict(hybrid=True, suffix=True),
                                    dict(hybrid=True, no_draft=True),
                                    dict(target="t", hybrid=True)])
def test_bad_settings_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        ServerSettings(**kwargs)


@pytest.mark.parametrize("name, value", [("port", "80"), ("num_draft_tokens", "3"),
                                         ("num_draft_tokens", True), ("max_queue", None),
                                         ("suffix", 1), ("target", 3)])
def test_settings_of_the_wrong_kind_name_the_field(name, value):
    """Settings built in Python (create_app's second argument): a ConfigError naming the
    field, not a TypeError from a comparison."""
    with pytest.raises(ConfigError, match=f"^{name}={value!r} is invalid: expected "):
        ServerSettings(**{name: value})


def test_settings_take_paths_and_the_devices_default_depth():
    settings = ServerSettings(target=Path("t"), draft=Path("d"))
    assert settings.target == Path("t") and settings.num_draft_tokens is None


@pytest.mark.parametrize("kwargs, expected", [
    ({}, f"draft model, goodput-plain depth from k = {CPU_DEFAULT_K} by default on cpu"),
    ({"adaptive": "fixed", "num_draft_tokens": 3}, "draft model, k = 3"),
    ({"suffix": True, "num_draft_tokens": 2, "adaptive": "fixed"}, "suffix drafting, k = 2"),
    ({"hybrid": True}, f"hybrid drafting, goodput-plain depth from k = {CPU_DEFAULT_K} by "
                       "default on cpu"),
    ({"adaptive": "goodput", "num_draft_tokens": 1}, "draft model, goodput depth from k = 1"),
    ({"hybrid": True, "hybrid_lookup": "suffix", "hybrid_chain": True, "draft_p_min": 0.5,
      "adaptive": "fixed", "num_draft_tokens": 4},
     "hybrid drafting (suffix lookup, chained), draft-p-min 0.5, k = 4"),
    ({"no_draft": True}, "plain decoding"),
])
def test_startup_line_says_how_requests_are_decoded(model_dirs, kwargs, expected):
    from verispec.server.run import describe_decoding, load_decoder

    target_only = kwargs.get("suffix") or kwargs.get("no_draft")
    settings = ServerSettings(target=str(model_dirs[0]),
                              draft=None if target_only else str(model_dirs[1]), **kwargs)
    assert describe_decoding(load_decoder(settings), settings) == expected


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_former_ngram_flag_is_an_alias_of_suffix_that_says_so(command, capsys):
    args = cli.build_parser().parse_args([command, "--ngram"] + (["x"] if command == "generate"
                                                                   else []))
    assert args.suffix is True
    assert "--ngram is a deprecated alias of --suffix" in capsys.readouterr().err
    assert cli.build_parser().parse_args([command, "--suffix"] + (
        ["x"] if command == "generate" else [])).suffix is True
    assert "deprecated" not in capsys.readouterr().err  # the new flag says nothing


def test_the_former_ngram_setting_warns_and_sets_suffix():
    with pytest.warns(DeprecationWarning, match=r"ServerSettings\(suffix=\.\.\.\)"):
        settings = ServerSettings(ngram=True, num_draft_tokens=2)
    assert settings.suffix is True
    assert ServerSettings(num_draft_tokens=2).suffix is False


@pytest.mark.parametrize("flag", ["--suffix", "--hybrid"])
def test_serve_lookup_flags_and_a_server_drafting_by_lookup(flag):
    args = cli.build_parser().parse_args(["serve", flag, "--k", "2"])
    settings = ServerSettings.from_args(args)
    assert (settings.suffix, settings.hybrid) == (flag == "--suffix", flag == "--hybrid")
    from verispec.server.run import load_decoder

    decoder = load_decoder(settings)  # the demo target; its draft model only with --hybrid
    if flag == "--suffix":
        assert decoder.draft is None and decoder.model_free is not None
    else:
        assert decoder.draft is not None and decoder.hybrid is not None
    prompt = "def f(x):\n    return x\ndef f(x):"
    expected = decoder.generate(prompt, max_new_tokens=24, speculative=False).text
    with ServerThread(create_app(decoder, settings)) as running:
        out = httpx.post(running.url + "/v1/completions", timeout=60,
                         json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == expected
    assert out.json()["speculation"]["num_draft_tokens"] == 2


def test_settings_are_frozen():
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    settings = ServerSettings.from_args(parser.parse_args([]))
    assert settings == ServerSettings()
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]


# --- `verispec serve` itself: the address is bound first, then the models load ------------


def _serve_error(argv: list[str], capsys) -> str:
    """Run ``verispec serve`` in-process; assert exit 2 with one line; return the line."""
    capsys.readouterr()
    status = cli.main(["serve", *argv])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err, (status, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("verispec: error: "), err
    return err


def test_serve_reports_a_held_port_and_a_bad_host(capsys):
    missing = ["--target", "/nonexistent/t", "--draft", "/nonexistent/d"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = _serve_error(["--port", str(port), *missing], capsys)
    assert f"127.0.0.1:{port}" in err and "--port" in err
    err = _serve_error(["--host", "no-such-host.invalid", "--port", "0", *missing], capsys)
    assert "host='no-such-host.invalid'" in err and "does not resolve" in err


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["foreground", "background-job"])
def test_serve_command_serves_on_the_port_it_prints(model_dirs, sigint_ignored):
    """The console script end to end: --port 0 binds a free port, the startup line names it,
    the openai client gets the library's completion there, and Ctrl-C (SIGINT) shuts it down
    gracefully with status 0, whether or not the process started with SIGINT ignored (a
    background job's, as under `make test &`)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("verispec")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [str(script), "serve", "--target", str(model_dirs[0]), "--draft", str(model_dirs[1]),
         "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored
        else None)
    try:
        line = process.stdout.readline()  # printed once the models are loaded
        assert line.startswith("verispec: serving 'verispec' on http://127.0.0.1:"), (
            line, process.stderr.read() if process.poll() is not None else "")
        assert (f"(draft model, goodput-plain depth from k = {CPU_DEFAULT_K} by default on "
                "cpu; API key not required" in line)
        url = line.split(" on ")[1].split()[0]
        assert not url.endswith(":0")
        demo = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=3, timeout=60)
        out = demo.completions.create(model="verispec", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
        expected = verispec.load(*model_dirs).generate(PROMPT, max_new_tokens=8)
        assert out.choices[0].text == expected.text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        err = process.stderr.read()
        assert "Traceback" not in err and "Application shutdown complete" in err, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
