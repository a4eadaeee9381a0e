"""Decode steps of the native runtime run torch's Python-side ops on one thread (busy machines, issue 11)."""

from __future__ import annotations

import pytest
import torch

from treedraft import kernels
from treedraft.engine import Engine, GenerationConfig
from treedraft.scheduler import Scheduler, host_torch_threads


@pytest.fixture
def two_threads():
    """torch at 2 intra-op threads for the test, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_torch_threads_sets_and_restores(two_threads) -> None:
    """The block runs at n threads; the old count comes back, also after an exception; None changes nothing."""
    with kernels.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), kernels.torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with kernels.torch_threads(None):
        assert torch.get_num_threads() == 2


def _threads_seen_by_steps(model, monkeypatch) -> list[int]:
    seen: list[int] = []
    step = Scheduler._step

    def spy(self):
        seen.append(torch.get_num_threads())
        return step(self)

    monkeypatch.setattr(Scheduler, "_step", spy)
    Engine(model).generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=4), drafter=None)
    return seen


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_native_steps_run_torch_on_one_thread(two_threads, monkeypatch) -> None:
    """With the fused native decoder every step (prefill and decode) sees 1 torch thread; the caller's 2 are
    restored after each step."""
    from test_batch import native_tiny

    model = native_tiny()
    assert host_torch_threads(model) == 1
    seen = _threads_seen_by_steps(model, monkeypatch)
    assert len(seen) >= 4 and set(seen) == {1}
    assert torch.get_num_threads() == 2


def test_float_models_keep_torch_threads(two_threads, monkeypatch) -> None:
    """A float32 model (no native linears) keeps torch's threads: its matmuls are torch's."""
    from native_utils import tiny_config

    from treedraft.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config(128, 96)).eval()
    assert host_torch_threads(model) is None
    assert host_torch_threads(object()) is None
    seen = _threads_seen_by_steps(model, monkeypatch)
    assert seen and set(seen) == {2}
