"""Scale-out on Ray Serve: ``treedraft serve --ray --replicas N``.

Each replica is one Ray actor that loads its own model and runs the plain server's ASGI app
(:func:`~.app.create_app`) unchanged: the same routes, request validation, API keys, batching worker,
queue/429 and Prometheus metrics. Serve's HTTP proxy spreads requests over the replicas (it prefers
the one with fewer requests in flight) and its controller replaces a replica that dies or fails its
health check. Every response names the replica that produced it in the ``x-treedraft-replica`` header,
and each replica's ``/metrics`` carries ``treedraft:replica_info{replica=...}``; behind the proxy,
``/health`` and ``/metrics`` answer for whichever replica the proxy picked.

Ray is optional (``pip install 'ray[serve]'``); this module imports it at the top, so import it only
once that is known to be installed (:func:`require_ray`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import ray
import torch
from prometheus_client import Gauge
from ray import serve
from ray.serve.config import HTTPOptions
from ray.serve.schema import LoggingConfig

from .app import create_app
from .protocol import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve.deployment import Application
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..api import LLM

log = logging.getLogger("treedraft.server")

APP_NAME = "treedraft"
REPLICA_HEADER = "x-treedraft-replica"
SERVE_NAMESPACE = "serve"  # where Serve names its replica actors ("SERVE_REPLICA::app#deployment#id")


class _ReplicaHeader:
    """ASGI middleware: every HTTP response carries ``x-treedraft-replica: <replica id>``."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.ingress()
