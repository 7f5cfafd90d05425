"""The server's continuous batching: a real uvicorn on 127.0.0.1, concurrent clients.

Concurrent greedy requests are decoded in one batch (the worker's rounds carry several rows)
and each one's text equals the same request sent alone; a client that disconnects mid-stream
frees its row within a round or so; requests beyond the batch size wait and still succeed;
/metrics counts the rounds by depth and the rows over them. Several choices in one request (a
list of prompts, ``n``) are rows of their own: a greedy choice equals its prompt alone, a
seeded choice i its prompt alone with seed + i; a stream carries each under its index, usage
counts each prompt once, a disconnect frees them all, and one bad prompt fails the request.
"""
# ruff: noqa: F811 (the tests take live_server's module fixture model_dirs by name)

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest

import verispec
from verispec.server import ServerSettings, create_app
from verispec.server import worker as worker_module
from verispec.server.worker import Event, GenerationWorker, Job
from verispec.text.stream import Completion

import live_server
from live_server import (  # noqa: F401 (model_dirs: a fixture)
    ServerThread,
    metric_values,
    model_dirs,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "x = [", "import os\n\nclass Stack:\n", "for i in range(3):",
           "while True:", "print('hello')"]
SETTINGS = ServerSettings(model_name=MODEL, max_tokens_limit=2000, max_batch_size=4,
                          max_queue=16)


@pytest.fixture(scope="module")
def server(model_dirs):
    decoder = verispec.load(*model_dirs, chat_template="plain")
    with ServerThread(create_app(decoder, SETTINGS)) as running:
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


def _round_counts(server) -> tuple[dict[int, float], dict[int, float], float]:
    """/metrics' rounds and rows by depth, and the running requests."""
    values = metric_values(httpx.get(server.url + "/metrics").text)
    by_depth = {"verispec_rounds_total": {}, "verispec_round_rows_total": {}}
    for name, value in values.items():
        metric, _, label = name.partition('{draft_tokens="')
        if metric in by_depth:
            by_depth[metric][int(label.rstrip('"}'))] = value
    return (by_depth["verispec_rounds_total"], by_depth["verispec_round_rows_total"],
            values["verispec_running_requests"])


def test_metrics_count_the_batch_rounds_by_depth_and_their_rows(server, client):
    worker = server.server.config.app.state.worker
    rounds_before, rows_before, _ = _round_counts(server)
    worker_rounds_before = worker.num_rounds
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(lambda p: _stream_text(client, p), PROMPTS))
    rounds_after, rows_after, running = _round_counts(server)
    rounds = {k: n - rounds_before.get(k, 0) for k, n in rounds_after.items()}
    rows = {k: n - rows_before.get(k, 0) for k, n in rows_after.items()}
    assert sum(rounds.values()) == worker.num_rounds - worker_rounds_before > 0
    assert all(0 <= k <= 32 for k in rounds)
    assert any(k > 0 and n > 0 for k, n in rounds.items())  # a draft: some rounds drafted
    assert all(rounds[k] <= rows[k] <= SETTINGS.max_batch_size * rounds[k] for k in rounds)
    assert sum(rows.values()) / sum(rounds.values()) > 1.5  # batched
    assert running == 0


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


# --- several choices in one request (a list of prompts, n): each choice a row of the batch --

TWO_PROMPTS = [PROMPTS[0], PROMPTS[2]]


def _alone(client, prompt, **settings):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **settings)
    return out.choices[0].text, out.usage


