"""The Ray Serve deployment of the server: each replica loads the models and serves the app
``create_app`` builds (``serve.ingress``), with its own generation worker and continuous batch.

    application(ServerSettings(...), RaySettings(replicas=2))  # what serve.run deploys
    app_builder({"replicas": 2, "target": "./t", ...})         # what a `serve run` config names

Routes, errors, auth and request limits are the app's own, so a replica answers exactly as
``verispec serve`` does; Ray's proxy in front routes each request to one replica. What this
is not: the driver (run.py connects to the cluster, deploys and waits) or the settings
(settings.py). Imports Ray at import time: only run.py and a replica import it, after the
``ray`` extra was checked.
"""

from __future__ import annotations

from dataclasses import fields, replace

from ray import serve
from ray.serve import Application

from ...errors import ConfigError, VerispecError
from ..settings import ServerSettings
from .settings import RaySettings

# settings a `serve run` config sets in its own keys (an application's name and route_prefix;
# the cluster is serve run's --address), not in the builder's args
_DRIVER_FIELDS = frozenset({"address", "app_name", "route_prefix"})


# Every answer of a replica names it, so an operator (and the failover test) can tell which
# replica served a request behind Ray's proxy.
REPLICA_HEADER = "x-verispec-replica"


class ReplicaUnhealthy(VerispecError, RuntimeError):
    """A replica's generation worker has stopped: Ray's health check replaces the replica."""


@serve.deployment(name="VerispecServer")
@serve.ingress()
class VerispecServer:
    """One replica: the models ``settings`` name, loaded once, and the server's app over them
    (built by ``__serve_build_asgi_app__`` after the constructor; its lifespan starts the
    generation worker). A model that cannot load raises here, which fails the deployment."""

    def __init__(self, settings: ServerSettings) -> None:
        import torch

        from ..run import load_decoder

        # The models load on one thread, as in `verispec serve`; the worker thread sets
        # settings.threads when it starts (server/run.py says why).
        torch.set_num_threads(1)
        self._settings = settings
        self._decoder = load_decoder(settings)
        self._app = None

    def __serve_build_asgi_app__(self):
        from ..app import create_app

        self._app = create_app(self._decoder, self._settings)
        self._app.add_middleware(NameReplica,
                                 name=serve.get_replica_context().replica_id.unique_id)
        return self._app

    def check_health(self) -> None:
        """Ray calls this periodically: a replica whose generation thread ended answers no
        request again, so it reports itself unhealthy and Ray starts another."""
        if self._app is not None and not self._app.state.worker.alive:
            raise ReplicaUnhealthy("the generation worker thread has stopped; Ray replaces "
                                   "this replica.")


class NameReplica:
    """ASGI middleware adding ``x-verispec-replica: <Ray's replica id>`` to every response,
    streamed or not (pure ASGI: it only touches the response's start message)."""

    def __init__(self, app, name: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


def application(server: ServerSettings, ray_settings: RaySettings) -> Application:
    """The deployment, bound to its settings: replicas of the server ``server`` describes, as
    many and as large as ``ray_settings`` says. ConfigError for settings Ray cannot take."""
    ray_settings.check_server(server)
    server = replace(server, threads=ray_settings.replica_threads(server))
    return VerispecServer.options(**ray_settings.deployment_options(server)).bind(server)


def app_builder(args: dict[str, object]) -> Application:
    """The application a `serve run` config names (import_path
    ``verispec.server.ray:app_builder``), its ``args`` the fields of ServerSettings and
    RaySettings by name: ``{"target": "./t", "draft": "./d", "min_replicas": 1, ...}``."""
    server_names = {f.name for f in fields(ServerSettings)}
    ray_names = {f.name for f in fields(RaySettings)} - _DRIVER_FIELDS
    for name, value in args.items():
        if name in _DRIVER_FIELDS:
            raise ConfigError(f"{name}={value!r} is invalid in a serve run config's args: set "
                              "the application's name and route_prefix in its own keys, and "
                              "the cluster with serve run --address.")
        if name not in server_names | ray_names:
            raise ConfigError(f"{name}={value!r} is invalid: expected a ServerSettings or "
                              "RaySettings field (the flags of verispec serve --help, with _ "
                              "for -).")
    return application(ServerSettings(**{k: v for k, v in args.items() if k in server_names}),
                       RaySettings(**{k: v for k, v in args.items() if k in ray_names}))
