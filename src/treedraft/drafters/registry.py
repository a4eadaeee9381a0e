"""The one drafter registry: name -> factory(target, tokenizer, options), aliases in one table, one cache.

A new drafter registers itself with :func:`register` (the built-in ones are at the bottom of
this file); the CLI, the Python API, the server and the benchmark all build drafters here, by
name, for a target model. ``"default"`` is resolved by :func:`default_name`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..interfaces import Drafter, TargetModel

DEFAULT = "default"
NONE = "none"  # plain decoding: the factory returns None
# the drafters that read a heads directory (--heads: Medusa heads, an EAGLE drafter) and those that read the suffix
# store (--suffix-store / --suffix-max-tokens / --suffix-share): a load whose drafter reads neither says so
HEADS_DRAFTERS = ("medusa", "hybrid", "hybrid-suffix", "eagle", "eagle-lookup", "hybrid-eagle")
SUFFIX_DRAFTERS = ("suffix", "hybrid-suffix", "hybrid-eagle", "hybrid-draft")
# the drafters that search a predicted output (OpenAI's prediction, --prediction): prompt lookup or suffix members
PREDICTION_DRAFTERS = ("prompt-lookup", "hybrid", "eagle-lookup", *SUFFIX_DRAFTERS)
ALIASES: dict[str, str] = {"plain": NONE}  # alias -> registered name


@dataclass(frozen=True)
class DrafterOptions:
    """What a factory may need beyond the target and the tokenizer."""

    model_name: str = ""  # the target's registry name (shipped Medusa heads are found by it)
    heads: str | None = DEFAULT  # Medusa heads directory; "default"/None = the heads shipped for model_name
    # ``suffix``: an opened SuffixStore (see drafters.suffix.open_suffix_store), hashed by identity; None = a
    # fresh in-memory store per built drafter (DrafterCache builds one per name, so one per LLM)
    suffix_store: Any = None
    tenant: str = ""  # whose earlier outputs ``suffix`` drafts from (the server binds one per request)
    # ``draft-model``: the draft model (registry name, .gguf or HF directory; None = the target's own file) and the
    # weights it drafts with ("auto": int4 on the CPU, the target's dtype elsewhere)
    draft_model: str | None = None
    draft_weights: str = "auto"


DrafterFactory = Callable[[TargetModel, Any, DrafterOptions], "Drafter | None"]


@dataclass(frozen=True)
class DrafterEntry:
    """One registered drafter."""

    name: str
    factory: DrafterFactory
    help: str


_REGISTRY: dict[str, DrafterEntry] = {}


def register(name: str, factory: DrafterFactory, help: str, *, replace: bool = False) -> None:
    """Register ``factory(target, tokenizer, options) -> Drafter | None`` under ``name``.

    ``replace=True`` overrides an existing entry (tests, plugins); otherwise a taken name raises.
    """
    if not name or name == DEFAULT or name in ALIASES:
        raise ValueError(f"drafter name {name!r} is reserved; pick another")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a drafter named {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = DrafterEntry(name, factory, help)


def names() -> tuple[str, ...]:
    """Registered drafter names, in registration order ("none" first)."""
    return tuple(_REGISTRY)


def choices() -> tuple[str, ...]:
    """Every name a user may give: "default", the registered names and the aliases."""
    return (DEFAULT, *_REGISTRY, *ALIASES)


def describe() -> str:
    """One line per choice, for --help texts."""
    return "; ".join(
        [
            f"{DEFAULT}: hybrid-suffix when Medusa heads exist for the model, else prompt-lookup; with --weights "
            "fp32 on the own runtime, or with --draft-model, hybrid-draft (without --draft-model: the model's own "
            "GGUF in int4 as the draft model)"
        ]
        + [f"{e.name}: {e.help}" for e in _REGISTRY.values()]
        + [f"{a} = {n}" for a, n in ALIASES.items()]
    )


def canonical(name: str) -> str:
    """Resolve an alias; unknown names raise ValueError listing the choices ("default" stays as is)."""
    name = ALIASES.get(name, name)
    if name != DEFAULT and name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(choices())}")
    return name


def heads_dir(options: DrafterOptions) -> Path | None:
    """The Medusa heads directory for these options: the given one, else the shipped one, else None."""
    if options.heads not in (None, DEFAULT):
        return Path(options.heads)
    from .medusa import shipped_heads_for

    return shipped_heads_for(options.model_name)


def default_name(options: DrafterOptions, target: TargetModel | None = None) -> str:
    """What "default" means: hybrid-suffix (Medusa heads + suffix) when heads exist, else
    prompt-lookup; on float weights (``target`` the own runtime on the CPU with unquantized linears, e.g.
    ``--weights fp32``) hybrid-draft (a draft model + suffix: :func:`self_draftable`), unless ``--heads`` names
    heads of one's own; there without a draft model, where an EAGLE drafter is shipped, hybrid-eagle.

    Measured on the 80 MT-Bench first turns, 256 new tokens (benchmarks/results/bench-mtbench80):
    hybrid 1.45x plain decoding against 1.18x for Medusa alone, with the same outputs. The suffix
    branches cost nothing measurable with a cold index and pay on repeated work
    (benchmarks/results/suffix_repeated-10x128). A one-row fp32 step streams ~4x an int4 step's bytes, so
    EAGLE's draft forwards cost little beside it: on the Zen 4, 20 MT-Bench first turns x 128 with fp32
    weights, hybrid-eagle 1.35x and 1.30x plain against hybrid-suffix 1.26x in two runs (session17.md); with
    int4 weights EAGLE stays behind (1.17x against 1.39x, bench-s16-zen4-80x256).
    """
    if options.heads in (None, DEFAULT) and target is not None and self_draftable(options, target):
        return "hybrid-draft"
    # the user's own EAGLE drafter, on any weights (hybrid-suffix failed on it, after the load)
    if options.heads not in (None, DEFAULT) and eagle_dir(options) is not None:
        return "hybrid-eagle"
    if heads_dir(options) is None:
        return "prompt-lookup"
    if target is not None and float_cpu_target(target) and eagle_dir(options) is not None:
        return "hybrid-eagle"
    return "hybrid-suffix"


def self_draftable(options: DrafterOptions, target: Any) -> bool:
    """Whether the default drafts a float target with a draft model (``hybrid-draft``): the one given
    (``draft_model``), else the target's own GGUF packed in int4 beside it, where the own runtime runs its
    architecture. A one-row fp32 step streams ~5x an int4 one's bytes and the int4 copy's top token is fp32's ~98%
    of the time, so its chains are long and cheap: 2.41x fp32 plain for SmolLM2 (20 MT-Bench first turns x 256,
    against hybrid-eagle's 1.65x) and 2.39x for Gemma 3 (10 x 128, against prompt lookup's 1.80x), Zen 4,
    bench-s31-fp32-hybrid-draft-20x256 / bench-s31-gemma-fp32-draft-10x128."""
    if not float_cpu_target(target):
        return False
    if options.draft_model is not None:
        return True
    from ..models.gguf_meta import model_architecture
    from ..models.loaders import own_runtime_loads
    from ..models.registry import resolve

    try:
        path = resolve(options.model_name) if options.model_name else None
        return path is not None and path.is_file() and own_runtime_loads(model_architecture(path), False)
    except (OSError, ValueError):  # not a file this package can read: no draft of its own
        return False


def float_cpu_target(target: Any) -> bool:
    """Whether ``target`` is the own runtime on the CPU with float (unquantized) weights and native kernels here
    (so an EAGLE net with its own draft vocabulary drafts natively beside it). A quantized load quantizes the
    lm_head too (Q8_0 beside int4 or int8 layers): its type tells, as in ``eagle_native.fast_drafting``."""
    from ..interfaces import target_device
    from ..models.llama import Transformer
    from ..models.quant import QuantLinear, native_kernels

    if not isinstance(target, Transformer) or target_device(target).type != "cpu":
        return False
    return not isinstance(target.lm_head, QuantLinear) and native_kernels() is not None


def build(
    name: str, target: TargetModel, tokenizer: Any = None, options: DrafterOptions | None = None
) -> Drafter | None:
    """A new drafter by name (or alias, or "default") for ``target``; None for plain decoding."""
    options = options or DrafterOptions()
    name = canonical(name)
    if name == DEFAULT:
        name = default_name(options, target)
    return _REGISTRY[name].factory(target, tokenizer, options)


class DrafterCache:
    """Drafters of one target, built on first use by name and reused ("default" shares its resolved entry)."""

    def __init__(self, target: TargetModel, tokenizer: Any = None, options: DrafterOptions | None = None) -> None:
        self.target, self.tokenizer = target, tokenizer
        self.options = options or DrafterOptions()
        self._built: dict[tuple[str, DrafterOptions], Drafter | None] = {}

    def built(self) -> list[Drafter]:
        """Every drafter built so far (None for plain decoding left out)."""
        return [d for d in self._built.values() if d is not None]

    def get(self, name: str, heads: str | None | object = ...) -> Drafter | None:
        """The drafter called ``name`` (built once per name and heads); ``heads``: override the options' heads."""
        opts = self.options if heads is ... else dataclasses.replace(self.options, heads=heads)
        name = canonical(name)
        if name == DEFAULT:
            name = default_name(opts, self.target)
        key = (name, opts)
        if key not in self._built:
            self._built[key] = _REGISTRY[name].factory(self.target, self.tokenizer, opts)
        return self._built[key]


