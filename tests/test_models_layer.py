"""The models layer: cached GGUF metadata, the per-machine measurement cache, rope scaling, HF-dir loading."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from treedraft.models import gguf_meta, llama, plan
from treedraft.models.errors import ModelLoadError
from treedraft.models.llama import LlamaConfig, rope_frequencies
from treedraft.models.loaders import gguf_config, load_gguf, load_hf_dir
from treedraft.models.tiny import tiny_llama

REAL_OTHERS = plan.CpuWindow.others  # conftest's autouse fixture replaces it; the busy-rule tests want it back
REAL_OTHERS_NOW = plan.others_now


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    gguf_meta._read_cached.cache_clear()  # the in-process memo would hide the disk cache


# ---- GGUF metadata ------------------------------------------------------------------------------------


def _write_gguf(path, arch: str = "qwen2", seed: int = 0, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A tiny Llama-family GGUF (F32, F16 and Q8_0 tensors); returns the float32 tensors written."""
    import gguf

    g = np.random.default_rng(seed)
    H, F, V, nh, nkv, hd = 32, 64, 100, 4, 2, 8
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:  # a non-default general.alignment moves every tensor offset
        w.add_custom_alignment(alignment)
    for k, v in {
        "context_length": 128,
        "embedding_length": H,
        "feed_forward_length": F,
        "block_count": 1,
        "attention.head_count": nh,
        "attention.head_count_kv": nkv,
    }.items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_token_list([f"t{i}" for i in range(V)])  # longer than SHORT_ARRAY: only its length is cached
    w.add_token_scores([float(i) for i in range(V)])  # a long numeric array: skipped in one step
    w.add_array("general.tags", ["tiny", "test"])  # short arrays are kept whole
    w.add_array(f"{arch}.short_ints", [3, 1, 4])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    shapes = {
        "token_embd.weight": (V, H),
        "output_norm.weight": (H,),
        "output.weight": (V, H),
        "blk.0.attn_norm.weight": (H,),
        "blk.0.ffn_norm.weight": (H,),
        "blk.0.attn_q.weight": (nh * hd, H),
        "blk.0.attn_k.weight": (nkv * hd, H),
        "blk.0.attn_v.weight": (nkv * hd, H),
        "blk.0.attn_q.bias": (nh * hd,),
        "blk.0.attn_k.bias": (nkv * hd,),
        "blk.0.attn_v.bias": (nkv * hd,),
        "blk.0.attn_output.weight": (H, nh * hd),
        "blk.0.ffn_gate.weight": (F, H),
        "blk.0.ffn_up.weight": (F, H),
        "blk.0.ffn_down.weight": (H, F),
    }
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        a = g.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 2 and i % 3 == 1:  # some matrices quantized to Q8_0, some F16, the rest F32
            q = gguf.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            a = gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(shape)
        elif len(shape) == 2 and i % 3 == 2:
            w.add_tensor(name, a.astype(np.float16))
            a = a.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, a)
        out[name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_header_is_parsed_once_and_cached_on_disk(tmp_path, monkeypatch) -> None:
    p = tmp_path / "m.gguf"
    _write_gguf(p)
    parses = []
    real = gguf_meta.parse_gguf
    monkeypatch.setattr(gguf_meta, "parse_gguf", lambda *a, **k: parses.append(a) or real(*a, **k))
    m = gguf_meta.read_gguf_meta(p)
    assert len(parses) == 1
    assert m.architecture == "qwen2" and m.context_length == 128 and m.vocab_size == 100
    assert m.tokenizer["bos_token_id"] == 1 and m.tokenizer["eos_token_id"] == 2
    assert m.tokenizer["chat_template"] == "{{ messages }}"
    assert "tokenizer.ggml.tokens" not in m.fields and m.array_lengths["tokenizer.ggml.tokens"] == 100
    assert m.get("general.tags") == ["tiny", "test"] and m.arch_get("short_ints") == [3, 1, 4]
    types = {t.name: t.type for t in m.tensors}
    assert {"F32", "F16", "Q8_0"} <= set(types.values())
    gguf_meta._read_cached.cache_clear()
    again = gguf_meta.read_gguf_meta(p)
    assert again == m and len(parses) == 1  # from the disk cache, no second parse
    cfg, meta = gguf_config(p)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_kv_heads, cfg.qkv_bias) == (100, 32, 2, True)
    assert meta["architecture"] == "qwen2" and len(parses) == 1
    # a damaged cache entry is parsed again (and rewritten), not trusted
    (f,) = (tmp_path / "cache" / "gguf").glob("*.json")
    f.write_text("{not json")
    gguf_meta._read_cached.cache_clear()
    assert gguf_meta.read_gguf_meta(p) == m and len(parses) == 2
    assert json.loads(f.read_text())["version"] == gguf_meta.CACHE_VERSION


