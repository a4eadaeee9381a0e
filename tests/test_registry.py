"""The drafter registry: names and aliases, the default-drafter choice, registration, one cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from treedraft.drafters import medusa, registry
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.registry import DrafterCache, DrafterOptions
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.models.callable_target import CallableTarget
from treedraft.models.tiny import tiny_llama


def _save_heads(m, d: Path) -> Path:
    MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight).save(d)
    return d


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_default_is_prompt_lookup_without_heads_and_hybrid_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = tiny_llama()
    none_shipped = DrafterOptions("tiny")
    assert registry.default_name(none_shipped) == "prompt-lookup"
    assert isinstance(registry.build("default", m, None, none_shipped), PromptLookupDrafter)
    # heads given explicitly
    given = DrafterOptions("tiny", heads=str(_save_heads(m, tmp_path / "given")))
    assert registry.default_name(given) == "hybrid-suffix"
    d = registry.build("default", m, None, given)
    assert isinstance(d, HybridDrafter) and isinstance(d.drafters[0], MedusaDrafter)
    assert isinstance(d.drafters[1], SuffixDrafter) and len(d.drafters) == 2  # the suffix index covers lookup
    # heads shipped in the package for this model name
    _save_heads(m, tmp_path / "shipped" / "tiny")
    monkeypatch.setattr(medusa, "HEADS_DIR", tmp_path / "shipped")
    assert registry.default_name(DrafterOptions("tiny")) == "hybrid-suffix"
    assert registry.default_name(DrafterOptions("tiny", heads=None)) == "hybrid-suffix"
    assert registry.default_name(DrafterOptions("other-model")) == "prompt-lookup"


def test_the_bundled_model_defaults_to_hybrid_with_suffix() -> None:
    assert (medusa.HEADS_DIR / "smollm2-135m-instruct" / "medusa.json").is_file()
    assert registry.default_name(DrafterOptions("smollm2-135m-instruct")) == "hybrid-suffix"


def test_models_on_float_weights_default_to_a_draft_model_and_then_hybrid_eagle(monkeypatch) -> None:
    """On fp32 weights (the own runtime, CPU, no quantized linear) a GGUF the own runtime runs drafts with its own
    int4 copy and suffix chains (hybrid-draft: 2.41x against hybrid-eagle's 1.65x on SmolLM2, 2.39x against
    prompt lookup's 1.80x on Gemma 3, Zen 4); without one (an HF directory, or no such file), the shipped EAGLE
    drafter takes the heads' place; quantized weights keep the heads; a given draft model is taken anywhere."""
    from test_batch import native_tiny

    from treedraft.models.quant import native_kernels

    if native_kernels() is None:
        pytest.skip("native extension unavailable: int4 / EAGLE would not draft natively beside a float target")
    opts = DrafterOptions("smollm2-135m-instruct")
    assert registry.default_name(opts, tiny_llama()) == "hybrid-draft"
    assert registry.default_name(DrafterOptions("gemma-3-270m"), tiny_llama()) == "hybrid-draft"
    assert registry.default_name(opts, native_tiny()) == "hybrid-suffix"  # q4 linears
    assert registry.default_name(opts, CallableTarget(lambda ids: None, vocab_size=8)) == "hybrid-suffix"
    assert registry.default_name(DrafterOptions("other-model"), tiny_llama()) == "prompt-lookup"
    assert registry.default_name(DrafterOptions("other-model", draft_model="d.gguf"), tiny_llama()) == "hybrid-draft"
    assert registry.default_name(opts) == "hybrid-suffix"  # no target to look at
    monkeypatch.setattr(registry, "self_draftable", lambda options, target: False)  # e.g. an HF directory
    assert registry.default_name(opts, tiny_llama()) == "hybrid-eagle"


def test_heads_of_ones_own_are_never_replaced_by_the_shipped_eagle(tmp_path: Path) -> None:
    """--heads DIR with Medusa heads only: on float weights the default drafts with them (it took the shipped EAGLE
    drafter and dropped them, silently), and --drafter eagle says the directory holds no EAGLE drafter (it used the
    shipped one instead)."""
    from treedraft.models.quant import native_kernels

    m = tiny_llama()
    own = DrafterOptions("smollm2-135m-instruct", heads=str(_save_heads(m, tmp_path / "own")))
    assert registry.default_name(own, m) == "hybrid-suffix"
    with pytest.raises(FileNotFoundError, match="holds no eagle.json, so it is no EAGLE drafter"):
        registry.build("eagle", m, None, own)
    if native_kernels() is not None:  # where a draft model would be the default on float weights
        assert registry.default_name(DrafterOptions("smollm2-135m-instruct"), m) == "hybrid-draft"


def test_aliases_none_and_unknown_names() -> None:
    m = tiny_llama()
    assert registry.build("none", m) is None and registry.build("plain", m) is None
    assert set(registry.choices()) >= {"default", "none", "plain", "prompt-lookup", "medusa", "hybrid"}
    assert "plain" not in registry.names() and "default" not in registry.names()
    with pytest.raises(ValueError, match="unknown drafter 'nope'; choose one of default, none"):
        registry.build("nope", m)
    with pytest.raises(FileNotFoundError, match="no Medusa heads are shipped for 'tiny'"):
        registry.build("medusa", m, None, DrafterOptions("tiny"))
    with pytest.raises(ValueError, match="output projection"):  # a target without weights: a clear refusal
        MedusaDrafter.for_target(CallableTarget(lambda t: {0: 1.0}, vocab_size=4), Path("unused"))


@pytest.mark.usefixtures("clean_registry")
def test_register_adds_a_drafter_that_every_caller_can_build() -> None:
    m = tiny_llama()
    seen = []

    def factory(target, tokenizer, options):
        seen.append((target, tokenizer, options))
        return PromptLookupDrafter(max_branches=2, name="my-drafter")

    registry.register("my-drafter", factory, "a test drafter")
    assert "my-drafter" in registry.names() and "my-drafter" in registry.choices()
    assert "my-drafter: a test drafter" in registry.describe()
    opts = DrafterOptions("tiny")
    d = registry.build("my-drafter", m, "tok", opts)
    assert d.name == "my-drafter" and seen == [(m, "tok", opts)]
    with pytest.raises(ValueError, match="already registered"):
        registry.register("my-drafter", factory, "again")
    registry.register("my-drafter", factory, "again", replace=True)
    for reserved in ("default", "plain", ""):
        with pytest.raises(ValueError, match="reserved"):
            registry.register(reserved, factory, "x")


def test_cache_builds_each_drafter_once_and_default_shares_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = tiny_llama()
    cache = DrafterCache(m, None, DrafterOptions("tiny", heads=str(_save_heads(m, tmp_path / "h"))))
    loads = []
    real_load = MedusaHeads.load
    monkeypatch.setattr(MedusaHeads, "load", staticmethod(lambda *a, **k: loads.append(a) or real_load(*a, **k)))
    hybrid = cache.get("default")
    assert isinstance(hybrid, HybridDrafter) and cache.get("hybrid-suffix") is hybrid and cache.get("default") is hybrid
    assert cache.get("medusa") is cache.get("medusa")
    assert len(loads) == 2  # once for the default hybrid, once for medusa; never again per call
    assert cache.get("prompt-lookup") is cache.get("prompt-lookup")
    assert cache.get("plain") is None
    # other heads: another entry; heads=None means the shipped ones (none for "tiny")
    other = cache.get("medusa", heads=str(_save_heads(m, tmp_path / "h2")))
    assert isinstance(other, MedusaDrafter) and other is not cache.get("medusa")
    with pytest.raises(FileNotFoundError):
        cache.get("medusa", heads=None)


def test_suffix_is_registered_and_uses_the_options_store_and_tenant() -> None:
    from treedraft.drafters.suffix import SuffixDrafter, open_suffix_store

    store = open_suffix_store()
    cache = registry.DrafterCache(object(), None, registry.DrafterOptions(suffix_store=store, tenant="t"))  # type: ignore[arg-type]
    d = cache.get("suffix")
    assert isinstance(d, SuffixDrafter) and d.store is store and d.tenant == "t"
    assert cache.get("suffix") is d  # built once per name and options
    # without a store each build gets its own in-memory one (one per LLM through its DrafterCache)
    a, b = registry.build("suffix", object()), registry.build("suffix", object())  # type: ignore[arg-type]
    assert a.store is not None and b.store is not None and a.store is not b.store


def test_publish_dir_replaces_a_leftover_and_keeps_a_concurrent_publication(tmp_path) -> None:
    """Cache directories (tokenizer, converted HF weights) appear by one rename: a leftover without its marker
    file is replaced, another process's complete publication is kept and this process's copy dropped."""
    from treedraft.models.cache import publish_dir, temp_sibling

    out = tmp_path / "tok"

    def written(text: str) -> Path:
        tmp = temp_sibling(out)
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text(text)
        return tmp

    out.mkdir()
    (out / "partial.bin").write_text("x")  # an interrupted older write: no marker
    tmp = written("first")
    assert publish_dir(tmp, out, "tokenizer.json")
    assert (out / "tokenizer.json").read_text() == "first" and not (out / "partial.bin").exists()
    assert not tmp.exists()
    tmp = written("second")  # another process published first: its copy stays, this one is dropped
    assert publish_dir(tmp, out, "tokenizer.json")
    assert (out / "tokenizer.json").read_text() == "first" and not tmp.exists()
    (tmp_path / "lone").mkdir()  # a temporary without the marker publishes nothing usable
    assert not publish_dir(tmp_path / "lone", tmp_path / "empty", "tokenizer.json")


def test_the_files_a_drafter_needs_are_checked_before_the_model_loads(tmp_path, monkeypatch) -> None:
    """A drafter whose heads are not shipped for the model, or a --heads path that is missing, a file, or holds
    the other kind of drafter, fails in load() before the model load (it took 11-73 s of load and first-use
    measurements before saying so); the shipped SmolLM2 files pass."""
    import treedraft
    import treedraft.api as api
    from treedraft.drafters.registry import DrafterOptions, check_files

    for name in ("medusa", "hybrid", "hybrid-suffix", "eagle", "eagle-lookup", "hybrid-eagle", "suffix", "none"):
        check_files(name, DrafterOptions("smollm2-135m-instruct"))
        if name not in ("suffix", "none"):
            with pytest.raises(FileNotFoundError, match="(are|is) shipped for 'gemma-3-270m'"):
                check_files(name, DrafterOptions("gemma-3-270m"))
    check_files("prompt-lookup", DrafterOptions("gemma-3-270m"))
    (tmp_path / "file").write_text("x")
    # named as the CLI flag and as load()'s argument (Python users read "--heads" alone: a review)
    for heads, match in ((tmp_path / "none", r"--heads \(heads=\) .*does not exist"), (tmp_path / "file", "is a file")):
        with pytest.raises(FileNotFoundError, match=match):
            check_files("prompt-lookup", DrafterOptions("smollm2-135m-instruct", str(heads)))
    with pytest.raises(FileNotFoundError, match="no medusa.json"):
        check_files("medusa", DrafterOptions("smollm2-135m-instruct", str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="holds no eagle.json"):
        check_files("eagle", DrafterOptions("smollm2-135m-instruct", str(tmp_path)))

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(api, "load_model", no_load)
    with pytest.raises(FileNotFoundError, match="no Medusa heads are shipped for 'gemma-3-270m'"):
        treedraft.load("gemma-3-270m", drafter="hybrid-suffix")


def test_the_default_with_ones_own_eagle_drafter_is_hybrid_eagle_on_any_weights(tmp_path: Path) -> None:
    """A review (session 44): `--heads <an EAGLE directory>` on int4 weights resolved "default" to hybrid-suffix,
    which then failed on the EAGLE directory after the model load."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from native_utils import tiny_native
    from test_eagle import random_net

    target = tiny_native(128)  # quantized linears: not a float target
    assert not registry.float_cpu_target(target)
    random_net(target, 0).save(tmp_path / "my-eagle")
    opts = DrafterOptions("tiny", heads=str(tmp_path / "my-eagle"))
    assert registry.default_name(opts, target) == "hybrid-eagle"
    assert isinstance(registry.build("default", target, None, opts), HybridDrafter)


def test_medusa_node_values_are_cached_once_per_useful_depth() -> None:
    """The scheduler's max_depth (tokens left) changes every step: the values were recomputed and cached anew each
    time (38 entries in 51 steps in a review's run)."""
    m = tiny_llama()
    cfg = MedusaConfig(
        "tiny", m.hidden_size, m.vocab_size, extra={"rank_accuracy": [[0.5, 0.2], [0.3, 0.1], [0.2, 0.1], [0.1, 0.1]]}
    )
    d = MedusaDrafter(MedusaHeads(cfg, m.lm_head.weight), ((0,), (1,), (0, 0), (0, 0, 0)))
    first = d.node_values(300)
    assert all(d.node_values(k) == first for k in range(3, 300))
    assert len(d._values) == 1 and d.node_values(1) == first[:2] and len(d._values) == 2
