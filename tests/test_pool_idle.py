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


def _asleep_after(pause: float) -> int:
    """Workers asleep ``pause`` seconds after a pooled call (the caller sleeps meanwhile)."""
    x = torch.randn(64, 128)
    w = _packed()
    kernels.mm(x, w)
    time.sleep(pause)
    return kernels.idle_workers_asleep()


def _eventually_asleep(limit: float = 5.0) -> bool:
    t = time.monotonic()
    while time.monotonic() - t < limit:  # (a loaded machine may not run the worker at once)
        if kernels.idle_workers_asleep() == 1:
            return True
        time.sleep(0.01)
    return False


def test_worker_sleeps_after_the_yield_window(two_threads) -> None:
    """With a 2 ms window the worker is asleep soon after a call, and then costs no CPU: a broken window would keep
    it polling (~0.3 s of CPU over a 300 ms pause on an idle machine)."""
    kernels.set_idle_wait(spin_us=100, yield_us=2000)
    _asleep_after(0.0)
    assert _eventually_asleep()
    t0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - t0 < 0.06


def test_worker_stays_awake_inside_the_yield_window(two_threads) -> None:
    """With a 1 s window the worker is still polling 100 ms after a call (without the yielding phase it would sleep
    after 100 us); with no window it sleeps."""
    kernels.set_idle_wait(spin_us=100, yield_us=1_000_000)
    assert _asleep_after(0.1) == 0
    kernels.set_idle_wait(spin_us=100, yield_us=0)
    _asleep_after(0.0)
    assert _eventually_asleep()


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


@pytest.mark.parametrize(
    "kw", [{"spin_us": -1}, {"yield_us": -5}, {"yield_us": 1.5}, {"spin_us": True}, {"yield_us": 3_000_000_000}]
)
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
    for bad in ("-3", "2ms", "1.5", "5000000000"):
        monkeypatch.setenv(_build.ENV_IDLE_YIELD, bad)
        with pytest.raises(ValueError, match="TREEDRAFT_POOL_YIELD_US"):
            _build.idle_yield_from_env()


def test_a_bad_idle_setting_is_said_and_the_kernels_still_load(monkeypatch, capsys) -> None:
    """A typo in TREEDRAFT_POOL_YIELD_US is reported on stderr and the default kept, never the kernels lost."""
    threads = kernels.get_num_threads()
    monkeypatch.setenv(_build.ENV_IDLE_YIELD, "2ms")
    assert _build.load_extension(reload=True) is not None
    assert "TREEDRAFT_POOL_YIELD_US" in capsys.readouterr().err
    monkeypatch.delenv(_build.ENV_IDLE_YIELD)
    assert _build.load_extension(reload=True) is not None
    kernels.set_num_threads(threads)  # (a reload takes torch's thread count)
