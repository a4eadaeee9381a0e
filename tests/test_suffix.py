"""Suffix drafter: index exactness, persistence and crash safety, eviction, tenancy, trees, real model."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.registry import DrafterOptions
from treedraft.drafters.suffix import (
    SuffixDrafter,
    make_suffix_drafter,
    open_suffix_store,
    tenant_id,
)
from treedraft.drafters.suffix_index import SEP, SuffixIndex, brute_force_continuations
from treedraft.drafters.suffix_store import SuffixStore, encode_record
from treedraft.engine import GenerationStats
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree

seqs_st = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=6)


def brute_longest(seqs: list[list[int]], ctx: list[int], max_len: int) -> int:
    """Longest suffix of ctx (<= max_len) that occurs with a following token, by scanning."""
    best = 0
    for m in range(1, min(max_len, len(ctx)) + 1):
        if brute_force_continuations(seqs, ctx[-m:]):
            best = m
    return best


# ---- index ----------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, pattern=st.lists(st.integers(0, 4), min_size=1, max_size=4), bulk=st.booleans())
def test_index_continuations_equal_brute_force(seqs: list[list[int]], pattern: list[int], bulk: bool) -> None:
    if bulk:
        idx = SuffixIndex.from_sequences(seqs)
    else:  # incremental: token by token, then closed (the per-request path and the store's append path)
        idx = SuffixIndex()
        for s in seqs:
            for i in range(0, len(s), 3):
                idx.extend(s[i : i + 3])
            idx.extend([], end=True)
    assert idx.continuations(pattern) == brute_force_continuations(seqs, pattern)


@settings(max_examples=150, deadline=None)
@given(seqs=seqs_st, ctx=st.lists(st.integers(0, 4), min_size=1, max_size=12), max_len=st.integers(1, 8))
def test_index_longest_match_and_tree_counts(seqs: list[list[int]], ctx: list[int], max_len: int) -> None:
    idx = SuffixIndex.from_sequences(seqs)
    m, nxt = idx.match(ctx, max_len)
    assert m == brute_longest(seqs, ctx, max_len)
    for min_len in (2, 3):  # seeded from the rarest of the last min_len tokens: the same answer, or none
        m2, nxt2 = idx.match(ctx, max_len, min_len)
        assert (m2, nxt2.tolist()) == ((m, nxt.tolist()) if m >= min_len else (0, []))
    if m == 0:
        return
    # every node's path probability is the empirical one: count(pattern + path) / count(pattern)
    paths = idx.expand(nxt, m, max_nodes=50, max_depth=4)
    occurrences = len(nxt)
    for i in range(len(paths.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(paths.tokens[j])
            j = paths.parents[j]
        path.reverse()
        full = ctx[len(ctx) - m :] + path
        count = brute_force_continuations(seqs, full[:-1]).get(full[-1], 0)
        assert paths.probs[i] == pytest.approx(count / occurrences), (path, paths)


def test_matches_do_not_cross_sequences() -> None:
    idx = SuffixIndex.from_sequences([[1, 2], [3, 4]])
    assert idx.continuations([2]) == {}  # 2 ends its sequence: the separator is no continuation
    assert idx.match([2, 3], 8)[0] == 1  # [2, 3] spans the boundary: only [3] matches
    assert int(idx.text[2]) == SEP


# ---- drafter trees -------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    seqs=seqs_st,
    ctx=st.lists(st.integers(0, 4), min_size=1, max_size=20),
    max_nodes=st.integers(1, 12),
    max_depth=st.integers(1, 6),
    alpha=st.sampled_from([0.5, 1.0, 4.0]),
)
def test_proposed_tree_is_a_valid_trie_within_budget(seqs, ctx, max_nodes, max_depth, alpha) -> None:
    store = SuffixStore()
    for s in seqs:
        store.add(s)
    d = SuffixDrafter(store, alpha=alpha, min_prob=0.0)
    tree = d.propose(DraftContext(list(ctx), None, max_nodes, max_depth, 1))  # TokenTree checks the trie rules
    assert tree.tokens[0] == ctx[-1]
    assert len(tree) <= max_nodes
    assert max(tree.depths()) <= max_depth
    # SuffixDecoding's adaptive size: at most alpha * (the longer of the two match lengths) nodes
    m = max(
        SuffixIndex.from_sequences(seqs).match(ctx, d.max_match)[0],
        SuffixIndex.from_sequences([ctx]).match(ctx, d.max_match)[0],
    )
    assert len(tree) - 1 <= max(1, int(alpha * m)) if m else len(tree) == 1


def test_drafter_follows_a_repeated_passage_and_the_request_grows() -> None:
    d = SuffixDrafter(None)  # request-local only
    toks = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    tree = d.propose(DraftContext(toks, None, 16, 8, 2))
    assert tree.tokens == (7, 8, 9, 10)  # match [5, 6, 7] (3 tokens) -> 3 nodes along the passage
    toks += [8, 9]  # the engine extends the same list; the index follows
    tree = d.propose(DraftContext(toks, None, 16, 8, 2))
    assert tree.tokens[:3] == (9, 10, 11)


def test_hybrid_merges_suffix_with_prompt_lookup() -> None:
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5, 6])
    h = HybridDrafter([PromptLookupDrafter(), SuffixDrafter(store)])
    tree = h.propose(DraftContext([9, 1, 2, 3], None, 8, 8, 1))
    assert tree.tokens[:4] == (3, 4, 5, 6)


@dataclass
class FixedTree:
    """Stands in for Medusa in a hybrid: always the same one-level tree of ``width`` children."""

    width: int
    name: str = "fixed"

    def propose(self, ctx: DraftContext) -> TokenTree:
        return TokenTree.from_sequences(ctx.root, [[1000 + i] for i in range(self.width)], max_nodes=ctx.max_nodes)


def tree_paths(t: TokenTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree (root excluded)."""
    return {tuple(t.tokens[j] for j in t.path_to(i)[1:]) for i in range(1, len(t))}


