"""`verispec serve --ray --ray-ingress haproxy`: the command starts a local Ray with Ray Serve's
HAProxy ingress flags, HAProxy forwards to each replica's own HTTP server, and the texts are
those of a single `verispec serve` with the same settings (greedy, streamed and not; the
official openai client). SIGTERM still ends the command promptly (the proxies' draining
period is the --drain-timeout, not Ray's 30 seconds).

tests/server/test_ray.py covers Ray's default proxy on a two-node cluster: routes, errors,
replica loss, autoscaling.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import openai
import pytest

from verispec import cli
from verispec.errors import ConfigError
from verispec.server import ServerSettings, create_app
from verispec.server.ray import RaySettings
from verispec.server.run import load_decoder
from verispec.text.demo import heldout_prompts

from live_server import RAY_PROXY_PATIENCE, ServerThread, serving_command

pytestmark = pytest.mark.usefixtures("all_cores")  # Ray's CPUs, unpinned

FLAGS = ["--model-name", "demo", "--threads", "1", "--max-tokens-limit", "256"]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """The command with a local Ray of its own: (process, url, log)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("ray_haproxy") / "serve.log"
    with serving_command(["serve", *FLAGS, "--port", str(port), "--ray", "--ray-ingress",
                          "haproxy", "--replica-cpus", "1", "--drain-timeout", "2"], log,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                              **RAY_PROXY_PATIENCE}) as process:
        yield process, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def single():
    settings = ServerSettings.from_args(cli.build_parser().parse_args(["serve", *FLAGS]))
    with ServerThread(create_app(load_decoder(settings), settings)) as running:
        yield running


def _completion(url: str, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0,
                                    stream=stream)
    if not stream:
        return out.choices[0].text
    return "".join(chunk.choices[0].text for chunk in out if chunk.choices)


def test_the_ingress_setting_is_checked_and_sets_ray_flags():
    server = ServerSettings(drain_timeout=2.0)
    assert RaySettings().ingress_environment(server) == {}
    flags = RaySettings(ingress="haproxy").ingress_environment(server)
    assert flags["RAY_SERVE_ENABLE_HA_PROXY"] == flags["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert flags["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"] == "2"
    with pytest.raises(ConfigError, match="ingress='nginx' is invalid"):
        RaySettings(ingress="nginx")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_text_through_haproxy_equals_the_single_server(command, single, stream):
    for prompt in heldout_prompts()[:2]:
        assert _completion(command[1], prompt, stream) == _completion(single.url, prompt, stream)


def test_sigterm_ends_the_command_promptly(command):
    process, _, log = command
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 20, log.read_text()  # not Ray's 30 s of draining
    assert not [line for line in log.read_text().splitlines() if line.startswith("Traceback")]
