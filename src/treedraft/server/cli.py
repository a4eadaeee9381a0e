"""`treedraft serve`: the command-line entry point of the server."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from typing import Any

from .app import create_app
from .auth import ENV_KEYS, keys_from_env
from .protocol import ServerSettings

log = logging.getLogger("treedraft.server")


RAY_INSTALL = "pip install 'ray[serve]'"


def settings_from_args(a: argparse.Namespace) -> ServerSettings:
    """The server's limits and keys from the `treedraft serve` flags (keys in $TREEDRAFT_API_KEYS added)."""
    settings = ServerSettings(
        max_queue=a.max_queue,
        max_batch=a.max_batch,
        step_rows=a.step_rows,
        prefill_chunk=a.prefill_chunk or None,
        native_prefill=a.native_prefill,
        prefix_cache_mb=a.prefix_cache_mb,
        max_tokens_limit=a.max_tokens_limit,
        default_max_tokens=a.default_max_tokens,
        served_model_names=tuple(a.served_model_name or ()),
        heads=a.heads,
        retry_after_s=a.retry_after,
        api_keys=(*(a.api_key or ()), *keys_from_env()),
        protect_health_metrics=a.protect_health_metrics,
    )
    if a.protect_health_metrics and not settings.api_keys:
        raise ValueError(f"--protect-health-metrics needs at least one key: give --api-key or set ${ENV_KEYS}")
    if a.threads is not None and a.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {a.threads}")
    if not DRAIN_MARGIN_S <= a.shutdown_timeout <= MAX_SHUTDOWN_S:
        raise ValueError(
            f"--shutdown-timeout must be {DRAIN_MARGIN_S:g} to {MAX_SHUTDOWN_S:g} s, got {a.shutdown_timeout}"
        )
    if a.ray and a.shutdown_timeout != DEFAULT_SHUTDOWN_S:
        raise ValueError("--shutdown-timeout is the single-process server's; Ray Serve shuts its replicas down itself")
    if not 0 <= a.port <= 65535:  # said before the model load (bind() raised OverflowError after it)
        raise ValueError(f"--port must be in 0..65535, got {a.port}")
    return settings


def _import_ray_serve() -> Any:
    """:mod:`.ray_serve`, or a ValueError naming the pip command when Ray Serve is not installed."""
    import importlib

    for mod in ("ray", "ray.serve"):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(
                f"treedraft serve --ray needs Ray Serve, which is not installed here ({type(e).__name__}: {e}); "
                f"install it with: {RAY_INSTALL}  (or: pip install 'treedraft[ray]')"
            ) from None
    from . import ray_serve

    return ray_serve


def cmd_serve(a: argparse.Namespace) -> int:
    """`treedraft serve`: load the model and run uvicorn until interrupted (with --ray: N replicas on Ray Serve)."""
    from ..cli import load_from_args

    settings = settings_from_args(a)
    if a.ray:
        return _import_ray_serve().cmd_serve_ray(a, settings)
    if a.replicas != 1 or a.ray_address or a.replica_cpus is not None:
        raise ValueError("--replicas, --ray-address and --replica-cpus need --ray")
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    t = time.perf_counter()
    llm = load_from_args(a)
    log.warning(
        "loaded %s in %.1fs, default drafter %s; starting the server on http://%s:%d (%s)",
        llm.model_name,
        time.perf_counter() - t,
        getattr(llm.engine.drafter, "name", "none"),
        a.host,
        a.port,
        f"{len(set(settings.api_keys))} API key(s)" if settings.api_keys else "no API key required",
    )
    run_server(create_app(llm, settings), a.host, a.port, a.log_level, a.shutdown_timeout)
    return 0


def run_server(app: Any, host: str, port: int, log_level: str, shutdown_s: float) -> None:
    """Serve ``app`` with uvicorn until a shutdown, which lets running requests finish for ``shutdown_s`` seconds
    (those still running 1 s before its end get a 503: :func:`draining_server`)."""
    import uvicorn

    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_s)
    draining_server(cfg, lambda: app.state.treedraft.drain(shutdown_s - DRAIN_MARGIN_S)).run()


DRAIN_MARGIN_S = 1.0  # requests still going this long before the grace period ends get their 503 (time to send it)
DEFAULT_SHUTDOWN_S = 30.0
MAX_SHUTDOWN_S = 86400.0  # a day (a timer of inf seconds overflows)


