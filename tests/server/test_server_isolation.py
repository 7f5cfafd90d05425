"""No request can fail another: a real uvicorn on 127.0.0.1 serving the demo pair.

Two clients stream long completions (greedy, and seeded sampled) while others send requests
that fail on faults of their own, all at once, as batch mates of those streams: a grammar with
a dead end (streamed and not), a repetition_penalty small enough to overflow a logit (refused
up front once the settings are bounded, else a NonFiniteError of that row's own), and
low-temperature sampled requests on the default block rule (T = 0.1, 64 tokens, k = 4: they
failed in the block rule's arithmetic until its fix, and must succeed or fail alone either
way). The long streams must end with the texts they have alone, each faulty request gets its
own error (an error status with the OpenAI error body, or an error event in its stream), and
the server goes on serving: a greedy request afterwards returns the reference text, and no row
is left running. A fault of the work every request shares (the target's pass, made to fail
once) ends each request of the batch with a 500 batch_failed, and the next requests are served
as before.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from verispec.engine.scorer import TargetScorer
from verispec.server import ServerSettings, create_app
from verispec.server.run import load_decoder

from live_server import ServerThread, wait_for

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "demo"
SETTINGS = ServerSettings(model_name=MODEL, max_batch_size=8, max_queue=16,
                          max_tokens_limit=1000)
LONG = {  # the innocent streams: each runs through every faulty request
    "greedy": {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 960,
               "temperature": 0, "ignore_eos": True},
    "seeded": {"model": MODEL, "prompt": "class Stack:\n", "max_tokens": 960,
               "temperature": 1.0, "seed": 3, "ignore_eos": True},
}
SHORT = {"model": MODEL, "prompt": "import os\n", "max_tokens": 32, "temperature": 0}
# "a", then a rule that can never end: the grammar allows no token after the first
DEAD_END = {"type": "grammar", "grammar": 'start: "a" x\nx: x "b"'}
FAULTY = {
    "dead_end_grammar": {"prompt": "x = ", "max_tokens": 16, "response_format": DEAD_END},
    "tiny_repetition_penalty": {"prompt": "def add(a, b):", "max_tokens": 16,
                                "repetition_penalty": 1e-38},
}
LOW_TEMPERATURE = {"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0.1,
                   "num_draft_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(load_decoder(SETTINGS), SETTINGS)) as running:
        yield running


def _events(response: httpx.Response) -> Iterator[dict | str]:
    """A stream's server-sent events as they come: each JSON payload, and "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:] if line == "data: [DONE]" else json.loads(line[6:])


def _streamed(url: str, body: dict, first_chunk: threading.Event | None = None
              ) -> tuple[str, dict | None]:
    """(text, the error event or None) of a streamed completion."""
    text, error = "", None
    with httpx.Client(base_url=url, timeout=120) as http, http.stream(
            "POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for event in _events(response):
            if event == "[DONE]":
                return text, error
            if "error" in event:
                error = event["error"]
                continue
            text += "".join(choice["text"] for choice in event["choices"])
            if first_chunk is not None:
                first_chunk.set()
    raise AssertionError(f"the stream ended without [DONE] after {text!r:.80}")


def _assert_own_error(error: dict) -> None:
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    assert error["code"] != "batch_failed", error  # its own fault, not its batch's


def _send_faulty(url: str, name: str, stream: bool) -> None:
    body = {"model": MODEL, **FAULTY[name]}
    if stream:
        _, error = _streamed(url, body)
        assert error is not None, name
        _assert_own_error(error)
        return
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code in (400, 500), (name, response.text)
    _assert_own_error(response.json()["error"])


def _send_low_temperature(url: str) -> None:
    _, error = _streamed(url, {"model": MODEL, **LOW_TEMPERATURE})
    if error is not None:  # the block rule's fault (until fixed) is the request's own
        _assert_own_error(error)


def _start_long_streams(url: str) -> tuple[dict[str, tuple[str, dict | None]],
                                           list[threading.Thread]]:
    """The LONG streams on threads, returned once each has its first chunk: their results
    (text, error event) fill the dict as they end."""
    results: dict[str, tuple[str, dict | None]] = {}
    started = {name: threading.Event() for name in LONG}
    streams = [threading.Thread(target=lambda name=name: results.update(
        {name: _streamed(url, LONG[name], started[name])})) for name in LONG]
    for stream in streams:
        stream.start()
    assert all(event.wait(120) for event in started.values())
    return results, streams


def test_faulty_requests_fail_alone_and_their_batch_mates_stream_on(server):
    alone = {name: _streamed(server.url, body)[0] for name, body in LONG.items()}
    reference = httpx.post(server.url + "/v1/completions", json=SHORT,
                           timeout=120).json()["choices"][0]["text"]
    results, streams = _start_long_streams(server.url)
    faulty = [lambda: _send_faulty(server.url, "dead_end_grammar", stream=False),
              lambda: _send_faulty(server.url, "dead_end_grammar", stream=True),
              lambda: _send_faulty(server.url, "tiny_repetition_penalty", stream=False)]
    faulty += [lambda: _send_low_temperature(server.url)] * 3
    with ThreadPoolExecutor(len(faulty)) as pool:  # batch mates of the streams and each other
        for future in [pool.submit(send) for send in faulty]:
            future.result()
    overlapped = all(stream.is_alive() for stream in streams)
    for stream in streams:
        stream.join(300)
    assert results == {name: (text, None) for name, text in alone.items()}
    assert overlapped, "a long stream ended before the faulty requests did: nothing was tested"
    # still serving: the reference text, and nothing left running
    after = httpx.post(server.url + "/v1/completions", json=SHORT, timeout=120)
    assert after.json()["choices"][0]["text"] == reference
    worker = server.server.config.app.state.worker
    wait_for(lambda: worker.num_running == 0, timeout=30)


def test_a_dead_end_grammar_gets_a_400_naming_response_format(server):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL, **FAULTY["dead_end_grammar"]}, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "response_format" in error["message"]
    assert error["param"] == "response_format"


def test_a_fault_of_the_shared_pass_ends_each_request_of_the_batch_with_a_500(server,
                                                                               monkeypatch):
    # the target's pass is the work every row shares: its fault ends the whole batch, each
    # request with batch_failed naming the cause's type, and the next batch serves as before
    reference = httpx.post(server.url + "/v1/completions", json=SHORT,
                           timeout=120).json()["choices"][0]["text"]
    results, streams = _start_long_streams(server.url)
    score, failed = TargetScorer.score, []

    def failing_once(self, *args, **kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError("the target's pass failed (injected)")
        return score(self, *args, **kwargs)

    monkeypatch.setattr(TargetScorer, "score", failing_once)
    for stream in streams:
        stream.join(300)
    assert failed
    for name, (_, error) in results.items():
        assert error is not None and error["code"] == "batch_failed", (name, error)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    monkeypatch.undo()
    after = httpx.post(server.url + "/v1/completions", json=SHORT, timeout=120)
    assert after.json()["choices"][0]["text"] == reference
