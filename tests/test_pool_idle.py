"""The native pool's idle wait (kernels/pool.h): spin, poll with sched_yield for a while, then sleep.

The yielding phase keeps a worker awake across the Python work between two decode forwards (drafting and
acceptance, 0.1-1.5 ms), which cost ~0.45 ms a forward on session 43's KVM Xeon when the worker had gone to sleep;
after it the worker must sleep, or an idle server would keep a core busy.
"""

from __future__ import annotations

import time

import pytest
import torch

from treedraft import kernels
from treedraft.kernels import _build

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


def _packed() -> kernels.PackedWeight:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=g)
    scale = (w.reshape(256, 4, 32).abs().amax(-1) / 127).half()
    q = torch.round(w.reshape(256, 4, 32) / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return kernels.pack_q8_0(scale, q.reshape(256, 128))


@pytest.fixture
def two_threads():
    old = kernels.get_num_threads()
    kernels.set_num_threads(2)
    yield
    kernels.set_idle_wait(spin_us=100, yield_us=2000)
    kernels.set_num_threads(old)


def _idle_cpu_seconds(pause: float) -> float:
    """Process CPU time over ``pause`` seconds of wall time right after a pooled call (the caller sleeps)."""
    x = torch.randn(8, 128)
    w = _packed()
    kernels.mm(x, w)
    t0 = time.process_time()
    time.sleep(pause)
    return time.process_time() - t0


def test_worker_sleeps_after_the_yield_window(two_threads) -> None:
    """With a 2 ms window the worker is asleep for most of a 300 ms pause: a broken window would burn ~0.3 s."""
    kernels.set_idle_wait(spin_us=100, yield_us=2000)
    assert _idle_cpu_seconds(0.3) < 0.06


def test_worker_stays_awake_inside_the_yield_window(two_threads) -> None:
    """With a 1 s window the worker keeps polling through a 200 ms pause (CPU time accrues; without the yielding
    phase it would sleep after 100 us). Other tests may share the cores, hence the loose bound."""
    kernels.set_idle_wait(spin_us=100, yield_us=1_000_000)
    assert _idle_cpu_seconds(0.2) > 0.02


def test_idle_wait_never_changes_results(two_threads) -> None:
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    w = _packed()
    outs = []
    for spin, yld in ((0, 0), (100, 0), (100, 5000), (3000, 0)):
        kernels.set_idle_wait(spin_us=spin, yield_us=yld)
        outs.append(kernels.mm(x, w))
        time.sleep(0.002)
        outs.append(kernels.mm(x, w))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("kw", [{"spin_us": -1}, {"yield_us": -5}, {"yield_us": 1.5}, {"spin_us": True}])
def test_idle_wait_rejects_bad_values(kw) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        kernels.set_idle_wait(**kw)


def test_idle_yield_from_env(monkeypatch) -> None:
    monkeypatch.delenv(_build.ENV_IDLE_YIELD, raising=False)
    assert _build.idle_yield_from_env() is None
    monkeypatch.setenv(_build.ENV_IDLE_YIELD, " 750 ")
    assert _build.idle_yield_from_env() == 750
    monkeypatch.setenv(_build.ENV_IDLE_YIELD, "0")
    assert _build.idle_yield_from_env() == 0
    for bad in ("-3", "2ms", "1.5"):
        monkeypatch.setenv(_build.ENV_IDLE_YIELD, bad)
        with pytest.raises(ValueError, match="TREEDRAFT_POOL_YIELD_US"):
            _build.idle_yield_from_env()