class TreedraftReplica:
    """One engine replica: its own model, ``threads`` torch threads, and the plain server's app."""

    def __init__(self, loader: Callable[[], LLM], settings: ServerSettings, threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.replica = serve.get_replica_context().replica_tag
        self.settings = settings
        t = time.perf_counter()
        self.llm = loader()
        log.warning(
            "replica %s: loaded %s in %.1fs, %d thread(s)",
            self.replica,
            self.llm.model_name,
            time.perf_counter() - t,
            torch.get_num_threads(),
        )
        self._fastapi: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The plain server's app for this replica's model, tagged with the replica id (Serve calls it once)."""
        app = create_app(self.llm, self.settings)
        srv = app.state.treedraft
        info = Gauge(
            "treedraft:replica_info",
            "The Ray Serve replica this exposition is from (always 1).",
            ["model_name", "replica"],
            registry=srv.metrics.registry,
        )
        info.labels(model_name=srv.names[0], replica=self.replica).set(1)
        app.add_middleware(_ReplicaHeader, replica=self.replica)  # outermost: 401s carry it too
        self._fastapi = app
        return app

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose model worker thread died is replaced."""
        if self._fastapi is not None and not self._fastapi.state.treedraft.worker.alive():
            raise RuntimeError(f"replica {self.replica}: the model worker thread is not running")


def deployment(
    loader: Callable[[], LLM],
    settings: ServerSettings,
    replicas: int = 1,
    threads: int | None = None,
    cpus_per_replica: float | None = None,
    log_level: str = "INFO",
) -> Application:
    """A Serve application of ``replicas`` engine replicas, each built by ``loader`` (a picklable callable).

    Each replica reserves ``cpus_per_replica`` Ray CPUs (default: ``threads``, else 1). Serve routes at most
    ``max_batch + max_queue + 1`` requests to a replica at once: one more than its batch and queue hold, so a
    full replica answers 429 + Retry-After itself, as the plain server does (Serve holds the rest until then).
    ``log_level`` is the replicas' (INFO logs every request, like uvicorn's access log).
    """
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    cpus = cpus_per_replica if cpus_per_replica is not None else float(threads or 1)
    dep = serve.deployment(
        TreedraftReplica,
        name="TreedraftReplica",
        num_replicas=replicas,
        max_ongoing_requests=settings.max_batch + settings.max_queue + 1,
        ray_actor_options={"num_cpus": cpus},
        health_check_period_s=5,
        logging_config=_logging(log_level),
    )
    return dep.bind(loader, settings, threads)


def _logging(level: str) -> LoggingConfig:
    """Serve's logging at ``level``; request (access) logs only at INFO and DEBUG."""
    level = level.upper()
    return LoggingConfig(log_level=level, enable_access_log=level in ("DEBUG", "INFO"))


@contextmanager
def local_cluster(num_cpus: int | None = None, object_store_mb: int = 256) -> Iterator[None]:
    """A one-machine Ray cluster on loopback only: node IP 127.0.0.1, no dashboard, no usage reporting."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the internet
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=num_cpus,
        object_store_memory=object_store_mb * 1024 * 1024,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def run_app(app: Application, host: str = "127.0.0.1", port: int = 8000, log_level: str = "INFO") -> None:
    """Start Serve's HTTP proxy on ``host:port`` and deploy ``app`` at ``/``; returns once every replica is up.

    ``log_level`` is Serve's controller and proxy's."""
    serve.start(http_options=HTTPOptions(host=host, port=port), logging_config=_logging(log_level))
    serve.run(app, name=APP_NAME, route_prefix="/")


def running_replicas() -> int:
    """How many replicas of the treedraft app Serve reports RUNNING (0 when the app is not deployed)."""
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return 0
    return sum(int(d.replica_states.get("RUNNING", 0)) for d in app.deployments.values())


def replica_actors() -> dict[str, str]:
    """The running replicas of the treedraft app: replica id -> Ray actor name (namespace ``serve``)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if a["namespace"] == SERVE_NAMESPACE and name.startswith(f"SERVE_REPLICA::{APP_NAME}#"):
            out[name.rsplit("#", 1)[1]] = name
    return out


# ----------------------------------------------------------------------------- command line


def loader_from_args(a: argparse.Namespace) -> Callable[[], LLM]:
    """A picklable model loader with the CLI's model flags (each replica calls it)."""
    from ..cli import load_from_args

    return partial(load_from_args, a)


def app_from_args(a: argparse.Namespace, settings: ServerSettings) -> Application:
    """The Serve application ``treedraft serve --ray`` deploys."""
    if a.suffix_store is not None and a.replicas > 1:
        raise ValueError(
            "--suffix-store is one process's directory and the replicas would all write it; "
            "drop it (each replica keeps its own store in memory) or use --replicas 1"
        )
    threads = a.threads if a.threads is not None else max(1, int(a.replica_cpus or 1))
    return deployment(loader_from_args(a), settings, a.replicas, threads, a.replica_cpus, a.log_level)


def cmd_serve_ray(a: argparse.Namespace, settings: ServerSettings) -> int:
    """``treedraft serve --ray``: join (``--ray-address``) or start a local cluster, deploy, serve until Ctrl-C."""
    app = app_from_args(a, settings)
    if not a.ray_address:  # same machine, same files: a wrong --model fails here, not in N replicas Serve retries
        from ..models.registry import resolve

        resolve(a.model)
    if a.ray_address:
        cluster: Any = joined_cluster(a.ray_address)
    else:
        need = math.ceil(a.replicas * (a.replica_cpus or a.threads or 1))
        cluster = local_cluster(num_cpus=max(os.cpu_count() or 1, need))
    with cluster:
        t = time.perf_counter()
        try:
            run_app(app, a.host, a.port, a.log_level)
        except RuntimeError as e:  # Serve gave up on the replicas; their traceback is in the log above
            raise ValueError(f"the replicas did not start (their error is logged above): {e}") from None
        log.warning(
            "%d replica(s) up in %.1fs; serving on http://%s:%d (%s); Ctrl-C stops",
            a.replicas,
            time.perf_counter() - t,
            a.host,
            a.port,
            f"{len(set(settings.api_keys))} API key(s)" if settings.api_keys else "no API key required",
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            log.warning("stopping")
    return 0


@contextmanager
def joined_cluster(address: str) -> Iterator[None]:
    """A running cluster (``ray start``): connect; on exit remove the treedraft app and disconnect, leaving it up."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        yield
    finally:
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()


def app_builder(args: Mapping[str, str]) -> Application:
    """``serve run treedraft.server.ray_serve:app_builder model=... replicas=2 threads=1``: the
    ``treedraft serve`` flags as ``key=value`` (dashes or underscores; ``api_key`` may be comma-separated; on/off
    flags as key=true / key=false; see :func:`treedraft.server.cli.serve_argv`)."""
    from ..cli import build_parser
    from .cli import serve_argv, settings_from_args

    a = build_parser().parse_args(serve_argv(args))
    return app_from_args(a, settings_from_args(a))
