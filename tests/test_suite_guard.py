"""The suite fails fast when a pytest-xdist worker crashes, instead of hanging.

A native crash (llama.cpp executing an instruction the machine faults on, say) kills a worker
process. The run must then end within a bounded time, red, with the crashed test named. This
runs a tiny suite with the project's pytest settings (pyproject.toml, the Makefile's xdist
flags, and the crash policy that tests/conftest.py loads) in a subprocess and kills one of its
workers with SIGSEGV.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"

_CRASHING = """
import os
import signal


def test_segfault():
    os.kill(os.getpid(), signal.SIGSEGV)
"""

_PASSING = """
import time


def test_one():
    time.sleep(0.2)


def test_two():
    time.sleep(0.2)
"""


def _tiny_suite(folder: Path) -> None:
    (folder / "test_crash.py").write_text(_CRASHING)
    for index in range(5):
        (folder / f"test_ok_{index}.py").write_text(_PASSING)


def test_a_crashed_worker_fails_the_run_within_a_minute(tmp_path):
    _tiny_suite(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(HELPERS), "PYTHONFAULTHANDLER": "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
               "-p", "crash_policy", "-c", str(ROOT / "pyproject.toml"),
               "--rootdir", str(tmp_path), str(tmp_path)]
    start = time.monotonic()
    # Without the policy this run hangs for good: the timeout turns that into a failure here.
    done = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0, done.stdout[-2000:]
    assert "crashed while running 'test_crash.py::test_segfault'" in done.stdout, (
        done.stdout[-2000:])
    assert elapsed < 60