def test_gguf_tensors_come_through_the_cached_table(tmp_path) -> None:
    """Tensor data read by offset from the cached table equals what was written (F32, F16, Q8_0)."""
    p = tmp_path / "m.gguf"
    written = _write_gguf(p)
    m = gguf_meta.read_gguf_meta(p)
    got = dict((t.name, a) for t, a in m.dequantized())
    assert set(got) == set(written)
    for name, a in written.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)
    model, _ = load_gguf(p)
    assert torch.equal(model.embed.weight, torch.from_numpy(written["token_embd.weight"]))
    assert torch.equal(model.layers[0].attn.wqkv.bias[:32], torch.from_numpy(written["blk.0.attn_q.bias"]))


def _reader_header(path) -> tuple[dict, dict, list]:
    """The header as ``gguf.GGUFReader`` (the reference implementation, slow on real vocabularies) sees it."""
    import gguf

    r = gguf.GGUFReader(str(path))
    fields, lengths = {}, {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            lengths[key] = len(f.data)
            if len(f.data) <= gguf_meta.SHORT_ARRAY:
                fields[key] = f.contents()
        else:
            fields[key] = f.contents()
    tensors = [
        (
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape.tolist())),
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in r.tensors
    ]
    return fields, lengths, tensors


@pytest.mark.parametrize("alignment", [None, 64])
def test_header_parse_equals_gguf_reader(tmp_path, alignment: int | None) -> None:
    """Fields, array lengths and the tensor table (offsets included) match gguf.GGUFReader's."""
    p = tmp_path / "m.gguf"
    _write_gguf(p, alignment=alignment)
    m = gguf_meta.parse_gguf(p)
    fields, lengths, tensors = _reader_header(p)
    assert m.fields == fields and m.array_lengths == lengths
    assert [(t.name, t.type, t.shape, t.offset, t.n_bytes) for t in m.tensors] == tensors
    assert m.get("general.alignment") == alignment


def test_corrupt_gguf_header_raises_model_load_error(tmp_path) -> None:
    """A wrong magic, or a string length pointing past the end, is reported with the file and the fix."""
    p = tmp_path / "m.gguf"
    _write_gguf(p)
    data = bytearray(p.read_bytes())
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ModelLoadError, match=r"magic\.gguf.*not a readable GGUF file.*no GGUF magic.*re-download"):
        gguf_meta.read_gguf_meta(bad)
    data[24:32] = (1 << 40).to_bytes(8, "little")  # the first key's length: 1 TiB
    bad = tmp_path / "len.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"len\.gguf.*not a readable GGUF file.*past the end"):
        gguf_meta.read_gguf_meta(bad)


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_truncated_gguf_raises_model_load_error_naming_the_file(tmp_path, cut: float) -> None:
    p = tmp_path / "whole.gguf"
    _write_gguf(p)
    data = p.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*not a readable GGUF file.*re-download"):
        gguf_meta.read_gguf_meta(bad)
    assert not list((tmp_path / "cache").glob("gguf/*.json"))  # nothing cached for a broken file


# ---- per-machine measurements ----------------------------------------------------------------------


