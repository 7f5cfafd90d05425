"""verispec on Ray Serve (``verispec serve --ray``; needs the ``ray`` extra): every replica is the
server ``create_app`` builds, with its own models, generation worker and batch, behind Ray's
HTTP proxy; Ray adds and removes replicas within an autoscaling range and replaces dead ones.

    from verispec.server import ServerSettings
    from verispec.server.ray import RaySettings, serve_on_ray
    serve_on_ray(ServerSettings(port=8000), RaySettings(min_replicas=1, max_replicas=4))

Layout: settings.py (RaySettings and the --ray flags; no Ray import), deployment.py (the
replica's deployment and the `serve run` builder, ``app_builder``), run.py (connect, deploy,
wait, clean up). Nothing is imported at import time: ``import verispec`` and ``verispec serve``
without --ray work without Ray installed.
"""

from __future__ import annotations

_LAZY = {"RaySettings": "settings", "application": "deployment", "app_builder": "deployment",
         "deploy": "run", "serve_on_ray": "run", "DeploymentFailed": "run"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'verispec.server.ray' has no attribute {name!r}")


__all__ = ["DeploymentFailed", "RaySettings", "app_builder", "application", "deploy",
           "serve_on_ray"]
