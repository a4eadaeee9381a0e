"""The model worker: :class:`Job` (one request), :class:`JobQueue` (bounded FIFO) and :class:`Worker`.

One worker thread owns the model (the engine reuses one KV cache and torch is not re-entrant here);
it takes jobs in queue order, streams :class:`~treedraft.text.Chunk` s back to the event loop
(``call_soon_threadsafe``), stops a job at its next chunk once its client has gone, and records metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine import GenerationConfig, GenerationStats
from ..interfaces import GenerationError
from ..text import Chunk
from ..tree import TreeError
from .metrics import Metrics
from .protocol import APIError, ServerSettings

if TYPE_CHECKING:
    from ..api import LLM
    from ..interfaces import Drafter

log = logging.getLogger("treedraft.server")


@dataclass
class Done:
    """The worker's last item for a job that finished: why, and its step stats."""

    finish_reason: str
    stats: GenerationStats


@dataclass
class Failed:
    """The worker's last item for a job that failed: the error to answer with."""

    error: APIError


class Job:
    """One generation request travelling from an HTTP handler to the worker and back."""

    def __init__(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        drafter: str,
        loop: asyncio.AbstractEventLoop,
        tenant: str | None = None,
    ) -> None:
        self.prompt_ids, self.config, self.drafter = prompt_ids, config, drafter
        self.tenant = tenant  # who asked: "key-<hash>" (API key) or "user-<user field>"; None when anonymous
        self.loop = loop
        self.t_arrival = time.perf_counter()
        self.cancelled = threading.Event()
        self._items: deque[Chunk | Done | Failed] = deque()
        self._ready = asyncio.Event()
        self.queue: JobQueue | None = None

    def cancel(self) -> bool:
        """Stop this job: True if it was still waiting (now dropped); else the worker stops at its next chunk."""
        self.cancelled.set()
        queue = self.queue
        return queue is not None and queue.remove(self)

    def deliver(self, item: Chunk | Done | Failed) -> None:
        """Called by the worker thread: hand one item to the event loop (dropped once the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # event loop closed: nobody is listening any more
            self.cancelled.set()

    def _put(self, item: Chunk | Done | Failed) -> None:
        self._items.append(item)
        self._ready.set()

    async def next(self, timeout: float) -> Chunk | Done | Failed | None:
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
            raise APIError(
                400,
                f"drafter {name!r} is not available on this server: {e}",
                param="treedraft.drafter",
                code="drafter_unavailable",
            ) from None

    @staticmethod
    def _for_tenant(drafter: Drafter | None, tenant: str | None) -> Drafter | None:
        """This request's drafter: one that keeps earlier outputs (``suffix``, or a hybrid holding it) is bound
        to the job's tenant, so it drafts from (and records into) that tenant's index only (unless the
        store is shared, --suffix-share); "" = anonymous."""
        bind = getattr(drafter, "for_tenant", None)
        return bind(tenant or "") if callable(bind) else drafter

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
            except Exception:
                log.exception("worker: unexpected error while finishing a job")
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        stats = GenerationStats()
        t_start = time.perf_counter()
        t_first: float | None = None
        t_last = 0.0
        gaps: list[float] = []  # seconds between consecutive generated tokens, as delivered
        n_tokens, outcome = 0, "error"
        gen = None
        try:
            drafter = self._for_tenant(self._drafter(job.drafter), job.tenant)
            gen = self.llm.text.stream(job.prompt_ids, job.config, drafter, stats)
            finish = "length"
            for chunk in gen:
                if job.cancelled.is_set():
                    break
                if chunk.token_ids:
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                    else:
                        gaps.append(now - t_last)
                    gaps += [0.0] * (len(chunk.token_ids) - 1)  # tokens that arrived together
                    t_last = now
                n_tokens += len(chunk.token_ids)
                job.deliver(chunk)
                finish = chunk.finish_reason or finish
            if job.cancelled.is_set():
                outcome = "aborted"
            else:
                outcome = finish
                job.deliver(Done(finish, stats))
        except APIError as e:  # raised deliberately: already the right status and message
            job.deliver(Failed(e))
        except GenerationError as e:  # the engine rejects the request itself (it names the limit): client's fault
            job.deliver(Failed(APIError(400, str(e), code="invalid_generation_request")))
        except TreeError as e:  # a drafter bug, not the client's fault
            log.exception("generation failed: drafter %r produced an invalid tree", job.drafter)
            job.deliver(Failed(APIError(500, f"internal error in the drafter: {e}", "server_error")))
        except Exception as e:
            # e.g. a KV cache overflow or a drafter's inconsistent q: answer 500, log it, keep serving
            log.exception("generation failed (drafter %r)", job.drafter)
            job.deliver(
                Failed(APIError(500, f"internal error during generation: {type(e).__name__}: {e}", "server_error"))
            )
        finally:
            if gen is not None:
                gen.close()
            self.metrics.record(stats, job.t_arrival, t_start, t_first, time.perf_counter(), n_tokens, outcome, gaps)
            self.metrics.observe_steps(1, len(stats.steps) + (t_first is not None))  # serial: 1 request per step
