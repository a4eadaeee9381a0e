"""Response pieces of the OpenAI routes: usage and speculative-decoding info blocks, SSE framing, and a
streaming response that cancels its job however the response ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi.responses import StreamingResponse

from ..engine import GenerationStats
from .worker import Job


def _usage(prompt_tokens: int, completion_tokens: int, jobs: Sequence[Job] = ()) -> dict:
    """OpenAI's usage block; with a predicted output, its completion_tokens_details too (summed over ``jobs``)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if jobs and jobs[0].config.prediction:
        got = [prediction_tokens(j.config.prediction, j.output_ids) for j in jobs]
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(a for a, _ in got),
            "rejected_prediction_tokens": sum(r for _, r in got),
        }
    return out


def prediction_tokens(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens as OpenAI counts them: the prediction's tokens that appear in the
    output in order (the length of the longest common subsequence), and the rest of the prediction.

    The LCS length by the bit-parallel recurrence of Allison & Dix (1986) in Hyyro's form (2004): one row of the
    dynamic programme is a bit vector V over the prediction's positions, and each output token updates it with
    U = V & match(token); V = (V + U) | (V - U). A few big-integer operations per output token, whatever the
    repetition (difflib's matcher took 14 s on a 2,000-token loop, on the server's event loop)."""
    m = len(prediction)
    if m == 0 or not output:
        return 0, m
    where: dict[int, int] = {}
    for i, t in enumerate(prediction):
        where[t] = where.get(t, 0) | (1 << i)
    full = (1 << m) - 1
    v = full
    for t in output:
        u = v & where.get(t, 0)
        v = ((v + u) | (v - u)) & full
    accepted = m - v.bit_count()
    return accepted, m - accepted


def _spec_info(drafter: str, stats: GenerationStats) -> dict:
    return {
        "drafter": drafter,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "steps": len(stats.steps),
        "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth()],
    }


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class _JobStreamingResponse(StreamingResponse):
    """A streaming response that cancels its jobs however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], jobs: list[Job], cancel: Callable[[Job], object]) -> None:
        """cancel: how a job is stopped (the app's, which counts a job dropped from the queue as aborted)."""
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.jobs, self.cancel = jobs, cancel

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                self.cancel(job)
