"""API keys: ``Authorization: Bearer <key>`` checked in constant time by a small ASGI middleware.

Every path needs a key once keys are configured, except ``/health`` and ``/metrics`` unless those
are protected too (``--protect-health-metrics``). A request that passes carries its *tenant* id in
``request.state.tenant``: ``key-<first 16 hex digits of sha256(key)>``, never the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from .protocol import APIError

ENV_KEYS = "TREEDRAFT_API_KEYS"  # comma-separated keys, added to the --api-key ones
OPEN_PATHS = ("/health", "/metrics")  # reachable without a key unless protect_health_metrics

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def keys_from_env(environ: MutableMapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys listed in ``$TREEDRAFT_API_KEYS`` (comma-separated, blanks ignored)."""
    raw = (os.environ if environ is None else environ).get(ENV_KEYS, "")
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def tenant_id(key: str) -> str:
    """The tenant id of an API key: a short hash, safe to log and to use as an index key."""
    return "key-" + _digest(key).hex()[:16]


class APIKeys:
    """The configured keys, compared in constant time (every key is checked, on equal-length digests)."""

    def __init__(self, keys: Iterable[str]) -> None:
        if isinstance(keys, str):
            raise ValueError("give the API keys as a list or tuple of strings, not one string")
        keys = tuple(keys)
        for k in keys:
            if not isinstance(k, str) or not k or k != k.strip():
                raise ValueError(
                    "an API key must be non-empty and have no surrounding whitespace; "
                    "check --api-key and $TREEDRAFT_API_KEYS"
                )
            if not (k.isascii() and k.isprintable()):
                # an HTTP header carries bytes that servers read as Latin-1: a key with other characters could never
                # be sent as it was configured
                raise ValueError(
                    "an API key must be printable ASCII (a header cannot carry other characters reliably); check "
                    "--api-key and $TREEDRAFT_API_KEYS"
                )
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def tenant(self, authorization: str | None) -> str:
        """The tenant id of a valid ``Authorization`` header; APIError 401 otherwise."""
        if not authorization:
            raise _unauthorized("missing API key: send the header 'Authorization: Bearer <key>'", "missing_api_key")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("malformed Authorization header: expected 'Bearer <key>'", "invalid_api_key")
        d = _digest(token)
        match = None
        for i, ref in enumerate(self._digests):  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(d, ref):
                match = i
        if match is None:
            raise _unauthorized("incorrect API key provided", "invalid_api_key")
        return tenant_id(token)


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, "invalid_request_error", code=code, headers={"WWW-Authenticate": "Bearer"})


class AuthMiddleware:
    """Pure ASGI middleware (it leaves streaming and disconnect detection untouched): 401 without a valid key."""

    def __init__(
        self, app: ASGIApp, keys: APIKeys, protect_open_paths: bool, on_reject: Callable[[int], None] | None = None
    ) -> None:
        self.app, self.keys, self.protect_open_paths, self.on_reject = app, keys, protect_open_paths, on_reject

    def needs_key(self, path: str) -> bool:
        """Whether ``path`` needs a key (always False with no keys configured)."""
        if not self.keys:
            return False
        return self.protect_open_paths or path.rstrip("/") not in OPEN_PATHS

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] == "http" and self.needs_key(scope["path"]):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            try:
                tenant = self.keys.tenant(header)
            except APIError as e:
                if self.on_reject is not None:
                    self.on_reject(e.status)
                await e.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
