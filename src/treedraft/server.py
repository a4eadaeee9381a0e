"""OpenAI-compatible HTTP server: ``treedraft serve``.

One worker thread owns the model (the engine reuses one KV cache and torch is not
re-entrant here); HTTP handlers validate a request on the event loop, tokenize it
on a side thread, and hand a :class:`Job` to a bounded FIFO :class:`JobQueue`.
The worker streams :class:`~treedraft.text.Chunk` s back through the event loop
(``call_soon_threadsafe``), checks between chunks whether the client went away,
and records Prometheus metrics. A full queue is answered with 429 + Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import GenerationConfig, GenerationStats
from .interfaces import GenerationError
from .text import Chunk
from .tree import TreeError
from .verify import RULES as _RULES

if TYPE_CHECKING:
    from .api import LLM
    from .interfaces import Drafter

log = logging.getLogger("treedraft.server")


def _request_drafters() -> tuple[str, ...]:
    """Drafter names a request may pick: 'default' (the server's own), the registry's names and aliases."""
    from .drafters.registry import choices

    return choices()


MAX_TREE_NODES_LIMIT = 512


# ----------------------------------------------------------------------------- settings + errors


@dataclass(frozen=True)
class ServerSettings:
    """Limits and names of one server instance."""

    max_queue: int = 64  # requests allowed to wait behind the running one; more -> 429
    max_tokens_limit: int | None = None  # largest max_tokens accepted (None: context window - 1)
    default_max_tokens: int = 256  # when a request gives none (capped by what the context leaves)
    served_model_names: tuple[str, ...] = ()  # names accepted in "model" (empty: the loaded model's name)
    heads: str | None = "default"  # Medusa heads for requests that pick drafter "medusa"
    retry_after_s: int = 1  # Retry-After header on 429
    poll_interval_s: float = 0.25  # how often a waiting handler checks for a client disconnect
    max_body_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ----------------------------------------------------------------------------- request schemas

_STRICT = ConfigDict(strict=True, extra="ignore")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The message content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TreedraftOptions(BaseModel):
    """The ``"treedraft"`` extension field: per-request drafter, tree budget and acceptance rule."""

    model_config = ConfigDict(strict=True, extra="forbid")
    drafter: str | None = None
    rule: str | None = None
    max_tree_nodes: int | None = Field(None, ge=1, le=MAX_TREE_NODES_LIMIT)


class _CommonRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = None
    # explicit JSON null means "default" for every optional field, as with OpenAI's API
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None -> 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # vLLM-style extra; 0 disables
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM-style extra
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    treedraft: TreedraftOptions | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


# pydantic tags each member of a union field in an error's location; say what the union accepts instead
_UNION_TAGS = {"str", "list[str]", "list[int]", "list[TextPart]"}
_UNION_HELP = {
    "stop": "should be a string or a list of strings",
    "prompt": "should be a string, a list with one string, or a list of token ids",
    "content": "should be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _error_location(loc: tuple) -> tuple[tuple, bool]:
    """Error location without union-member tags; True when a tag was cut."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and part in _UNION_TAGS:
            return loc[:i], True
    return loc, False


def _parse(model: type[BaseModel], body: bytes) -> Any:  # noqa: ANN401
    """Validate a JSON body; any problem -> a 400 APIError naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, "the request body must be a JSON object") from None
        loc, in_union = _error_location(first["loc"])
        msg = _UNION_HELP.get(str(loc[-1]) if loc else "", first["msg"]) if in_union else first["msg"]
        others = {_error_location(x["loc"])[0] for x in errs} - {loc}
        more = f" (and {len(others)} more problem{'s' if len(others) > 1 else ''})" if others else ""
        param = ".".join(str(p) for p in loc)
        raise APIError(400, f"{param or 'body'}: {msg}{more}", param=param or None) from None


def _reject_unsupported(req: _CommonRequest) -> None:
    """400 for OpenAI parameters this server does not implement (never silently ignored)."""
    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported; this server returns exactly one choice (n=1)", param="n")
    if req.presence_penalty or req.frequency_penalty:
        raise APIError(400, "presence_penalty and frequency_penalty are not supported; leave them at 0",
                       param="presence_penalty" if req.presence_penalty else "frequency_penalty")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed together with stream=true", param="stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.tools or req.tool_choice not in (None, "none"):
            raise APIError(400, "tools / tool_choice are not supported", param="tools")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
    if isinstance(req, CompletionRequest):
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.best_of not in (None, 1):
            raise APIError(400, f"best_of={req.best_of} is not supported; use 1", param="best_of")
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")


# ----------------------------------------------------------------------------- metrics


class _Family:
    """One metric family: samples keyed by a sorted label tuple."""

    def __init__(self, name: str, kind: str, help_: str, labeled: bool = False) -> None:
        self.name, self.kind, self.help = name, kind, help_
        # unlabeled families are exported as 0 before their first event; labeled ones only once seen
        self.values: dict[tuple[tuple[str, str], ...], float] = {} if labeled else {(): 0.0}

    def inc(self, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value


class _Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1


_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                 160.0, 640.0)
_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)


def _fmt_labels(base: dict[str, str], extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = list(base.items()) + list(extra)
    if not items:
        return ""
    esc = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in items)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(items, esc)) + "}"


def _label_order(kv: tuple[tuple[tuple[str, str], ...], float]) -> list[tuple[str, int, str]]:
    """Sort samples by label, numeric label values (positions, statuses) numerically."""
    return [(k, int(v) if v.isdigit() else -1, v) for k, v in kv[0]]


def _fmt_num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{int(v)}.0"


class Metrics:
    """Thread-safe counters, gauges and histograms rendered in Prometheus text format (vLLM-like names)."""

    def __init__(self, model_name: str) -> None:
        self.lock = threading.Lock()
        self.labels = {"model_name": model_name}
        f = _Family
        self.requests = f("treedraft:num_requests_total", "counter", "Requests accepted into the queue.")
        self.success = f("treedraft:request_success_total", "counter", "Finished requests by finish reason.", True)
        self.aborted = f("treedraft:request_aborted_total", "counter",
                         "Requests whose client disconnected before the answer was complete.")
        self.errors = f("treedraft:request_errors_total", "counter", "Requests answered with an error, by status.",
                        True)
        self.prompt_tokens = f("treedraft:prompt_tokens_total", "counter", "Prefill tokens processed.")
        self.gen_tokens = f("treedraft:generation_tokens_total", "counter", "Generated tokens.")
        self.last_tps = f("treedraft:generation_tokens_per_second", "gauge",
                          "Decode speed (tokens/s) of the most recently finished request.")
        self.drafts = f("treedraft:spec_decode_num_drafts_total", "counter", "Verify steps that checked a draft tree.")
        self.draft_tokens = f("treedraft:spec_decode_num_draft_tokens_total", "counter",
                              "Draft tokens verified (tree nodes, root excluded).")
        self.accepted = f("treedraft:spec_decode_num_accepted_tokens_total", "counter",
                          "Draft tokens accepted (bonus tokens excluded).")
        self.accepted_pos = f("treedraft:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                              "Accepted draft tokens by depth in the tree (0 = first draft token).", True)
        self.drafts_pos = f("treedraft:spec_decode_num_drafts_per_pos_total", "counter",
                            "Drafts whose tree reached this depth (denominator of acceptance per position).", True)
        self.steps = f("treedraft:spec_decode_num_verify_steps_total", "counter",
                       "All target forward steps after prefill, plain ones included "
                       "(mean accepted length = (accepted + steps) / steps).")
        self.families = [self.requests, self.success, self.aborted, self.errors, self.prompt_tokens,
                         self.gen_tokens, self.last_tps, self.drafts, self.draft_tokens, self.accepted,
                         self.accepted_pos, self.drafts_pos, self.steps]
        h = _Histogram
        self.ttft = h("treedraft:time_to_first_token_seconds", "Arrival to first generated token.", _TIME_BUCKETS)
        self.e2e = h("treedraft:e2e_request_latency_seconds", "Arrival to last generated token.", _TIME_BUCKETS)
        self.queue_time = h("treedraft:request_queue_time_seconds", "Time spent waiting for the worker.",
                            _TIME_BUCKETS)
        self.tps = h("treedraft:request_generation_tokens_per_second", "Per-request decode speed.", _RATE_BUCKETS)
        self.histograms = [self.ttft, self.e2e, self.queue_time, self.tps]
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def gauge_fn(self, name: str, help_: str, fn: Callable[[], float]) -> None:
        """A gauge whose value is read at scrape time."""
        self.gauges[name] = (help_, fn)

    def error(self, status: int) -> None:
        """Count one request answered with an error."""
        with self.lock:
            self.errors.inc(status=str(status))

    def record(self, stats: GenerationStats, t_arrival: float, t_start: float | None, t_first: float | None,
               t_end: float, n_tokens: int, outcome: str) -> None:
        """Account one generation (finished, aborted or failed) from the worker thread."""
        with self.lock:
            if outcome == "aborted":
                self.aborted.inc()
            elif outcome in ("stop", "length"):
                self.success.inc(finished_reason=outcome)
            if t_start is not None:
                self.queue_time.observe(t_start - t_arrival)
                self.prompt_tokens.inc(stats.prompt_tokens)
            if t_first is not None:
                self.ttft.observe(t_first - t_arrival)
                self.e2e.observe(t_end - t_arrival)
            self.gen_tokens.inc(n_tokens)
            if n_tokens and stats.t_decode > 0:
                self.tps.observe(stats.tokens_per_s)
                self.last_tps.set(stats.tokens_per_s)
            self.steps.inc(len(stats.steps))
            for s in stats.steps:
                if s.tree_size <= 1:
                    continue
                self.drafts.inc()
                self.draft_tokens.inc(s.tree_size - 1)
                self.accepted.inc(s.accepted)
                for d in range(s.tree_depth):
                    self.drafts_pos.inc(position=str(d))
                for d in range(s.accepted):
                    self.accepted_pos.inc(position=str(d))

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []
        with self.lock:
            for name, (help_, fn) in self.gauges.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge",
                          f"{name}{_fmt_labels(self.labels)} {_fmt_num(fn())}"]
            for fam in self.families:
                lines += [f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} {fam.kind}"]
                for key, v in sorted(fam.values.items(), key=_label_order):
                    lines.append(f"{fam.name}{_fmt_labels(self.labels, key)} {_fmt_num(v)}")
            for h in self.histograms:
                lines += [f"# HELP {h.name} {h.help}", f"# TYPE {h.name} histogram"]
                for b, c in zip((*h.buckets, math.inf), (*h.counts, h.count)):
                    lines.append(f"{h.name}_bucket{_fmt_labels(self.labels, (('le', _fmt_num(b)),))} {c}")
                lines.append(f"{h.name}_sum{_fmt_labels(self.labels)} {_fmt_num(h.sum)}")
                lines.append(f"{h.name}_count{_fmt_labels(self.labels)} {h.count}")
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- jobs, queue, worker


@dataclass
class _Done:
    finish_reason: str
    stats: GenerationStats


@dataclass
class _Failed:
    error: APIError


class Job:
    """One generation request travelling from an HTTP handler to the worker and back."""

    def __init__(self, prompt_ids: list[int], config: GenerationConfig, drafter: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.prompt_ids, self.config, self.drafter = prompt_ids, config, drafter
        self.loop = loop
        self.t_arrival = time.perf_counter()
        self.cancelled = threading.Event()
        self._items: deque[Chunk | _Done | _Failed] = deque()
        self._ready = asyncio.Event()
        self.queue: JobQueue | None = None

    def cancel(self) -> bool:
        """Stop this job: True if it was still waiting (now dropped); else the worker stops at its next chunk."""
        self.cancelled.set()
        queue = self.queue
        return queue is not None and queue.remove(self)

    def deliver(self, item: Chunk | _Done | _Failed) -> None:
        """Called by the worker thread: hand one item to the event loop (dropped once the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # event loop closed: nobody is listening any more
            self.cancelled.set()

    def _put(self, item: Chunk | _Done | _Failed) -> None:
        self._items.append(item)
        self._ready.set()

    async def next(self, timeout: float) -> Chunk | _Done | _Failed | None:
        """The next item from the worker, or None after ``timeout`` seconds without one."""
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self._items.popleft()


class JobQueue:
    """Bounded FIFO of waiting jobs; a job whose client left can be removed from the middle."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def put_nowait(self, job: Job) -> bool:
        """Append a job; False when ``maxsize`` jobs are already waiting."""
        with self._cv:
            if self._closed or len(self._items) >= self.maxsize:
                return False
            job.queue = self
            self._items.append(job)
            self._cv.notify()
            return True

    def remove(self, job: Job) -> bool:
        """Take a still-waiting job out of the queue."""
        with self._cv:
            try:
                self._items.remove(job)
                return True
            except ValueError:
                return False

    def get(self) -> Job | None:
        """Block until a job is available (None once closed)."""
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            job = self._items.popleft()
            job.queue = None
            return job

    def close(self) -> None:
        """Wake the worker and make it exit; waiting jobs are dropped."""
        with self._cv:
            self._closed = True
            self._items.clear()
            self._cv.notify_all()


class Worker:
    """The single thread that runs the model, one job at a time, in queue order."""

    def __init__(self, llm: LLM, settings: ServerSettings, metrics: Metrics) -> None:
        self.llm, self.settings, self.metrics = llm, settings, metrics
        self.queue = JobQueue(settings.max_queue)
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="treedraft-worker", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop waiting ones and join the thread."""
        job = self.running
        if job is not None:
            job.cancelled.set()
        self.queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()

    def _drafter(self, name: str) -> Drafter | None:
        try:  # built once per name by the LLM's drafter cache
            return self.llm.get_drafter(name, heads=self.settings.heads)
        except (ImportError, FileNotFoundError, ValueError) as e:
            # the name is valid (checked in prepare) but this server cannot build it (e.g. no heads)
            log.warning("drafter %r is not available: %s: %s", name, type(e).__name__, e)
            raise APIError(400, f"drafter {name!r} is not available on this server: {e}",
                           param="treedraft.drafter", code="drafter_unavailable") from None

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled.is_set():  # its client left just as the job was dequeued
                self.metrics.record(GenerationStats(), job.t_arrival, None, None, time.perf_counter(), 0, "aborted")
                continue
            self.running = job
            try:
                self._run(job)
            except Exception:  # noqa: BLE001 - keep serving; the job already got its error
                log.exception("worker: unexpected error while finishing a job")
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        stats = GenerationStats()
        t_start = time.perf_counter()
        t_first: float | None = None
        n_tokens, outcome = 0, "error"
        gen = None
        try:
            drafter = self._drafter(job.drafter)
            gen = self.llm.text.stream(job.prompt_ids, job.config, drafter, stats)
            finish = "length"
            for chunk in gen:
                if job.cancelled.is_set():
                    break
                if t_first is None and chunk.token_ids:
                    t_first = time.perf_counter()
                n_tokens += len(chunk.token_ids)
                job.deliver(chunk)
                finish = chunk.finish_reason or finish
            if job.cancelled.is_set():
                outcome = "aborted"
            else:
                outcome = finish
                job.deliver(_Done(finish, stats))
        except APIError as e:  # raised deliberately: already the right status and message
            job.deliver(_Failed(e))
        except GenerationError as e:  # the engine rejects the request itself (it names the limit): client's fault
            job.deliver(_Failed(APIError(400, str(e), code="invalid_generation_request")))
        except TreeError as e:  # a drafter bug, not the client's fault
            log.exception("generation failed: drafter %r produced an invalid tree", job.drafter)
            job.deliver(_Failed(APIError(500, f"internal error in the drafter: {e}", "server_error")))
        except Exception as e:  # noqa: BLE001 - any other error (ValueError included) is a server bug
            # e.g. a KV cache overflow or a drafter's inconsistent q: answer 500, log it, keep serving
            log.exception("generation failed (drafter %r)", job.drafter)
            job.deliver(_Failed(APIError(500, f"internal error during generation: {type(e).__name__}: {e}",
                                         "server_error")))
        finally:
            if gen is not None:
                gen.close()
            self.metrics.record(stats, job.t_arrival, t_start, t_first, time.perf_counter(), n_tokens, outcome)


# ----------------------------------------------------------------------------- responses


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _spec_info(drafter: str, stats: GenerationStats) -> dict:
    return {"drafter": drafter, "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "steps": len(stats.steps), "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth()]}


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class _JobStreamingResponse(StreamingResponse):
    """A streaming response that cancels its job however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], job: Job) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


@dataclass
class _Prepared:
    """A validated request ready for the worker."""

    prompt_ids: list[int]
    config: GenerationConfig
    drafter: str
    stream: bool
    include_usage: bool
    model: str


class OpenAIServer:
    """Request handling behind the routes: validation, queueing, response shaping."""

    def __init__(self, llm: LLM, settings: ServerSettings | None = None) -> None:
        self.llm = llm
        self.settings = settings = settings or ServerSettings()
        self.names = settings.served_model_names or (llm.model_name,)
        self.metrics = Metrics(self.names[0])
        self.worker = Worker(llm, settings, self.metrics)
        self.context = llm.model.max_seq_len
        self.tokens_limit = min(settings.max_tokens_limit or self.context - 1, self.context - 1)
        self.tok_pool = ThreadPoolExecutor(1, "treedraft-tokenize")  # keeps tokenizing off the event loop
        m = self.metrics
        m.gauge_fn("treedraft:num_requests_running", "Requests being generated now (0 or 1).",
                   lambda: float(self.worker.running is not None))
        m.gauge_fn("treedraft:num_requests_waiting", "Requests waiting in the queue.",
                   lambda: float(len(self.worker.queue)))
        m.gauge_fn("treedraft:max_queue_size", "Waiting requests allowed before 429.",
                   lambda: float(settings.max_queue))

    def start(self) -> None:
        """Start the worker (app startup)."""
        self.worker.start()

    def stop(self) -> None:
        """Stop the worker and the tokenizer thread (app shutdown)."""
        self.worker.stop()
        self.tok_pool.shutdown(wait=False, cancel_futures=True)

    # -- validation

    async def read(self, request: Request, model: type[BaseModel]) -> Any:  # noqa: ANN401
        """The request body validated against ``model``."""
        body = await request.body()
        if len(body) > self.settings.max_body_bytes:
            raise APIError(413, f"the request body has {len(body)} bytes; the limit is {self.settings.max_body_bytes}")
        return _parse(model, body)

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (404 when unknown)."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise APIError(404, f"the model {name!r} does not exist on this server; available: "
                                f"{', '.join(self.names)}", param="model", code="model_not_found")
        return name

    def encode(self, req: _CommonRequest) -> list[int]:
        """Request -> prompt ids (runs on the tokenizer thread; user errors -> APIError 400)."""
        chat = isinstance(req, ChatCompletionRequest)
        try:
            if chat:
                if not req.messages:
                    raise APIError(400, "messages must contain at least one message", param="messages")
                msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in req.messages]
                if not any(m["content"].strip() for m in msgs):
                    raise APIError(400, "all messages are empty; give some text", param="messages")
                return self.llm.encode_prompt(msgs)
            p = req.prompt
            if isinstance(p, list) and p and isinstance(p[0], str):
                if len(p) != 1:
                    raise APIError(400, f"got {len(p)} prompts; this server takes exactly one per request",
                                   param="prompt")
                p = p[0]
            if isinstance(p, list):
                if not p:
                    raise APIError(400, "prompt is empty; give text or token ids", param="prompt")
                return list(p)
            return self.llm.encode_prompt(p, raw=True)
        except APIError:
            raise
        except ValueError as e:  # GenerationError or tokenizer/template complaints
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except Exception as e:  # noqa: BLE001 - e.g. a chat template raising on odd input
            raise APIError(400, f"could not tokenize the input: {type(e).__name__}: {e}",
                           param="messages" if chat else "prompt") from None

    async def prepare(self, req: _CommonRequest) -> _Prepared:
        """Validate everything that can be checked before queueing; tokenize off the event loop."""
        model = self.check_model(req.model)
        _reject_unsupported(req)
        chat = isinstance(req, ChatCompletionRequest)
        pname = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, pname)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"{pname} must be at least 1, got {max_tokens}", param=pname)
        if max_tokens is not None and max_tokens > self.tokens_limit:
            raise APIError(400, f"{pname}={max_tokens} is above this server's limit of {self.tokens_limit}",
                           param=pname)
        opts = req.treedraft or TreedraftOptions()
        drafter = opts.drafter or "default"
        if drafter not in _request_drafters():
            raise APIError(400, f"unknown drafter {drafter!r}; choose one of {', '.join(_request_drafters())}",
                           param="treedraft.drafter")
        if opts.rule is not None and opts.rule not in _RULES:
            raise APIError(400, f"unknown acceptance rule {opts.rule!r}; choose one of {', '.join(_RULES)}",
                           param="treedraft.rule")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not x for x in stop):
            raise APIError(400, f"stop strings must be non-empty, got {stop!r}", param="stop")
        prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tok_pool, self.encode, req)
        try:
            self.llm.engine.check_prompt(prompt_ids)
        except GenerationError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt",
                           code="context_length_exceeded" if len(prompt_ids) >= self.context else None) from None
        room = self.context - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, self.tokens_limit, room)
        elif max_tokens > room:
            raise APIError(400, f"this model's context window is {self.context} tokens; the prompt has "
                                f"{len(prompt_ids)} and {pname}={max_tokens} asks for more than the {room} left; "
                                f"lower {pname} or shorten the prompt", param=pname, code="context_length_exceeded")
        try:
            cfg = self.llm.config(max_new_tokens=max_tokens,
                                  temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                                  seed=req.seed, stop=stop, rule=opts.rule or "speculative",
                                  max_tree_nodes=opts.max_tree_nodes or 64)
            cfg = replace(cfg, ignore_eos=bool(req.ignore_eos))
        except ValueError as e:  # e.g. rule 'greedy' with temperature > 0
            raise APIError(400, str(e), param="treedraft.rule" if "rule" in str(e) else None) from None
        inc = bool(req.stream_options and req.stream_options.include_usage)
        return _Prepared(prompt_ids, cfg, drafter, bool(req.stream), inc, model)

    def drafter_name(self, requested: str) -> str:
        """The name reported back: what 'default' resolves to, 'none' for plain decoding."""
        if requested == "default":
            d = self.llm.engine.drafter
            return "none" if d is None else getattr(d, "name", type(d).__name__)
        return "none" if requested == "plain" else requested

    # -- queueing

    def submit(self, p: _Prepared) -> Job:
        """Queue a job, or 429 + Retry-After when the queue is full."""
        if not self.worker.alive():
            raise APIError(503, "the model worker is not running; restart the server", "server_error")
        job = Job(p.prompt_ids, p.config, p.drafter, asyncio.get_running_loop())
        if not self.worker.queue.put_nowait(job):
            s = self.settings
            raise APIError(429, f"the server is busy: {s.max_queue} requests are already waiting; retry after "
                                f"{s.retry_after_s}s", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(s.retry_after_s)})
        with self.metrics.lock:
            self.metrics.requests.inc()
        return job

    async def next_or_disconnect(self, job: Job, request: Request) -> Chunk | _Done | _Failed | None:
        """The worker's next item; None (and the job cancelled) once the client has gone."""
        while True:
            item = await job.next(self.settings.poll_interval_s)
            if item is not None:
                return item
            if await request.is_disconnected():
                if job.cancel():  # it never reached the worker, which counts the others
                    with self.metrics.lock:
                        self.metrics.aborted.inc()
                return None

    async def serve(self, request: Request, p: _Prepared, chat: bool) -> Response:
        """Queue the request, wait for its first output (or error), then answer or start streaming."""
        job = self.submit(p)
        try:
            first = await self.next_or_disconnect(job, request)
        except BaseException:
            job.cancel()
            raise
        if first is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if isinstance(first, _Failed):
            raise first.error
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if p.stream:
            return _JobStreamingResponse(self.stream_events(job, first, p, rid, created, chat), job)
        return await self.collect(request, job, first, p, rid, created, chat)

    # -- responses

    async def collect(self, request: Request, job: Job, item: Chunk | _Done | _Failed, p: _Prepared, rid: str,
                      created: int, chat: bool) -> Response:
        """A whole (non-streamed) completion."""
        texts: list[str] = []
        n = 0
        try:
            while not isinstance(item, _Done):
                if isinstance(item, _Failed):
                    raise item.error
                texts.append(item.text)
                n += len(item.token_ids)
                nxt = await self.next_or_disconnect(job, request)
                if nxt is None:
                    return Response(status_code=499)
                item = nxt
        finally:
            job.cancel()  # a no-op once done; frees the worker on any other exit
        text = "".join(texts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": item.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": item.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": p.model, "system_fingerprint": None, "choices": [choice],
                             "usage": _usage(len(p.prompt_ids), n),
                             "treedraft": _spec_info(self.drafter_name(p.drafter), item.stats)})

    async def stream_events(self, job: Job, item: Chunk | _Done | _Failed, p: _Prepared, rid: str, created: int,
                            chat: bool) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": p.model, "system_fingerprint": None}
        extra = {"usage": None} if p.include_usage else {}

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        n = 0
        try:
            if chat:
                yield _sse(chunk(None, None, role=True))
            while True:
                if isinstance(item, _Failed):  # headers are already sent: report in-band, like vLLM
                    self.metrics.error(item.error.status)
                    yield _sse(item.error.body())
                    break
                if isinstance(item, _Done):
                    yield _sse(chunk(None if chat else "", item.finish_reason))
                    if p.include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(len(p.prompt_ids), n),
                                    "treedraft": _spec_info(self.drafter_name(p.drafter), item.stats)})
                    break
                n += len(item.token_ids)
                if item.text:
                    yield _sse(chunk(item.text, None))
                nxt = await job.next(3600.0)
                while nxt is None:  # a disconnect cancels this generator, so there is nothing else to watch
                    nxt = await job.next(3600.0)
                item = nxt
            yield _sse("[DONE]")
        finally:
            job.cancel()

    def models(self) -> dict:
        """The /v1/models listing."""
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "treedraft",
                                            "root": self.llm.model_name, "max_model_len": self.context}
                                           for n in self.names]}