def test_machine_key_names_cpu_isa_torch_and_threads(monkeypatch) -> None:
    k = plan.machine_key()
    assert k["cpu"] and k["torch"] == torch.__version__ and k["threads"] == torch.get_num_threads()
    assert isinstance(k["isa"], list) and set(k["isa"]) <= plan._ISA
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    assert plan.machine_key()["threads"] == 977
    assert plan.measurement_path("x", {})[0] != plan.measurement_path("x", {"a": 1})[0]


def test_cached_measurement_measures_once_and_again_when_corrupt_or_retune(monkeypatch) -> None:
    monkeypatch.setattr(plan, "load_average", lambda: 0.0)  # a quiet machine throughout
    calls = []

    def measure() -> dict:
        calls.append(1)
        return {"v": len(calls)}

    assert plan.cached_measurement("k", {"m": 1}, measure) == {"v": 1}
    assert plan.cached_measurement("k", {"m": 1}, measure) == {"v": 1} and len(calls) == 1
    assert plan.cached_measurement("k", {"m": 2}, measure) == {"v": 2}  # another key: its own entry
    f, _ = plan.measurement_path("k", {"m": 1})
    f.write_text('{"key": ')  # corrupt file
    assert plan.cached_measurement("k", {"m": 1}, measure) == {"v": 3}
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    assert plan.cached_measurement("k", {"m": 1}, measure) == {"v": 4}
    monkeypatch.setenv("TREEDRAFT_RETUNE", "0")
    assert plan.cached_measurement("k", {"m": 1}, measure) == {"v": 4}

    def load(v: dict) -> int:
        if v["v"] < 5:
            raise ValueError("unusable")
        return v["v"]

    assert plan.cached_measurement("k", {"m": 1}, measure, load) == 5  # an unusable value is measured again


def test_a_measurement_taken_under_load_is_taken_again_once_the_machine_is_quiet(monkeypatch) -> None:
    monkeypatch.setattr(plan.CpuWindow, "others", REAL_OTHERS)
    monkeypatch.setattr(plan, "_cpu_ticks", lambda: None)  # no /proc/stat: the load-average rule
    cores = 4
    monkeypatch.setattr(plan.os, "cpu_count", lambda: cores)
    load = {"now": 9.0}
    monkeypatch.setattr(plan, "load_average", lambda: load["now"])
    calls = []

    def measure() -> dict:
        calls.append(load["now"])
        return {"v": len(calls)}

    assert plan.cached_measurement("busy", {"m": 1}, measure) == {"v": 1}  # measured at load 9 on 4 cores
    assert plan.cached_measurement("busy", {"m": 1}, measure) == {"v": 1}  # still busy: the entry is used
    load["now"] = 3.0  # neither busy nor quiet: still used
    assert plan.cached_measurement("busy", {"m": 1}, measure) == {"v": 1} and calls == [9.0]
    load["now"] = 0.5  # quiet: measured again, and now stored as a quiet measurement
    assert plan.cached_measurement("busy", {"m": 1}, measure) == {"v": 2}
    load["now"] = 0.1
    assert plan.cached_measurement("busy", {"m": 1}, measure) == {"v": 2} and calls == [9.0, 0.5]
    assert plan.measured_busy({"load": 5.0}, now=1.0) and not plan.measured_busy({}, now=0.0)


