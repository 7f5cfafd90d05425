"""What a hostile client found in ``verispec serve``, each defect reproduced and kept fixed.

The numbers follow the issue's list: 1 DNS rebinding and cross-site requests, 2 slowloris,
3 overload replies and logs, 4 deeply nested JSON, 5 extreme sampling values, 6 aborted uploads,
7 loose types, 8 seeds under an adaptive depth, 9 stream_options.include_usage, 10 usage past a
stop string, 11 a non-ASCII API key, 12 two servers on one port, 13 SIGTERM with requests in
flight. A real uvicorn on 127.0.0.1 (tests/helpers/live_server.py's ServerThread, which runs the
server class and protocol `verispec serve` runs), raw sockets and httpx for what a client library
hides.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import verispec
from verispec import cli
from verispec.errors import ConfigError
from verispec.server import ServerSettings, create_app
from verispec.server.run import bind_address

from live_server import ServerThread, wait_for
from tiny_models import build_tokenizer, layer_dropped_draft, save_model, untied_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MODEL = "tiny"
PROMPT = "def add(a, b):"
GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
JSON = {"Content-Type": "application/json"}
LONG = 1500  # tokens: seconds of generation


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("hardening_models")
    target = untied_llama(len(tokenizer), seed=1, max_positions=4096)  # varied text
    return (save_model(target, tokenizer, root / "target"),
            save_model(layer_dropped_draft(target), tokenizer, root / "draft"))


@pytest.fixture(scope="module")
def reference(model_dirs):
    return verispec.load(*model_dirs, chat_template="plain")


SETTINGS = ServerSettings(model_name=MODEL, max_tokens_limit=2000, max_queue=1, max_batch_size=1,
                          header_timeout=1.0, max_connections=24)


@pytest.fixture(scope="module")
def server(model_dirs):
    decoder = verispec.load(*model_dirs, chat_template="plain")
    with ServerThread(create_app(decoder, SETTINGS)) as running:
        yield running


def post(server, path: str = "/v1/completions", body: object = GOOD, headers=None,
         **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={**JSON, **(headers or {})},
                      timeout=60, **kwargs)


def assert_serving(server) -> None:
    response = post(server)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def error_of(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


# --- 1. DNS rebinding and cross-site requests -----------------------------------------------


@pytest.mark.parametrize("headers, status, code", [
    ({"Host": "evil.example.com", "Origin": "http://evil.example.com",
      "Content-Type": "text/plain"}, 403, "host_not_allowed"),  # the request
    ({"Host": "evil.example.com"}, 403, "host_not_allowed"),  # DNS rebinding
    ({"Origin": "http://evil.example.com"}, 403, "host_not_allowed"),  # a cross-site page
    ({"Origin": "null"}, 403, "host_not_allowed"),  # a sandboxed or file:// page
    ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),  # a CORS-simple POST
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
])
def test_foreign_hosts_origins_and_non_json_bodies_are_refused(server, headers, status, code):
    error_of(post(server, headers=headers), status, code)
    assert_serving(server)


def test_loopback_names_and_same_origin_pages_are_served(server):
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert post(server, headers={"Host": host}).status_code == 200
    origin = {"Origin": f"http://localhost:{port}"}
    assert post(server, headers=origin).status_code == 200
    assert post(server, headers={"Content-Type": "application/json; charset=utf-8"}
                ).status_code == 200


def test_host_names_follow_the_bind_address_and_allowed_hosts():
    assert ServerSettings().host_names() == {"localhost", "127.0.0.1", "::1"}
    assert ServerSettings(host="0.0.0.0").host_names() == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in ServerSettings(host="10.1.2.3").host_names()
    assert ServerSettings(allowed_hosts="api.example.com, [::1]").host_names() == {
        "api.example.com", "::1"}
    assert ServerSettings(allowed_hosts="*").host_names() == {"*"}
    with pytest.raises(ConfigError, match="allowed_hosts"):
        ServerSettings(allowed_hosts=" , ")


def test_allowed_hosts_lets_a_named_host_in(model_dirs):
    settings = ServerSettings(model_name=MODEL, allowed_hosts="api.example.test")
    decoder = verispec.load(*model_dirs, chat_template="plain")
    with ServerThread(create_app(decoder, settings)) as running:
        assert post(running, headers={"Host": "api.example.test"}).status_code == 200
        error_of(post(running, headers={"Host": "127.0.0.1"}), 403, "host_not_allowed")


# --- 2. slowloris: stalled connections are closed, new ones capped ---------------------------


def _half_sent(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    return sock


def test_stalled_headers_are_disconnected_and_do_not_starve_others(server):
    stalled = [_half_sent(server.url) for _ in range(20)]  # under the 24-connection cap
    try:
        assert_serving(server)  # served while the stalled connections are open
        time.sleep(SETTINGS.header_timeout + 1.0)
        for sock in stalled:  # the server closed each after --header-timeout
            sock.settimeout(5)
            assert sock.recv(1024) == b""
    finally:
        for sock in stalled:
            sock.close()
    assert_serving(server)


def test_connections_past_the_cap_are_closed_at_once(server):
    held = [_half_sent(server.url) for _ in range(SETTINGS.max_connections + 6)]
    try:
        closed = 0
        for sock in held:
            sock.settimeout(0.5)
            try:
                closed += sock.recv(1024) == b""
            except ConnectionResetError:  # closed with our request bytes unread
                closed += 1
            except TimeoutError:
                pass  # still open: within the cap
        assert closed >= 6
    finally:
        for sock in held:
            sock.close()
    time.sleep(SETTINGS.header_timeout + 0.5)
    assert_serving(server)


# --- 3. overload: its own error kind, one INFO line, no traceback ---------------------------


def test_overload_is_a_busy_503_with_retry_after_and_an_info_line(server, caplog):
    caplog.set_level(logging.INFO, logger="verispec.server")
    body = json.dumps({**GOOD, "max_tokens": LONG, "stream": True})
    with httpx.Client(base_url=server.url, timeout=60, headers=JSON) as http:
        with http.stream("POST", "/v1/completions", content=body) as running:
            lines = running.iter_lines()  # keep a reference: a collected iterator closes it
            next(lines)  # the long generation is on the worker now
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(post, server)  # --max-queue 1: this one waits
                wait_for(lambda: http.get("/health").json()["queue_depth"] == 1)
                refused = post(server)
                error = error_of(refused, 503, "queue_full")
                assert refused.headers["retry-after"] == "1"
                assert "busy" in error["message"] and "internal" not in error["message"]
                running.close()  # the client goes away: the waiting request runs
                assert waiting.result(timeout=30).status_code == 200
    records = [r for r in caplog.records if r.name == "verispec.server"]
    assert any(r.levelno == logging.INFO and "ServerOverloaded" in r.getMessage()
               for r in records)
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in records)
    assert_serving(server)


# --- 4. deeply nested JSON ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [40, 3000, 100_000])
def test_deeply_nested_json_is_a_400(server, depth):
    body = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    error_of(post(server, body=body), 400, "invalid_json")
    assert_serving(server)


def test_brackets_inside_strings_do_not_count_as_nesting(server):
    body = {**GOOD, "prompt": "[" * 100 + "{" * 100}
    assert post(server, body=body).status_code == 200


# --- 5. extreme sampling values: the limit the math gives ------------------------------------


@pytest.mark.parametrize("fields", [{"temperature": 1e-40}, {"temperature": 1, "top_p": 1e-300},
                                    {"temperature": 5e-324}])
@pytest.mark.parametrize("stream", [False, True])
def test_vanishing_temperature_and_top_p_decode_greedily(server, reference, fields, stream):
    body = {**GOOD, "max_tokens": 12, **fields, "stream": stream, "seed": 1}
    response = post(server, body=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.split("\n\n")
                  if line.startswith("data: {")]
        assert not any("error" in e for e in events)
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    else:
        text = response.json()["choices"][0]["text"]
    assert text == reference.generate(PROMPT, max_new_tokens=12, temperature=0).text


# --- 6. an aborted upload ------------------------------------------------------------------


def test_an_aborted_upload_is_not_a_server_error(server, caplog):
    caplog.set_level(logging.INFO)
    before = _count_500s(server)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"prompt": ')
        time.sleep(0.3)
    time.sleep(0.5)
    assert not any("Exception in ASGI application" in r.getMessage() or r.exc_info
                   for r in caplog.records)
    assert _count_500s(server) == before
    assert_serving(server)


def _count_500s(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("verispec_requests_total") and 'status="500"' in line)


# --- 7. loose types ---------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("max_tokens", "5"), ("max_tokens", 5.0), ("num_draft_tokens", True),
    ("stream", "yes"), ("stream", 1), ("seed", True), ("top_k", "3"), ("temperature", True),
    ("temperature", "0.5"), ("n", True), ("stop", 5), ("model", 7),
])
def test_loosely_typed_fields_are_refused(server, field, value):
    error = error_of(post(server, body={**GOOD, field: value}), 422, "validation_error")
    assert error["param"].split(".")[0] == field  # (a union member may follow: stop.str)


# --- 8. a seed under an adaptive depth --------------------------------------------------------


def test_a_seed_fixes_the_output_under_goodput(model_dirs, reference):
    # the seeded request follows the policy like any other, and its text is plain decoding's
    settings = ServerSettings(model_name=MODEL, adaptive="goodput", max_tokens_limit=200)
    body = {**GOOD, "max_tokens": 48, "temperature": 1.0, "seed": 11}
    decoder = verispec.load(*model_dirs, adaptive=verispec.GoodputPolicyConfig(),
                            chat_template="plain")
    with ServerThread(create_app(decoder, settings)) as running:
        first, second = post(running, body=body).json(), post(running, body=body).json()
        unseeded = post(running, body={**body, "seed": None}).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["choices"][0]["text"] == reference.generate(
        PROMPT, max_new_tokens=48, temperature=1.0, seed=11, speculative=False).text
    assert first["speculation"]["depth_policy"] == "goodput"
    assert unseeded["speculation"]["depth_policy"] == "goodput"
    # the control: another seed gives another text
    other = reference.generate(PROMPT, max_new_tokens=48, temperature=1.0, seed=12).text
    assert other != first["choices"][0]["text"]


def test_serve_help_says_a_seed_fixes_the_text_at_any_depth(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a seeded request's text is the same at any depth" in help_text


# --- 9. stream_options.include_usage ----------------------------------------------------------


def _events(response: httpx.Response) -> list[str]:
    return [e for e in response.text.split("\n\n") if e]


def test_usage_comes_only_when_asked_in_a_final_chunk_without_choices(server):
    body = {**GOOD, "max_tokens": 8, "stream": True}
    plain = _events(post(server, body=body))
    assert plain[-1] == "data: [DONE]" and all('"usage"' not in e for e in plain)
    asked = _events(post(server, body={**body, "stream_options": {"include_usage": True}}))
    assert asked[-1] == "data: [DONE]"
    usage_chunk = json.loads(asked[-2][6:])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert all('"usage"' not in e for e in asked[:-2])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    chat_usage = json.loads(_events(post(server, "/v1/chat/completions", chat))[-2][6:])
    assert chat_usage["object"] == "chat.completion.chunk" and chat_usage["choices"] == []


def test_stream_options_without_stream_is_a_400(server):
    error_of(post(server, body={**GOOD, "stream_options": {"include_usage": True}}), 400,
             "invalid_value")


# --- 10. usage counts the tokens the client received ---------------------------------------------


def test_usage_stops_at_the_stop_string(server, reference):
    greedy = reference.generate(PROMPT, max_new_tokens=24, temperature=0)
    first_char = greedy.text[0]
    cut = post(server, body={**GOOD, "max_tokens": 24, "stop": [first_char]}).json()
    assert cut["choices"][0]["text"] == "" and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] == 0  # was 3: tokens verified past the stop
    stop = greedy.text[len(greedy.text) // 2:][:3]
    out = post(server, body={**GOOD, "max_tokens": 24, "stop": [stop]}).json()
    text = out["choices"][0]["text"]
    assert text == greedy.text[: greedy.text.find(stop)]
    tokenizer = reference.tokenizer
    used = out["usage"]["completion_tokens"]
    assert 0 < used < len(greedy.token_ids)
    assert tokenizer.decode(greedy.token_ids[:used]).startswith(text)  # the text's tokens,
    assert not tokenizer.decode(greedy.token_ids[: used - 1]).startswith(text)  # and no more


# --- 11. a non-ASCII API key --------------------------------------------------------------------


@pytest.mark.parametrize("key", ["clé-secrète", "key with space", "tab\tkey", "ключ"])
def test_a_key_an_http_header_cannot_carry_is_refused_at_start(key, capsys):
    with pytest.raises(ConfigError, match="printable ASCII"):
        ServerSettings(api_key=key)
    assert cli.main(["serve", "--api-key", key, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "api_key" in err and "Traceback" not in err


# --- 12. two servers on one port ---------------------------------------------------------------


def test_the_second_of_two_servers_on_one_port_fails_in_one_line():
    first = bind_address("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_address("127.0.0.1", port)  # right away: the first is already listening
    finally:
        first.close()


def test_servers_started_together_one_serves_one_exits_2(model_dirs):
    port_holder = bind_address("127.0.0.1", 0)
    port = port_holder.getsockname()[1]
    port_holder.close()
    script = Path(sys.executable).with_name("verispec")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    argv = [str(script), "serve", "--target", str(model_dirs[0]), "--draft", str(model_dirs[1]),
            "--port", str(port), "--threads", "1"]
    processes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        loser = next(p for p in processes if p.poll() is not None)
        winner = next(p for p in processes if p is not loser)
        err = loser.stderr.read()
        assert loser.returncode == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and f":{port}" in err
        assert winner.stdout.readline().startswith("verispec: serving")
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


# --- 13. SIGTERM with requests in flight ----------------------------------------------------------


def test_sigterm_ends_cut_streams_with_an_error_event_and_done(model_dirs):
    script = Path(sys.executable).with_name("verispec")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        [str(script), "serve", "--target", str(model_dirs[0]), "--draft", str(model_dirs[1]),
         "--port", "0", "--threads", "1", "--drain-timeout", "1", "--max-tokens-limit", "4000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("verispec: serving"), process.stderr.read()
        url = line.split(" on ")[1].split()[0]
        body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
        results: dict[str, httpx.Response] = {}

        def stream(name: str) -> None:
            results[name] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=stream, args=(name,)) for name in ("running",
                                                                              "queued")]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    assert results["running"].status_code == 200  # it was streaming when the signal came
    for name, response in results.items():
        if response.status_code == 503:  # not yet streaming: a plain 503 is a whole answer
            assert response.json()["error"]["code"] == "shutting_down"
            continue
        events = _events(response)
        assert events[-1] == "data: [DONE]", (name, events[-3:])
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_overloaded"
    assert "Traceback" not in process.stderr.read()
