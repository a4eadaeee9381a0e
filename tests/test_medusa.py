"""Medusa heads: module, persistence, drafting, training, calibration (tiny models)."""

from __future__ import annotations

import os

import pytest
import torch

from treedraft.drafters.medusa import HeadsMismatchError, MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.llama import bf16_gemm_available
from treedraft.models.quant import native_kernels
from treedraft.models.tiny import tiny_llama
from treedraft.training.calibrate import choose_tree, grow_tree
from treedraft.training.data import batched_greedy
from treedraft.training.train import TrainConfig, evaluate, head_targets, train_heads


def _cfg(model, **kw) -> MedusaConfig:
    return MedusaConfig(base_model="tiny", hidden_size=model.hidden_size, vocab_size=model.vocab_size, **kw)


def test_heads_have_distinct_parameters_and_start_as_lm_head() -> None:
    m = tiny_llama()
    heads = MedusaHeads(_cfg(m, num_heads=3, num_layers=2), m.lm_head.weight)
    ptrs = {p.data_ptr() for p in heads.parameters()}
    assert len(ptrs) == 3 * 2 * 2  # weight + bias per block, nothing shared
    h = torch.randn(5, m.hidden_size)
    out = heads(h)  # (5, K, V)
    assert out.shape == (5, 3, m.vocab_size)
    for k in range(3):  # zero-initialised residual blocks: every head starts as the base lm_head
        torch.testing.assert_close(out[:, k], m.lm_head(h))


def test_separate_projection_and_draft_vocab() -> None:
    m = tiny_llama()
    sep = MedusaHeads(_cfg(m, shared_lm_head=False), m.lm_head.weight)
    assert sep.proj[0].weight.data_ptr() != sep.proj[1].weight.data_ptr()
    vm = torch.tensor([5, 3, 9, 1])
    sub = MedusaHeads(_cfg(m, draft_vocab=4), m.lm_head.weight, vm)
    h = torch.randn(2, m.hidden_size)
    torch.testing.assert_close(sub(h)[:, 0], m.lm_head(h)[:, vm])
    # a separate projection scores the same draft vocabulary (training targets index into it)
    sep_sub = MedusaHeads(_cfg(m, shared_lm_head=False, draft_vocab=4), m.lm_head.weight, vm)
    assert sep_sub(h).shape == (2, 4, 4)
    torch.testing.assert_close(sep_sub(h)[:, 0], m.lm_head(h)[:, vm])
    with pytest.raises(ValueError, match="vocab_map"):
        MedusaHeads(_cfg(m, shared_lm_head=False, draft_vocab=4), m.lm_head.weight)


def test_save_load_roundtrip_and_mismatch(tmp_path) -> None:
    m = tiny_llama()
    heads = MedusaHeads(_cfg(m, draft_vocab=8), m.lm_head.weight, torch.arange(m.vocab_size).flip(0))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    old = os.umask(0o022)
    try:
        heads.save(tmp_path)
    finally:
        os.umask(old)
    # as readable as the json beside it (0644 under umask 022): safetensors wrote the weights 0600 (a review)
    assert {(tmp_path / f).stat().st_mode & 0o777 for f in ("heads.safetensors", "medusa.json")} == {0o644}
    back = MedusaHeads.load(tmp_path, m.lm_head.weight, "tiny", m.hidden_size, m.vocab_size)
    h = torch.randn(3, m.hidden_size)
    torch.testing.assert_close(back(h), heads(h))
    assert torch.equal(back.vocab_map, heads.vocab_map)
    with pytest.raises(HeadsMismatchError, match="base model"):
        MedusaHeads.load(tmp_path, m.lm_head.weight, "other-model")
    with pytest.raises(HeadsMismatchError, match="hidden size"):
        MedusaHeads.load(tmp_path, m.lm_head.weight, hidden_size=m.hidden_size + 1)