def test_a_measurement_during_other_processes_work_is_retaken_when_they_stop_whatever_our_own_load(
    monkeypatch,
) -> None:
    # what other processes used during the measurement decides, not the load average (which counts this
    # process too: a benchmark keeping both cores busy itself never looked quiet by it)
    monkeypatch.setattr(plan, "load_average", lambda: 7.0)  # our own work: irrelevant now
    during, now = {"others": 1.5}, {"others": 0.8}
    monkeypatch.setattr(plan.CpuWindow, "others", lambda self: during["others"])
    samples = []
    monkeypatch.setattr(plan, "others_now", lambda seconds=plan.QUIET_SAMPLE_S: samples.append(1) or now["others"])
    calls = []

    def measure() -> dict:
        calls.append(during["others"])
        return {"v": len(calls)}

    assert plan.cached_measurement("o", {"m": 1}, measure) == {"v": 1}  # another job took 1.5 cores meanwhile
    assert plan.cached_measurement("o", {"m": 1}, measure) == {"v": 1}  # still 0.8 cores busy: used as is
    during["others"], now["others"] = 0.05, 0.1  # quiet: measured again, stored as a quiet measurement
    assert plan.cached_measurement("o", {"m": 1}, measure) == {"v": 2} and calls == [1.5, 0.05]
    n = len(samples)
    assert plan.cached_measurement("o", {"m": 1}, measure) == {"v": 2} and len(calls) == 2
    assert len(samples) == n  # a quiet entry is used without watching the machine
    assert plan.measured_busy({"others": 0.6, "load": 0.0}, now=0.2)
    assert not plan.measured_busy({"others": 0.6, "load": 0.0}, now=0.3)  # not quiet enough yet
    assert not plan.measured_busy({"others": 0.4, "load": 9.0}, now=0.0)  # our own load alone: not busy


def test_cpu_window_counts_other_processes_cpu_not_our_own(monkeypatch) -> None:
    clock = {"wall": 100.0, "busy": 50.0, "own": 3.0}
    monkeypatch.setattr(plan.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(plan, "_cpu_ticks", lambda: clock["busy"])
    monkeypatch.setattr(plan.CpuWindow, "_own_seconds", staticmethod(lambda: clock["own"]))
    monkeypatch.setattr(plan.CpuWindow, "others", REAL_OTHERS)
    w = plan.CpuWindow()
    # 2 s: every CPU-second busy was ours (2 threads x 2 s) -> nobody else
    clock.update(wall=102.0, busy=54.0, own=7.0)
    assert w.others() == pytest.approx(0.0)
    clock.update(wall=104.0, busy=60.0, own=9.0)  # 10 busy s in 4 s, 6 ours: others took one core
    assert w.others() == pytest.approx(1.0)
    monkeypatch.setattr(plan, "_cpu_ticks", lambda: None)
    assert w.others() is None


def test_a_sample_of_other_processes_serves_the_entries_of_one_load(monkeypatch) -> None:
    windows = []

    class Window:
        def __init__(self) -> None:
            windows.append(self)

        def others(self) -> float:
            return 0.7

    monkeypatch.setattr(plan, "CpuWindow", Window)
    monkeypatch.setattr(plan, "others_now", REAL_OTHERS_NOW)
    monkeypatch.setattr(plan, "_last_sample", None)
    monkeypatch.setattr(plan.time, "sleep", lambda s: None)
    clock = {"t": 50.0}
    monkeypatch.setattr(plan.time, "monotonic", lambda: clock["t"])
    assert plan.others_now() == 0.7 and plan.others_now() == 0.7 and len(windows) == 1
    clock["t"] += plan._SAMPLE_REUSE_S + 1  # later: watched again
    assert plan.others_now() == 0.7 and len(windows) == 2


def test_cpu_ticks_reads_proc_stat_busy_and_stolen_time() -> None:
    ticks = plan._cpu_ticks()
    if ticks is None:
        pytest.skip("no /proc/stat here")
    with open("/proc/stat") as f:
        first = [int(x) for x in f.readline().split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    busy = (sum(first) - first[3] - first[4]) / hz  # everything but idle and iowait
    assert abs(ticks - busy) < 5.0  # read a moment apart


def test_pack_tuned_caches_the_kernel_plan(tmp_path, monkeypatch) -> None:
    """Without the native extension (else the fp32 path takes the row-invariant plan, tests/test_f32mm.py)."""
    from treedraft import kernels

    monkeypatch.setattr(kernels, "available", lambda: False)
    tunes = []
    real = llama.tune_matmul_plan
    monkeypatch.setattr(llama, "tune_matmul_plan", lambda lin, *a: tunes.append(1) or real(lin, reps=1))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"stand-in for the model file the plan is keyed by")
    m = tiny_llama()
    plan.pack_tuned(m, weights, torch.float32)
    first = dict(m.matmul_plan)
    assert len(tunes) == 1 and set(first) == set(llama.MATMUL_BUCKETS)
    m2 = tiny_llama()
    plan.pack_tuned(m2, weights, torch.float32)
    assert len(tunes) == 1 and m2.matmul_plan == first  # read from the cache
    (f,) = (tmp_path / "cache" / "tune").glob("matmul-plan-*.json")
    d = json.loads(f.read_text())
    d["value"]["1"] = "no-such-kernel"
    f.write_text(json.dumps(d))
    plan.pack_tuned(tiny_llama(), weights, torch.float32)
    assert len(tunes) == 2  # an invalid plan entry is measured again
    f.write_text("garbage")
    plan.pack_tuned(tiny_llama(), weights, torch.float32)
    assert len(tunes) == 3
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    plan.pack_tuned(tiny_llama(), weights, torch.float32)
    assert len(tunes) == 4


# ---- Llama-3 rope scaling ---------------------------------------------------------------------------


def test_llama3_rope_scaling_matches_the_reference_formula() -> None:
    """Llama 3.1 frequency scaling, computed per frequency from its definition (Meta's llama-models
    ``apply_scaling``; Dubey et al. 2024): wavelengths shorter than old/high keep their frequency,
    longer than old/low are divided by ``factor``, and in between the frequency is interpolated
    linearly in ``old / wavelength`` between the two."""
    rs = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        max_seq_len=512,
        rope_theta=10000.0,
        rope_scaling=rs,
    )  # head_dim 16: 8 frequencies
    expected, regimes = [], set()
    for i in range(0, 16, 2):
        f = 10000.0 ** (-i / 16)
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            expected.append(f)
            regimes.add("high")
        elif wavelen > 64 / 1.0:
            expected.append(f / 8.0)
            regimes.add("low")
        else:
            s = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - s) * f / 8.0 + s * f)
            regimes.add("mid")
    assert regimes == {"high", "mid", "low"}  # the config exercises every branch
    got = rope_frequencies(cfg)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=0)
    plain = rope_frequencies(LlamaConfig(**{**cfg.__dict__, "rope_scaling": None}))
    assert not torch.allclose(got, plain)