def test_several_prompts_with_n_choices_each_equal_their_prompts_alone(server, client):
    alone = [_alone(client, prompt, temperature=0) for prompt in TWO_PROMPTS]
    out = client.completions.create(model=MODEL, prompt=TWO_PROMPTS, n=2, max_tokens=12,
                                    temperature=0)
    assert [choice.index for choice in out.choices] == [0, 1, 2, 3]
    # choice i answers prompt i // n
    assert [choice.text for choice in out.choices] == [alone[i // 2][0] for i in range(4)]
    assert all(choice.finish_reason == "length" for choice in out.choices)
    assert out.usage.prompt_tokens == sum(usage.prompt_tokens for _, usage in alone)
    assert out.usage.completion_tokens == 2 * sum(usage.completion_tokens for _, usage in alone)
    speculation = out.model_extra["speculation"]  # over all four choices
    assert speculation["num_rounds"] >= 4 and 0 <= speculation["accepted"] <= speculation[
        "drafted"]
    assert server.server.config.app.state.worker.num_running == 0


def test_seeded_choices_stream_under_their_index_as_seed_plus_index_alone(server, client):
    settings = {"temperature": 1.0, "top_p": 0.9}
    alone, usages = zip(*[_alone(client, TWO_PROMPTS[0], seed=5 + i, **settings) for i in range(3)])
    texts, finished = defaultdict(str), {}
    stream = client.completions.create(model=MODEL, prompt=TWO_PROMPTS[0], n=3, max_tokens=12,
                                       seed=5, stream=True,
                                       stream_options={"include_usage": True}, **settings)
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice a chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = chunk.model_extra["speculation"]
    assert tuple(texts[i] for i in range(3)) == alone
    assert len(set(alone)) > 1  # three seeds: the choices are not copies of one another
    assert sorted(finished) == [0, 1, 2]  # each choice ends once, with its own summary
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(
        usage.completion_tokens for usage in usages)
    assert chunks[-1].usage.prompt_tokens == usages[0].prompt_tokens  # one prompt, counted once


def test_chat_with_n_returns_n_messages(server, client):
    messages = [{"role": "user", "content": "Say hi."}]
    alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0).choices[0].message.content
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         temperature=0, n=2)
    assert [(c.index, c.message.role, c.message.content) for c in out.choices] == [
        (0, "assistant", alone), (1, "assistant", alone)]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0, n=2, stream=True))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]  # each choice opens with its role
    texts = defaultdict(str)
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == {0: alone, 1: alone}


