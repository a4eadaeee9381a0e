"""Fused native decode forward (models/fused.py, kernels/fused.h): agreement with the Python path, row
invariance, cache contents, packed segments, fallbacks, and greedy speculative == plain on the real model."""

from __future__ import annotations

import warnings

import pytest
import torch

from treedraft import kernels
from treedraft.models import fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")

V = 96


def _tiny_native(seed: int = 0, lm_q8: bool = True, bias: bool = False, max_seq_len: int = 128, fp32: bool = False):
    """A tiny seeded GQA model with every linear native (q4 layers, q8 lm_head), as load(weights='int4') does;
    ``fp32``: the float32 linears packed with the exact plan instead (fused.h kind 2), as load(weights='fp32')."""
    from treedraft.models.llama import Linear, LlamaConfig, Transformer
    from treedraft.models.quant import quantize_q4_rtn, quantize_q8_rtn, swap_linears

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=max_seq_len,
        qkv_bias=bias,
        tie_embeddings=False,
    )
    model = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))  # non-trivial norm weights
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape))
    if fp32:  # the fp32 weights as they are, packed with the row-invariant plan (models/plan.py pack_tuned)
        from treedraft.models.matmul import exact_plan

        model.pack(exact_plan())
        model.exact_attention = True
        return model
    qw = {
        n: (quantize_q8_rtn if n == "lm_head" and lm_q8 else quantize_q4_rtn)(m.weight.detach())
        for n, m in model.named_modules()
        if isinstance(m, Linear)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 rounding of the rtn scales
        swap_linears(model, qw, {"q4": "native", "q8": "native"}, kernels)
    assert model.exact_attention
    return model


def _tree(n: int, start: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Binary tree of n nodes (parent of i is (i-1)//2): parents, positions (n,), mask (n, start + n)."""
    parents = [(i - 1) // 2 for i in range(n)]
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    depth = []
    for i in range(n):
        j, d = i, 0
        while j >= 0:
            mask[i, start + j] = True
            j, d = parents[j], d + (j > 0)
        depth.append(d)
    return parents, torch.tensor([start + d for d in depth]), mask


def _prefill(model, prompt: torch.Tensor, max_len: int = 128):
    cache = model.new_cache(max_len=max_len)
    model(prompt[None], torch.arange(len(prompt)), cache, start=0)
    cache.keep(0, range(len(prompt)))
    return cache


def _step(model, toks, pos, cache, start, mask=None, use_fused=True, monkeypatch=None):
    monkeypatch.setenv(fused.ENV_DISABLE, "0" if use_fused else "1")
    with torch.inference_mode():
        return model(toks[None], pos, cache, start=start, mask=mask)


@pytest.fixture
def calls(monkeypatch):
    """Counts native fused forwards (a spy on fused.forward_segments)."""
    from native_utils import count_native

    return count_native(monkeypatch)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [1, 6])
def test_fused_matches_python_path(T: int, bias: bool, kv_dtype: torch.dtype, monkeypatch, calls) -> None:
    """Logits, hidden states and the new cache slots agree with the Python path to float rounding."""
    model = _tiny_native(bias=bias)
    model.kv_dtype = kv_dtype
    assert fused.status(model) is None
    g = torch.Generator().manual_seed(1)
    prompt, new = torch.randint(0, V, (23,), generator=g), torch.randint(0, V, (T,), generator=g)
    out, caches = {}, {}
    for use in (True, False):
        cache = _prefill(model, prompt)
        out[use] = _step(model, new, torch.arange(23, 23 + T), cache, 23, None, use, monkeypatch)
        caches[use] = cache
    assert calls["fused"] == 1  # the fused run went native, the other one did not
    (lf, hf), (lp, hp) = out[True], out[False]
    assert lf.shape == lp.shape == (1, T, V) and hf.shape == hp.shape == (1, T, 64) and lf.dtype == torch.float32
    # the q4/int8-activation linears turn 1-ulp differences into rare code flips: a loose bound on logits
    torch.testing.assert_close(hf, hp, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lf, lp, atol=2e-3, rtol=2e-3)
    tol = 1e-5 if kv_dtype == torch.float32 else 1e-3  # fp16 storage: inputs 1e-6 apart may round 1 ulp apart
    for kf, kp in zip(caches[True].k + caches[True].v, caches[False].k + caches[False].v, strict=True):
        assert kf.dtype == kp.dtype == kv_dtype
        assert torch.equal(kf[:, :, :23], kp[:, :, :23])  # the prefix is untouched
        torch.testing.assert_close(kf[:, :, 23 : 23 + T].float(), kp[:, :, 23 : 23 + T].float(), atol=tol, rtol=tol)
        assert not kf[:, :, 23 + T :].any()  # nothing written past the step
        assert kf[:, :, 23 : 23 + T].abs().sum() > 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("P", [40, 150, 300])
def test_tree_rows_equal_one_token_rows_bitwise(P: int, kv_dtype: torch.dtype, monkeypatch, calls) -> None:
    """Each node of a 16-node tree step gets the bits of plain 1-token steps along its root path.

    P = 150 and 300 put the keys of a step into several 128-key blocks (split over threads, then folded).
    """
    model = _tiny_native(seed=2, max_seq_len=512)
    model.kv_dtype = kv_dtype
    g = torch.Generator().manual_seed(5)
    prompt, toks = torch.randint(0, V, (P,), generator=g), torch.randint(0, V, (16,), generator=g)
    parents, pos, mask = _tree(16, P)
    lt, ht = _step(model, toks, pos, _prefill(model, prompt, 512), P, mask, True, monkeypatch)
    steps = 0
    for leaf in (15, 11, 8):  # three root-to-leaf paths
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        steps += len(path)
        cache = _prefill(model, prompt, 512)
        for d, node in enumerate(path):
            l1, h1 = _step(model, toks[node : node + 1], torch.tensor([P + d]), cache, P + d, None, True, monkeypatch)
            cache.keep(P + d, [0])
            assert torch.equal(l1[0, 0], lt[0, node]) and torch.equal(h1[0, 0], ht[0, node]), (leaf, node)
    assert steps == 13 and calls["fused"] == 1 + steps  # every step went native


def test_logits_for_and_causal_block(monkeypatch) -> None:
    """logits_for picks rows like the Python path; a mask-less T>1 step is causal over the new block."""
    model = _tiny_native(seed=3)
    g = torch.Generator().manual_seed(7)
    prompt, new = torch.randint(0, V, (30,), generator=g), torch.randint(0, V, (5,), generator=g)
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    with torch.inference_mode():
        lf, hf = model(new[None], torch.arange(30, 35), _prefill(model, prompt), start=30)
        causal = torch.ones(5, 35, dtype=torch.bool).tril(30)
        lm, hm = model(new[None], torch.arange(30, 35), _prefill(model, prompt), start=30, mask=causal)
        ls, _ = model(new[None], torch.arange(30, 35), _prefill(model, prompt), start=30, logits_for=slice(-2, None))
    assert torch.equal(lf, lm) and torch.equal(hf, hm)
    assert ls.shape == (1, 2, V) and torch.equal(ls, lf[:, -2:])


@pytest.mark.parametrize("fp32", [False, True])
def test_packed_segments_equal_separate_calls(fp32: bool) -> None:
    """Two requests packed into one native call get each request's bits from running it alone (int4 and fp32)."""
    model = _tiny_native(seed=4, bias=fp32, fp32=fp32)
    assert fused.status(model) is None
    g = torch.Generator().manual_seed(9)
    pa, pb = torch.randint(0, V, (17,), generator=g), torch.randint(0, V, (33,), generator=g)
    ta, tb = torch.randint(0, V, (1,), generator=g), torch.randint(0, V, (7,), generator=g)
    _, pos_b, mask_b = _tree(7, 33)
    with torch.inference_mode():
        alone = []
        for p, t, pos, m in ((pa, ta, torch.tensor([17]), None), (pb, tb, pos_b, mask_b)):
            c = _prefill(model, p)
            alone.append((fused.forward_segments(model, t, pos, [fused.Seg(c, len(p), len(t), m)]), c))
        ca, cb = _prefill(model, pa), _prefill(model, pb)
        segs = [fused.Seg(ca, 17, 1, None), fused.Seg(cb, 33, 7, mask_b)]
        logits, h = fused.forward_segments(model, torch.cat([ta, tb]), torch.cat([torch.tensor([17]), pos_b]), segs)
    assert logits.shape == (8, V) and h.shape == (8, 64)
    assert torch.equal(logits[:1], alone[0][0][0]) and torch.equal(logits[1:], alone[1][0][0])
    assert torch.equal(h[:1], alone[0][0][1]) and torch.equal(h[1:], alone[1][0][1])
    for c, (_, c_alone) in zip((ca, cb), alone, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(c.k + c.v, c_alone.k + c_alone.v, strict=True))


def test_disabled_by_env_runs_the_python_path(monkeypatch, calls) -> None:
    model = _tiny_native(seed=5)
    g = torch.Generator().manual_seed(11)
    prompt, new = torch.randint(0, V, (12,), generator=g), torch.randint(0, V, (3,), generator=g)
    monkeypatch.setenv(fused.ENV_DISABLE, "1")
    assert fused.status(model) == f"disabled by {fused.ENV_DISABLE}"
    with torch.inference_mode():
        model(new[None], torch.arange(12, 15), _prefill(model, prompt), start=12)
    assert calls["fused"] == 0


def test_automatic_fallbacks(monkeypatch, calls) -> None:
    """No extension, a non-native linear, exact attention off or a batch of 2: the Python path, with a reason."""
    from treedraft.models.tiny import tiny_llama

    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    fp32 = tiny_llama(vocab_size=V, hidden=64)
    fp32.exact_attention = True
    assert "neither a native linear nor an exact fp32 one" in fused.status(fp32)  # not packed: BLAS F.linear
    model = _tiny_native(seed=6)
    assert fused.status(model) is None
    model.layers[1].attn.exact_attention = False  # one layer's flag: seen by the next call
    assert fused.status(model) == "exact_attention is off"
    model.exact_attention = True
    assert fused.status(model) is None
    with monkeypatch.context() as mp:
        mp.setattr(kernels, "available", lambda: False)
        mp.setattr(kernels, "unavailable_reason", lambda: "disabled by TREEDRAFT_NO_EXT")
        assert fused.status(model) is None  # built before: the modules are unchanged
        model.layers[0].attn.wo = _tiny_native(seed=6).layers[0].attn.wo  # a replaced module: rebuilt
        assert "native extension unavailable" in fused.status(model)
    m2 = _tiny_native(seed=6)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        c = m2.new_cache(max_len=64, batch=2)
        m2(torch.randint(0, V, (2, 9), generator=g), torch.arange(9), c, start=0)
        m2(torch.randint(0, V, (2, 1), generator=g), torch.tensor([9]), c, start=9)  # B=2: Python path
        c1 = _prefill(m2, torch.randint(0, V, (9,), generator=g), max_len=10)
        with pytest.raises(ValueError, match="KV cache overflow"):  # the Python path's error, unchanged
            m2(torch.randint(0, V, (1, 2), generator=g), torch.arange(9, 11), c1, start=9)


def test_decoder_rebuilt_after_each_kind_of_change_and_unchecked_otherwise(monkeypatch) -> None:
    """The per-step validity check is O(1) until something is assigned (models/watch.py); each kind of change
    the decoder depends on (module, parameter, buffer, NativeLinear.packed, exact_attention, .to()) rebuilds it."""
    from treedraft.models import watch

    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    model = _tiny_native(seed=7, bias=True)
    full = []
    orig = fused._Watch.valid

    def counting(self, m):
        if watch.count() != self.seen:
            full.append(1)
        return orig(self, m)

    monkeypatch.setattr(fused._Watch, "valid", counting)
    dec = fused.decoder_for(model)
    assert dec is not None
    full.clear()
    for _ in range(5):
        assert fused.decoder_for(model) is dec
    assert full == []  # nothing changed: no slot scan
    torch.nn.Linear(4, 4)  # an unrelated module anywhere in the process: one scan, same decoder
    assert fused.decoder_for(model) is dec and fused.decoder_for(model) is dec
    assert len(full) == 1
    other = _tiny_native(seed=8, bias=True)
    changes = [
        lambda: setattr(model.layers[1].ffn, "w2", other.layers[1].ffn.w2),  # a module
        lambda: setattr(model.norm, "weight", torch.nn.Parameter(model.norm.weight.clone())),  # a parameter
        lambda: setattr(model.layers[0].attn.wqkv, "bias", model.layers[0].attn.wqkv.bias.clone()),  # a buffer
        lambda: setattr(model.layers[2].attn.wo, "packed", other.layers[2].attn.wo.packed),  # not registered
        lambda: setattr(model.layers[0].attn, "exact_attention", True),  # not registered (same value)
        lambda: model.to(torch.float32),  # _apply swaps buffers without the hooks
    ]
    for i, change in enumerate(changes):
        full.clear()
        change()
        new = fused.decoder_for(model)
        assert new is not None and full == [1], i  # the change was seen: one full scan
        if i < 4:  # a different object in a watched slot: rebuilt (the last two keep the same objects)
            assert new is not dec, i
        dec = new
        full.clear()
        assert fused.decoder_for(model) is dec and full == [], i  # checked out: unchecked again


@pytest.mark.slow
@pytest.mark.parametrize(("weights", "kv_dtype"), [("int4", "auto"), ("int8", "auto"), ("int4", "float32")])
def test_speculative_equals_plain_on_the_real_model_fused(weights: str, kv_dtype: str, monkeypatch, calls) -> None:
    """Greedy hybrid-drafter output equals plain greedy output with every decode step through the fused path."""
    import treedraft
    from treedraft.engine import GenerationConfig
    from treedraft.models import quant_load

    if quant_load.native_kernels() is None:
        pytest.skip("native kernels unavailable")
    key = quant_load._machine_key
    monkeypatch.setattr(quant_load, "_machine_key", lambda path, extra: key(path, extra + "|test-native"))
    monkeypatch.setattr(quant_load, "choose_kernels", lambda qw, natives, log=None: {"q4": "native", "q8": "native"})
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    llm = treedraft.load(weights=weights, kv_dtype=kv_dtype)
    assert fused.status(llm.model) is None
    assert llm.model.new_cache(8).kv.dtype == (torch.float32 if kv_dtype == "float32" else torch.float16)  # auto: fp16
    cfg = GenerationConfig(max_new_tokens=48, ignore_eos=True, logprobs=2)
    for prompt in ("Write a haiku about the sea.", "Repeat after me: the quick brown fox jumps over the lazy dog."):
        ids = llm.encode_prompt(prompt)
        before = calls["fused"]
        plain = llm.engine.generate(ids, cfg, None)
        assert calls["fused"] - before == -(-len(ids) // 64) + 47  # every 64-row prompt chunk and decode step: native
        spec = llm.engine.generate(ids, cfg, llm.engine.drafter)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.stats.mean_accepted_length > 1.0
        assert spec.logprobs == plain.logprobs, prompt  # tree rows are bitwise the 1-token rows: same values
        assert [lp.top[0][0] for lp in plain.logprobs] == plain.token_ids  # greedy: each token its row's best


def test_auto_kv_dtype_is_float16_only_for_quantized_weights_on_the_own_runtime() -> None:
    """'auto' stores the cache in fp16 when the chosen weights are int4/int8, else in the weights' dtype."""
    from treedraft.api import kv_dtype_for

    assert kv_dtype_for("auto", "own", {"weights": "auto", "resolved": "int4"}) == torch.float16
    assert kv_dtype_for("auto", "own", {"weights": "int8", "resolved": "int8"}) == torch.float16
    assert kv_dtype_for("auto", "own", {"weights": "auto", "chosen": "fp32"}) is None  # auto resolved to fp32
    assert kv_dtype_for("auto", "own", None) is None  # --weights fp32
    assert kv_dtype_for("auto", "hf", {"resolved": "int4"}) is None
    assert kv_dtype_for("float32", "own", {"resolved": "int4"}) == torch.float32
    assert kv_dtype_for("float16", "own", None) == torch.float16


def test_cli_kv_dtype_flag_reaches_load_and_rejects_bad_values(monkeypatch, capsys) -> None:
    """--kv-dtype on the model commands and bench: the value reaches load(); a bad one names the choices."""
    from treedraft import cli

    seen: dict = {}
    monkeypatch.setattr("treedraft.load", lambda *a, **k: seen.update(k))
    cli.load_from_args(cli.build_parser().parse_args(["generate", "--kv-dtype", "float32", "hi"]))
    assert seen["kv_dtype"] == "float32"
    assert cli.build_parser().parse_args(["serve"]).kv_dtype == "auto"
    assert cli.build_parser().parse_args(["bench", "--kv-dtype", "float16"]).kv_dtype == "float16"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--kv-dtype", "bfloat16", "hi"])
    assert "float16" in capsys.readouterr().err


def test_load_rejects_an_unknown_kv_dtype() -> None:
    """A bad kv_dtype fails before the model load, naming the choices."""
    import treedraft

    with pytest.raises(ValueError, match="kv_dtype must be one of .*float16"):
        treedraft.load(kv_dtype="bfloat16")