def test_drafter_tree_follows_choices_and_head_ranks() -> None:
    m = tiny_llama()
    heads = MedusaHeads(_cfg(m, num_heads=2), m.lm_head.weight)
    d = MedusaDrafter(heads, ((0,), (1,), (0, 0), (0, 1)))
    h = torch.randn(m.hidden_size)
    tree = d.propose(DraftContext([1, 2, 7], h, max_nodes=64, max_depth=8))
    logits = heads(h)
    top = [logits[k].topk(2).indices.tolist() for k in range(2)]
    assert tree.tokens == (7, top[0][0], top[0][1], top[1][0], top[1][1])
    assert tree.parents == (-1, 0, 0, 1, 1)
    assert len(d.propose(DraftContext([7], h, max_nodes=3, max_depth=8))) == 3
    assert max(d.propose(DraftContext([7], h, max_nodes=64, max_depth=1)).depths()) == 1
    # a small budget (a request in a big batch) gives the full tree's first nodes and runs fewer heads
    calls: list[int] = []
    real = heads.draft_logits
    heads.draft_logits = lambda h_, r_, n: calls.append(n) or real(h_, r_, n)  # type: ignore[method-assign]
    for n in (2, 3, 4, 5):
        small = d.propose(DraftContext([1, 2, 7], h, max_nodes=n, max_depth=8))
        assert (small.tokens, small.parents) == (tree.tokens[:n], tree.parents[:n])
    assert calls == [1, 1, 2, 2]


def test_coupled_requests_perturb_the_first_heads_ranks_only() -> None:
    """A sampled, coupled request: the first head's children are its top-k of log q + the target's Gumbel noise at
    the root's next position (eagle_tree.coupled_pick), the later heads keep their top-k (their q is a marginal)."""
    from treedraft.sampling import SamplingParams, gumbel_key, gumbel_topk

    m = tiny_llama()
    heads = MedusaHeads(_cfg(m, num_heads=2), m.lm_head.weight)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    d = MedusaDrafter(heads, ((0,), (1,), (0, 0), (0, 1)))
    s = SamplingParams(temperature=1.0)
    moved = 0
    for t in range(20):
        h = torch.randn(m.hidden_size)
        ctx = DraftContext([1, 2, 7], h, max_nodes=64, max_depth=8, sampling=s, coupling=t)
        tree = d.propose(ctx)
        logits = heads(h)
        first = gumbel_topk(logits[0], s, gumbel_key(t, 3), 2)[0].tolist()
        assert list(tree.tokens[1:3]) == first
        assert list(tree.tokens[3:5]) == logits[1].topk(2).indices.tolist()
        moved += first != logits[0].topk(2).indices.tolist()
    assert moved > 0  # the noise did reorder some rows
    greedy = d.propose(DraftContext([1, 2, 7], h, max_nodes=64, max_depth=8))
    assert list(greedy.tokens[1:3]) == logits[0].topk(2).indices.tolist()


def _head_q8(heads: MedusaHeads, k: int, kernels):
    """Head k's own int8 copies, packed alone: (root projection or None, residual block weight, its bias)."""
    from treedraft.drafters.medusa_native import pack_q8

    lin = heads.blocks[k][0].linear
    root = None if heads.root_proj is None else pack_q8(heads.root_proj[k].weight, kernels)
    return root, pack_q8(lin.weight, kernels), lin.bias.detach().float()