# ---- Hugging Face directories: Llama-3 scaling, Qwen2 (qkv bias), Mistral ---------------------------------

_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _hf_model(kind: str):
    from transformers import LlamaConfig as HFLlama
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if kind == "llama3-scaled":
        cfg = HFLlama(
            **_TINY,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = Qwen2Config(**_TINY), Qwen2ForCausalLM
    else:
        cfg, cls = MistralConfig(**_TINY, sliding_window=None), MistralForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # random everything, biases and norms included
            p.copy_(
                torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.5 / p.shape[-1] ** 0.5)
                + (1.0 if "norm" in name else 0.0)
            )
    return model


@pytest.mark.parametrize("kind", ["llama3-scaled", "qwen2", "mistral"])
def test_hf_dir_loading_matches_transformers(tmp_path, kind: str) -> None:
    ref = _hf_model(kind)
    ref.save_pretrained(str(tmp_path))
    ours = load_hf_dir(tmp_path)
    if kind == "qwen2":
        assert ours.config.qkv_bias and ref.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if kind == "llama3-scaled":
        assert ours.config.rope_scaling and ours.config.rope_scaling["rope_type"] == "llama3"
    toks = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(1))  # past the 32-token original
    with torch.no_grad():
        want = ref(toks).logits
        got, _ = ours.forward(toks, torch.arange(80))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_hf_dir_with_rope_scaling_in_the_old_key_and_unsupported_types(tmp_path) -> None:
    """transformers < 5 wrote "rope_scaling"; 5 writes "rope_parameters": both load the same; yarn is refused."""
    ref = _hf_model("llama3-scaled")
    ref.save_pretrained(str(tmp_path))
    new = load_hf_dir(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    (tmp_path / "config.json").write_text(json.dumps(c))
    old = load_hf_dir(tmp_path)
    assert torch.equal(old.inv_freq, new.inv_freq)
    c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelLoadError, match="yarn.*runtime='hf'"):
        load_hf_dir(tmp_path)


