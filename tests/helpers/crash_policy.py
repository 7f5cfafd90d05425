"""The suite's policy for a crashed pytest-xdist worker: fail the run at once, never hang.

A worker that dies on a signal (a segfault or an illegal instruction inside a native library)
is replaced by pytest-xdist by default; with ``--dist loadfile`` the replacement can leave the
controller waiting for work that never comes, so the run idles until CI's limit. With
``--max-worker-restart 0`` xdist stops scheduling after the first crash and reports the test the
worker was running as failed ("worker 'gwN' crashed while running ...").

Loaded by tests/conftest.py for the whole suite, and with ``-p crash_policy`` by the test that
crashes a worker on purpose (tests/test_suite_guard.py), so both run the same code. An explicit
``--max-worker-restart`` on the command line wins.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config.option, "maxworkerrestart", None) is None:
        config.option.maxworkerrestart = "0"