# ---- the built-in drafters (factories import their modules lazily) ---------------------------


def _none(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> None:
    return None


def _prompt_lookup(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter()


def _medusa(target: TargetModel, tokenizer: Any, options: DrafterOptions, latency: dict | None = None) -> Drafter:
    from .medusa import MedusaDrafter

    d = heads_dir(options)
    if d is None:
        raise FileNotFoundError(_no_medusa(options))
    # with the curve (the paid hybrids): the projection's copy that drafts faster here (drafters/draft_format.py)
    return MedusaDrafter.for_target(target, d, options.model_name, latency=latency)


def _hybrid(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .hybrid import HybridDrafter

    return HybridDrafter([_medusa(target, tokenizer, options), _prompt_lookup(target, tokenizer, options)])


def suffix_sizing(target: TargetModel) -> dict[str, Any]:
    """Suffix drafter options that size its trees by this machine's verify cost (see drafters/suffix_sizing):
    the target's measured latency curve, long chains allowed (64 nodes, 64 deep, 4 nodes per matched token).
    A target that cannot be timed here (no ``new_cache``: a callable or remote one) keeps the alpha rule."""
    from ..scheduler import measured_latency

    if not callable(getattr(target, "new_cache", None)):
        return {}
    return {"latency": measured_latency(target), "alpha": 4.0, "max_spec_tokens": 64, "max_depth": 64}


MEDUSA_DRAFT_COST_KIND = "medusa-draft-cost"


def draft_cost_on_curve(target: TargetModel, medusa: Any, latency: dict[int, float], reps: int = 11) -> float:
    """Seconds one one-node Medusa propose costs, on the scale of ``latency`` (the cached curve).

    The ratio to a one-row forward is measured once per machine, target and heads shape and cached beside
    the latency curve (like it, re-measured when it was taken under load and the machine is quiet now), so
    every process on a machine gates the heads alike.

    Timed as in decoding, each draft right after a one-row forward of the target (whose weights evict the heads'
    from the caches: back to back, drafting measured ~2/3 of its cost in the decode loop), then scaled by the
    curve's one-row time over the one-row forwards timed here (load slows both alike).
    """
    import torch

    from ..interfaces import DraftContext, target_device
    from ..models.plan import cached_measurement
    from ..training.calibrate import _target_facts
    from .eagle_cost import timed_after_forwards

    dev = target_device(target)
    w = next(medusa.heads.parameters())

    def measure() -> dict:
        ctx = DraftContext([0], torch.zeros(medusa.heads.config.hidden_size, dtype=w.dtype, device=w.device), 2, 1)
        context = max(1, min(256, getattr(target, "max_seq_len", 512) - 2))
        g = torch.Generator().manual_seed(0)
        cache = target.new_cache(context + 2)  # type: ignore[attr-defined]
        with torch.inference_mode():
            prompt = torch.randint(0, target.vocab_size, (1, context), generator=g).to(dev)
            target.forward(prompt, torch.arange(context, device=dev), cache, 0, logits_for=slice(-1, None))
            cache.keep(0, range(context))
            # the whole call, as the hybrid makes it: heads, ranking, tree
            fwd, draft = timed_after_forwards(target, prompt, cache, context, reps + 1, lambda i: medusa.propose(ctx))
        return {"ratio": min(draft[1:]) / min(fwd[1:])}  # warm-up dropped; fastest reps (load only adds time)

    def load(v: dict) -> float:
        ratio = float(v["ratio"])
        if not 0.0 <= ratio < 100.0:
            raise ValueError(f"implausible draft cost ratio {ratio}")
        return ratio

    cfg = medusa.heads.config
    key = {
        **_target_facts(target),
        "heads": type(medusa.heads).__name__,
        "num_heads": getattr(cfg, "num_heads", None),
        "head_params": sum(p.numel() for p in medusa.heads.parameters()),
        "head_dtype": str(w.dtype),
        "draft_path": medusa.heads.draft_path,  # which copy of the weights drafting streams (its format)
        # the rows of the projection a propose streams (a smaller drafting vocabulary costs less)
        "draft_vocab": None if medusa.heads.base_weight is None else int(medusa.heads.base_weight.shape[0]),
        "reps": reps,
    }
    return cached_measurement(MEDUSA_DRAFT_COST_KIND, key, measure, load, dev) * latency[1]


def _hybrid_suffix(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .hybrid import HybridDrafter
    from .suffix import make_suffix_drafter

    # Medusa heads + suffix; no prompt-lookup member: the suffix drafter's request index finds the same
    # matches (longest match in prompt + output, down to one token), and sized by the latency curve its
    # chains beat prompt lookup's fixed-rule branches, which only add rows next to them (benchmarks/
    # suffix_replay.py on the MT-Bench second turns: 2.24x against 2.14x with prompt lookup and 2.07x for
    # prompt lookup alone, est. x plain on the quiet Xeon curve; first turns 1.19x against 1.17x).
    sizing = suffix_sizing(target)
    suffix = make_suffix_drafter(options.suffix_store, options.tenant, min_match=1, **sizing)
    latency = sizing.get("latency")
    medusa: Any = _medusa(target, tokenizer, options, latency)
    if latency is not None:  # the heads are paid: they draft only the nodes that pay for their rows and time
        medusa.draft_cost = draft_cost_on_curve(target, medusa, latency)
    # lead_extra=0: when the suffix chain leads (>= 2 expected tokens), the heads are not run at all
    return HybridDrafter([medusa, suffix], name="hybrid-suffix", lead_extra=0, latency=latency)


MEDUSA_DRAFTERS = ("medusa", "hybrid", "hybrid-suffix")  # drafters with Medusa heads
EAGLE_DRAFTERS = ("eagle", "eagle-lookup", "hybrid-eagle")  # drafters with an EAGLE drafter


def _no_medusa(options: DrafterOptions) -> str:
    return (
        f"no Medusa heads are shipped for {options.model_name!r}; "
        "train some with `treedraft train-heads` and pass --heads DIR"
    )


def _no_eagle(options: DrafterOptions) -> str:
    from .eagle import EAGLE_JSON

    if options.heads not in (None, DEFAULT):
        return (
            f"--heads (heads=) {options.heads} holds no {EAGLE_JSON}, so it is no EAGLE drafter (Medusa heads?); pass "
            "the directory `treedraft train-eagle` wrote, or leave it out for the shipped EAGLE drafter"
        )
    return (
        f"no EAGLE drafter is shipped for {options.model_name!r}; "
        f"train one with `treedraft train-eagle` and pass --heads DIR (heads=DIR: the directory holding {EAGLE_JSON})"
    )


def check_files(name: str, options: DrafterOptions) -> None:
    """What drafter ``name`` reads from disk (the heads directory; shipped Medusa heads or EAGLE drafter), checked
    before the slow model load and first-use measurements: a FileNotFoundError saying what is missing (the same the
    drafter's build would raise, tens of seconds later)."""
    if options.heads not in (None, DEFAULT) and not Path(options.heads).is_dir():
        what = "is a file" if Path(options.heads).exists() else "does not exist"
        raise FileNotFoundError(
            f"--heads (heads=) {options.heads} {what}; give the directory `treedraft train-heads` or `train-eagle` wrote"
        )
    if name in MEDUSA_DRAFTERS:
        from .medusa import check_heads_dir

        d = heads_dir(options)
        if d is None:
            raise FileNotFoundError(_no_medusa(options))
        check_heads_dir(d)
    if name in EAGLE_DRAFTERS and eagle_dir(options) is None:
        raise FileNotFoundError(_no_eagle(options))


def eagle_dir(options: DrafterOptions) -> Path | None:
    """The EAGLE drafter directory: ``--heads DIR`` when it holds an eagle.json; with no ``--heads``, the shipped
    one; else None. A ``--heads DIR`` without one (Medusa heads of the user's) is never replaced by the shipped
    EAGLE drafter: the default then drafts with those heads, and ``--drafter eagle`` says what is missing."""
    from .eagle import EAGLE_JSON, shipped_eagle_for

    if options.heads not in (None, DEFAULT):
        return Path(options.heads) if (Path(options.heads) / EAGLE_JSON).is_file() else None
    return shipped_eagle_for(options.model_name)


def _eagle(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Any:
    from .eagle import EagleDrafter

    d = eagle_dir(options)
    if d is None:
        raise FileNotFoundError(_no_eagle(options))
    name = options.model_name or None
    eagle = EagleDrafter.for_target(target, d, name)
    if eagle.curve is not None:  # sized by this machine's curve: its own drafting priced the same way
        from .draft_format import EAGLE_FORMATS, EAGLE_PREFER_WITHIN, cheapest

        # the draft layer's copy that drafts a full-depth tree fastest here (draft_format), measured and cached
        eagle = cheapest(
            [priced_eagle(target, d, name, w, eagle) for w in EAGLE_FORMATS],
            lambda e: e.draft_costs[0] + (e.depth - 1) * e.draft_costs[1],
            EAGLE_PREFER_WITHIN,
        )
    return eagle


def priced_eagle(
    target: TargetModel, d: Path, model_name: str | None, draft_weights: str = "q8", reuse: Any = None
) -> Any:
    """The EAGLE drafter in ``d`` with its draft layer's native copy in ``draft_weights`` (``reuse``: an already built
    one, taken when it has that format) and, where it sizes its trees by this machine's curve, its drafting costs on
    that curve (measured once per machine and format, cached)."""
    from .eagle import EagleDrafter
    from .eagle_cost import eagle_draft_costs_on_curve

    e = reuse if reuse is not None and reuse.draft_weights == draft_weights else None
    e = e or EagleDrafter.for_target(target, d, model_name, draft_weights=draft_weights)
    if e.curve is not None:
        e.draft_costs = eagle_draft_costs_on_curve(target, e, float(e.curve(1)))
    return e


def _with_suffix(member: Drafter, name: str, target: TargetModel, options: DrafterOptions) -> Drafter:
    """``member`` + suffix chains in one tree, sized by this machine's verify cost: a confident suffix chain (>= 2
    expected tokens: copied text, earlier outputs) leads alone and the member is not run that step (lead_extra=0)."""
    from .hybrid import HybridDrafter
    from .suffix import make_suffix_drafter

    sizing = suffix_sizing(target)
    suffix = make_suffix_drafter(options.suffix_store, options.tenant, min_match=1, **sizing)
    return HybridDrafter([member, suffix], name=name, lead_extra=0, latency=sizing.get("latency"))


def _hybrid_eagle(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    # hybrid-suffix with the EAGLE drafter in the Medusa heads' place, paid the same way: asked for its first
    # k nodes only when their measured per-rank acceptance pays for their rows and its draft forwards
    return _with_suffix(_eagle(target, tokenizer, options), "hybrid-eagle", target, options)


def _eagle_lookup(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .hybrid import HybridDrafter

    return HybridDrafter(
        [_eagle(target, tokenizer, options), _prompt_lookup(target, tokenizer, options)], name="eagle-lookup"
    )


def _draft_model(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .draft_model import load_draft_model

    return load_draft_model(target, tokenizer, options.draft_model, options.draft_weights, options.model_name)


def _hybrid_draft(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    # the draft model's own sized tree where no suffix chain leads
    return _with_suffix(_draft_model(target, tokenizer, options), "hybrid-draft", target, options)


def _suffix(target: TargetModel, tokenizer: Any, options: DrafterOptions) -> Drafter:
    from .suffix import make_suffix_drafter

    return make_suffix_drafter(options.suffix_store, options.tenant, **suffix_sizing(target))


register(NONE, _none, "plain decoding, no drafts")
register("prompt-lookup", _prompt_lookup, "continuations of earlier n-gram matches in the context")
register("medusa", _medusa, "Medusa heads on the target's hidden state (--heads, or the shipped ones)")
register("hybrid", _hybrid, "Medusa tree + prompt-lookup branches, verified in one pass")
register(
    "hybrid-suffix",
    _hybrid_suffix,
    "Medusa tree + suffix chains (this request and earlier outputs), sized by verify cost",
)
register("eagle", _eagle, "EAGLE feature drafter with EAGLE-2 dynamic trees (shipped, or --heads DIR)")
register("eagle-lookup", _eagle_lookup, "EAGLE tree + prompt-lookup branches, verified in one pass")
register(
    "hybrid-eagle",
    _hybrid_eagle,
    "EAGLE tree + suffix chains, EAGLE drafting only the nodes that pay (hybrid-suffix with EAGLE for the heads)",
)
register(
    "draft-model",
    _draft_model,
    "a smaller draft model of the same tokenizer (--draft-model; default: the target's own file in int4), "
    "drafting dynamic trees (one chain up to 12 deep by default)",
)
register(
    "hybrid-draft",
    _hybrid_draft,
    "draft-model tree + suffix chains; a confident suffix chain drafts alone (the draft model idles that step)",
)
register(
    "suffix",
    _suffix,
    "frequent continuations from this request and earlier outputs "
    "(SuffixDecoding; --suffix-store DIR keeps them across restarts)",
)
