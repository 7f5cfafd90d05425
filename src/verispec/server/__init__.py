"""verispec's OpenAI-compatible HTTP server (``verispec serve``; needs the ``serve`` extra).

    from verispec.server import ServerSettings, create_app
    app = create_app(verispec.load(), ServerSettings(api_key="secret"))

Layout: settings.py (the settings dataclass and the CLI flags it generates), app.py (the factory
and routes), schemas.py (pydantic request bodies -> checked parameters), prompts.py (text, token
and chat prompts; the chat template), worker.py (the one generation thread and its queue),
generation.py (jobs -> JSON or server-sent events), responses.py (OpenAI bodies and chunks),
errors.py (the exception -> status table), metrics.py (Prometheus), run.py (load and serve).

Nothing is imported at import time: ``verispec --help`` works without FastAPI installed.
"""

from __future__ import annotations

_LAZY = {"create_app": "app", "ServerSettings": "settings", "serve": "run"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'verispec.server' has no attribute {name!r}")


__all__ = ["create_app", "ServerSettings", "serve"]