@settings(max_examples=80, deadline=None)
@given(
    seqs=seqs_st,
    ctx=st.lists(st.integers(0, 4), min_size=1, max_size=20),
    max_nodes=st.integers(1, 16),
    max_depth=st.integers(1, 6),
    width=st.integers(0, 10),
    lead_score=st.sampled_from([0.5, 2.0, float("inf")]),
)
def test_hybrid_with_suffix_is_one_valid_tree_within_budget(seqs, ctx, max_nodes, max_depth, width, lead_score) -> None:
    store = SuffixStore()
    for s_ in seqs:
        store.add(s_)
    members = [FixedTree(width), PromptLookupDrafter(), SuffixDrafter(store, min_prob=0.0)]
    h = HybridDrafter(members, lead_score=lead_score, lead_extra=None)  # followers may fill the budget
    dc = DraftContext(list(ctx), None, max_nodes, max_depth, 1)
    tree = h.propose(dc)  # TokenTree checks the trie rules (parents first, no duplicate siblings)
    assert tree.tokens[0] == ctx[-1] and len(tree) <= max_nodes and max(tree.depths()) <= max_depth
    # nothing invented: every path is one a member proposed
    proposed = set().union(*(tree_paths(m.propose(dc)) for m in members))
    assert tree_paths(tree) <= proposed
    # nothing wasted: the budget is filled as far as the members' union allows
    assert len(tree) == min(max_nodes, 1 + len(proposed))


def test_a_confident_suffix_tree_leads_the_hybrid_budget() -> None:
    store = SuffixStore()
    store.add(list(range(100, 140)))  # a passage seen in an earlier request
    ctx = DraftContext([5, *range(100, 120)], None, 12, 24, 1)  # repeating it: a 20-token match
    suffix = SuffixDrafter(store, use_local=False)
    assert suffix.propose_scored(ctx)[1] >= 2.0
    h = HybridDrafter([FixedTree(10), PromptLookupDrafter(), suffix])
    tree = h.propose(ctx)
    assert tree.tokens[1:] == tuple(range(120, 131))  # the suffix chain takes all 11 draft slots
    h.lead_score = float("inf")  # never lead: the wide tree comes first and the chain is cut to one node
    assert h.propose(ctx).tokens[1:] == (*range(1000, 1010), 120)


def test_hybrid_suffix_is_registered_and_records_into_the_options_store(tmp_path: Path) -> None:
    from treedraft.drafters import registry
    from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
    from treedraft.models.tiny import tiny_llama

    m = tiny_llama()
    MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight).save(tmp_path / "heads")
    store = open_suffix_store()
    opts = registry.DrafterOptions("tiny", heads=str(tmp_path / "heads"), suffix_store=store, tenant="t")
    d = registry.build("hybrid-suffix", m, None, opts)
    assert isinstance(d, HybridDrafter) and d.name == "hybrid-suffix"
    assert [type(x) for x in d.drafters] == [MedusaDrafter, SuffixDrafter]  # one tree of both
    member = d.drafters[1]
    assert member.store is store and member.tenant == "t" and member.min_match == 1
    assert member.latency is not None and member.max_depth == 64  # sized by this machine's measured verify cost
    d.for_tenant("u").finish([1, 2], [3, 4])
    assert [(r.tenant, list(r.tokens)) for r in store.records()] == [("u", [1, 2, 3, 4])]


def test_make_suffix_drafter_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match="unknown suffix drafter option"):
        make_suffix_drafter(None, "", alfa=2.0)
    assert make_suffix_drafter(None, "x", alpha=2.0).alpha == 2.0


