"""``verispec serve --ray``: connect to a Ray cluster (or start a local one), start Ray Serve's
HTTP proxy on --host/--port, deploy the replicas, wait for them, serve until Ctrl-C or SIGTERM,
then delete the application (and stop the local Ray this command started).

    serve_on_ray(ServerSettings(port=8000), RaySettings(replicas=2))   # the command
    deploy(ServerSettings(...), RaySettings(...))                      # deploy and return

What this is not: the replica (deployment.py) or its settings (settings.py). Ray is imported
here inside the functions, behind the ``ray`` extra's check, so ``verispec serve`` without --ray
and ``import verispec`` never need it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from ...errors import ConfigError, UnsupportedFeatureError, VerispecError
from ..settings import ServerSettings
from .settings import RaySettings


class DeploymentFailed(VerispecError, RuntimeError):
    """Ray could not start the replicas: the message carries what the replica raised (a model
    that does not load, a missing package on a node) and where the replica logs are."""


def import_ray():
    """``ray`` and ``ray.serve``, or UnsupportedFeatureError naming the extra."""
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError as exc:
        raise UnsupportedFeatureError(
            f"verispec serve --ray needs the ray extra ({exc.name} is not installed): pip "
            "install 'verispec[ray]'.") from None
    return ray, serve


def serve_on_ray(server: ServerSettings, ray_settings: RaySettings) -> int:
    """Deploy, print the startup line, wait for Ctrl-C (returns 0) or SIGTERM (returns 143, as
    `verispec serve` does), then delete the application; a Ray started here is stopped. Ctrl-C
    while the replicas load is KeyboardInterrupt (the command exits 130), deleting what was
    deployed on the way."""
    ray_settings.check_server(server)
    ray, serve = import_ray()
    # before ray.init: a local Ray's processes inherit this environment (--ray-ingress)
    os.environ.update(ray_settings.ingress_environment(server))
    owned = connect(ray, ray_settings.address)
    try:
        deploy(server, ray_settings)
        try:
            print(startup_line(server, ray_settings, owned), flush=True)
            return wait_for_shutdown()
        finally:
            serve.delete(ray_settings.app_name)
    finally:
        if owned:
            serve.shutdown()
            ray.shutdown()


def connect(ray, address: str | None) -> bool:
    """Join the cluster at ``address`` (or RAY_ADDRESS), else start a local Ray: True when this
    process started it (and so stops it). Already connected (the Python API's caller did
    ray.init): nothing to do, not ours."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    # "local", not None: with no address Ray would also join whatever cluster last ran on this
    # machine, and the help promises a Ray of this command's own.
    ray.init(address=address, logging_level=logging.WARNING)
    return address == "local"


def deploy(server: ServerSettings, ray_settings: RaySettings) -> None:
    """Start Serve's proxies on --host/--port (kept as they are where Serve already runs) and
    run the application; return once every replica is up. A replica that cannot start (its
    model does not load) fails the deployment: DeploymentFailed with the replica's error, and
    the failed application is deleted. An application of the same name is not replaced:
    ConfigError."""
    ray, serve = import_ray()
    from ray.serve.exceptions import RayServeException

    from .deployment import application

    app, name = application(server, ray_settings), ray_settings.app_name  # ConfigError first
    serve.start(http_options={"host": server.host, "port": server.port,
                              "keep_alive_timeout_s": max(1, round(server.keep_alive_timeout))})
    if name in serve.status().applications:  # serve.run would replace it
        raise ConfigError(f"app_name={name!r} is invalid: an application of that name already "
                          "runs on this cluster; pass another --ray-app (and --route-prefix), or "
                          "stop the command that deployed it.")
    try:
        serve.run(app, name=name, route_prefix=ray_settings.route_prefix)
    except RayServeException as exc:  # the controller refused it (a route prefix in use)
        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        raise ConfigError(f"route_prefix={ray_settings.route_prefix!r} is invalid: Ray Serve "
                          f"refused the application ({cause}); pass another --route-prefix "
                          "and --ray-app.") from None
    except RuntimeError as exc:  # serve.run's DEPLOY_FAILED
        message = replica_error(serve, name) or str(exc)
        serve.delete(name)
        raise DeploymentFailed(f"the Ray Serve application {name!r} failed to deploy: "
                               f"{message}") from None
    except KeyboardInterrupt:  # Ctrl-C while the replicas load: leave no half a deployment
        serve.delete(name)
        raise


def replica_error(serve, app_name: str) -> str | None:
    """What the failed deployment's replicas raised: the last line of the traceback Ray keeps
    in the deployment's status (``ModelLoadError: ...``), with where to find the rest."""
    application = serve.status().applications.get(app_name)
    if application is None:
        return None
    for deployment in application.deployments.values():
        lines = [line.strip() for line in deployment.message.splitlines() if line.strip()]
        if lines:
            return (f"a replica failed to start: {lines[-1]} (the whole traceback: the Ray "
                    "controller's log, or `serve status`)")
    return None


def wait_for_shutdown() -> int:
    """Block until Ctrl-C (returns 0) or SIGTERM (143). Both are handled here, as uvicorn
    handles them for `verispec serve`, so a command started in the background, where SIGINT
    comes in ignored, still stops on it."""
    received: list[int] = []
    stop = threading.Event()

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        stop.set()

    previous = {signum: signal.signal(signum, on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0 if received[0] == signal.SIGINT else 128 + signal.SIGTERM


def startup_line(server: ServerSettings, ray_settings: RaySettings, owned: bool) -> str:
    host = f"[{server.host}]" if ":" in server.host else server.host
    prefix = "" if ray_settings.route_prefix == "/" else ray_settings.route_prefix
    resources = f"{ray_settings.replica_cpus:g} CPU"
    if ray_settings.num_gpus(server):
        resources += f", {ray_settings.num_gpus(server):g} GPU"
    cluster = "on a local Ray" if owned else "on the Ray cluster"
    auth = "required" if server.api_key else "not required"
    return (f"verispec: serving {server.model_name!r} on http://{host}:{server.port}{prefix} "
            f"through Ray Serve ({ray_settings.describe()}; {resources} each; {cluster}; "
            f"API key {auth}; OpenAI routes under {prefix}/v1)")
