"""attn_scores (treedraft.load / --attn-scores): the bf16 score mode's policy, its measured 'auto' choice and exactness
on the real model. The kernel arithmetic itself is tested in test_attention.py."""

from __future__ import annotations

import pytest
import torch

from treedraft import kernels

needs_bf16 = pytest.mark.skipif(
    not kernels.available() or not kernels.bf16_scores_supported(), reason="needs a native build with AVX512-BF16"
)


def _tiny_hd32():
    """A tiny seeded model on native q4 linears with head_dim 32 (bf16 scores need hd % 32 == 0)."""
    from native_utils import tiny_native_hd32

    return tiny_native_hd32(640)


def test_a_bad_attn_scores_value_is_refused_before_loading() -> None:
    import treedraft
    from treedraft.api import load_model

    for fn in (treedraft.load, load_model):
        with pytest.raises(ValueError, match=r"attn_scores must be one of \['auto', 'float32', 'bf16'\]"):
            fn("no-such-model", attn_scores="fp16")


def test_the_cli_lists_the_attn_scores_choices(capsys) -> None:
    from treedraft.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--attn-scores", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_policy_float32_weights_and_missing_instructions(monkeypatch) -> None:
    """float32 asks for nothing; auto keeps float32 scores for fp32 weights (the exact reference) and where the kernels
    lack the instructions; an explicit bf16 there is an error that says what to change."""
    from treedraft import api

    net = _tiny_hd32() if kernels.available() else None
    if net is None:
        pytest.skip("native kernels unavailable")
    assert api.attn_scores_for("float32", "own", net, None) is False
    net.weights_info = {"resolved": "fp32"}
    assert api.attn_scores_for("auto", "own", net, None) is False
    monkeypatch.setattr(kernels, "bf16_scores_supported", lambda: False)
    net.weights_info = {"resolved": "int4"}
    assert api.attn_scores_for("auto", "own", net, None) is False
    with pytest.raises(ValueError, match="needs a CPU with AVX512-BF16"):
        api.attn_scores_for("bf16", "own", net, None)
    with pytest.raises(ValueError, match="needs the own runtime"):
        api.attn_scores_for("bf16", "hf", object(), None)


@needs_bf16
def test_auto_measures_once_per_machine_then_reuses_the_choice(tmp_path, monkeypatch) -> None:
    """'auto' times a tree step both ways (the decoder's switch toggled, the model's setting left as it was), caches
    the faster, and a later load reads the file instead of measuring; TREEDRAFT_RETUNE=1 measures again."""
    from treedraft import api
    from treedraft.models import fused

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    net = _tiny_hd32()
    net.weights_info = {"resolved": "int4"}
    dec = fused.decoder_for(net)
    toggled: list[bool] = []
    real = type(dec).set_bf16_scores
    monkeypatch.setattr(type(dec), "set_bf16_scores", lambda self, on: toggled.append(on) or real(self, on))
    first = api.attn_scores_for("auto", "own", net, None)
    assert set(toggled[:-1]) == {False, True} and toggled[-1] is False  # both timed, then back to the model's
    assert net.bf16_scores is False
    assert list((tmp_path / "tune").glob("attn-*.json"))
    toggled.clear()
    assert api.attn_scores_for("auto", "own", net, None) is first and toggled == []  # from the cache
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    api.attn_scores_for("auto", "own", net, None)
    assert set(toggled) == {False, True}


@needs_bf16
def test_auto_keeps_float32_scores_where_the_context_cannot_hold_the_probe(tmp_path, monkeypatch) -> None:
    """A model loaded with a context shorter than the 8-row probe (max_seq_len 8) is not measured: float32 scores,
    and nothing cached (it used to fail the load, asking for a cache of negative length)."""
    from native_utils import tiny_native_hd32

    from treedraft import api

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    net = tiny_native_hd32(8)
    net.weights_info = {"resolved": "int4"}
    assert api.attn_scores_for("auto", "own", net, None) is False
    assert not list((tmp_path / "tune").glob("attn-*.json"))


@needs_bf16
@pytest.mark.slow
def test_speculative_equals_plain_with_bf16_scores_on_the_real_model() -> None:
    """Greedy output with the default drafter equals plain greedy output when decode attention scores in bf16, on the
    real model (int4 weights), and the mode does change the arithmetic (logits differ from float32 scores')."""
    from conftest import assert_spec_equals_plain, load_real

    llm = load_real(weights="int4", attn_scores="bf16")
    assert llm.model.bf16_scores
    assert sum(assert_spec_equals_plain(llm)) / 3 > 1.0
    ids = torch.tensor(llm.encode_prompt("List three uses of a paperclip and explain each one."))
    with torch.inference_mode():
        out = []
        for on in (True, False):
            llm.model.bf16_scores = on
            c = llm.model.new_cache(64)
            llm.model.forward(ids[None, :-1], torch.arange(len(ids) - 1), c, 0)
            n = len(ids) - 1  # the last token as a decode step on the prompt's cache (the fused, native attention)
            out.append(torch.log_softmax(llm.model.forward(ids[None, -1:], torch.tensor([n]), c, n)[0][0, 0], -1))
        llm.model.bf16_scores = True
    top = out[1].topk(20).indices
    diff = (out[0] - out[1])[top].abs()
    # another arithmetic (session 35: up to 0.19 on the top 20 log-probabilities of this step), far inside what the
    # int4 weights themselves move (their logits differ from fp32's by up to 3-4.6)
    assert 0 < float(diff.max()) < 0.5, float(diff.max())