def create_app(llm: LLM, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI application serving ``llm``; the worker starts and stops with the app's lifespan."""
    srv = OpenAIServer(llm, settings)
    metrics = srv.metrics

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        srv.start()
        try:
            yield
        finally:
            srv.stop()

    app = FastAPI(title="treedraft", version=_version(), lifespan=lifespan)
    app.state.treedraft = srv

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, e: APIError) -> JSONResponse:
        metrics.error(e.status)
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        metrics.error(e.status_code)
        err = APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, e: RequestValidationError) -> JSONResponse:
        metrics.error(400)
        return APIError(400, f"invalid request: {e.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _internal_error(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.error(500)
        return APIError(500, f"internal server error: {type(e).__name__}", "server_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (stream or not)."""
        req = await srv.read(request, ChatCompletionRequest)
        return await srv.serve(request, await srv.prepare(req), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions on a raw prompt (no chat template)."""
        req = await srv.read(request, CompletionRequest)
        return await srv.serve(request, await srv.prepare(req), chat=False)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model (and its aliases)."""
        return srv.models()

    @app.get("/health")
    async def health() -> Response:
        """200 while the worker thread is alive, else 503."""
        if not srv.worker.alive():
            return APIError(503, "the model worker is not running", "server_error").response()
        return JSONResponse({"status": "ok", "model": srv.names[0], "waiting": len(srv.worker.queue),
                             "running": int(srv.worker.running is not None)})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        """Prometheus text-format metrics."""
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _version() -> str:
    from . import __version__
    return __version__


# ----------------------------------------------------------------------------- CLI


def cmd_serve(a: argparse.Namespace) -> int:
    """`treedraft serve`: load the model and run uvicorn until interrupted."""
    import uvicorn

    from .cli import load_from_args

    settings = ServerSettings(max_queue=a.max_queue, max_tokens_limit=a.max_tokens_limit,
                              default_max_tokens=a.default_max_tokens,
                              served_model_names=tuple(a.served_model_name or ()), heads=a.heads,
                              retry_after_s=a.retry_after)
    t = time.perf_counter()
    llm = load_from_args(a)
    log.warning("loaded %s in %.1fs; serving on http://%s:%d", llm.model_name, time.perf_counter() - t, a.host, a.port)
    uvicorn.run(create_app(llm, settings), host=a.host, port=a.port, log_level=a.log_level,
                timeout_graceful_shutdown=5)
    return 0


def register(subparsers: Any) -> None:  # noqa: ANN401 - argparse's private _SubParsersAction
    """Add `treedraft serve` to the CLI."""
    from .cli import add_model_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    add_model_args(p)
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait behind the running one; beyond that the server answers 429")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context window)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use in 'model' (repeatable; default: the model's name)")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds sent with 429")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    p.set_defaults(func=cmd_serve)
