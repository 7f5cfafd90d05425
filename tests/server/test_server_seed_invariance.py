"""Seed invariance through the server: a real uvicorn on 127.0.0.1, the official openai client.

A seeded sampled request's text is a function of (model, prompt, seed, sampling settings) alone
(verispec.sample.seeded): sent to a speculative server under an adaptive depth policy while 8 other
clients keep it busy (greedy, unseeded and other seeds' requests, streaming or not, joining and
leaving its batch), it returns the text that the same request gets alone from a plain server
(no draft), streamed or not. Its reply names the server's depth policy, not "fixed": a seeded
request follows the policy like any other.

The demo pair: a real draft that agrees with its target often, so rounds keep several tokens.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from verispec.server import ServerSettings, create_app
from verispec.server.run import load_decoder
from verispec.text.demo import heldout_prompts

from live_server import ServerThread, wait_for

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "demo"
POLICY = "goodput"
NUM_OTHER_CLIENTS = 8
SEEDED = [  # (prompt index, completion settings); T 0.7 throughout
    (0, dict(seed=11, max_tokens=24)),
    (1, dict(seed=12, max_tokens=20, top_p=0.9)),
    (2, dict(seed=2**63 - 1, max_tokens=24, extra_body={"num_draft_tokens": 8})),
    (3, dict(seed=0, max_tokens=16, extra_body={"top_k": 40})),
]


def _server(settings: ServerSettings) -> ServerThread:
    """The app `verispec serve` would run with these settings (the demo pair: no --target)."""
    return ServerThread(create_app(load_decoder(settings), settings))


@pytest.fixture(scope="module")
def speculative_server():
    settings = ServerSettings(model_name=MODEL, adaptive=POLICY, max_batch_size=12,
                              max_queue=32)
    with _server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server():
    with _server(ServerSettings(model_name=MODEL, no_draft=True)) as running:
        yield running


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _complete(client, prompt: str, stream: bool, **settings) -> tuple[str, dict]:
    """A completion's text and its speculation summary (a stream's from its finishing chunk)."""
    settings.setdefault("temperature", 0.7)
    if not stream:
        out = client.completions.create(model=MODEL, prompt=prompt, **settings)
        return out.choices[0].text, out.model_extra["speculation"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **settings))
    return "".join(chunk.choices[0].text for chunk in chunks), chunks[-1].model_extra[
        "speculation"]


OTHER_REQUESTS = [  # what the other clients send, in turn
    dict(temperature=0.0, max_tokens=24),
    dict(temperature=1.0, max_tokens=32),
    dict(temperature=1.0, top_p=0.9, seed=5, max_tokens=12),
    dict(temperature=0.7, max_tokens=40, extra_body={"num_draft_tokens": 1}),
    dict(temperature=0.0, max_tokens=8, extra_body={"num_draft_tokens": 6}),
]


def _keep_busy(client, prompts: list[str], client_index: int, stop: threading.Event) -> int:
    """One other client: requests one after another until ``stop``; -> how many it sent."""
    sent = 0
    while not stop.is_set():
        settings = OTHER_REQUESTS[(client_index + sent) % len(OTHER_REQUESTS)]
        _complete(client, prompts[(client_index * 7 + sent) % len(prompts)],
                  stream=(client_index + sent) % 2 == 1, **settings)
        sent += 1
    return sent


@pytest.mark.slow
def test_a_seeded_request_among_eight_clients_equals_the_plain_server_alone(
        speculative_server, plain_server):
    prompts = heldout_prompts()
    plain = _client(plain_server)
    expected = [_complete(plain, prompts[index], stream=False, **settings)[0]
                for index, settings in SEEDED]
    for (index, settings), text in zip(SEEDED, expected):  # the plain server streams it alike
        assert _complete(plain, prompts[index], stream=True, **settings)[0] == text
    assert len(set(expected)) == len(expected) and all(expected)

    client = _client(speculative_server)
    worker = speculative_server.server.config.app.state.worker
    stop = threading.Event()
    with ThreadPoolExecutor(NUM_OTHER_CLIENTS) as pool:
        others = [pool.submit(_keep_busy, client, prompts[10:], i, stop)
                  for i in range(NUM_OTHER_CLIENTS)]
        try:
            wait_for(lambda: worker.num_running >= NUM_OTHER_CLIENTS // 2, timeout=60)
            rounds_before, rows_before = worker.num_rounds, worker.num_row_rounds
            for stream in (False, True):
                for (index, settings), text in zip(SEEDED, expected):
                    got, speculation = _complete(client, prompts[index], stream, **settings)
                    assert got == text, (stream, settings)
                    assert speculation["depth_policy"] == POLICY
            rounds = worker.num_rounds - rounds_before
            rows = worker.num_row_rounds - rows_before
        finally:
            stop.set()
        assert all(future.result() >= 1 for future in others)
    assert rows / rounds > 3, f"{rows} row-rounds over {rounds} rounds: hardly batched"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_seeded_request_reports_the_servers_depth_policy(speculative_server, plain_server,
                                                           stream):
    prompt = heldout_prompts()[4]
    for settings in (dict(seed=7), dict(seed=7, top_p=0.9), dict()):
        _, speculation = _complete(_client(speculative_server), prompt, stream, max_tokens=8,
                                   **settings)
        assert speculation["depth_policy"] == POLICY, settings
    _, speculation = _complete(_client(plain_server), prompt, stream, max_tokens=8, seed=7)
    assert speculation["depth_policy"] == "fixed" and speculation["num_draft_tokens"] == 0
