"""GGUF block unpacking, quantized linears and --weights (issue 11)."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest
import torch

from treedraft.models import gguf_blocks as gb
from treedraft.models.quant import (
    Int4PackLinear,
    Int8PackLinear,
    NativeLinear,
    QWeight,
    build_linear,
    choose_kernels,
    quantize_q4_rtn,
    rows_match,
    swap_linears,
)

gguf = pytest.importorskip("gguf")
RNG = np.random.default_rng(0)


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _random_blocks(n: int, k: int, qtype: int) -> np.ndarray:
    """Random raw blocks whose fp16 scale fields hold finite values (random bytes would hold NaN/inf)."""
    per, size = gb._BLOCK[qtype]
    raw = RNG.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    f16 = {gb.Q4_0: (0,), gb.Q4_1: (0, 2), gb.Q5_0: (0,), gb.Q8_0: (0,), gb.Q4_K: (0, 2)}[qtype]
    for off in f16:
        vals = (RNG.standard_normal((n, k // per)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = vals[..., None].view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", [gb.Q4_0, gb.Q4_1, gb.Q4_K, gb.Q5_0, gb.Q8_0])
def test_unpacked_blocks_dequantize_bit_exactly_like_gguf(qtype: int) -> None:
    n, k = 8, 512
    raw = _random_blocks(n, k, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(n, k)
    if qtype == gb.Q8_0:
        w = gb.dequantize_q8(*gb.unpack_q8_0(raw, (n, k)))
    elif qtype == gb.Q5_0:
        scale, q = gb.unpack_q5_0(raw, (n, k))
        assert q.dtype == torch.int8 and int(q.min()) >= -16 and int(q.max()) <= 15
        w = gb.dequantize_q8(scale, q)
    else:
        scale, minv, q = gb.UNPACK_Q4[qtype](raw, (n, k))
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (n, k // 32)
        w = gb.dequantize_q4(scale, minv, q)
    if qtype == gb.Q4_0:  # d*q + (-8d) gives +0.0 where d*(q-8) gives -0.0 (d < 0, q = 8): equal values
        np.testing.assert_array_equal(w.numpy(), ref)
        assert (_bits(w) != _bits(ref)).sum() == ((ref == 0) & np.signbit(ref)).sum()
    else:
        np.testing.assert_array_equal(_bits(w), _bits(ref))


def test_unpack_refuses_a_wrong_byte_count() -> None:
    raw = _random_blocks(4, 64, gb.Q4_1)
    with pytest.raises(ValueError, match="do not hold"):
        gb.unpack_q4_1(raw, (4, 96))


def _q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale, minv, q = gb.unpack_q4_1(_random_blocks(n, k, gb.Q4_1), (n, k))
    return scale, minv, q


def test_int4pack_with_float32_scales_multiplies_by_the_exact_q4_1_weights() -> None:
    scale, minv, q = _q4(64, 128)
    mod = Int4PackLinear(scale, minv, q, scale_dtype=torch.float32)
    np.testing.assert_array_equal(_bits(mod.dequantized()), _bits(gb.dequantize_q4(scale, minv, q)))


def test_int4pack_bf16_weights_are_the_file_values_with_bf16_scale_and_zero() -> None:
    """Fast path: q exact, scale and zero = minv + 8 * scale rounded to bf16, w = fma(q - 8, scale, zero).

    Read back through the kernel with a unit input, so each weight also comes out rounded to bf16.
    """
    scale, minv, q = _q4(64, 128)
    mod = Int4PackLinear(scale, minv, q)
    s = scale.bfloat16().double().repeat_interleave(32, 1)
    z = (minv + 8 * scale).bfloat16().double().repeat_interleave(32, 1)
    expect = ((q.double() - 8) * s + z).float().bfloat16().float()
    np.testing.assert_array_equal(_bits(mod.dequantized()), _bits(expect))


def test_int8pack_weights_are_exactly_q_times_bf16_scale() -> None:
    w = torch.randn(48, 96)
    mod = Int8PackLinear(w)
    d = mod.dequantized()
    assert torch.equal(mod.scales.float().bfloat16().float(), mod.scales.float())  # bf16-exact scales
    assert (d - w).abs().max() <= mod.scales.float().max() / 2 + 1e-6  # round-to-nearest, nothing clipped
    x = torch.randn(3, 96)
    ref = (x.bfloat16().double() @ d.double().t()).float()
    torch.testing.assert_close(mod(x), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kernel", ["int4pack", "int8pack"])
def test_tree_rows_equal_one_token_rows(kernel: str) -> None:
    """The stock kernels claim row invariance: rows of a 16-row product equal 1-row products bit for bit."""
    qw = QWeight("q4", _q4(128, 256), "test")
    mod = build_linear(qw, kernel)
    for rows in (2, 5, 16):
        assert rows_match(mod, 256, rows=rows)


def test_rows_match_catches_a_row_dependent_kernel() -> None:
    class Wobbly(torch.nn.Module):
        in_features = 8

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + 1e-6 * x.shape[0])

    assert not rows_match(Wobbly(), 8)


def _fake_kernels(row_dependent: bool = False) -> types.ModuleType:
    """A stand-in for treedraft.kernels: exact float32 weights, optionally with row-count dependent rows."""
    m = types.ModuleType("treedraft.kernels")
    m.available = lambda: True
    m.pack_q4_1 = lambda scale, minv, q: gb.dequantize_q4(scale, minv, q)
    m.pack_q8_0 = lambda scale, q: gb.dequantize_q8(scale, q)

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.stack([w @ r for r in x])  # one row at a time: row invariant
        return y * (1 + 1e-6 * x.shape[0]) if row_dependent else y

    m.mm = mm
    return m


def test_native_kernel_is_a_measured_candidate_and_refused_when_rows_vary(monkeypatch) -> None:
    qw = {
        "a": QWeight("q4", _q4(64, 128), "t"),
        "b": QWeight("q8", gb.unpack_q8_0(_random_blocks(64, 128, gb.Q8_0), (64, 128)), "t"),
    }
    logs: list[str] = []
    good = choose_kernels(qw, _fake_kernels(), logs.append)
    assert set(good) == {"q4", "q8"} and all(v in ("native", "int4pack", "int8pack") for v in good.values())
    assert any("native" in ln for ln in logs)  # it was measured
    logs.clear()
    bad = choose_kernels(qw, _fake_kernels(row_dependent=True), logs.append)
    assert bad == {"q4": "int4pack", "q8": "int8pack"}
    assert any("refused" in ln for ln in logs)


def test_missing_native_package_means_stock_kernels(monkeypatch) -> None:
    from treedraft.models import quant

    monkeypatch.setitem(sys.modules, "treedraft.kernels", None)  # import fails
    assert quant.native_kernels() is None
    monkeypatch.setitem(sys.modules, "treedraft.kernels", _fake_kernels())
    assert quant.native_kernels() is not None


def _tiny():
    from treedraft.models.llama import LlamaConfig, Transformer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64
    )
    return Transformer(cfg).eval()


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_tiny_model_swaps_every_linear_and_tree_rows_equal_single_rows(weights: str, tmp_path, monkeypatch) -> None:
    from treedraft.models.quant import QuantLinear
    from treedraft.models.quant_load import apply_weights

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    model = _tiny()
    info = apply_weights(model, None, weights)
    assert info["resolved"] == weights
    lin = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(lin) == 2 * 4 + 1
    with torch.inference_mode():
        x = torch.randn(1, 7, 64)
        for n in lin:
            m = model.get_submodule(n)
            xi = torch.randn(1, 7, m.in_features)
            full = m(xi)
            assert all(torch.equal(full[:, i], m(xi[:, i : i + 1])[:, 0]) for i in range(7)), n
        del x


def test_q4_rtn_roundtrip_error_is_within_half_a_step() -> None:
    w = torch.randn(32, 64)
    qw = quantize_q4_rtn(w)
    step = qw.parts[0].repeat_interleave(32, 1)
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_int4pack_refuses_shapes_it_cannot_pack_and_swap_falls_back_with_a_warning() -> None:
    qw = QWeight("q4", _q4(40, 64), "t")  # 40 rows: not a multiple of 16
    with pytest.raises(ValueError, match="rows % 16"):
        build_linear(qw, "int4pack")
    holder = torch.nn.Module()
    holder.lin = torch.nn.Linear(64, 40, bias=False)
    with pytest.warns(UserWarning, match="lin.*int8pack"):
        swap_linears(holder, {"lin": qw}, {"q4": "int4pack"})
    assert isinstance(holder.lin, Int8PackLinear)


def test_bad_weights_value_lists_the_choices() -> None:
    from treedraft.models.quant_load import check_weights, resolve_weights

    with pytest.raises(ValueError, match="auto, fp32, int8, int4"):
        check_weights("int3")
    with pytest.raises(ValueError, match="--weights fp32"):
        resolve_weights("int4", "own", "cuda", torch.bfloat16)
    assert resolve_weights("auto", "hf", "cpu", torch.float32) == "fp32"


def test_cli_rejects_a_bad_weights_value(capsys) -> None:
    from treedraft.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--weights", "int3"])
    err = capsys.readouterr().err
    assert "int3" in err and "int4" in err and "fp32" in err


def test_gguf_type_without_exact_mapping_is_named_in_the_warning(tmp_path) -> None:
    """A tiny GGUF whose ffn_down is Q5_1 (no exact 4- or 8-bit form, like Q6_K) warns naming the tensor and type;
    a Q5_0 one is kept exactly as int8 (its 5-bit values fit int8 with the same scale), without a warning."""
    from treedraft.models.quant_load import gguf_weights

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, down_type=gguf.GGMLQuantizationType.Q5_1)
    with pytest.warns(UserWarning) as rec:
        qw = gguf_weights(path, 1, 2, 2, "int4", tied=True)
    msg = " ".join(str(r.message) for r in rec)
    assert "ggml type 7" in msg and "blk.0.ffn_down.weight" in msg
    assert qw["layers.0.ffn.w2"].fmt == "q8" and qw["layers.0.attn.wqkv"].fmt == "q4"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gguf_weights(path, 1, 2, 2, "int8", tied=True)  # int8 asked: no 4-bit mapping expected, no warning
    exact = tmp_path / "q5_0.gguf"
    _write_tiny_gguf(exact, down_type=gguf.GGMLQuantizationType.Q5_0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w2 = gguf_weights(exact, 1, 2, 2, "int4", tied=True)["layers.0.ffn.w2"]
    t = next(t for t in gguf.GGUFReader(str(exact)).tensors if t.name == "blk.0.ffn_down.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w2.dequantize().shape)
    assert w2.fmt == "q8" and w2.source == "gguf Q5_0"
    np.testing.assert_array_equal(w2.dequantize().numpy(), ref)


def _write_tiny_gguf(path, down_type) -> None:
    """One-layer Llama GGUF: linears Q4_1, ffn_down ``down_type``, token_embd Q8_0."""
    H, I, V = 64, 128, 96
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_context_length(64)
    rng = np.random.default_rng(1)

    def add(name: str, shape: tuple[int, int], qt) -> None:
        x = rng.standard_normal(shape).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(x, qt)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)

    Q41 = gguf.GGMLQuantizationType.Q4_1
    add("token_embd.weight", (V, H), gguf.GGMLQuantizationType.Q8_0)
    for n, s in (
        ("attn_q", (H, H)),
        ("attn_k", (H, H)),
        ("attn_v", (H, H)),
        ("attn_output", (H, H)),
        ("ffn_gate", (I, H)),
        ("ffn_up", (I, H)),
    ):
        add(f"blk.0.{n}.weight", s, Q41)
    add("blk.0.ffn_down.weight", (H, I), down_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.slow
def test_real_file_blocks_and_int4_weights_equal_the_dequantized_file() -> None:
    """Every Q4_1/Q8_0 tensor of the bundled GGUF unpacks to gguf's own dequantization bit for bit, and
    the int4 kernel (float32 scales) multiplies by exactly those weights."""
    from treedraft.models.registry import resolve

    reader = gguf.GGUFReader(str(resolve("smollm2-135m-instruct")))
    seen = set()
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if int(t.tensor_type) not in (gb.Q4_1, gb.Q8_0):
            continue
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if int(t.tensor_type) == gb.Q8_0:
            np.testing.assert_array_equal(_bits(gb.dequantize_q8(*gb.unpack_q8_0(t.data, shape))), _bits(ref))
            continue
        parts = gb.unpack_q4_1(t.data, shape)
        np.testing.assert_array_equal(_bits(gb.dequantize_q4(*parts)), _bits(ref), err_msg=t.name)
        kind = t.name.split(".")[2]
        if kind not in seen:  # one tensor of each kind through the kernel (the identity product is slow)
            seen.add(kind)
            mod = Int4PackLinear(*parts, scale_dtype=torch.float32)
            np.testing.assert_array_equal(_bits(mod.dequantized()), _bits(ref), err_msg=t.name)
    assert len(seen) == 7


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int4", "int8", "int4-native", "int8-native"])
def test_speculative_equals_plain_on_the_real_model(weights: str, monkeypatch) -> None:
    """Greedy output with the default (hybrid) drafter equals plain greedy output of the same quantized weights.

    '-native' forces the native int8-activation linears (and with them the row-invariant decode attention)
    whatever this machine's measured kernel choice is, under a separate tuning-cache key.
    """
    from conftest import assert_spec_equals_plain, load_real

    from treedraft.models import quant_load
    from treedraft.models.quant import NativeLinear, QuantLinear

    native = weights.endswith("-native")
    weights = weights.removesuffix("-native")
    if native:
        if quant_load.native_kernels() is None:
            pytest.skip("native kernels unavailable")
        key = quant_load._machine_key
        monkeypatch.setattr(quant_load, "_machine_key", lambda path, extra: key(path, extra + "|test-native"))
        monkeypatch.setattr(
            quant_load, "choose_kernels", lambda qw, natives, log=None: {"q4": "native", "q8": "native"}
        )
    llm = load_real(weights=weights)  # one first-use measurement across pytest -n workers (conftest)
    assert llm.model.weights_info["resolved"] == weights
    assert isinstance(llm.model.layers[0].attn.wqkv, QuantLinear) and isinstance(llm.model.lm_head, QuantLinear)
    if native:
        assert isinstance(llm.model.layers[0].attn.wqkv, NativeLinear) and llm.model.exact_attention
    accepted = assert_spec_equals_plain(llm)
    assert min(accepted) > 1.0  # the drafter did get tokens accepted on every prompt


def test_auto_measures_once_then_reuses_the_cached_choice(tmp_path, monkeypatch) -> None:
    from treedraft.models import quant_load

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    info = quant_load.apply_weights(_tiny(), None, "auto", probe_ids=list(range(1, 20)))
    assert info["chosen"] in ("fp32", "int4", "int8")
    assert set(info["top1_agreement"]) == {"fp32", "int4", "int8"}
    assert list((tmp_path / "tune").glob("quant-*.json"))

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(quant_load, "_measure_auto", boom)
    again = quant_load.apply_weights(_tiny(), None, "auto")
    assert again["chosen"] == info["chosen"]
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    with pytest.raises(AssertionError, match="measured again"):
        quant_load.apply_weights(_tiny(), None, "auto")


def test_gguf_meta_tensor_bytes_match_gguf_reader(tmp_path) -> None:
    """The cached tensor table feeds quant_load: every tensor's bytes equal gguf.GGUFReader's."""
    from treedraft.models import gguf_meta

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, down_type=gguf.GGMLQuantizationType.Q8_0)
    meta = gguf_meta.read_gguf_meta(path)
    assert meta.architecture == "llama" and meta.arch_get("block_count") == 1
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in meta.tensors] == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = meta.tensor(t.name)
        assert mine.type == t.tensor_type.name and mine.shape == tuple(int(d) for d in reversed(t.shape))
        np.testing.assert_array_equal(meta.tensor_raw(mm, mine), t.data, err_msg=t.name)


def test_auto_stores_the_kernel_choice_of_each_format_for_explicit_weights(tmp_path, monkeypatch) -> None:
    """weights=auto measures the int4 and int8 kernels anyway: a later --weights int4/int8 load reuses them."""
    from treedraft.models import quant_load

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    info = quant_load.apply_weights(_tiny(), None, "auto", probe_ids=list(range(1, 20)))
    assert set(info["kernels_by_format"]) == {"int4", "int8"}

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(quant_load, "choose_kernels", boom)
    for w in ("int4", "int8"):
        again = quant_load.apply_weights(_tiny(), None, w)
        assert again["kernels"] == info["kernels_by_format"][w] and again["resolved"] == w


def test_q4_pair_choice_is_measured_once_and_applied(tmp_path, monkeypatch) -> None:
    """The paired-tiles choice is measured at the first load on a machine, stored in the tune file, and applied (from
    the file) at every load."""
    import treedraft.kernels as tk
    from treedraft.models import quant_load

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    measured, applied = [], []
    monkeypatch.setattr(quant_load, "choose_q4_pair", lambda mods, *a, **k: measured.append(mods) or False)
    monkeypatch.setattr(tk, "set_q4_pair", applied.append)
    model = _tiny()
    first = quant_load.apply_weights(model, None, "int4")
    again = quant_load.apply_weights(_tiny(), None, "int4")
    assert len(measured) == 1 and first["q4_pair"] is False and again["q4_pair"] is False
    assert applied == ([False, False] if tk.available() else [])
    if tk.available():  # timed on the model's own native q4 linears, as swapped in
        q4 = [m for m in model.modules() if isinstance(m, NativeLinear) and m.packed.kind == tk.Q4_1]
        assert q4 and [id(m) for m in measured[0]] == [id(m) for m in q4]


def test_rtn_scales_are_the_fp16_values_the_packed_formats_store() -> None:
    """Codes are rounded against the scale (and Q4 minimum) as packed (fp16, like GGUF's d and m): packing them
    changes nothing (no 'rounding changed it' warning) and code x scale (+ min) is within a code step of w (half a
    step, plus what rounding the scale and minimum to fp16 moves the end codes)."""
    from treedraft.models.quant import quantize_q8_rtn

    torch.manual_seed(0)
    w = torch.randn(48, 64) * torch.logspace(-4, 0, 48)[:, None]  # rows down to subnormal-fp16 scales
    w[3] = 0.0  # an all-zero row: a positive scale, codes 0
    for qw in (quantize_q4_rtn(w), quantize_q8_rtn(w)):
        scale = qw.parts[0]
        assert torch.equal(scale.to(torch.float16).float(), scale) and bool((scale > 0).all())
        if qw.fmt == "q4":
            lo, q = qw.parts[1], qw.parts[2]
            assert torch.equal(lo.to(torch.float16).float(), lo)
            back = q.float().reshape(48, 2, 32) * scale[..., None] + lo[..., None]
            step = scale
        else:
            q = qw.parts[1]
            back = q.float().reshape(48, 2, 32) * scale[..., None]
            step = scale
        err = (back - w.reshape(48, 2, 32)).abs().amax(-1)
        assert bool((err <= step).all()), (qw.fmt, err / step)
        kernels = pytest.importorskip("treedraft.kernels")
        if not kernels.available():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any pack warning fails the test
            build_linear(qw, "native", None, kernels)


def test_weight_bytes_counts_what_the_native_kernels_stream() -> None:
    """A native q4 linear streams 20 bytes per 32 weights (16 of nibbles, fp16 scale and min), padded to 16-row
    tiles; its quantized parts carry float32 scales, which weight_bytes used to count (24 bytes per block)."""
    from native_utils import tiny_native

    from treedraft.models.quant import weight_bytes

    model = tiny_native(32)
    lin = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert lin and all(m.packed.kind_name == "Q4_1" for m in lin)
    expect = sum(-(-m.out_features // 16) * 16 * (m.in_features // 32) * 20 for m in lin)
    assert weight_bytes(model) == expect == sum(m.packed.nbytes for m in lin)


def test_auto_times_int4_with_its_measured_q4_tiles(tmp_path, monkeypatch) -> None:
    """'auto' measures the Q4_1 paired-tiles choice on its int4 trial and times int4 under it (it timed int4 with the
    kernel's default paired tiles, 25% slower at 8-16 rows on a Zen 4, and picked the slower int8 there); the choice
    is stored, applied when int4 is chosen, and not measured again by a later explicit int4 load."""
    import treedraft.kernels as tk
    from treedraft.models import quant_load

    if not tk.available() or not tk.q4_pair_supported():
        pytest.skip("needs the native kernels with the paired Q4_1 tiles")
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    state = {"pair": True}
    timed: list[tuple[str, bool]] = []
    measured: list[int] = []
    monkeypatch.setattr(tk, "set_q4_pair", lambda on: state.__setitem__("pair", on))
    monkeypatch.setattr(quant_load, "choose_q4_pair", lambda mods, *a, **k: measured.append(len(mods)) or False)
    real = quant_load.time_modules

    def spy(mods, rows, *a, **k):
        q4 = any(isinstance(m, NativeLinear) and m.packed.kind == tk.Q4_1 for m in mods)
        q8 = any(isinstance(m, NativeLinear) and m.packed.kind == tk.Q8_0 for m in mods)
        timed.append(("int4" if q4 else "int8" if q8 else "fp32", state["pair"]))
        return real(mods, rows, *a, **k)

    monkeypatch.setattr(quant_load, "time_modules", spy)
    info = quant_load.apply_weights(_tiny(), None, "auto", probe_ids=list(range(1, 20)))
    assert measured and measured[0] > 0  # on the int4 trial's own Q4_1 linears
    assert {p for w, p in timed if w == "int4"} == {False}  # int4 timed with the measured (single) tiles
    assert {p for w, p in timed if w == "int8"} == {True}  # and the default restored before int8
    assert info["q4_pair"] == (False if info["resolved"] == "int4" else None)
    assert state["pair"] is (False if info["resolved"] == "int4" else True)
    assert not any(k.startswith("q4_pair@") for k in info)
    again = quant_load.apply_weights(_tiny(), None, "int4")
    assert again["q4_pair"] is False and len(measured) == 1  # reused from the auto measurement


def test_auto_times_int4_and_int8_in_alternating_rounds_and_keeps_each_ones_fastest(tmp_path, monkeypatch) -> None:
    """'auto' times int4 and int8 in alternating rounds and keeps each one's fastest: a burst of load that meets one
    format's first timing does not decide (timed one after the other, it had made a session-41 Xeon choose int8,
    whose every forward there is slower)."""
    from treedraft.models import quant_load

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    trials: list[torch.nn.Module] = []
    real_trial = quant_load._trial_model
    monkeypatch.setattr(quant_load, "_trial_model", lambda *a: trials.append(real_trial(*a)) or trials[-1])
    calls: list[str] = []

    def fake_time(mods, rows, *a, **k):
        ids = {id(m) for m in mods}
        w = next((f for f, t in zip(("int4", "int8"), trials) if ids <= {id(m) for m in t.modules()}), "fp32")
        calls.append(w)
        if w == "int4":  # round 1 meets a burst of load, round 2 is int4's fastest, the later ones are slower than int8
            rnd = (calls.count("int4") + 1) // 2
            return 0.025 if rnd == 1 else 0.0005 if rnd == 2 else 0.0015
        return {"fp32": 1.0, "int8": 0.001}[w]

    monkeypatch.setattr(quant_load, "time_modules", fake_time)
    monkeypatch.setattr(quant_load, "_top1_agreement", lambda *a, **k: 1.0)
    info = quant_load.apply_weights(_tiny(), None, "auto", probe_ids=list(range(1, 20)))
    q = [w for w in calls if w != "fp32"]
    assert len(q) == 2 * 2 * quant_load.AUTO_ROUNDS  # 1 and 16 rows, both formats, every round
    assert q[:8] == ["int4", "int4", "int8", "int8", "int8", "int8", "int4", "int4"]  # the order alternates
    assert info["chosen"] == "int4" and info["resolved"] == "int4"
    # each format's fastest round (ms): not the burst's, not the last round's (int8 would win on those, or on means)
    assert info["linear_ms_rows_1_16"] == pytest.approx({"fp32": 2000.0, "int4": 1.0, "int8": 2.0})


def test_int4_and_int8_targets_get_their_own_latency_curves(tmp_path, monkeypatch) -> None:
    """The measurement key of a target names its native linears' block formats: int4 and int8 models have the same
    linear classes and parameters, and shared one cached latency curve (each load's check then measured again)."""
    import treedraft.kernels as tk
    from treedraft.models import quant_load
    from treedraft.training.calibrate import _target_facts

    if not tk.available():
        pytest.skip("needs the native kernels")
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    facts = {}
    for w in ("int4", "int8"):
        m = _tiny()
        quant_load.apply_weights(m, None, w)
        facts[w] = _target_facts(m)
    assert facts["int4"]["linears"] == facts["int8"]["linears"] == ["NativeLinear"]
    assert facts["int4"]["packed"] == ["Q4_1"] and facts["int8"]["packed"] == ["Q8_0"]  # (a GGUF int4: + Q8_0)
    assert "packed" not in _target_facts(_tiny())  # fp32: the key as it was


def test_int_weights_elsewhere_name_the_setting_to_change() -> None:
    """int4 / int8 off the own runtime on the CPU in float32: the error names the one setting in the way (it told an hf
    runtime user to pass --device cpu --dtype fp32, which changed nothing)."""
    from treedraft.models.quant_load import resolve_weights

    for args, fix in (
        (("hf", "cpu", torch.float32), "--runtime own"),
        (("own", "cuda", torch.float32), "--device cpu"),
        (("own", "cpu", torch.bfloat16), "--dtype fp32"),
    ):
        with pytest.raises(ValueError, match=f"use --weights fp32 or auto, or {fix}"):
            resolve_weights("int4", *args)
        assert resolve_weights("auto", *args) == "fp32"
    assert resolve_weights("int8", "own", "cpu", torch.float32) == "int8"
    with pytest.raises(ValueError, match="device 'cuda' and dtype bfloat16; .* or --device cpu --dtype fp32"):
        resolve_weights("int8", "own", "cuda", torch.bfloat16)  # every setting in the way, at once
    with pytest.raises(ValueError, match="does not run this model's architecture; use --weights fp32 or auto$"):
        resolve_weights("int4", "hf", "cpu", torch.float32, own_loads=False)  # auto chose hf: only the weights can go