# ---- persistence ----------------------------------------------------------------------------------------
def test_store_round_trip(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path, snapshot_every=3)
    data = [([1, 2, 3], "a"), ([4, 5], "b"), ([6, 7, 8, 9], "a"), ([10], "a"), ([11, 12], "b")]
    for toks, ten in data:
        st_.add(toks, ten)
    st_.close()  # 3 records went to the snapshot, 2 are in the log
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = SuffixStore(tmp_path)
    assert [(list(r.tokens), r.tenant) for r in again.records()] == data
    assert again.index_for("a").continuations([6]) == {7: 1}
    # seqs keep growing after a reload
    assert again.add([13], "a") == 6


def test_stale_log_records_after_a_snapshot_are_not_doubled(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path, snapshot_every=10**6)
    st_.add([1, 2], "a")
    st_.add([3, 4], "a")
    log = (tmp_path / "log.bin").read_bytes()
    st_.snapshot()
    st_.close()
    (tmp_path / "log.bin").write_bytes(log)  # a crash between the snapshot's rename and the log's reset
    again = SuffixStore(tmp_path)
    assert [list(r.tokens) for r in again.records()] == [[1, 2], [3, 4]]


def _two_records_then(tmp_path: Path, damage) -> tuple[SuffixStore, list[warnings.WarningMessage]]:
    st_ = SuffixStore(tmp_path, snapshot_every=10**6)
    st_.add([1, 2, 3], "a")
    st_.add([4, 5, 6], "a")
    st_.close()
    log = tmp_path / "log.bin"
    log.write_bytes(damage(log.read_bytes()))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        again = SuffixStore(tmp_path)
    return again, w


def test_torn_tail_is_reported_and_dropped(tmp_path: Path) -> None:
    torn = encode_record(3, "a", [7, 8, 9])[:-5]  # a crash in the middle of an append (never acknowledged)
    again, w = _two_records_then(tmp_path, lambda b: b + torn)
    ends = len(encode_record(1, "a", [1, 2, 3])) * 2
    assert [list(r.tokens) for r in again.records()] == [[1, 2, 3], [4, 5, 6]]
    assert len(w) == 2 and "log.bin" in str(w[0].message) and f"byte offset {ends}" in str(w[0].message)
    assert "kept at" in str(w[1].message) and (tmp_path / "log.bin.damaged").read_bytes().endswith(torn)
    again.add([7], "a")
    again.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the damage was cleaned up: reported once
        assert [list(r.tokens) for r in SuffixStore(tmp_path).records()] == [[1, 2, 3], [4, 5, 6], [7]]


def test_corrupt_record_is_skipped_and_later_acknowledged_ones_kept(tmp_path: Path) -> None:
    def flip(b: bytes) -> bytes:
        b = bytearray(b)
        b[30] ^= 0xFF  # inside the first record's payload
        return bytes(b)

    again, w = _two_records_then(tmp_path, flip)
    assert [list(r.tokens) for r in again.records()] == [[4, 5, 6]]
    assert len(w) == 2 and "byte offset 0" in str(w[0].message)


def test_truncated_and_garbage_files_never_crash(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path, snapshot_every=1)
    st_.add([1, 2, 3], "a")
    st_.close()
    snap = tmp_path / "snapshot.bin"
    cut = snap.read_bytes()[:-2]
    snap.write_bytes(cut)
    (tmp_path / "log.bin").write_bytes(os.urandom(64))
    with pytest.warns(UserWarning, match="snapshot.bin"):
        again = SuffixStore(tmp_path)
    assert again.records() == []
    # the clean rewrite does not destroy what could not be read: the damaged bytes are kept beside it
    assert (tmp_path / "snapshot.bin.damaged").read_bytes() == cut and (tmp_path / "log.bin.damaged").is_file()


def test_one_store_at_a_time_per_directory_and_add_after_close_reopens(tmp_path: Path) -> None:
    """A second store on an open directory is refused with a message (two writers handed out the same sequence
    numbers: one's records were lost); after close() the other opens it and sees everything; a closed store's add
    opens the directory again (it failed with an AttributeError and lost the record)."""
    a = SuffixStore(tmp_path)
    a.add([1, 2, 3], "t")
    with pytest.raises(ValueError, match="is open in another store"):
        SuffixStore(tmp_path)
    a.close()
    b = SuffixStore(tmp_path)
    assert [list(r.tokens) for r in b.records()] == [[1, 2, 3]]
    b.add([4, 5], "t")
    with pytest.raises(ValueError, match="is open in another store"):
        a.add([9], "t")  # the closed store cannot take the directory back while b has it
    b.close()
    assert a.add([6, 7], "t") > 0  # reopened: b's record read first, then this one appended after it
    a.close()
    assert [list(r.tokens) for r in SuffixStore(tmp_path).records()] == [[1, 2, 3], [4, 5], [6, 7]]


