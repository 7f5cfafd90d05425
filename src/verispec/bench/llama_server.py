"""llama.cpp's own server as a baseline in ``verispec bench --llama-server PATH``.

What this is: the same GGUF files served by a ``llama-server`` binary, plain and with its own
draft-model speculation (``--spec-type draft-simple``, a greedy draft whose tokens are kept while
the target's sampled token equals them), each a method of the bench: one HTTP request per prompt
to ``/completion`` on loopback, timed by the client's wall clock from request to reply, with the
tokens counted from the reply (``return_tokens``). The request asks for exactly max_new_tokens
(``ignore_eos``), no prompt cache (each prompt is prefilled as verispec's are), and, at T > 0,
plain sampling (top-k 0, top-p 1, min-p 0: llama.cpp's defaults would truncate the distribution
verispec samples in full).

What this is not: part of verispec. The binary is the user's (built from llama.cpp's source);
verispec never downloads or builds it. A request costs an HTTP round trip on loopback that
verispec's in-process methods do not pay (well under a millisecond per reply here).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

START_TIMEOUT_S = 120.0


@dataclass
class LlamaServer:
    """A running ``llama-server`` process on 127.0.0.1 (stop() ends it)."""

    process: subprocess.Popen
    port: int
    log_path: Path

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float,
                 seed: int) -> dict:
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "seed": seed,
                "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "stream": False}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_llama_server(binary: str, target: str, draft: str | None, num_draft_tokens: int,
                       threads: int, context_size: int, log_dir: Path, parallel: int = 1,
                       extra_args: Sequence[str] = ()) -> LlamaServer:
    """Start ``binary`` on a free loopback port serving ``target`` (with ``draft``: llama.cpp's
    draft-model speculation of up to ``num_draft_tokens`` tokens) with ``parallel`` slots and
    ``extra_args`` appended (e.g. ``--spec-type ngram-mod``), and wait until it is ready. The
    binary's directory goes first on LD_LIBRARY_PATH: a llama.cpp build puts its shared
    libraries beside it."""
    if not Path(binary).is_file():
        raise ConfigError(f"--llama-server {binary!r} is not a file; pass the path of a "
                          "llama-server binary built from llama.cpp's source.")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [binary, "-m", target, "--host", "127.0.0.1", "--port", str(port), "-t",
               str(threads), "-tb", str(threads), "-c", str(context_size), "-np", str(parallel),
               "--no-webui", *extra_args]
    if draft is not None:
        command += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max",
                    str(num_draft_tokens), "--spec-draft-n-min", "0", "-td", str(threads)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-server-{'spec' if draft else 'plain'}-{port}.log"
    log = log_path.open("w")
    library_path = os.pathsep.join(filter(None, [str(Path(binary).resolve().parent),
                                                 os.environ.get("LD_LIBRARY_PATH")]))
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "LD_LIBRARY_PATH": library_path})
    server = LlamaServer(process, port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ConfigError(f"llama-server exited with status {process.returncode} at start; "
                              f"see {log_path}.")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    raise ConfigError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s; see "
                      f"{log_path}.")
