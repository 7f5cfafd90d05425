"""RaySettings: how ``verispec serve --ray`` deploys the server on Ray Serve (replicas, the
autoscaling range, each replica's CPUs and GPUs, the cluster), and the ``--ray`` flags it
generates, as ServerSettings generates the server's.

Data and checks only: this module imports neither Ray nor torch, so ``verispec serve --help`` and
every configuration error work without the ``ray`` extra. What the settings become in Ray's
terms (a deployment's options, the replica's thread count) is computed here too, as plain
dicts, so that it is tested without a cluster; deployment.py hands them to Ray.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from ...config import require
from ...errors import ConfigError
from ..settings import ServerSettings, _setting, add_field_argument, check_kinds

# Ray's own defaults (AutoscalingConfig): kept when the flags are not given
RAY_UPSCALE_DELAY = 30.0
RAY_DOWNSCALE_DELAY = 600.0
RAY_LOOK_BACK_PERIOD = 30.0
# AutoscalingConfig.metrics_interval_s's default: Ray warns (and says it will refuse) a
# look-back period that is not longer
RAY_METRICS_INTERVAL = 10.0

# what carries HTTP to the replicas; "haproxy" turns on these Ray Serve feature flags: HAProxy
# as the ingress, forwarding to an HTTP server in each replica (direct ingress), instead of
# Serve's Python proxy relaying every streamed chunk over Ray's actor calls (the proxy's cost:
# benchmarks/ray_proxy.py, dev/LOG.md)
INGRESSES = ("proxy", "haproxy")
HAPROXY_FLAGS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}

# the fields that only an autoscaling range uses
_AUTOSCALING_FIELDS = ("target_ongoing_requests", "upscale_delay", "downscale_delay",
                       "autoscaling_window")


@dataclass(frozen=True)
class RaySettings:
    """Where and how many: the Ray Serve deployment of ``verispec serve --ray``. Every replica is
    the server ServerSettings describes (its own models, worker thread and batch)."""

    replicas: int | None = _setting(
        None, "replicas, a fixed count (default: 1 without an autoscaling range)", metavar="N",
        value_type=int)
    min_replicas: int | None = _setting(
        None, "autoscaling: the fewest replicas (default: 1 with --max-replicas; 0 scales to "
        "zero when idle)", metavar="N", value_type=int)
    max_replicas: int | None = _setting(
        None, "autoscaling: the most replicas (gives an autoscaling range instead of "
        "--replicas)", metavar="N", value_type=int)
    target_ongoing_requests: float | None = _setting(
        None, "autoscaling: the requests (running and queued) a replica should carry on "
        "average; more and Ray adds replicas, fewer and it removes them (default: "
        "--max-batch-size: requests start to wait beyond a full batch)", metavar="N",
        value_type=float)
    upscale_delay: float | None = _setting(
        None, f"autoscaling: seconds the load must ask for more replicas before one is added "
        f"(default: Ray's {RAY_UPSCALE_DELAY:g})", metavar="SECONDS", value_type=float)
    downscale_delay: float | None = _setting(
        None, f"autoscaling: seconds the load must ask for fewer replicas before one is "
        f"removed (default: Ray's {RAY_DOWNSCALE_DELAY:g})", metavar="SECONDS", value_type=float)
    autoscaling_window: float | None = _setting(
        None, f"autoscaling: seconds of load the decisions average over, more than "
        f"{RAY_METRICS_INTERVAL:g} (Ray's look_back_period_s; default {RAY_LOOK_BACK_PERIOD:g})",
        metavar="SECONDS",
        value_type=float)
    replica_cpus: float = _setting(
        1.0, "CPUs Ray reserves for each replica (fractions allowed); also the replica's torch "
        "threads when --threads is not given", metavar="N")
    replica_gpus: float | None = _setting(
        None, "GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0)",
        metavar="N", value_type=float)
    address: str | None = _setting(
        None, "the Ray cluster to deploy on: 'auto' for the one `ray start` runs on this "
        "machine, or HOST:PORT of its head (default: RAY_ADDRESS when set, else a local Ray "
        "started for this command and stopped with it)", flag="--ray-address", metavar="ADDR")
    app_name: str = _setting("verispec", "the Ray Serve application's name (several on one "
                             "cluster need different names and --route-prefix)",
                             flag="--ray-app", metavar="NAME")
    route_prefix: str = _setting("/", "the path the application is served under: /v1/... "
                                 "becomes PREFIX/v1/...", metavar="PATH")
    ingress: str = _setting(
        "proxy", "what carries HTTP to the replicas: 'proxy', Ray Serve's Python HTTP proxy "
        "(Ray's default), or 'haproxy', Ray's HAProxy ingress straight to each replica's own "
        "HTTP server (feature flags of Ray Serve, set for the local Ray this command starts; a "
        "cluster started apart needs them in its environment, docs/server.md)",
        flag="--ray-ingress", choices=INGRESSES)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def __post_init__(self) -> None:
        check_kinds(self)
        require(self.replicas is None or self.replicas >= 1, "replicas", self.replicas,
                "an integer >= 1 (to scale to zero: --min-replicas 0 --max-replicas N)")
        require(self.replicas is None or not self.autoscaling, "replicas", self.replicas,
                "either --replicas N (a fixed count) or --min-replicas/--max-replicas (an "
                "autoscaling range), not both")
        require(self.min_replicas is None or self.min_replicas >= 0, "min_replicas",
                self.min_replicas, "an integer >= 0")
        require(not self.autoscaling or self.max_replicas is not None, "max_replicas", None,
                f"the range's top, an integer >= {self.min_replicas or 1}, with --min-replicas")
        low = 1 if self.min_replicas is None else max(1, self.min_replicas)
        require(self.max_replicas is None or self.max_replicas >= low, "max_replicas",
                self.max_replicas, f"an integer >= {low} (the range's bottom, --min-replicas)")
        for name in _AUTOSCALING_FIELDS:
            value = getattr(self, name)
            require(value is None or self.autoscaling, name, value,
                    "no value without an autoscaling range: add --min-replicas/--max-replicas, "
                    "or drop it for a fixed --replicas count")
        for name in ("target_ongoing_requests", "replica_cpus"):
            value = getattr(self, name)
            require(value is None or 0 < value < math.inf, name, value, "a number > 0")
        require(self.autoscaling_window is None or
                RAY_METRICS_INTERVAL < self.autoscaling_window < math.inf, "autoscaling_window",
                self.autoscaling_window, f"a number of seconds > {RAY_METRICS_INTERVAL:g} (Ray's "
                "metrics interval)")
        for name in ("upscale_delay", "downscale_delay", "replica_gpus"):
            value = getattr(self, name)
            require(value is None or 0 <= value < math.inf, name, value, "a number >= 0")
        require(bool(self.app_name), "app_name", self.app_name, "a non-empty name")
        require(self.route_prefix.startswith("/") and (self.route_prefix == "/" or not
                self.route_prefix.endswith("/")), "route_prefix", self.route_prefix,
                "a path starting with '/' and not ending with one, e.g. / or /verispec")
        require(self.address is None or bool(self.address), "address", self.address,
                "'auto', HOST:PORT, or no --ray-address for a local Ray")
        require(self.ingress in INGRESSES, "ingress", self.ingress,
                " or ".join(repr(kind) for kind in INGRESSES))

    def check_server(self, server: ServerSettings) -> None:
        """The server settings a Ray deployment cannot take: ConfigError naming the fix."""
        require(server.port != 0, "port", server.port,
                "a fixed port with --ray: Ray's proxies bind the same port on every node")
        require(not server.device.startswith("cuda") or self.num_gpus(server) > 0,
                "replica_gpus", self.replica_gpus,
                f"a number > 0 with --device {server.device} (each replica needs its GPU), or "
                "--device cpu")

    def ingress_environment(self, server: ServerSettings) -> dict[str, str]:
        """The environment a Ray started for this command needs for --ray-ingress: none for
        Ray's proxy; HAPROXY_FLAGS for HAProxy, with the proxies' and the replicas' minimum
        draining periods made --drain-timeout (Ray's default holds a stopping command for 30
        seconds)."""
        if self.ingress == "proxy":
            return {}
        drain = f"{max(server.drain_timeout, 0.1):g}"
        return {**HAPROXY_FLAGS, "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": drain,
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": drain}

    def num_gpus(self, server: ServerSettings) -> float:
        if self.replica_gpus is not None:
            return self.replica_gpus
        return 1.0 if server.device.startswith("cuda") else 0.0

    def replica_threads(self, server: ServerSettings) -> int:
        """A replica's torch threads: --threads, else its CPU reservation (at least one). Ray
        packs replicas by their reservations; more threads than that would contend with the
        replicas beside it."""
        return server.threads or max(1, int(self.replica_cpus))

    def deployment_options(self, server: ServerSettings) -> dict[str, object]:
        """The options of the replicas' Ray Serve deployment (Deployment.options), as data.

        max_ongoing_requests is the replica's own capacity, the rows of its batch and its queue:
        Ray routes no request to a replica that would refuse it for a full queue, and holds the
        rest until a replica has room (or the autoscaler adds one). The drain timeout becomes
        Ray's graceful shutdown: a replica being removed gets that long to finish its requests.
        A model that does not load fails again when retried (the same files, the same code), so
        the deployment fails after one failed start per replica, not Ray's three.
        """
        options: dict[str, object] = {
            "ray_actor_options": {"num_cpus": self.replica_cpus,
                                  "num_gpus": self.num_gpus(server)},
            "max_ongoing_requests": server.max_batch_size + server.max_queue,
            "graceful_shutdown_timeout_s": server.drain_timeout,
            "max_constructor_retry_count": max(1, self.min_replicas or self.replicas or 1),
        }
        if not self.autoscaling:
            return {**options, "num_replicas": self.replicas or 1}
        return {**options, "autoscaling_config": {
            "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests or server.max_batch_size,
            "upscale_delay_s": _or(self.upscale_delay, RAY_UPSCALE_DELAY),
            "downscale_delay_s": _or(self.downscale_delay, RAY_DOWNSCALE_DELAY),
            "look_back_period_s": _or(self.autoscaling_window, RAY_LOOK_BACK_PERIOD)}}

    def describe(self) -> str:
        """The replicas for the startup line: '2 replicas' or '1-4 replicas, autoscaled'."""
        if not self.autoscaling:
            count = self.replicas or 1
            return f"{count} replica{'s' if count > 1 else ''}"
        low = 1 if self.min_replicas is None else self.min_replicas
        return f"{low}-{self.max_replicas} replicas, autoscaled"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RaySettings:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ray`` and one flag per RaySettings field, in a group of their own."""
    group = parser.add_argument_group("ray", "serve on Ray Serve (the ray extra): every replica "
                                      "is this server, behind Ray's HTTP proxy")
    group.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead of "
                       "serving from this process; --host and --port are the proxy's")
    for f in fields(RaySettings):
        add_field_argument(group, f)


def ray_settings_from_args(args: argparse.Namespace) -> RaySettings | None:
    """RaySettings with --ray, None without; a Ray flag without --ray is a ConfigError (it
    would be ignored)."""
    settings = RaySettings.from_args(args)
    if args.ray:
        return settings
    default = RaySettings()
    for f in fields(RaySettings):
        if getattr(settings, f.name) != getattr(default, f.name):
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            raise ConfigError(f"{flag} applies to a Ray deployment; add --ray, or drop it.")
    return None