def test_draft_logits_are_the_first_heads_and_drafting_copies_only_round() -> None:
    torch.manual_seed(0)
    m = tiny_llama(seed=2)
    vm = torch.randperm(m.vocab_size)
    heads = MedusaHeads(
        _cfg(m, num_heads=3, draft_vocab=40, root_conditioned=True), m.lm_head.weight, vm, m.embed.weight
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    h, root = torch.randn(m.hidden_size), torch.tensor(5)
    full = heads(h, root)  # (3, 40)
    on = heads.pack_for_drafting()
    assert on is (heads._native is not None or heads._draft_w is not None)
    assert (heads._native is not None) is (native_kernels() is not None)  # hidden 32: the kernels' group size
    if native_kernels() is None and not bf16_gemm_available():
        assert on is False  # no native kernels, no native bf16 GEMM: never the (slow, emulated) bf16 path
    for n in (1, 2, 3):
        got = heads.draft_logits(h, root, n)
        assert got.shape == (n, 40)
        if heads._native is not None:  # int8 weights (and int8 activations in the kernel): the float32 scores
            nd = heads._native  # computed from the dequantized int8 weights, up to the activations' rounding
            e = heads.embed_weight[root]
            want = []
            for k in range(n):
                r, w, b = _head_q8(heads, k, nd.k)
                u = h + e @ r.dequantize().T
                want.append(u + torch.nn.functional.silu(u @ w.dequantize().T + b))
            want = torch.stack(want) @ nd.proj.dequantize().T
            torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))
            torch.testing.assert_close(got, full[:n], rtol=0, atol=0.06 * float(full.abs().max()))
            assert not torch.equal(got, full[:n])  # it really is the int8 path
            # the heads' blocks run as one stacked call: bitwise what one native call per head gives
            x, kmm = h.reshape(1, -1), nd.k.mm
            per_head = []
            for k in range(n):
                r, w, b = _head_q8(heads, k, nd.k)
                u = x + kmm(e.reshape(1, -1).contiguous(), r)
                per_head.append(u + torch.nn.functional.silu(kmm(u.contiguous(), w) + b))
            assert torch.equal(nd.features(heads, h, root, n), torch.cat(per_head))
        elif heads._draft_w is not None:  # bf16 inputs and weights, float32 sums, bf16 result: the float32
            z = heads.hidden(h, root, n)  # scores up to that rounding
            want = z.bfloat16().float() @ heads.base_weight.bfloat16().float().T
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)
            assert not torch.equal(got, full[:n])  # it really is the bf16 path
        else:
            torch.testing.assert_close(got, full[:n], rtol=1e-5, atol=1e-5)
    heads._native = heads._draft_w = None
    torch.testing.assert_close(heads.draft_logits(h, root, 2), full[:2], rtol=1e-5, atol=1e-5)
    plain = MedusaHeads(_cfg(m, num_heads=3), m.lm_head.weight)  # not root-conditioned
    if plain.pack_for_drafting() and plain._native is not None:
        nd, x = plain._native, h.reshape(1, -1)
        per_head = [
            x + torch.nn.functional.silu(nd.k.mm(x, w) + b) for _, w, b in (_head_q8(plain, k, nd.k) for k in range(2))
        ]
        assert torch.equal(nd.features(plain, h, None, 2), torch.cat(per_head))
    sep = MedusaHeads(_cfg(m, num_heads=2, shared_lm_head=False), m.lm_head.weight)
    assert sep.pack_for_drafting() is False  # only the shared projection has a drafting copy
    torch.testing.assert_close(sep.draft_logits(h, None, 1), sep(h)[:1])