def test_a_torn_weight_cache_is_converted_again_not_a_failed_load(tmp_path, capsys) -> None:
    """A review (session 44): a truncated cached .safetensors failed every later load with SafetensorError."""
    from treedraft.models.registry import load_own

    p = tmp_path / "m.gguf"
    _write_gguf(p)
    first, _ = load_own(p, torch.float32, "cpu", None)
    (cached,) = (tmp_path / "cache" / "weights").glob("*.safetensors")
    whole = cached.stat().st_size
    cached.write_bytes(cached.read_bytes()[: 1 << 10])
    again, _ = load_own(p, torch.float32, "cpu", None)
    assert "cannot be used" in capsys.readouterr().err and cached.stat().st_size == whole
    assert torch.equal(again.embed.weight, first.embed.weight)


def test_tune_files_that_cannot_be_read_are_measured_again_and_retune_0_is_off(tmp_path, monkeypatch, capsys) -> None:
    from treedraft.models.quant_load import _read_tune

    f = tmp_path / "quant-x.json"
    f.write_text(json.dumps({"kernels": {"q4": "native"}}))
    monkeypatch.setenv("TREEDRAFT_RETUNE", "0")  # documented: any value but empty or 0 asks (0 measured again)
    assert _read_tune(f, "kernels") == {"kernels": {"q4": "native"}}
    assert _read_tune(f, "chosen") is None  # incomplete for what is asked: measured again, not a KeyError
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    assert _read_tune(f, "kernels") is None
    monkeypatch.delenv("TREEDRAFT_RETUNE")
    f.write_text('{"kernels": {"q4": "nat')  # torn
    assert _read_tune(f, "kernels") is None and "cannot be read" in capsys.readouterr().err


def test_an_empty_cache_variable_is_the_default_cache_not_the_working_directory(monkeypatch, tmp_path) -> None:
    from pathlib import Path

    from treedraft.models.cache import cache_dir

    monkeypatch.setenv("TREEDRAFT_CACHE", "")
    assert cache_dir() == (Path.home() / ".cache" / "treedraft").resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREEDRAFT_CACHE", "rel")
    assert cache_dir() == tmp_path / "rel"  # absolute: a later chdir does not move it


def test_a_gguf_with_a_zero_alignment_or_a_type_it_cannot_read_says_so(tmp_path) -> None:
    import gguf

    def make(path, alignment=None, q_type=None) -> None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_context_length(128)
        if alignment is not None:
            w.add_uint32("general.alignment", alignment)
        if q_type is not None:
            bs, ts = gguf.GGML_QUANT_SIZES[q_type]
            w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64 // bs * ts), np.uint8), raw_dtype=q_type)
        w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    make(tmp_path / "a0.gguf", alignment=0)
    with pytest.raises(ModelLoadError, match="alignment is 0"):
        gguf_meta.parse_gguf(tmp_path / "a0.gguf")
    q = getattr(gguf.GGMLQuantizationType, "Q1_0", None)
    if q is None:
        pytest.skip("this gguf package has no Q1_0 type")
    make(tmp_path / "q.gguf", q_type=q)
    meta = gguf_meta.parse_gguf(tmp_path / "q.gguf")
    with pytest.raises(ModelLoadError, match="attn_q.*cannot dequantize"):  # was a bare NotImplementedError
        list(meta.dequantized())


def test_the_kernel_choice_key_names_the_isa(monkeypatch) -> None:
    """A KVM guest's CPU model name is generic: an AVX2 build reused the AVX-512 build's choices unmeasured."""
    from treedraft.models import quant_load

    real = plan.machine_key
    a = quant_load._machine_key(None, "int4|native=build-a")
    monkeypatch.setattr(plan, "machine_key", lambda *x: {**real(*x), "isa": ["avx2"]})
    assert quant_load._machine_key(None, "int4|native=build-a") != a
    assert quant_load._machine_key(None, "int4|native=build-b") != quant_load._machine_key(None, "int4|native=build-a")