def test_a_store_under_a_missing_directory_is_refused_and_a_new_one_is_announced(tmp_path: Path, capsys) -> None:
    """A path whose parent does not exist (a typo) is refused instead of quietly starting an empty store there; a new
    store in an existing directory says so once; reopening it says nothing."""
    with pytest.raises(ValueError, match="parent directory .*nope.* does not exist"):
        SuffixStore(tmp_path / "nope" / "store")
    assert not (tmp_path / "nope").exists()
    SuffixStore(tmp_path / "store").close()
    assert "starting a new suffix store" in capsys.readouterr().err
    SuffixStore(tmp_path / "store").close()
    assert "starting a new suffix store" not in capsys.readouterr().err


# ---- bound and tenancy ------------------------------------------------------------------------------------
def test_eviction_keeps_the_bound_and_drops_the_oldest(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path, max_tokens=100)
    st_.index_for("a")  # built before the adds: appends and evictions must keep it in step
    for i in range(40):
        st_.add([i] * 7, "a")
        assert st_.num_tokens <= 100
    kept = [r.tokens[0] for r in st_.records()]
    assert kept == list(range(40 - len(kept), 40)) and st_.num_tokens > 80
    assert st_.index_for("a").continuations([0]) == {}  # evicted from the index too
    st_.close()
    assert [r.tokens[0] for r in SuffixStore(tmp_path, max_tokens=100).records()] == kept
    with pytest.warns(UserWarning) as said:  # a smaller bound applies on load, and says what it dropped
        smaller = SuffixStore(tmp_path, max_tokens=30)
    assert smaller.num_tokens <= 30
    gone = len(kept) - len(smaller.records())
    assert f"{7 * gone} tokens ({gone} whole records) over the bound of 30" in str(said[0].message)


def test_a_request_longer_than_the_bound_keeps_its_tail_and_the_tenant_its_newest(tmp_path: Path) -> None:
    """A request over the bound used to wipe its tenant's whole history, itself included (a review found it)."""
    st_ = SuffixStore(tmp_path, max_tokens=2000)
    for i in range(10):
        st_.add(list(range(100 * i, 100 * i + 150)), "A")
    st_.add([5000 + k for k in range(2100)], "A")
    assert [list(r.tokens) for r in st_.records("A")] == [[5000 + k for k in range(100, 2100)]]
    assert st_.tenant_tokens("A") == 2000 and st_.index_for("A").continuations([5100]) == {5101: 1}
    st_.close()
    assert st_.tenant_tokens("A") == SuffixStore(tmp_path, max_tokens=2000).tenant_tokens("A") == 2000


def test_a_store_is_tied_to_its_tokenizer(tmp_path: Path) -> None:
    """A store written under one tokenizer is refused under another (its ids would draft other tokens, and ids past
    the vocabulary failed every request they were drafted for: a review saw HTTP 500s); an older store without the
    tie takes the tokenizer once its ids fit the vocabulary; models of one tokenizer share a store."""
    st_ = SuffixStore(tmp_path / "s")
    st_.bind_tokenizer("49152:aaaa", 49152)
    st_.add([1, 2, 49000], "t")
    st_.close()
    again = SuffixStore(tmp_path / "s")
    again.bind_tokenizer("49152:aaaa", 49152)  # the same tokenizer (another model of the family): fine
    with pytest.raises(ValueError, match="another tokenizer.*its own --suffix-store"):
        again.bind_tokenizer("262144:bbbb", 262144)
    again.close()
    old = SuffixStore(tmp_path / "old")  # written before the tie: no store.json
    old.add([1, 2, 236761], "t")
    with pytest.raises(ValueError, match="token id 236761, past this model's vocabulary of 49152"):
        old.bind_tokenizer("49152:aaaa", 49152)
    old.bind_tokenizer("262144:bbbb", 262144)  # fits: adopted
    old.close()
    with pytest.raises(ValueError, match="another tokenizer"):
        SuffixStore(tmp_path / "old").bind_tokenizer("49152:aaaa", 49152)
    SuffixStore().bind_tokenizer("x", 10)  # in memory: nothing to tie


def test_a_snapshot_or_log_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    """A snapshot.bin that is a directory used to be skipped without a word, hiding every record in it."""
    SuffixStore(tmp_path / "s").close()
    (tmp_path / "s" / "snapshot.bin").unlink(missing_ok=True)
    (tmp_path / "s" / "snapshot.bin").mkdir()
    with pytest.raises(ValueError, match=r"snapshot.bin is not a regular file"):
        SuffixStore(tmp_path / "s")


