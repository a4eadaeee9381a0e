"""Prometheus metrics of the server, through ``prometheus_client`` with one registry per app.

Names follow vLLM's (``vllm:`` -> ``treedraft:``) where a counterpart exists, so dashboards carry over.
Every metric carries a ``model_name`` label. Counters are exported with the ``_total`` suffix (and
prometheus_client's ``_created`` timestamps); a per-app :class:`~prometheus_client.CollectorRegistry`
keeps two servers in one process (tests) apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from ..engine import GenerationStats

_TIME_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
_BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)


class Metrics:
    """The server's counters, gauges and histograms (thread-safe: the worker thread records, HTTP scrapes)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._gauges: dict[str, Gauge] = {}

        def counter(name: str, help_: str, *labels: str) -> Counter:
            c = Counter(name, help_, ["model_name", *labels], registry=self.registry)
            # an unlabeled series is exported as 0 before its first event; labeled ones once seen
            return c if labels else c.labels(model_name=model_name)

        def histogram(name: str, help_: str, buckets: Sequence[float]) -> Histogram:
            h = Histogram(name, help_, ["model_name"], buckets=tuple(buckets), registry=self.registry)
            return h.labels(model_name=model_name)

        self.requests = counter(
            "treedraft:num_requests", "Jobs accepted: one per prompt and choice (an n=2 request counts 2)."
        )
        self._success = counter("treedraft:request_success", "Finished requests by finish reason.", "finished_reason")
        self.aborted = counter(
            "treedraft:request_aborted",
            "Jobs whose client disconnected before the answer was complete (or before its request was read whole).",
        )
        self._errors = counter("treedraft:request_errors", "Requests answered with an error, by HTTP status.", "status")
        self.prompt_tokens = counter(
            "treedraft:prompt_tokens",
            "Prompt tokens of the jobs that began decoding, per job (an n=2 request's prompt twice), prefix-cache "
            "hits included.",
        )
        self.gen_tokens = counter("treedraft:generation_tokens", "Generated tokens.")
        self.last_tps = Gauge(
            "treedraft:generation_tokens_per_second",
            "Decode speed (tokens/s) of the most recently finished request.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name=model_name)
        self.drafts = counter("treedraft:spec_decode_num_drafts", "Verify steps that checked a draft tree.")
        self.draft_tokens = counter(
            "treedraft:spec_decode_num_draft_tokens", "Draft tokens verified (tree nodes, root excluded)."
        )
        self.accepted = counter(
            "treedraft:spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens excluded)."
        )
        self._accepted_pos = counter(
            "treedraft:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by depth in the tree (0 = first draft token).",
            "position",
        )
        self._drafts_pos = counter(
            "treedraft:spec_decode_num_drafts_per_pos",
            "Drafts whose tree reached this depth (denominator of acceptance per position).",
            "position",
        )
        self.steps = counter(
            "treedraft:spec_decode_num_verify_steps",
            "All target forward steps after prefill, plain ones included "
            "(mean accepted length = (accepted + steps) / steps).",
        )
        self.ttft = histogram(
            "treedraft:time_to_first_token_seconds", "Arrival to first generated token.", _TIME_BUCKETS
        )
        self.itl = histogram(
            "treedraft:inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request, as streamed.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram("treedraft:e2e_request_latency_seconds", "Arrival to last generated token.", _TIME_BUCKETS)
        self.queue_time = histogram(
            "treedraft:request_queue_time_seconds", "Time spent waiting for the worker.", _TIME_BUCKETS
        )
        self.tps = histogram(
            "treedraft:request_generation_tokens_per_second", "Per-request decode speed.", _RATE_BUCKETS
        )
        self.accept_len = histogram(
            "treedraft:request_mean_accepted_length",
            "Per-request tokens committed per verify step (bonus included; 1 = plain).",
            _ACCEPT_BUCKETS,
        )
        self.batch_size = histogram("treedraft:batch_size", "Requests in one target forward step.", _BATCH_BUCKETS)

    # -- recording

    def gauge_fn(self, name: str, help_: str, fn: Callable[[], float]) -> None:
        """A gauge whose value is read at scrape time."""
        g = Gauge(name, help_, ["model_name"], registry=self.registry)
        g.labels(model_name=self.model_name).set_function(fn)
        self._gauges[name] = g

    def success(self, finished_reason: str) -> None:
        """Count one request that finished normally ("stop" or "length")."""
        self._success.labels(model_name=self.model_name, finished_reason=finished_reason).inc()

    def error(self, status: int) -> None:
        """Count one request answered with an error."""
        self._errors.labels(model_name=self.model_name, status=str(status)).inc()

    def observe_steps(self, batch_size: int, n_steps: int = 1) -> None:
        """Record ``n_steps`` target forward steps that each carried ``batch_size`` requests."""
        for _ in range(n_steps):
            self.batch_size.observe(batch_size)

    def record(
        self,
        stats: GenerationStats,
        t_arrival: float,
        t_start: float | None,
        t_first: float | None,
        t_end: float,
        n_tokens: int,
        outcome: str,
        token_gaps: Sequence[float] = (),
    ) -> None:
        """Account one generation (finished, aborted or failed); ``token_gaps``: seconds between its tokens."""
        if outcome == "aborted":
            self.aborted.inc()
        elif outcome in ("stop", "length"):
            self.success(outcome)
        if t_start is not None:
            self.queue_time.observe(t_start - t_arrival)
            self.prompt_tokens.inc(stats.prompt_tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t_arrival)
            self.e2e.observe(t_end - t_arrival)
        for g in token_gaps:
            self.itl.observe(g)
        self.gen_tokens.inc(n_tokens)
        if stats.new_tokens > 1 and stats.t_decode > 0:  # (one token: no decode step ran, no rate to record)
            self.tps.observe(stats.tokens_per_s)
            self.last_tps.set(stats.tokens_per_s)
        if stats.steps:
            self.accept_len.observe(stats.mean_accepted_length)
        self.steps.inc(len(stats.steps))
        for s in stats.steps:
            if s.tree_size <= 1:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(s.tree_size - 1)
            self.accepted.inc(s.accepted)
            for d in range(s.tree_depth):
                self._drafts_pos.labels(model_name=self.model_name, position=str(d)).inc()
            for d in range(s.accepted):
                self._accepted_pos.labels(model_name=self.model_name, position=str(d)).inc()

    # -- exposition

    def render(self) -> str:
        """Prometheus text exposition format."""
        return generate_latest(self.registry).decode()

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The body and content type a scraper asked for (text format, or OpenMetrics when it accepts it)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
