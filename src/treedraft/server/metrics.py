"""Prometheus metrics of the server: a small thread-safe registry rendered in text exposition format 0.0.4."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import GenerationStats


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