@pytest.mark.parametrize("share", [False, True])
def test_each_tenant_is_bounded_and_evicts_only_its_own_oldest(tmp_path: Path, share: bool) -> None:
    st_ = SuffixStore(tmp_path, max_tokens=50, share=share)
    st_.add([900] * 40, "bob")  # bob's only request: far below the bound
    st_.index_for("bob")  # built before alice's adds: her evictions must not touch it
    for i in range(30):
        st_.add([i] * 7, "alice")
        assert st_.tenant_tokens("alice") <= 50 and st_.tenant_tokens("bob") == 40
    assert [list(r.tokens) for r in st_.records("bob")] == [[900] * 40]  # alice never evicted bob
    kept = [int(r.tokens[0]) for r in st_.records("alice")]
    assert kept == list(range(30 - len(kept), 30)) and st_.tenant_tokens("alice") > 40  # her own oldest went
    assert st_.num_tokens == st_.tenant_tokens("alice") + 40
    assert st_.index_for("bob").continuations([900]) == {900: 39}
    assert st_.index_for("alice").continuations([0]) == {}  # evicted from her index too
    st_.close()
    with pytest.warns(UserWarning, match=r"were evicted, oldest first.*--suffix-max-tokens|--suffix-max-tokens"):
        again = SuffixStore(tmp_path, max_tokens=30, share=share)  # a smaller bound on load: each tenant trimmed
    # bob's one request is over the new bound alone: its last 30 tokens stay (it used to vanish whole)
    assert [list(r.tokens) for r in again.records("bob")] == [[900] * 30]
    assert 0 < again.tenant_tokens("alice") <= 30


def test_tenants_are_isolated_unless_shared(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path)
    st_.add([1, 2, 3, 4, 5], "alice")
    ctx = DraftContext([9, 1, 2, 3], None, 16, 8, 1)
    assert len(SuffixDrafter(st_, "alice").propose(ctx)) > 1
    assert len(SuffixDrafter(st_, "bob").propose(ctx)) == 1
    assert st_.index_for("bob").continuations([1]) == {}
    st_.close()
    shared = open_suffix_store(tmp_path, share=True)
    assert shared.index_for("bob").continuations([1]) == {2: 1}
    assert len(SuffixDrafter(shared, "bob").propose(ctx)) > 1


def test_requests_are_recorded_once_under_the_tenant_they_ran_for() -> None:
    store = SuffixStore()
    d = SuffixDrafter(store, "alice", prompt_context=2)
    req = [1, 2, 3, 4, 5]  # prompt [1, 2, 3], then the engine appends verified tokens
    d.propose(DraftContext(req, None, 8, 8, 3))
    req += [6, 7]
    d.propose(DraftContext(req, None, 8, 8, 3))
    d.tenant = "bob"  # switched for the next request: the one in progress still belongs to alice
    d.propose(DraftContext([9, 9], None, 8, 8, 1))  # a new request: the previous one is recorded (auto_record)
    assert [(r.tenant, list(r.tokens)) for r in store.records()] == [("alice", [2, 3, 4, 5, 6, 7])]
    HybridDrafter([PromptLookupDrafter(), d]).finish([9], [9, 8])  # the explicit end, through the hybrid
    d.flush()  # nothing in progress any more: no second record
    assert [(r.tenant, list(r.tokens)) for r in store.records()] == [("alice", [2, 3, 4, 5, 6, 7]), ("bob", [9, 9, 8])]


def test_tenant_id_hashes_the_key_and_separates_users() -> None:
    a, b = tenant_id("sk-secret", "u1"), tenant_id("sk-secret", "u2")
    assert a != b and "sk-secret" not in a and tenant_id("sk-secret", "u1") == a
    assert tenant_id("other", "u1") != a and tenant_id() == ""


# ---- the real model -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_greedy_equal_plain_and_warm_index_accepts(smollm_int4, tmp_path: Path) -> None:
    smollm = smollm_int4
    store = SuffixStore(tmp_path)
    d = SuffixDrafter(store, "t1")
    prompt = "Explain in three sentences why the sky is blue."
    plain = smollm.generate(prompt, drafter=None, max_new_tokens=64)
    cold_stats, warm_stats, other_stats = GenerationStats(), GenerationStats(), GenerationStats()
    cold = [t for c in smollm.stream(prompt, drafter=d, stats=cold_stats, max_new_tokens=64) for t in c.token_ids]
    assert cold == plain.token_ids
    # the engine recorded the finished request itself (finish), once, under t1
    assert [(r.tenant, len(r.tokens)) for r in store.records()] == [
        ("t1", len(d.record_tokens(smollm.encode_prompt(prompt), cold)))
    ]
    warm = [t for c in smollm.stream(prompt, drafter=d, stats=warm_stats, max_new_tokens=64) for t in c.token_ids]
    assert warm == plain.token_ids
    assert warm_stats.mean_accepted_length > 1.5 > cold_stats.mean_accepted_length, (
        warm_stats.mean_accepted_length,
        cold_stats.mean_accepted_length,
    )
    # another tenant gets nothing from t1's output (it drafts from its own request only)
    other = d.for_tenant("t2")
    out = [t for c in smollm.stream(prompt, drafter=other, stats=other_stats, max_new_tokens=64) for t in c.token_ids]
    assert out == plain.token_ids
    assert other_stats.accepted_tokens == cold_stats.accepted_tokens
    # by name through the registry (load() opened the LLM's in-memory store): equal to plain, cold and warmed;
    # the store is the session fixture's, so other tests' suffix-drafting requests may already sit in it
    before = len(smollm.suffix_store.records())
    for _ in range(2):
        assert smollm.generate(prompt, drafter="suffix", max_new_tokens=64).token_ids == plain.token_ids
    assert smollm.get_drafter("suffix").store is smollm.suffix_store
    assert len(smollm.suffix_store.records()) == before + 2
    # and the store survives a restart
    store.close()
    assert SuffixStore(tmp_path).index_for("t1").continuations(plain.token_ids[:3]) != {}


