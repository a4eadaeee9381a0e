"""The native calls release the GIL and serialize on one lock (kernels/qgemm.cpp ``td::serialized``).

The server's engine thread runs each step's forward in C++; while it does, the event loop (HTTP streaming,
detokenizing on other threads) must be able to run Python, and two threads must never run the thread pool
or one decoder's scratch buffers at once.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from native_utils import tiny_native

from treedraft import kernels
from treedraft.models import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")

CTX = 96  # cache slots per sequence


def _prefilled(model, prompt: list[int]):
    """A cache holding ``prompt`` (native chunk from slot 0) and the logits of its last row."""
    cache = model.new_cache(max_len=CTX)
    t = torch.tensor(prompt)
    out = fused.forward_segments(
        model, t, torch.arange(len(prompt)), [fused.Seg(cache, 0, len(prompt), None)], None, True
    )
    assert out is not None, fused.status(model)
    cache.keep(0, range(len(prompt)))
    return cache, out[0][-1]


def _greedy(model, prompt: list[int], n: int) -> list[tuple[int, torch.Tensor]]:
    """n greedy one-token native steps after ``prompt``: (token, logits row) per step."""
    cache, last = _prefilled(model, prompt)
    out, pos = [], len(prompt)
    for _ in range(n):
        tok = int(last.argmax())
        seg = fused.Seg(cache, pos, 1, None)
        logits, _h = fused.forward_segments(model, torch.tensor([tok]), torch.tensor([pos]), [seg])
        cache.keep(pos, [0])
        last = logits[0]
        out.append((tok, last.clone()))
        pos += 1
    return out


def test_concurrent_forwards_equal_sequential_ones() -> None:
    """Four threads decoding their own sequences through ONE decoder at once get bitwise their solo results."""
    model = tiny_native(CTX, seed=3)
    prompts = [[(7 * i + j) % 60 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    n = 60
    with torch.inference_mode():
        ref = [_greedy(model, p, n) for p in prompts]
    got: list[list[tuple[int, torch.Tensor]] | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    go = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            with torch.inference_mode():
                go.wait()
                got[i] = _greedy(model, prompts[i], n)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g is not None
        assert [t for t, _ in g] == [t for t, _ in r], f"sequence {i}: tokens differ"
        for step, ((_, lr), (_, lg)) in enumerate(zip(r, g)):
            assert torch.equal(lr, lg), f"sequence {i}, step {step}: logits differ from the solo run"


def test_forward_releases_the_gil() -> None:
    """Python code on another thread runs while a thread is inside FusedDecoder.forward.

    With a switch interval far longer than the test, the interpreter never takes the GIL from a running thread:
    the main thread gets it back only when the worker gives it up, i.e. inside the native call (or when the
    worker ends). So the main thread sees the worker mid-loop exactly when forward releases the GIL.
    """
    model = tiny_native(CTX, seed=4)
    dec = fused.decoder_for(model)
    assert dec is not None
    n = 400
    with torch.inference_mode():
        cache, _ = _prefilled(model, [1, 2, 3])
    seg_k, seg_v = [cache.k], [cache.v]
    tokens, pos = torch.arange(1, 33), torch.arange(3, 35)  # 32 causal rows at slot 3
    done = [0]
    started, stop = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        for _ in range(n):
            if stop.is_set():
                break
            dec.forward(tokens, pos, [32], [3], seg_k, seg_v, [fused._EMPTY_MASK], None, True)
            done[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        started.wait()
        seen = done[0]  # the main thread runs again: the worker has given up the GIL
        stop.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert seen < n, "the main thread only ran after the worker's last forward: forward holds the GIL"
