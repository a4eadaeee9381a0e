"""The model worker: :class:`Job` (one request), :class:`JobQueue` (bounded FIFO) and :class:`Worker`.

One worker thread owns the model and runs the batched decode loop (:class:`~treedraft.scheduler.Scheduler`):
up to ``max_batch`` jobs decode together, one target forward per step; jobs join from the queue and leave
at step boundaries (finished, failed, or cancelled because their client left). Each job's tokens go
through its own :class:`~treedraft.text.TextStream` and its :class:`~treedraft.text.Chunk` s back to the
event loop (``call_soon_threadsafe``); metrics are recorded per job and per step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine import GenerationConfig, GenerationStats
from ..interfaces import GenerationError
from ..logprobs import TokenLogprob, prompt_logprobs
from ..scheduler import Request, Scheduler, measured_latency, measured_step_rows
from ..text import Chunk, TextStream
from ..tree import TreeError
from .metrics import Metrics
from .protocol import APIError, ServerSettings

if TYPE_CHECKING:
    from ..api import LLM
    from ..interfaces import Drafter

log = logging.getLogger("treedraft.server")

# The GIL switch interval while a worker runs (seconds; CPython's default is 5 ms). The event loop thread streams
# the previous step's tokens while the native forward runs without the GIL; on two busy cores it often has not
# finished when the forward returns, and the worker, which needs the GIL back to accept the step's tokens, then
# waited up to the whole default interval: at 8 concurrent requests the acceptance phase of a step took 2.5-3 ms
# instead of 0.5 (benchmarks/serve_cpu.py with TREEDRAFT_STEP_TRACE, AMD EPYC Zen 5, 2 cores).
GIL_SWITCH_INTERVAL_S = 0.0005
# TREEDRAFT_STEP_TRACE=FILE: append one line per step (start, seconds in the step, jobs, rows, prefill rows, tokens,
# forward / planning+drafting / acceptance seconds) for benchmarks/serve_cpu.py --trace
STEP_TRACE = os.environ.get("TREEDRAFT_STEP_TRACE") or None


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``top -H``, /proc/PID/task/TID/comm; Linux, 15 bytes), so the
    model worker's CPU time can be told from the event loop's; a no-op where prctl is unavailable."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


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
        self.score_top: int | None = None  # echo + logprobs: score the prompt (top alternatives per token) first
        self.score_only = False  # echo with max_tokens 0: answered once the prompt is scored, nothing decoded
        self.prompt_logprobs: list[TokenLogprob] | None = None  # set by the worker before it delivers any item
        # another choice of the same prompt, queued (so admitted and scored) before this one: it scores the prompt
        self.scored_by: Job | None = None
        self.tenant = tenant  # who asked: "key-<hash>" (API key) or "user-<user field>"; None when anonymous
        self.loop = loop
        self.t_arrival = time.perf_counter()
        self.checked_at = time.monotonic()  # when the HTTP handler last asked whether the client is still there
        self.cancelled = threading.Event()
        # the job's last item (Done or Failed) is given once: by the worker, or by a shutdown's drain on its thread
        self._final_lock = threading.Lock()
        self.final_claimed = False
        self._items: deque[Chunk | Done | Failed] = deque()
        self.output_ids: list[int] = []  # with a prediction: the generated ids handed out so far (for its usage)
        self._ready = asyncio.Event()
        self.queue: JobQueue | None = None

    def prompt_scores(self) -> list[TokenLogprob]:
        """The echoed prompt's logprobs: this job's, or those of the choice that scored the prompt for it."""
        return (self.scored_by or self).prompt_logprobs or []

    def claim_final(self) -> bool:
        """True for the first caller only: whoever gives this job its last item (the worker's Done or Failed, or
        :meth:`Worker.fail_all` from another thread); the others leave it answered."""
        with self._final_lock:
            if self.final_claimed:
                return False
            self.final_claimed = True
            return True

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

    @staticmethod
    def deliver_all(items: list[tuple[Job, Chunk | Done | Failed]]) -> None:
        """Called by the worker thread once per step: every job's items of the step, in one hand-off per event loop
        (one wake-up of the loop, not one per token and job)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Chunk | Done | Failed]]] = {}
        for job, item in items:
            by_loop.setdefault(job.loop, []).append((job, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(Job._put_all, batch)
            except RuntimeError:  # event loop closed: nobody is listening any more
                for job, _ in batch:
                    job.cancelled.set()

    @staticmethod
    def _put_all(batch: list[tuple[Job, Chunk | Done | Failed]]) -> None:
        for job, item in batch:
            job._put(item)

    async def next(self, timeout: float) -> Chunk | Done | Failed | None:
        """The next item from the worker, or None after ``timeout`` seconds without one."""
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        item = self._items.popleft()
        if self.config.prediction and isinstance(item, Chunk):
            self.output_ids += item.token_ids
        return item


class JobQueue:
    """Bounded FIFO of waiting jobs; a job whose client left can be removed from the middle."""

    def __init__(self, maxsize: int, free: int = 0) -> None:
        self.maxsize = maxsize
        # batch slots the worker fills from the queue at its next step: jobs taking them do not wait behind the running
        # ones, so they do not count against ``maxsize`` (the worker keeps this up to date)
        self.free = free
        self._items: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def _room(self) -> int:  # (the lock held)
        return 0 if self._closed else max(0, self.maxsize + self.free - len(self._items))

    def room(self) -> int:
        """Jobs that may be queued now: the free batch slots and ``maxsize`` waiting behind the running ones."""
        with self._cv:
            return self._room()

    def put_nowait(self, job: Job) -> bool:
        """Append a job; False when the free batch slots are taken and ``maxsize`` jobs are already waiting."""
        with self._cv:
            if self._room() < 1:
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

    def get_nowait(self) -> Job | None:
        """The next waiting job, or None when there is none."""
        with self._cv:
            if self._closed or not self._items:
                return None
            return self._take()

    def _take(self) -> Job:  # (the lock held, a job waiting)
        job = self._items.popleft()
        job.queue = None
        self.free = max(0, self.free - 1)  # it takes a slot (the worker recounts after admitting)
        return job

    @property
    def closed(self) -> bool:
        return self._closed

    def get(self) -> Job | None:
        """Block until a job is available (None once closed)."""
        with self._cv:
            while not self._items and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            return self._take()

    def close(self) -> None:
        """Wake the worker and make it exit; waiting jobs are dropped."""
        with self._cv:
            self._closed = True
            self._items.clear()
            self._cv.notify_all()


@dataclass
class _Live:
    """A job in the batch: its request in the scheduler, its text state and its timings."""

    req: Request
    text: TextStream
    stats: GenerationStats
    t_start: float
    t_first: float | None = None
    t_last: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens, as delivered
    n_tokens: int = 0


class Worker:
    """The single thread that runs the model: up to ``settings.max_batch`` jobs per step, in queue order."""

    def __init__(self, llm: LLM, settings: ServerSettings, metrics: Metrics) -> None:
        self.llm, self.settings, self.metrics = llm, settings, metrics
        self.queue = JobQueue(settings.max_queue, free=settings.max_batch)
        self.running: dict[Job, _Live] = {}  # the batch (read by the HTTP side for gauges: len only)
        self.sched: Scheduler | None = None  # built on the worker thread (step_rows may be measured)
        # the last step's items, handed to the event loop during the next step's forward (see _step)
        self._pending: list[tuple[Job, Chunk | Done | Failed]] = []
        self.failing: APIError | None = None  # set by fail_all: every job in the batch or still to come gets it
        self._thread = threading.Thread(target=self._loop, name="treedraft-worker", daemon=True)

    def start(self) -> None:
        """Start the worker thread (and shorten the process's GIL switch interval, see GIL_SWITCH_INTERVAL_S)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running jobs, drop waiting ones and join the thread."""
        for job in list(self.running):
            job.cancelled.set()
        self.queue.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def fail_all(self, error: APIError) -> None:
        """Answer every running and waiting job with ``error`` now, and every job that comes later (a shutdown whose
        grace period ends: their clients get an error, not a cut connection). Called from another thread: the
        answers go out at once, not after the step the worker may be in (seconds, for a long prefill); the worker
        then drops the running jobs at its next loop and fails new ones before admitting them."""
        self.failing = error
        for job in list(self.running):  # (a snapshot taken under the GIL; the worker may change the dict meanwhile)
            if job.claim_final():
                job.deliver(Failed(error))
        while (job := self.queue.get_nowait()) is not None:
            self._refuse(job, error)

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

    def _scheduler(self) -> Scheduler:
        """The batched loop: --step-rows shared equally, or (default) a lone request's tree from the measured
        latency curve and, in a batch, the curve's row budget (draft nodes where their acceptance pays)."""
        s = self.settings
        model = self.llm.engine.model
        if s.step_rows is not None:
            log.info("batched decoding: up to %d requests per step, %d tree rows per step", s.max_batch, s.step_rows)
            return Scheduler(
                self.llm.engine,
                step_rows=s.step_rows,
                prefill_chunk=s.prefill_chunk,
                native_prefill=s.native_prefill,
                prefix_cache_bytes=s.prefix_cache_mb << 20,
            )
        rows, latency = measured_step_rows(model), measured_latency(model)
        log.info(
            "batched decoding: up to %d requests per step; a lone request's tree up to %d rows, a batch's draft "
            "rows from the latency curve",
            s.max_batch,
            rows,
        )
        return Scheduler(
            self.llm.engine,
            rows,
            s.prefill_chunk,
            latency=latency,
            native_prefill=s.native_prefill,
            prefix_cache_bytes=s.prefix_cache_mb << 20,
        )

    def _loop(self) -> None:
        _name_os_thread("td-worker")  # its kernel pool threads inherit the name
        try:
            self.sched = self._scheduler()
        except Exception:
            log.exception("worker: could not set up the batched loop")
            return
        self.sched.before_forward = self._flush
        while True:
            if not self.running:
                self._flush()
                job = self.queue.get()  # idle: block until a job comes
                if job is None:
                    return
                self._admit(job)
            while len(self.running) < self.settings.max_batch:
                job = self.queue.get_nowait()
                if job is None:
                    break
                self._admit(job)
            self._count_free()
            if self.queue.closed:
                self._flush()
                for job in list(self.running):
                    self._leave(job, "aborted")
                return
            for job in [j for j in self.running if j.cancelled.is_set()]:  # its slot is free for the next step
                self._leave(job, "error" if job.final_claimed else "aborted")  # (answered 503 by a drain, then left)
            if self.failing is not None:  # most were answered by fail_all; one it missed (being admitted) is here
                self._flush()
                for job in list(self.running):
                    self._fail(job, self.failing)
            if not self.running:
                continue
            try:
                self._step()
            except Exception:
                log.exception("worker: unexpected error in a step")

    def _admit(self, job: Job) -> None:
        """Put a dequeued job into the batch (or answer it at once: cancelled, or an invalid request)."""
        now = time.perf_counter()
        if job.cancelled.is_set():  # its client left just as the job was dequeued
            self.metrics.record(GenerationStats(), job.t_arrival, None, None, now, 0, "aborted")
            return
        if self.failing is not None:  # shutting down: answered before any of its work (a prefill, a drafter's build)
            self._refuse(job, self.failing)
            return
        stats = GenerationStats()
        try:
            if job.score_top is not None:  # one forward over the prompt, on this thread (it owns the model)
                job.prompt_logprobs = prompt_logprobs(self.llm.model, job.prompt_ids, job.score_top)
            if job.score_only:
                if job.claim_final():
                    job.deliver(Done("length", stats))
                self.metrics.record(stats, job.t_arrival, now, None, time.perf_counter(), 0, "length")
                return
            drafter = self._for_tenant(self._drafter(job.drafter), job.tenant)
            req = self.sched.add(job.prompt_ids, job.config, drafter, stats, tag=job, scope=job.tenant or "")
        except Exception as e:
            if job.claim_final():
                job.deliver(Failed(self._api_error(job, e)))
            self.metrics.record(stats, job.t_arrival, now, None, time.perf_counter(), 0, "error")
            return
        text = self.llm.text.text_stream(job.config, req.max_new, stats)
        self.running[job] = _Live(req, text, stats, now)

    def _fail(self, job: Job, error: APIError) -> None:
        """Answer a running job with ``error`` (unless it was answered already) and take it out of the batch."""
        if job.claim_final():
            job.deliver(Failed(error))
        self._leave(job, "error")

    def _refuse(self, job: Job, error: APIError) -> None:
        """Answer a job that never ran with ``error`` (counted as a failure)."""
        if job.claim_final():
            job.deliver(Failed(error))
        self.metrics.record(GenerationStats(), job.t_arrival, None, None, time.perf_counter(), 0, "error")

    def _flush(self) -> None:
        """Hand the last step's items to the event loop (one wake-up per loop)."""
        out, self._pending = self._pending, []
        if out:
            Job.deliver_all(out)

    def _step(self) -> None:
        """One scheduler step. Its items reach the event loop while the *next* step's forward runs: the scheduler
        calls :meth:`_flush` after planning, just before the forward releases the GIL, so the loop's streaming
        (JSON, SSE framing, socket writes) overlaps the forward instead of taking the GIL from the worker's
        planning: the rest of a step besides forward, planning and acceptance fell from 0.57-0.92 ms to
        0.21-0.31 ms at 1 and 8 streams (benchmarks/serve_cpu.py --trace, interleaved). A token reaches its
        client one planning phase later; when no step follows (idle, the last job left, shutdown) the items go
        at once."""
        t0 = time.perf_counter()
        try:
            events = self.sched.step()
        except Exception as e:  # the forward itself failed (e.g. a cache overflow): every job in it fails
            log.exception("generation step failed for %d requests", len(self.running))
            self._flush()
            for job in list(self.running):
                self._fail(job, self._api_error(job, e))
            return
        self._flush()  # a step without a forward (nothing planned) keeps the items in order
        self.metrics.observe_steps(len(self.running))
        out: list[tuple[Job, Chunk | Done | Failed]] = []
        try:
            self._collect(events, out)
        finally:
            self._pending = out
            if not self.running:
                self._flush()
        if STEP_TRACE is not None:
            ls = self.sched.last_step
            with open(STEP_TRACE, "a") as f:
                f.write(
                    f"{t0:.6f} {time.perf_counter() - t0:.6f} {len(self.running)} {ls.rows} {ls.prefill_rows} "
                    f"{ls.committed} {ls.t_forward:.6f} {ls.t_draft + ls.t_plan:.6f} {ls.t_commit:.6f}\n"
                )

    def _collect(self, events: list[tuple[Request, list[int]]], out: list[tuple[Job, Chunk | Done | Failed]]) -> None:
        """Turn a step's tokens into each job's item (one chunk per job and step: its tokens' text together). An error
        in one job's text fails that job alone: the others' events of the step are still delivered (dropped, a job
        whose request finished in this step would have stayed in the batch for ever: never planned again)."""
        for req, new in events:
            job = req.tag
            live = self.running.get(job)
            if live is None:
                continue
            try:
                self._collect_one(job, live, req, new, out)
            except Exception as e:
                log.exception("worker: error while delivering a step's tokens; failing that request")
                if job in self.running:
                    if job.claim_final():
                        out.append((job, Failed(self._api_error(job, e))))
                    try:
                        self._leave(job, "error")
                    except Exception:
                        self.running.pop(job, None)
                        self._count_free()
                        log.exception("worker: error while removing a failed request")

    def _collect_one(
        self, job: Job, live: _Live, req: Request, new: list[int], out: list[tuple[Job, Chunk | Done | Failed]]
    ) -> None:
        """:meth:`_collect` for one job's event."""
        if req.error is not None:
            if job.claim_final():
                out.append((job, Failed(self._api_error(job, req.error))))
            self._leave(job, "error")
            return
        chunks = live.text.feed(new)
        now = time.perf_counter()
        n = sum(len(c.token_ids) for c in chunks)
        if n:
            if live.t_first is None:
                live.t_first = now
            else:
                live.gaps.append(now - live.t_last)
            live.gaps += [0.0] * (n - 1)  # tokens that arrived together
            live.t_last = now
            live.n_tokens += n
        if len(chunks) == 1:
            out.append((job, chunks[0]))
        elif chunks:
            text, ids = "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]
            lps = None if chunks[0].logprobs is None else [x for c in chunks for x in c.logprobs or []]
            out.append((job, Chunk(text, ids, chunks[-1].finish_reason, lps)))
        if live.text.done:
            finish = chunks[-1].finish_reason or "length"
            if not job.claim_final():  # a shutdown's drain answered it with a 503 during this step
                self._leave(job, "error")
                return
            self._leave(job, finish)  # first: the drafter (suffix store) records it before the client hears Done
            out.append((job, Done(finish, live.stats)))

    def _count_free(self) -> None:
        """Tell the queue how many batch slots its next jobs may take without waiting."""
        self.queue.free = self.settings.max_batch - len(self.running)

    def _leave(self, job: Job, outcome: str) -> None:
        """Take a job out of the batch and record it."""
        live = self.running.pop(job)
        self._count_free()
        live.stats.cut(live.n_tokens)  # tokens committed but never delivered (cancelled) do not count
        try:
            self.sched.remove(live.req)
        except Exception:
            log.exception("worker: error while removing a finished request")
        self.metrics.record(
            live.stats,
            job.t_arrival,
            live.t_start,
            live.t_first,
            time.perf_counter(),
            live.n_tokens,
            outcome,
            live.gaps,
        )

    @staticmethod
    def _api_error(job: Job, e: BaseException) -> APIError:
        """The answer for a job that failed with ``e`` (client errors 4xx, everything else 500, logged)."""
        if isinstance(e, APIError):  # raised deliberately: already the right status and message
            return e
        if isinstance(e, GenerationError):  # the engine rejects the request itself (it names the limit)
            return APIError(400, str(e), code="invalid_generation_request")
        if isinstance(e, TreeError):  # a drafter bug, not the client's fault
            log.error("generation failed: drafter %r produced an invalid tree", job.drafter, exc_info=e)
            return APIError(500, f"internal error in the drafter: {e}", "server_error")
        # e.g. a KV cache overflow or a drafter's inconsistent q: answer 500, log it, keep serving
        log.error("generation failed (drafter %r)", job.drafter, exc_info=e)
        return APIError(500, f"internal error during generation: {type(e).__name__}: {e}", "server_error")