@pytest.mark.slow
def test_real_model_default_includes_suffix_and_greedy_equals_plain(smollm_int4) -> None:
    smollm = smollm_int4
    from treedraft.drafters import registry

    store = SuffixStore()  # its own store: the LLM's is counted by the test above
    d = registry.build("default", smollm.model, smollm.tokenizer, DrafterOptions(smollm.model_name, suffix_store=store))
    assert isinstance(d, HybridDrafter) and any(isinstance(m, SuffixDrafter) for m in d.drafters)
    for prompt in ("Write a haiku about autumn leaves.",):
        plain = smollm.generate(prompt, drafter=None, max_new_tokens=40).token_ids
        cold, warm = GenerationStats(), GenerationStats()
        for stats in (cold, warm):  # the first run is recorded by the engine; the second drafts from it
            out = [t for c in smollm.stream(prompt, drafter=d, stats=stats, max_new_tokens=40) for t in c.token_ids]
            assert out == plain
        assert warm.mean_accepted_length > cold.mean_accepted_length + 1.0, (cold.mean_accepted_length, warm)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_does_not_keep_the_directory_after_the_parent_closes(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path)
    st_.add([1, 2], "t")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its fork handlers have run): alive until the parent says
        os.close(w)
        os.write(ready_w, b"r")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.read(ready_r, 1)
    try:
        st_.close()
        again = SuffixStore(tmp_path)  # the child is alive: its copies of the lock file let go at fork
        assert [list(x.tokens) for x in again.records()] == [[1, 2]]
        again.close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def test_a_failed_load_lets_go_of_the_suffix_store(tmp_path: Path) -> None:
    import treedraft

    with pytest.raises(ValueError) as e:  # an unknown model: the store was opened before the model was looked up
        treedraft.load("no-such-model-xyz", suffix_store=str(tmp_path / "s"), drafter=None)
    assert e.value is not None  # (the traceback, which holds load's frame, is still alive here)
    SuffixStore(tmp_path / "s").close()  # the directory is free


def test_load_ties_a_store_to_the_model_tokenizer_and_refuses_another(tmp_path: Path) -> None:
    """treedraft.load binds --suffix-store to the model's tokenizer: a fresh store records it, a store of another
    tokenizer is refused with what to do (not HTTP 500s at the first drafted out-of-vocabulary id) and let go."""
    import json

    import treedraft

    llm = treedraft.load(suffix_store=str(tmp_path / "mine"), drafter="suffix", weights="int4")
    llm.close()
    meta = json.loads((tmp_path / "mine" / "store.json").read_text())
    assert meta["vocab_size"] == 49152 and meta["tokenizer_sha256"].startswith("49152:")
    other = tmp_path / "other"
    SuffixStore(other).close()
    (other / "store.json").write_text(json.dumps({"tokenizer_sha256": "262144:0123", "vocab_size": 262144}))
    with pytest.raises(ValueError, match="another tokenizer.*give this model its own --suffix-store"):
        treedraft.load(suffix_store=str(other), drafter="suffix", weights="int4")
    SuffixStore(other).close()  # the failed load let go of the directory


def test_only_the_recently_drafting_tenants_keep_an_index_in_memory(monkeypatch) -> None:
    """An index costs ~11 KB per tenant of short requests and a keyless server makes a tenant of every `user` field:
    beyond MAX_INDICES the least recently drafting tenant's index is dropped and rebuilt, the same, when it drafts."""
    monkeypatch.setattr(SuffixStore, "MAX_INDICES", 3)
    st_ = SuffixStore()
    for i in range(6):
        st_.add([10 * i, 10 * i + 1, 10 * i + 2], f"t{i}")
        assert st_.index_for(f"t{i}").continuations([10 * i]) == {10 * i + 1: 1}
    assert list(st_._indices) == ["t3", "t4", "t5"]
    st_.index_for("t4")  # drafting again makes it recent
    st_.add([7, 8], "t0")  # t0's index is gone: its records are not
    assert st_.index_for("t0").continuations([0]) == {1: 1} and st_.index_for("t0").continuations([7]) == {8: 1}
    assert list(st_._indices) == ["t5", "t4", "t0"]  # t3 went: t4 had drafted after it


