"""OpenAI-compatible HTTP server: ``treedraft serve``.

One worker thread owns the model; HTTP handlers validate a request on the event loop, tokenize it
on a side thread, and hand a :class:`Job` to a bounded FIFO :class:`JobQueue`. A full queue is
answered with 429 + Retry-After. Modules, one concern each:

- :mod:`.protocol`: server limits, request models, body parsing and validation, :class:`APIError`;
- :mod:`.auth`: API keys (Bearer, constant-time compare) as an ASGI middleware; tenant ids;
- :mod:`.metrics`: Prometheus metrics (``prometheus_client``, one registry per app);
- :mod:`.worker`: :class:`Job`, :class:`JobQueue` and the model :class:`Worker` thread;
- :mod:`.app`: :class:`OpenAIServer` (request preparation, responses, SSE) and :func:`create_app`;
- :mod:`.cli`: ``treedraft serve`` (:func:`cmd_serve`, :func:`register`).
- :mod:`.ray_serve`: ``treedraft serve --ray``, N replicas of the app on Ray Serve (optional; imports Ray,
  so it is not imported here).
"""

from __future__ import annotations

from .app import OpenAIServer, create_app
from .auth import APIKeys, tenant_id
from .cli import cmd_serve, register
from .metrics import Metrics
from .protocol import (
    MAX_TREE_NODES_LIMIT,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ServerSettings,
    TreedraftOptions,
)
from .worker import Job, JobQueue, Worker

__all__ = [
    "MAX_TREE_NODES_LIMIT",
    "APIError",
    "APIKeys",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Job",
    "JobQueue",
    "Metrics",
    "OpenAIServer",
    "ServerSettings",
    "TreedraftOptions",
    "Worker",
    "cmd_serve",
    "create_app",
    "register",
    "tenant_id",
]
