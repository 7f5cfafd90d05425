"""The server's continuous batching: a real uvicorn on 127.0.0.1, concurrent clients.

Concurrent greedy requests are decoded in one batch (the worker's rounds carry several rows)
and each one's text equals the same request sent alone; a client that disconnects mid-stream
frees its row within a round or so; requests beyond the batch size wait and still succeed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import verispec
from verispec.server import ServerSettings, create_app

from test_server import ServerThread, model_dirs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "x = [", "import os\n\nclass Stack:\n", "for i in range(3):",
           "while True:", "print('hello')"]
SETTINGS = ServerSettings(model_name=MODEL, max_tokens_limit=2000, max_batch_size=4,
                          max_queue=16)


@pytest.fixture(scope="module")
def server(model_dirs):
    with ServerThread(create_app(verispec.load(*model_dirs), SETTINGS)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _stream_text(client, prompt: str, max_tokens: int = 40) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def test_concurrent_greedy_requests_are_batched_and_equal_each_alone(server, client):
    alone = [_stream_text(client, prompt) for prompt in PROMPTS]
    worker = server.server.config.app.state.worker
    rounds_before, rows_before = worker.num_rounds, worker.num_row_rounds
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _stream_text(client, p), PROMPTS))
    assert together == alone
    rounds, rows = worker.num_rounds - rounds_before, worker.num_row_rounds - rows_before
    assert rows / rounds > 1.5, f"{rows} row-rounds over {rounds} rounds: not batched"
    assert worker.num_running == 0


def test_a_disconnect_frees_its_row(server, client):
    worker = server.server.config.app.state.worker
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)
            assert worker.num_running == 1
        deadline = time.monotonic() + 10
        while worker.num_running:
            assert time.monotonic() < deadline, "the disconnected row was not freed"
            time.sleep(0.02)
        assert http.get("/health").json()["running"] == 0
    assert _stream_text(client, PROMPTS[1], max_tokens=4)  # still serving


def test_requests_beyond_the_batch_size_wait_and_succeed(server, client):
    prompts = PROMPTS + PROMPTS[:4]  # 10 requests, 4 rows at a time
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: _stream_text(client, p, max_tokens=12), prompts))
    assert texts[:4] == texts[len(PROMPTS):]
    assert all(texts)


def test_a_bad_request_joining_with_others_gets_its_error_and_they_go_on(server, client):
    # requests sent together join in one gap between rounds: each is checked on its own, the
    # over-long prompt gets its 413 and the others join (one prefill) and decode as alone
    alone = [_stream_text(client, prompt, max_tokens=12) for prompt in PROMPTS[:3]]

    def send(prompt: str) -> str | int:
        try:
            return _stream_text(client, prompt, max_tokens=12)
        except openai.APIStatusError as exc:
            return exc.status_code

    prompts = [PROMPTS[0], "x " * 3000, PROMPTS[1], PROMPTS[2]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(send, prompts))
    assert results == [alone[0], 413, alone[1], alone[2]]
    assert server.server.config.app.state.worker.num_running == 0