def test_a_store_refused_after_loading_is_left_as_it_was_on_disk(tmp_path: Path) -> None:
    """Opening another model's store with a smaller bound evicted and rewrote it before the tokenizer check refused
    it: the owner then found 1 of 20 records (a review). A load's eviction is now written only at the next add."""
    st_ = SuffixStore(tmp_path / "s", max_tokens=10_000)
    st_.bind_tokenizer("A", 100)
    for i in range(20):
        st_.add([i % 90] * 100, "t")
    st_.close()
    with pytest.warns(UserWarning, match="evicted"):
        wrong = SuffixStore(tmp_path / "s", max_tokens=150)
    with pytest.raises(ValueError, match="another tokenizer"):
        wrong.bind_tokenizer("B", 100)
    wrong.close()
    again = SuffixStore(tmp_path / "s", max_tokens=10_000)
    assert len(again.records()) == 20
    again.close()
    with pytest.warns(UserWarning, match="evicted"):
        small = SuffixStore(tmp_path / "s", max_tokens=150)
    small.bind_tokenizer("A", 100)
    small.add([5, 6], "t")  # the first write keeps only what the bound allows
    small.close()
    assert SuffixStore(tmp_path / "s", max_tokens=10_000).tenant_tokens("t") <= 150


def test_ids_on_disk_are_checked_even_where_a_smaller_bound_dropped_them(tmp_path: Path) -> None:
    """A store from before the tokenizer tie, opened with a smaller bound: the dropped (older) records stay on disk
    until a write, so the vocabulary check must see them too (else they came back later under a matching tie)."""
    old = SuffixStore(tmp_path / "s", max_tokens=10_000)
    old.add([1, 2, 60_000], "t")  # an id past a 32k vocabulary, in the oldest record
    for _ in range(5):
        old.add([3, 4, 5] * 30, "t")
    old.close()
    with pytest.warns(UserWarning, match="evicted"):
        small = SuffixStore(tmp_path / "s", max_tokens=300)
    assert all(60_000 not in r.tokens for r in small.records())  # dropped in memory ...
    with pytest.raises(ValueError, match="token id 60000, past this model's vocabulary of 32000"):
        small.bind_tokenizer("32000:aaaa", 32_000)  # ... but still on disk: refused
    small.close()


def test_a_damaged_store_refused_after_loading_keeps_every_readable_record(tmp_path: Path) -> None:
    """A torn log is rewritten at load (so the damage is reported once): with every record it could read, not with
    what a smaller bound keeps, so a refusal right after loading loses nothing."""
    st_ = SuffixStore(tmp_path / "s", max_tokens=10_000)
    st_.bind_tokenizer("A", 100)
    for i in range(20):
        st_.add([i % 90] * 100, "t")
    st_.close()
    with open(tmp_path / "s" / "log.bin", "ab") as f:
        f.write(b"SXR1\x10\x00")  # a torn append
    with pytest.warns(UserWarning):
        wrong = SuffixStore(tmp_path / "s", max_tokens=150)
    with pytest.raises(ValueError, match="another tokenizer"):
        wrong.bind_tokenizer("B", 100)
    wrong.close()
    assert len(SuffixStore(tmp_path / "s", max_tokens=10_000).records()) == 20


def test_a_closed_store_never_writes_over_a_directory_another_store_holds(tmp_path: Path) -> None:
    a = SuffixStore(tmp_path)
    a.add([1, 1, 1], "t")
    a.close()
    b = SuffixStore(tmp_path)
    b.add([2, 2, 2], "t")  # acknowledged while b holds the directory
    with pytest.raises(ValueError, match="open in another store"):
        a.snapshot()  # a let go of the directory: it must not write its stale records there
    with pytest.raises(ValueError, match="open in another store"):
        a.bind_tokenizer("x", 10)
    b.add([3, 3, 3], "t")
    b.close()
    a.snapshot()  # nobody holds it now: a takes it again and writes what is there
    a.close()
    assert [list(r.tokens) for r in SuffixStore(tmp_path).records()] == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]


