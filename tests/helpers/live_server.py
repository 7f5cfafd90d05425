"""A real server for the tests: uvicorn on 127.0.0.1 in a thread, and what the tests poll it with.

ServerThread serves an app as `verispec serve` does; serving_command runs the `verispec serve`
command in a process of its own; model_dirs (a module fixture) saves the tiny model pair the
server tests load; wait_for polls a condition; metric_values reads /metrics.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verispec.server.http import VerispecServer, uvicorn_config

from tiny_models import build_tokenizer, save_model, tiny_llama

# The environment of a Ray a test starts: a proxy gets 30 s, not Ray's 5-10, to answer its
# readiness and health checks. The suite's other worker may hold both cores while a proxy
# starts, and Ray then kills the proxy and the command exits before serving.
RAY_PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
                      "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


class ServerThread:
    """uvicorn serving ``app`` on an ephemeral 127.0.0.1 port from a background thread."""

    def __init__(self, app) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        # as `verispec serve` runs it: the guarded protocol, timeouts, draining on shutdown
        self.server = VerispecServer(uvicorn_config(app, app.state.settings,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny Llama target and a one-layer draft saved with their tokenizer: (target, draft)."""
    tokenizer = build_tokenizer()
    root = tmp_path_factory.mktemp("server_models")
    target = save_model(tiny_llama(len(tokenizer), seed=1, max_positions=2048), tokenizer,
                        root / "target")
    draft = save_model(tiny_llama(len(tokenizer), seed=2, layers=1, max_positions=2048),
                       tokenizer, root / "draft")
    return target, draft


@contextlib.contextmanager
def serving_command(args: list[str], log: Path, env: dict[str, str] | None = None,
                    timeout: float = 240):
    """`python -m verispec <args>` with its output in ``log``, yielded once it prints its
    "verispec: serving" line (a process that exits first fails the test with its log); sent
    SIGTERM at the end unless a test ended it."""
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "verispec", *args], stdout=out,
                                   stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for(lambda: "verispec: serving" in log.read_text() or process.poll() is not None,
                 timeout=timeout)
        assert process.poll() is None, log.read_text()
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(120)


def wait_for(condition, timeout: float = 10.0) -> None:
    """Poll ``condition`` every 20 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def metric_values(text: str) -> dict[str, float]:
    """A Prometheus text page as {series with its labels: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}