def draining_server(config: Any, drain: Any) -> Any:
    """A uvicorn server that calls ``drain()`` when its shutdown begins (SIGTERM, Ctrl-C), before it waits for the
    running requests: the app then answers what is left near the end of the grace period with an error."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            drain()
            await super().shutdown(sockets=sockets)

    return DrainingServer(config)


def register(subparsers: Any) -> None:
    """Add `treedraft serve` to the CLI."""
    from ..cli import add_model_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    add_model_args(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests allowed to wait behind a full batch (free batch slots do not count: 0 = serve up to --max-batch at "
        "once, queue none); beyond that the server answers 429",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="requests decoded together, one target forward per step (the queue holds the rest; 1 = one at a time)",
    )
    p.add_argument(
        "--step-rows",
        type=int,
        default=None,
        help="draft-tree rows per step shared equally by the batch (default: from this machine's latency "
        "curve, measured once: a lone request's tree is the largest forward costing <= 3 one-token forwards, "
        "and a batch's draft rows go to the requests whose drafts get accepted, as far as they pay)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens a joining request prefills per step, so running requests wait at most one "
        "chunk (0 = whole prompts)",
    )
    p.add_argument(
        "--native-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill prompts through the native decoder in chunks of <= 64 rows (several requests' chunks per "
        "step, up to --prefill-chunk rows; default on): faster than the Python prefill and the same arithmetic "
        "as `treedraft generate`, so greedy text equals the CLI's when --prefill-chunk is at least 64. "
        "--no-native-prefill: prompts in --prefill-chunk pieces through the Python path",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="memory for finished prompt prefills (keys/values, hidden states, first-token logits): a request "
        "whose prompt, or a prefix of it, was prefilled before for the same tenant skips those rows and gets the "
        "same tokens (any prefix with the native prefill of --weights int4/int8; on the Python prefill path one "
        "ending on a --prefill-chunk boundary); least recently used entries go first (0 = off)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default and upper bound: the context window - 1)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="max_tokens when a request gives none (default 256; OpenAI and vLLM run to the context's end instead)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="name(s) clients use in 'model' (repeatable; default: the model's name)",
    )
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds sent with 429")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (repeatable; keys in ${ENV_KEYS}, comma-separated, "
        "are added and stay out of the process list)",
    )
    p.add_argument(
        "--protect-health-metrics",
        action="store_true",
        help="with API keys: /health and /metrics need a key too (default: open, for probes and scrapers)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads of the model (default: torch's, i.e. all cores; with --ray: per replica, default 1)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_S,
        help="seconds a shutdown (SIGTERM, Ctrl-C) lets running requests finish (not with --ray); those still running 1 s before the "
        "end are answered with a 503 error (server_shutting_down) (default 30)",
    )
    r = p.add_argument_group(f"scale-out on Ray Serve (optional: {RAY_INSTALL})")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve through Ray Serve's HTTP proxy on --host/--port: --replicas engine replicas, each with its "
        "own model and batching worker, same routes and API keys",
    )
    r.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas (Ray restarts one that dies)")
    r.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --ray: join this running cluster (e.g. 'auto' or HEAD_IP:6379 after `ray start`); "
        "default: start a one-machine cluster on 127.0.0.1",
    )
    r.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="with --ray: Ray CPUs each replica reserves (default: --threads, else 1)",
    )
    p.set_defaults(func=cmd_serve)


_SWITCHES = ("protect_health_metrics", "suffix_share")  # store_true flags: key=true turns them on
_ON_OFF = ("native_prefill",)  # --flag / --no-flag pairs: key=true or key=false (a review: they could not be given)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def serve_argv(args: Mapping[str, str]) -> list[str]:
    """``treedraft serve --ray`` arguments from Ray Serve's ``key=value`` pairs (``serve run
    treedraft.server.ray_serve:app_builder ...``); a ValueError for an on/off flag given neither true nor false."""
    argv = ["serve", "--ray"]
    for k, v in args.items():
        key = k.replace("-", "_")
        flag = "--" + key.replace("_", "-")
        if key in _SWITCHES or key in _ON_OFF:
            on = str(v).strip().lower()
            if on not in _TRUE + _FALSE:
                raise ValueError(f"{k}={v!r}: give {k}=true or {k}=false")
            if on in _TRUE:
                argv.append(flag)
            elif key in _ON_OFF:
                argv.append("--no-" + flag[2:])
            continue
        for x in str(v).split(",") if key in ("api_key", "served_model_name") else [str(v)]:
            argv += [flag, x]
    return argv