def test_a_failed_snapshot_loses_nothing_and_the_store_keeps_recording(tmp_path: Path, monkeypatch) -> None:
    import treedraft.drafters.suffix_store as ss

    st_ = SuffixStore(tmp_path, snapshot_every=2)
    st_.add([1, 2, 3], "t")
    real, fails = os.replace, []

    def full_disk(src, dst):
        if str(src).endswith("snapshot.tmp") and not fails:
            fails.append(src)
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(ss.os, "replace", full_disk)
    with pytest.warns(UserWarning, match="could not write a snapshot"):
        assert st_.add([4, 5, 6], "t") == 2  # durable in the log: acknowledged
    assert fails
    st_.add([7, 8, 9], "t")  # the retry snapshots (the disk is fine again) and empties the log
    assert (tmp_path / "log.bin").stat().st_size == 0
    st_.add([7, 8, 10], "t")
    st_.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [list(r.tokens) for r in SuffixStore(tmp_path).records()]
    assert got == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [7, 8, 10]]


@pytest.mark.parametrize("damage", ["bit", "ones"])
def test_a_damaged_snapshot_header_hides_no_log_record(tmp_path: Path, damage: str) -> None:
    st_ = SuffixStore(tmp_path, snapshot_every=2)
    for i in range(3):
        st_.add([1, 2, 3, i], "t")  # records 1-2 in the snapshot, 3 in the log
    st_.close()
    snap = tmp_path / "snapshot.bin"
    data = bytearray(snap.read_bytes())
    if damage == "bit":
        data[11] ^= 1  # the last sequence number's third byte: 2 -> 65538
    else:
        data[8:16] = b"\xff" * 8
    snap.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="last sequence number .* is damaged"):
        again = SuffixStore(tmp_path)
    assert [r.seq for r in again.records()] == [1, 2, 3]
    assert again.add([9], "t") == 4


def test_a_snapshot_written_before_the_header_checksum_still_loads(tmp_path: Path) -> None:
    import struct

    recs = [encode_record(1, "t", [1, 2]), encode_record(2, "t", [3, 4])]
    (tmp_path / "snapshot.bin").write_bytes(struct.pack("<8sQ", b"SXSNAP01", 2) + b"".join(recs))
    (tmp_path / "log.bin").write_bytes(encode_record(2, "t", [3, 4]) + encode_record(3, "t", [5]))  # 2: stale
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st_ = SuffixStore(tmp_path)
    assert [(r.seq, list(r.tokens)) for r in st_.records()] == [(1, [1, 2]), (2, [3, 4]), (3, [5])]


def test_a_forked_child_gets_a_free_store_lock(tmp_path: Path) -> None:
    st_ = SuffixStore(tmp_path)
    st_.add([1, 2], "t")
    with st_.lock:  # as if another thread of the parent were inside add() at the fork
        pid = os.fork()
        if pid == 0:
            ok = st_.lock.acquire(timeout=5)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    st_.close()


def test_the_store_is_bounded_in_all_evicting_the_oldest_of_any_tenant(tmp_path: Path) -> None:
    """Per-tenant bounds alone let a keyless server's store grow with every new `user` field (a review, session 44)."""
    assert SuffixStore(max_tokens=10).max_total_tokens == 160  # default: 16 tenants' worth
    st_ = SuffixStore(tmp_path, max_tokens=1000, max_total_tokens=100, snapshot_every=10**6)
    for i in range(12):  # twelve tenants, ten tokens each: over the bound at the eleventh
        st_.add([100 + i] * 5 + [7, 8, 9, 10, i], f"user-{i}")
    assert st_.num_tokens <= 100
    tenants = [r.tenant for r in st_.records()]
    assert tenants == [f"user-{i}" for i in range(12 - len(tenants), 12)]  # the oldest went first, whoever's
    assert st_.tenant_tokens("user-0") == 0 and "user-0" not in st_._tenant_tokens  # forgotten, not kept at 0
    assert st_.index_for("user-0").continuations([7, 8, 9, 10]) == {}  # its index rebuilt from what is left
    assert st_.index_for("user-11").continuations([7, 8, 9, 10]) == {11: 1}
    kept = [(r.seq, list(r.tokens)) for r in st_.records()]
    st_.close()
    assert [(r.seq, list(r.tokens)) for r in SuffixStore(tmp_path, max_total_tokens=100).records()] == kept
    with pytest.warns(UserWarning, match="or 30 in all"):  # opened with a smaller bound in all: evicted and said
        small = SuffixStore(tmp_path, max_total_tokens=30)
    assert small.num_tokens <= 30 and small.records()[-1].seq == kept[-1][0]
    small.close()
    one = SuffixStore(max_tokens=1000, max_total_tokens=20)
    one.add(list(range(50)), "a")  # a request alone over the bound in all keeps its last tokens
    assert [list(r.tokens) for r in one.records()] == [list(range(30, 50))]
    with pytest.raises(ValueError, match="suffix-max-total-tokens"):
        SuffixStore(max_total_tokens=0)