def test_a_disconnect_frees_every_choice(server, client):
    worker = server.server.config.app.state.worker
    body = {"model": MODEL, "prompt": TWO_PROMPTS, "n": 2, "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines)[6:])["choices"]
            assert worker.num_running == 4  # the response starts once every choice has joined
        deadline = time.monotonic() + 10
        while worker.num_running:
            assert time.monotonic() < deadline, "the disconnected choices were not freed"
            time.sleep(0.02)
    assert _alone(client, TWO_PROMPTS[1], temperature=0)[0]  # still serving


def test_one_bad_prompt_fails_the_request_and_frees_the_others(server, client):
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model=MODEL, prompt=[TWO_PROMPTS[0], "x " * 3000], n=2,
                                  max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
    assert raised.value.status_code == 413  # the second prompt is over --max-prompt-tokens
    assert "--max-prompt-tokens" in raised.value.message
    worker = server.server.config.app.state.worker
    deadline = time.monotonic() + 10
    while worker.num_running or worker.queue_depth:
        assert time.monotonic() < deadline, "the bad request's other choices kept running"
        time.sleep(0.02)
    assert _alone(client, TWO_PROMPTS[1], temperature=0)[0]


@pytest.mark.parametrize("body, code", [
    ({"prompt": TWO_PROMPTS, "n": 3}, "invalid_value"),  # 6 choices; 4 fit in the batch
    ({"prompt": "x", "n": 0}, "invalid_value"),
    ({"prompt": "x", "n": 2, "seed": 2**63 - 1}, "invalid_value"),  # choice 1: seed 2**63
    ({"prompt": "x", "n": 2, "best_of": 2}, "unsupported_parameter"),
])
def test_choices_beyond_what_the_server_takes_get_a_400(server, client, body, code):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code
    assert _alone(client, TWO_PROMPTS[0], temperature=0)[0]


class _RecordedWorker:
    """A GenerationWorker over ``decoder`` (prefill budget 8, batch of 4) whose cross-thread
    posts are recorded in order (its module's post_all), on a real event loop in a thread; its
    finish hook records ``(None, "finished", completion)`` in the same order."""

    SETTINGS = {"temperature": 0.0, "ignore_eos": True}

    def __init__(self, decoder, monkeypatch) -> None:
        self.order: list[tuple[Job, Event, object]] = []
        original = worker_module.post_all

        def recording(posts):
            self.order.extend(posts)
            original(posts)

        monkeypatch.setattr(worker_module, "post_all", recording)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.worker = GenerationWorker(
            decoder, max_queue=8,
            options=replace(decoder.batch_options, max_batch_size=4, prefill_budget=8),
            on_finish=lambda row, outcome: self.order.append((None, "finished", row.completion)))

    def __enter__(self):
        self.thread.start()
        self.worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.worker.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def submit(self, prompt: str, max_tokens: int) -> Job:
        job = Job(lambda batch: batch.prepare(prompt, max_new_tokens=max_tokens,
                                              **self.SETTINGS), self.loop)
        self.worker.submit_all([job])
        return job

    def posted(self, job: Job, event: Event) -> bool:
        return any(posted is job and kind is event for posted, kind, _ in list(self.order))

    def completion(self, job: Job) -> Completion:
        return next(value for posted, kind, value in list(self.order)
                    if posted is job and kind is Event.DONE)

    @staticmethod
    def wait_for(condition) -> None:
        live_server.wait_for(condition, timeout=60)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_row_streams(model_dirs,
                                                                             monkeypatch):
    # prefill budget 8: a ~90-token prompt arriving while a row streams goes in 8 tokens a gap
    # (engine/prefill.py) while the running row gets its rounds (a delta in most: some hold
    # text back; admitted whole, the prompt would start within a round); both texts equal the
    # same requests alone
    decoder = verispec.load(*model_dirs, chat_template="plain")
    long_prompt = " ".join(PROMPTS)
    with _RecordedWorker(decoder, monkeypatch) as recorded:
        short = recorded.submit(PROMPTS[0], 160)
        recorded.wait_for(lambda: recorded.posted(short, Event.DELTA))
        submitted = len(recorded.order)
        long = recorded.submit(long_prompt, 8)
        recorded.wait_for(lambda: recorded.posted(short, Event.DONE)
                          and recorded.posted(long, Event.DONE))
    order = recorded.order
    num_prompt_tokens = len(decoder.tokenizer.encode(long_prompt))
    started = next(i for i, (posted, event, _) in enumerate(order)
                   if posted is long and event is Event.STARTED)
    rounds_meanwhile = sum(1 for posted, event, _ in order[submitted:started]
                           if posted is short and event is Event.DELTA)
    assert num_prompt_tokens > 80 and rounds_meanwhile >= (num_prompt_tokens - 1) // 8 // 2
    settings = _RecordedWorker.SETTINGS
    assert recorded.completion(long).text == decoder.generate(long_prompt, max_new_tokens=8,
                                                              **settings).text
    assert recorded.completion(short).text == decoder.generate(PROMPTS[0], max_new_tokens=160,
                                                               **settings).text


def test_a_request_cancelled_while_its_prompt_is_prefilled_in_chunks_never_joins(model_dirs,
                                                                                monkeypatch):
    decoder = verispec.load(*model_dirs, chat_template="plain")
    # the long prompt needs ~90 gaps, the short row runs 300 tokens: the cancel comes while
    # the prompt is still going in, and the next gap drops it
    with _RecordedWorker(decoder, monkeypatch) as recorded:
        short = recorded.submit(PROMPTS[0], 300)
        recorded.wait_for(lambda: recorded.posted(short, Event.DELTA))
        long = recorded.submit(" ".join(PROMPTS * 8), 8)
        recorded.wait_for(lambda: recorded.worker.num_prefilling == 1)
        long.cancel()  # the client went away
        recorded.wait_for(lambda: recorded.worker.num_prefilling == 0)
        recorded.wait_for(lambda: recorded.posted(short, Event.DONE))
        recorded.wait_for(lambda: not recorded.worker.busy)
    assert not recorded.posted(long, Event.STARTED) and not recorded.posted(long, Event.ERROR)


def test_a_rows_books_close_before_its_end_is_posted(model_dirs, monkeypatch):
    # a client that has read its row's end must find the worker (num_running) and /metrics
    # (the finish hook) already without that row: the CI run on 03396a1 read num_running == 1
    decoder = verispec.load(*model_dirs, chat_template="plain")
    with _RecordedWorker(decoder, monkeypatch) as recorded:
        jobs = [recorded.submit(prompt, tokens) for prompt, tokens in zip(PROMPTS, (3, 9, 5))]
        recorded.wait_for(lambda: all(recorded.posted(job, Event.DONE) for job in jobs))
    for job in jobs:
        completion = recorded.completion(job)
        finished, done = (next(i for i, (_, kind, value) in enumerate(recorded.order)
                               if kind == event and value is completion)
                          for event in ("finished", Event.DONE))
        assert finished < done
