"""benchmarks/gpu_check.py's verdict and gpu_check.sh's refusal without CUDA (the check itself needs a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
gpu_check = pytest.importorskip("gpu_check")


def _doc(equal: dict[str, list[bool]]) -> dict:
    recs = [
        {"method": m, "prompt_id": str(i), "equal_to_reference": e} for m, es in equal.items() for i, e in enumerate(es)
    ]
    return {"methods": list(equal), "records": recs, "summary": {}}


PARITY_OK = {"positions": 40, "max_abs_diff": 1e-4, "logit_scale": 30.0, "argmax_agreement": 1.0, "ok": True}


def test_summary_passes_only_when_parity_holds_and_every_drafter_equals_plain():
    doc = _doc({"plain": [True, True], "hybrid-suffix": [True, True], "hf": [False, True]})
    text, ok = gpu_check.summary("GPU X", PARITY_OK, doc, "| table |", 12.0)
    assert ok  # transformers' own greedy text may differ (its fp32 order); it is reported, not required
    assert "`hybrid-suffix` = treedraft plain: 2/2" in text and "| table |" in text and "GPU X" in text

    bad = _doc({"plain": [True, True], "hybrid-suffix": [True, False], "eagle": [True, True]})
    text, ok = gpu_check.summary("GPU X", PARITY_OK, bad, "", 1.0)
    assert not ok and "`hybrid-suffix` = treedraft plain: 1/2 **(FAILED)**" in text
    assert "`eagle` = treedraft plain: 2/2" in text

    off = dict(PARITY_OK, max_abs_diff=0.5, ok=False)
    text, ok = gpu_check.summary("GPU X", off, _doc({"plain": [True]}), "", 1.0)
    assert not ok and "FAILED" in text


def test_a_path_that_crashes_fails_the_check_and_inequality_is_only_reported():
    doc = _doc({"plain": [True], "hybrid-suffix": [True]})
    extra = {
        "JSON Schema": {"ok": True, "equal": False, "tokens": 40, "mean_accepted": 2.5},
        "batched (4 requests, scheduler)": {"ok": True, "equal": 3, "of": 4},
    }
    text, ok = gpu_check.summary("GPU X", PARITY_OK, doc, "", 1.0, extra)
    assert ok and "- JSON Schema: ran; = plain: False" in text and "= alone 3/4" in text
    extra["sampled (t 0.7, seed 3)"] = {"ok": False, "error": "RuntimeError: Expected all tensors on one device"}
    text, ok = gpu_check.summary("GPU X", PARITY_OK, doc, "", 1.0, extra)
    assert not ok and "- sampled (t 0.7, seed 3): **FAILED**: RuntimeError: Expected" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_sh_refuses_clearly_without_cuda(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), DEVICE="cuda")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "sees no CUDA device" in r.stderr and "--device cpu" in r.stderr
    assert not (tmp_path / "gpu-check").exists()  # stopped before any work