def test_int8_drafting_keeps_greedy_output_and_mostly_the_tree() -> None:
    """Heads drafting through their int8 copies: same greedy output as plain decoding; the trees differ from
    the float32 heads' only where two candidates' scores are within the rounding."""
    if native_kernels() is None:
        pytest.skip("treedraft.kernels (the native int8 kernels) is not available here")
    torch.manual_seed(0)
    m = tiny_llama(seed=3)
    heads = MedusaHeads(_cfg(m, root_conditioned=True), m.lm_head.weight, embed_weight=m.embed.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    ref = MedusaDrafter(heads, ((0,), (1,), (0, 0), (0, 1), (1, 0)))
    ctxs = [DraftContext([3, t], torch.randn(m.hidden_size), max_nodes=64, max_depth=8) for t in range(20)]
    want = [ref.propose(c).tokens for c in ctxs]
    assert heads.pack_for_drafting() and heads._native is not None
    got = [ref.propose(c).tokens for c in ctxs]
    assert sum(a == b for a, b in zip(got, want)) >= 15  # top-2 of 64 per head: a few near-ties flip
    eng = Engine(m)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = eng.generate([3, 1, 4, 1, 5], cfg, drafter=None)
    spec = eng.generate([3, 1, 4, 1, 5], cfg, drafter=ref)
    assert spec.token_ids == plain.token_ids


def test_bf16_pack_failure_falls_back_to_float32_drafting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN build that reports bf16 GEMM but cannot pack: drafting stays float32 and gives the same tree."""
    import treedraft.drafters.medusa as medusa_mod

    torch.manual_seed(0)
    m = tiny_llama(seed=2)
    heads = MedusaHeads(_cfg(m, num_heads=2), m.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    h = torch.randn(m.hidden_size)
    ctx = DraftContext([1, 2, 7], h, max_nodes=64, max_depth=8)
    want = MedusaDrafter(heads, ((0,), (1,), (0, 0), (0, 1), (1, 0))).propose(ctx)  # never packed: float32
    want_logits = heads.draft_logits(h, None, 2)

    def cannot_pack(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("could not create a primitive descriptor for a reorder primitive")

    import treedraft.drafters.medusa_native as native_mod

    monkeypatch.setattr(
        native_mod.NativeDraft, "build", staticmethod(lambda heads, proj_format="q8": None)
    )  # no native kernels
    monkeypatch.setattr(medusa_mod, "bf16_gemm_available", lambda: True)
    monkeypatch.setattr(medusa_mod, "pack_bf16", cannot_pack)
    assert heads.pack_for_drafting() is False and heads._draft_w is None
    # bitwise the never-packed float32 drafting (the skinny-GEMM kernel); within float32 rounding of the
    # training forward's z @ W^T (a different GEMM: equal bits on some CPUs, not on an AVX-512 Zen 5)
    torch.testing.assert_close(heads.draft_logits(h, None, 2), want_logits, rtol=0, atol=0)
    torch.testing.assert_close(heads.draft_logits(h, None, 2), heads(h)[:2], rtol=1e-5, atol=1e-5)
    got = MedusaDrafter(heads, ((0,), (1,), (0, 0), (0, 1), (1, 0))).propose(ctx)
    assert got.tokens == want.tokens and got.parents == want.parents


def test_drafter_refuses_choices_that_are_not_prefix_closed() -> None:
    m = tiny_llama()
    heads = MedusaHeads(_cfg(m, num_heads=2), m.lm_head.weight)
    with pytest.raises(ValueError, match="prefix-closed"):
        MedusaDrafter(heads, ((0,), (1, 0)))


def test_medusa_greedy_equals_plain_on_tiny_model() -> None:
    m = tiny_llama(seed=3)
    heads = MedusaHeads(_cfg(m), m.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    eng = Engine(m)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = eng.generate([3, 1, 4, 1, 5], cfg, drafter=None)
    spec = eng.generate([3, 1, 4, 1, 5], cfg, drafter=MedusaDrafter(heads))
    assert spec.token_ids == plain.token_ids


class OracleHeads(MedusaHeads):
    """Head k ranks first the target's own greedy token at i+k+2 (i found by matching the hidden state h_i),
    then three wrong tokens that differ from head to head; records every call's logits."""

    def __init__(self, cfg: MedusaConfig, lm_head_weight: torch.Tensor, full: list[int], table: torch.Tensor) -> None:
        super().__init__(cfg, lm_head_weight)
        self.full, self.table, self.calls = full, table, []

    def forward(self, h: torch.Tensor, root: torch.Tensor | None = None) -> torch.Tensor:
        i = int((self.table - h.float()).norm(dim=-1).argmin())
        K, V = self.config.num_heads, self.config.vocab_size
        out = torch.full((K, V), -10.0)
        for k in range(K):
            right = self.full[i + k + 2] if i + k + 2 < len(self.full) else 0
            for score, off in ((10.0, 0), (5.0, 1 + k), (4.0, 6 + k), (3.0, 11 + k)):
                out[k, (right + off) % V] = score
        self.calls.append(out)
        return out

    def draft_logits(self, h: torch.Tensor, root: torch.Tensor | None, num_heads: int) -> torch.Tensor:
        return self.forward(h, root)[:num_heads]


def test_medusa_heads_predicting_the_future_are_accepted_depth_by_depth() -> None:
    """Heads aligned with the target's own future tokens: long accepted runs, depth d drafted by head d-1."""
    m = tiny_llama(seed=3)
    eng = Engine(m)
    prompt, cfg = [3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=40)
    plain = eng.generate(prompt, cfg, drafter=None).token_ids
    full = prompt + plain
    with torch.inference_mode():
        _, table = m(torch.tensor([full]), torch.arange(len(full)))  # (1, L, H): h_i produced token i+1
    heads = OracleHeads(_cfg(m), m.lm_head.weight, full, table[0])
    drafter = MedusaDrafter(heads)
    trees = []

    class Recorder:
        name = "medusa"

        def propose(self, ctx: DraftContext):
            trees.append(drafter.propose(ctx))
            return trees[-1]

    spec = eng.generate(prompt, cfg, Recorder())
    assert spec.token_ids == plain
    assert spec.stats.mean_accepted_length > 3.5  # 4 heads, all right: ~5 tokens per step
    assert spec.stats.acceptance_per_depth()[:4] == [1.0] * 4
    assert len(trees) == len(heads.calls) > 5
    for tree, logits in zip(trees, heads.calls):
        for node, d in enumerate(tree.depths()):
            if d:  # depth d comes from head d-1's top-k (and not from any other head's)
                assert tree.tokens[node] in logits[d - 1].topk(drafter.topk[d - 1]).indices.tolist()


def test_medusa_load_refuses_unknown_keys_and_misshaped_tensors(tmp_path) -> None:
    import json

    m = tiny_llama()
    MedusaHeads(_cfg(m, num_heads=2), m.lm_head.weight).save(tmp_path)
    meta = json.loads((tmp_path / "medusa.json").read_text())

    def load_with(**changes) -> MedusaHeads:
        d = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        (tmp_path / "medusa.json").write_text(json.dumps(d))
        return MedusaHeads.load(tmp_path, m.lm_head.weight)

    assert load_with().config.num_heads == 2
    with pytest.raises(HeadsMismatchError, match=r"unknown keys \['temperature'\]"):
        load_with(temperature=0.7)
    with pytest.raises(HeadsMismatchError, match=r"missing keys \['hidden_size'\]"):
        load_with(hidden_size=None)
    with pytest.raises(HeadsMismatchError, match="missing tensors"):
        load_with(num_layers=2)
    with pytest.raises(HeadsMismatchError, match="wrong shapes.*does not match|does not match.*wrong shapes"):
        load_with(hidden_size=m.hidden_size * 2)
    with pytest.raises(HeadsMismatchError, match="unexpected tensors"):
        load_with(num_heads=1)
    (tmp_path / "medusa.json").write_text("{not json")
    with pytest.raises(HeadsMismatchError, match="not valid JSON"):
        MedusaHeads.load(tmp_path, m.lm_head.weight)


def test_base_weight_is_converted_once_and_follows_the_heads() -> None:
    m = tiny_llama()
    lm16 = m.lm_head.weight.to(torch.bfloat16)
    heads = MedusaHeads(_cfg(m, num_heads=2), lm16)
    assert heads.base_weight.dtype == torch.float32  # the heads' dtype, converted in set_base, not per forward
    h = torch.randn(3, m.hidden_size)
    torch.testing.assert_close(heads(h)[:, 0], h @ lm16.float().T)
    assert "base_weight" not in heads.state_dict()  # never saved with the heads
    heads.to(torch.bfloat16)
    assert heads.base_weight.dtype == torch.bfloat16 and heads(h.bfloat16()).dtype == torch.bfloat16
    sub = MedusaHeads(_cfg(m, draft_vocab=4), m.lm_head.weight, torch.tensor([5, 3, 9, 1])).to("meta")
    assert sub.vocab_map.device.type == "meta" and sub.base_weight.device.type == "meta"


def test_hybrid_refuses_sampled_trees() -> None:
    from treedraft.drafters.callable import CallableDrafter
    from treedraft.drafters.hybrid import HybridDrafter, merge_trees
    from treedraft.drafters.prompt_lookup import PromptLookupDrafter
    from treedraft.sampling import SamplingParams
    from treedraft.tree import TokenTree, TreeError

    sampled = TokenTree((9, 1, 2), (-1, 0, 0), {0: torch.full((16,), 1 / 16)})
    with pytest.raises(TreeError, match="sampled"):
        merge_trees([TokenTree.chain(9, [1]), sampled], 10)
    m = tiny_llama()
    drafter = CallableDrafter(
        lambda prefix: {t: 1.0 for t in range(8)}, m.vocab_size, mode="sample", seed=0, name="my-sampler"
    )
    hybrid = HybridDrafter([PromptLookupDrafter(), drafter])
    cfg = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(TreeError, match="'my-sampler' sampled"):
        Engine(m).generate([1, 2, 3, 1, 2], cfg, hybrid)
    drafter.close()
    topk = CallableDrafter(lambda prefix: {t: 1.0 for t in range(8)}, m.vocab_size, mode="topk")
    assert len(Engine(m).generate([1, 2, 3, 1, 2], cfg, HybridDrafter([PromptLookupDrafter(), topk])).token_ids) == 8


def test_head_targets_do_not_cross_sequences() -> None:
    tok = torch.tensor([10, 11, 12, 20, 21])
    seq = torch.tensor([0, 0, 0, 1, 1])
    t = head_targets(tok, seq, 2)
    assert t.tolist() == [[11, 12], [12, -100], [-100, -100], [21, -100], [-100, -100]]


def test_batched_generation_matches_engine_greedy() -> None:
    m = tiny_llama(seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    eng = Engine(m)
    for p, (ans, hid) in zip(prompts, batched_greedy(m, prompts, 12, frozenset())):
        assert ans == eng.generate(p, GenerationConfig(max_new_tokens=12), drafter=None).token_ids
        assert hid.shape == (12, m.hidden_size)
        # hidden j is the state whose lm_head chose answer j
        assert m.lm_head(hid).argmax(-1).tolist() == ans


def test_training_learns_the_base_models_continuations(tmp_path) -> None:
    from safetensors.torch import save_file

    m = tiny_llama(seed=2, vocab_size=32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (4,), generator=g).tolist() for _ in range(48)]
    toks, hids, seqs = [], [], []
    for i, (ans, hid) in enumerate(batched_greedy(m, prompts, 24, frozenset())):
        toks.append(torch.tensor(ans))
        hids.append(hid.half())
        seqs.append(torch.full((len(ans),), i))
    save_file(
        {"tokens": torch.cat(toks).int(), "hidden": torch.cat(hids), "seq": torch.cat(seqs).int()},
        str(tmp_path / "shard_00000.safetensors"),
    )
    mcfg = _cfg(m, num_heads=2)
    before = evaluate(
        MedusaHeads(mcfg, m.lm_head.weight), torch.cat(hids).float(), head_targets(torch.cat(toks), torch.cat(seqs), 2)
    )
    heads, report = train_heads(
        tmp_path,
        m.lm_head.weight,
        mcfg,
        TrainConfig(epochs=30, lr=3e-3, batch_size=64, heldout_frac=0.0),
        tmp_path / "o",
        progress=False,
    )
    after = evaluate(heads, torch.cat(hids).float(), head_targets(torch.cat(toks), torch.cat(seqs), 2))
    assert after["top1"][0] > before["top1"][0] + 0.2
    assert (tmp_path / "o" / "checkpoint.pt").is_file()


def test_grow_tree_is_prefix_closed_and_ordered() -> None:
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    choices, values = grow_tree(acc, 12)
    seen = set()
    for c in choices:
        assert len(c) == 1 or c[:-1] in seen
        seen.add(c)
    assert values == sorted(values, reverse=True)
    assert choices[:3] == [(0,), (0, 0), (1,)]  # 0.6, 0.3, 0.2
    assert values[1] == pytest.approx(0.3)


def test_choose_tree_follows_the_latency_curve() -> None:
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    flat = choose_tree(acc, {1: 1.0, 64: 1.0})
    steep = choose_tree(acc, {1: 1.0, 2: 2.0, 64: 64.0})
    assert flat["nodes"] > 10  # free extra tokens: take them all
    assert steep["nodes"] == 0  # each node doubles the cost: plain decoding wins
    assert flat["expected_len"] == pytest.approx(1 + sum(grow_tree(acc, 64)[1][: flat["nodes"]]))


def test_merge_trees_unions_paths_and_respects_budget() -> None:
    from treedraft.drafters.hybrid import merge_trees
    from treedraft.tree import TokenTree, retrieve_indices

    a = TokenTree.from_sequences(9, [[1, 2], [3]])
    b = TokenTree.from_sequences(9, [[1, 4], [5, 6]])
    m = merge_trees([a, b], 64)

    def paths(t: TokenTree) -> set[tuple[int, ...]]:
        return {tuple(t.tokens[i] for i in row if i >= 0) for row in retrieve_indices(t).tolist()}

    assert paths(m) == {(9, 1, 2), (9, 3), (9, 1, 4), (9, 5, 6)}
    assert len(m) == 7  # the shared prefix (9, 1) is stored once
    small = merge_trees([a, b], 5)
    assert len(small) == 5 and small.tokens[:4] == a.tokens
    with pytest.raises(ValueError, match="roots"):
        merge_trees([a, TokenTree.chain(8, [1])], 10)


def test_root_conditioned_heads_read_the_root_embedding() -> None:
    m = tiny_llama(seed=6)
    cfg = _cfg(m, num_heads=2, root_conditioned=True)
    with pytest.raises(ValueError, match="embedding"):
        MedusaHeads(cfg, m.lm_head.weight)
    heads = MedusaHeads(cfg, m.lm_head.weight, embed_weight=m.embed.weight)
    h = torch.randn(3, m.hidden_size)
    roots = torch.tensor([1, 2, 3])
    torch.testing.assert_close(heads(h, roots)[:, 0], m.lm_head(h))  # zero-init: plain lm_head at first
    with pytest.raises(ValueError, match="root"):
        heads(h)
    with torch.no_grad():
        heads.root_proj[1].weight.copy_(torch.eye(m.hidden_size))
    x = h + m.embed.weight[roots]
    expect = m.lm_head(heads.blocks[1](x))
    torch.testing.assert_close(heads(h, roots)[:, 1], expect)
    assert not torch.allclose(heads(h, torch.tensor([4, 4, 4]))[:, 1], expect)
    # the drafter feeds the tree root: its depth-2 candidate is the head's top-1 given that root
    d = MedusaDrafter(heads, ((0,), (0, 0)))
    tree = d.propose(DraftContext([5, 9], h[0], max_nodes=8, max_depth=4))
    assert tree.tokens[2] == int(heads(h[0], torch.tensor(9))[1].argmax())


def test_root_conditioned_heads_roundtrip(tmp_path) -> None:
    m = tiny_llama(seed=7)
    heads = MedusaHeads(_cfg(m, root_conditioned=True), m.lm_head.weight, embed_weight=m.embed.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    heads.save(tmp_path)
    back = MedusaHeads.load(tmp_path, m.lm_head.weight, "tiny", embed_weight=m.embed.weight)
    h, r = torch.randn(2, m.hidden_size), torch.tensor([3, 4])
    torch.testing.assert_close(back(h, r), heads(h, r))


def test_fp16_saved_heads_load_back_close(tmp_path) -> None:
    m = tiny_llama(seed=8)
    heads = MedusaHeads(_cfg(m, draft_vocab=16), m.lm_head.weight, torch.arange(m.vocab_size))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    heads.save(tmp_path, dtype=torch.float16)
    back = MedusaHeads.load(tmp_path, m.lm_head.weight)
    assert back.vocab_map.dtype == torch.long and next(back.parameters()).dtype == torch.float32
    h = torch.randn(2, m.hidden_size)
    torch.testing.assert_close(back(h), heads(h), atol=2e-2, rtol=1e-2)


def test_top_k_rows_ranks_like_a_stable_sort() -> None:
    """Best first, ties to the lower index; rows with too few finite scores still give k distinct ids."""
    from treedraft.drafters.medusa import top_k_rows

    g = torch.Generator().manual_seed(0)
    for t in range(50):
        x = torch.randn(3, 40, generator=g)
        if t % 2:
            x = x.round()  # many ties
        want = [sorted(range(40), key=lambda j: (-float(r[j]), j))[:5] for r in x]
        assert top_k_rows(x, 5) == want
    x = torch.full((1, 6), float("-inf"))
    x[0, 4] = 1.0
    got = top_k_rows(x, 3)[0]
    assert got[0] == 4 and len(set(got)) == 3


def test_a_heads_path_that_is_missing_or_a_file_says_so(tmp_path) -> None:
    """--heads pointing nowhere or at a file: the error says which (both read 'no medusa.json' before)."""
    from treedraft.drafters.medusa import MedusaHeads

    with pytest.raises(FileNotFoundError, match="heads directory .*nowhere does not exist"):
        MedusaHeads.load(tmp_path / "nowhere", None)
    (tmp_path / "f.md").write_text("x")
    with pytest.raises(FileNotFoundError, match="heads directory .*f.md is a file"):
        MedusaHeads.load(tmp_path / "f.md", None)
    with pytest.raises(FileNotFoundError, match="no medusa.json"):
        MedusaHeads.load(tmp_path, None)
    # an EAGLE drafter's directory given to a Medusa drafter (the default): say which drafters read it (a review: the
    # error named only train-heads)
    (tmp_path / "eagle.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="an EAGLE drafter .*--drafter eagle, eagle-lookup or hybrid-eagle"):
        MedusaHeads.load(tmp_path, None)
