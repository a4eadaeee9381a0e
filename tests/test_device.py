"""Devices and dtypes: inputs are built where the target lives, sampling draws on the CPU, RoPE stays fp32.

The CUDA smoke test runs the same checks as the CPU one and is skipped where CUDA is absent.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from spec_stats import one_thread  # noqa: F401 (fixture)

from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext, target_device
from treedraft.models.callable_target import CallableTarget
from treedraft.models.llama import rope_frequencies
from treedraft.models.loaders import load_hf_dir
from treedraft.models.tiny import tiny_llama
from treedraft.sampling import SamplingParams, sample
from treedraft.training.calibrate import measure_latency
from treedraft.training.data import batched_greedy
from treedraft.tree import TokenTree, full_attention_mask, tree_mask, tree_positions

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")),
]


# ---- the engine builds every input on the target's device ----------------------------
class _Cache:
    def __init__(self) -> None:
        self.length = 0

    def keep(self, start: int, indices) -> None:
        self.length = start + len(list(indices))


class MetaTarget:
    """Claims to live on the 'meta' device; records where its inputs were built; always predicts token 1."""

    vocab_size, max_seq_len = 8, 64
    device = torch.device("meta")

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device]] = []

    def new_cache(self, max_len: int | None = None) -> _Cache:
        return _Cache()

    def forward(self, tokens, positions, cache=None, start=None, mask=None, logits_for=None):
        self.seen += [
            (name, t.device)
            for name, t in (("tokens", tokens), ("positions", positions), ("mask", mask))
            if t is not None
        ]
        T = tokens.shape[-1]
        rows = len(range(T)[logits_for]) if logits_for is not None else T
        logits = torch.zeros(1, rows, self.vocab_size)
        logits[..., 1] = 5.0
        return logits, None


class Chain:
    name = "chain"

    def propose(self, ctx: DraftContext) -> TokenTree:
        return TokenTree.chain(ctx.root, [1] * min(3, ctx.max_depth))


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=0)], ids=["greedy", "sampled"]
)
def test_engine_builds_tokens_positions_and_masks_on_the_target_device(sampling: SamplingParams) -> None:
    target = MetaTarget()
    r = Engine(target).generate([1, 2, 3], GenerationConfig(max_new_tokens=9, sampling=sampling), Chain())
    assert len(r.token_ids) == 9 and r.stats.accepted_tokens > 0
    names = {name for name, _ in target.seen}
    assert names == {"tokens", "positions", "mask"}  # prefill and trees both went through
    wrong = [(name, dev) for name, dev in target.seen if dev.type != "meta"]
    assert not wrong, f"inputs built off the target's device: {wrong[:4]}"


def test_targets_report_their_device() -> None:
    m = tiny_llama()
    assert m.device == torch.device("cpu") == target_device(m)
    assert target_device(CallableTarget(lambda toks: {0: 1.0}, vocab_size=4)) == torch.device("cpu")
    assert target_device(torch.nn.Linear(2, 2).to("meta")) == torch.device("meta")  # no attribute: parameters
    assert target_device(object()) == torch.device("cpu")


def test_tree_helpers_take_a_device() -> None:
    tree = TokenTree.from_sequences(5, [[1, 2], [3]])
    pos = tree_positions(tree, 7, "meta")
    mask = full_attention_mask(tree, 7, "meta")
    assert pos.device.type == "meta" and mask.device.type == "meta" and mask.shape == (4, 11)
    # default: cpu, values unchanged
    assert tree_positions(tree, 7).tolist() == [7, 8, 9, 8]
    cpu = full_attention_mask(tree, 7)
    assert cpu.device.type == "cpu" and cpu[:, :7].all() and torch.equal(cpu[:, 7:], tree_mask(tree))


def test_sampling_draws_on_the_cpu_generator_for_any_input_device() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    a = [sample(probs, SamplingParams(seed=s).generator()) for s in range(20)]
    b = [sample(probs.double(), SamplingParams(seed=s).generator()) for s in range(20)]
    assert a == b and len(set(a)) > 1
    assert SamplingParams(seed=0).generator().device.type == "cpu"


# ---- RoPE frequencies stay float32 in bf16/fp16 models -----------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_keeps_fp32_rope(dtype: torch.dtype) -> None:
    m32 = tiny_llama(seed=0, max_seq_len=8192)
    m16 = copy.deepcopy(m32).to(dtype)
    assert m16.embed.weight.dtype == dtype
    assert m16.inv_freq.dtype == torch.float32
    assert torch.equal(m16.inv_freq, rope_frequencies(m32.config))
    assert m16.half().inv_freq.dtype == torch.float32
    # far-apart positions: a rounded frequency turns into a large relative-angle error (0.54 vs 0.09 here)
    toks = torch.randint(0, m32.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor(list(range(6)) + list(range(4090, 4096)))
    with torch.inference_mode():
        ref, _ = m32(toks, pos)
        low, _ = m16(toks, pos)
    assert (ref - low).abs().max() < 0.25


def test_loader_in_bf16_keeps_fp32_rope(tmp_path) -> None:
    from safetensors.torch import save_file

    m = tiny_llama(seed=1)
    c = m.config
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "tie_word_embeddings": False,
                "rope_theta": c.rope_theta,
                "max_position_embeddings": 8192,
            }
        )
    )
    hd = c.head_dim
    qo, kvo = c.num_heads * hd, c.num_kv_heads * hd
    sd = {
        "model.embed_tokens.weight": m.embed.weight,
        "model.norm.weight": m.norm.weight,
        "lm_head.weight": m.lm_head.weight,
    }
    for i, blk in enumerate(m.layers):
        p = f"model.layers.{i}."
        q, k, v = blk.attn.wqkv.weight.split((qo, kvo, kvo))
        gate, up = blk.ffn.w13.weight.split(c.intermediate_size)
        sd.update(
            {
                p + "input_layernorm.weight": blk.attn_norm.weight,
                p + "post_attention_layernorm.weight": blk.ffn_norm.weight,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": blk.attn.wo.weight,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": blk.ffn.w2.weight,
            }
        )
    save_file({k: v.detach().clone() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    m16 = load_hf_dir(tmp_path, torch.bfloat16)
    assert m16.embed.weight.dtype == torch.bfloat16 and m16.inv_freq.dtype == torch.float32
    assert torch.equal(m16.inv_freq, rope_frequencies(m16.config))


# ---- smoke test on each device (cuda: skipped without a GPU) -------------------------------
class SampledChildren:
    """Depth-1 children sampled without replacement from a fixed q (recorded in child_q)."""

    name = "sampled"

    def __init__(self, vocab: int) -> None:
        self.q = torch.softmax(torch.linspace(0, 2, vocab, dtype=torch.float64), 0)
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, ctx: DraftContext) -> TokenTree:
        rest, kids = self.q.clone(), []
        for _ in range(3):
            t = int(torch.multinomial(rest, 1, generator=self.gen))
            kids.append(t)
            rest[t] = 0.0
        return TokenTree((ctx.root, *kids), (-1, 0, 0, 0), {0: self.q})


@pytest.mark.parametrize("device", DEVICES)
def test_device_smoke(device: str) -> None:
    m = tiny_llama(seed=3).to(device)
    assert target_device(m).type == device
    eng = Engine(m)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
    greedy = GenerationConfig(max_new_tokens=24)
    plain = eng.generate(prompt, greedy, drafter=None).token_ids
    assert eng.generate(prompt, greedy, PromptLookupDrafter()).token_ids == plain
    heads = MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight).to(device)
    assert heads.base_weight.device.type == device
    assert eng.generate(prompt, greedy, MedusaDrafter(heads)).token_ids == plain
    # same logits as on the CPU (fp32)
    if device != "cpu":
        cpu = tiny_llama(seed=3)
        with torch.inference_mode():
            a, _ = cpu(torch.tensor([prompt]), torch.arange(len(prompt)))
            b, _ = m(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device))
        torch.testing.assert_close(b.cpu(), a, atol=1e-3, rtol=1e-3)
    # sampling: seeded, with sampled (child_q) and deterministic children, every rule
    for rule in ("speculative", "typical"):
        cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=5), rule=rule)
        a = eng.generate(prompt, cfg, SampledChildren(m.vocab_size)).token_ids
        b = eng.generate(prompt, cfg, SampledChildren(m.vocab_size)).token_ids
        assert a == b and len(a) == 16
        assert len(eng.generate(prompt, cfg, PromptLookupDrafter()).token_ids) == 16
    # half precision: fp32 rope, generation runs
    m16 = tiny_llama(seed=3).to(device=device, dtype=torch.bfloat16)
    assert m16.inv_freq.dtype == torch.float32 and m16.inv_freq.device.type == device
    assert len(Engine(m16).generate(prompt, greedy, PromptLookupDrafter()).token_ids) == 24
    # training helpers run on the model's device
    ((ans, hid),) = batched_greedy(m, [prompt], 6, frozenset())
    assert ans == plain[:6] and hid.device.type == device
    assert set(measure_latency(m, context=16, sizes=(1, 4), reps=1)) == {1, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_training_runs_on_the_models_device(device: str, tmp_path) -> None:
    """train-heads, the calibrator's rank accuracy and train-eagle with the target on ``device``: the shards stay on
    the CPU and each batch goes over. On CUDA the heads and the EAGLE net were left on the CPU beside the target's
    weights (a device mismatch at the first step, after all the data had been generated)."""
    from test_eagle import write_tiny_shards
    from test_training import TC, _mcfg, _tiny_data

    from treedraft.drafters.eagle_net import EagleConfig
    from treedraft.training.eagle_train import EagleTrainConfig, train_eagle
    from treedraft.training.train import rank_accuracy, train_heads

    m, d = _tiny_data(tmp_path)
    m = m.to(device)
    mcfg = _mcfg(m, num_heads=2, root_conditioned=True)  # as train-heads trains them: the root's embedding too
    heads, rep = train_heads(
        d, m.lm_head.weight, mcfg, TC, tmp_path / "heads", progress=False, embed_weight=m.input_embedding_weight()
    )
    assert next(heads.parameters()).device.type == device and rep["train_rows"] > 0
    hid, tok = torch.randn(6, m.hidden_size), torch.randint(0, m.vocab_size, (6,))
    acc = rank_accuracy(heads, hid, torch.randint(0, m.vocab_size, (6, 2)), max_rank=3, roots=tok)
    assert len(acc) == 2 and all(0.0 <= a <= 1.0 for row in acc for a in row)
    write_tiny_shards(m.cpu(), tmp_path / "eagle-data", n=8)
    m = m.to(device)
    tc = EagleTrainConfig(epochs=1, tokens_per_batch=128, heldout=0.25, unroll=2, eval_unroll=2)
    net, erep = train_eagle(
        tmp_path / "eagle-data", m, EagleConfig.for_target(m, "tiny"), tc, tmp_path / "ck", progress=False
    )
    assert net.fc.weight.device.type == device and len(erep["epochs"][-1]["heldout_top1"]) == 2


def test_moving_a_model_off_the_cpu_drops_the_cpu_kernels_or_refuses() -> None:
    """The row-invariant fp32 plan and attention are native CPU kernels: a model moved off the CPU runs the stock
    ops there. Quantized weights cannot move at all: a clear error, and nothing moved. (Both used to reach the C++
    kernels with device pointers.) The meta device stands in for a GPU."""
    from native_utils import tiny_config
    from test_batch import native_tiny

    from treedraft import kernels
    from treedraft.models.llama import Transformer
    from treedraft.models.matmul import exact_plan

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    m = Transformer(tiny_config(64, 32)).eval()
    m.pack(exact_plan())
    m.exact_attention = True
    m.half()  # a dtype change on the CPU keeps them
    assert m.exact_attention and m.matmul_plan is not None
    with torch.device("meta"):  # (a default device is not where a CPU-to-CPU cast sends the weights)
        m.float()
    assert m.exact_attention and m.matmul_plan is not None
    m.to("meta")
    assert not m.exact_attention and m.matmul_plan is None and m.embed.weight.device.type == "meta"
    q = native_tiny()
    with pytest.raises(RuntimeError, match="quantized weights .* CPU code"):
        q.to("meta")
    assert q.embed.weight.device.type == "cpu" and q.exact_attention


def test_a_cast_on_the_cpu_makes_the_planned_weight_copies_again() -> None:
    """A plan reading (in, out) copies of the weights (``xwt``): after .half().float() the copies follow the
    rounded weights (they kept the old values, off by ~3e-4 in a product)."""
    from native_utils import tiny_config

    from treedraft.models.llama import Transformer

    torch.manual_seed(0)
    m = Transformer(tiny_config(64, 32)).eval()
    m.pack(dict.fromkeys((1, 2, 4), "xwt"))
    m.half().float()
    lin = m.layers[0].attn.wqkv
    assert torch.equal(lin.weight_t, lin.weight.t())
    x = torch.randn(2, lin.in_features)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


def test_the_native_entry_points_refuse_tensors_off_the_cpu() -> None:
    """Their C++ reads host memory: a GPU tensor's device pointer would be read as one (the meta device stands in)."""
    from treedraft import kernels

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    x = torch.zeros(2, 64, device="meta")
    w = kernels.pack_q8_0(torch.ones(8, 2), torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="mm: the native kernels are CPU code, got a tensor on meta"):
        kernels.mm(x, w)
    with pytest.raises(ValueError, match="mm_f32: the native kernels are CPU code"):
        kernels.mm_f32(torch.zeros(2, 64), torch.zeros(8, 64, device="meta"))
    with pytest.raises(ValueError, match="quantize_activations: the native kernels are CPU code"):
        kernels.quantize_activations(x)
    q, kv = torch.zeros(1, 4, 16, device="meta"), torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match="attend: the native kernels are CPU code"):
        kernels.attend(q, kv, kv, None, 0.25)
