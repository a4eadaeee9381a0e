"""A smaller draft model as the drafter (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318), drafting EAGLE-2 dynamic trees (Li et al. 2024, arXiv:2406.16858) instead of one chain.

The draft model is any causal LM this package loads (own runtime or transformers) that shares the target's
tokenizer: a small sibling of the target, or the target's own GGUF packed in int4 beside a float target, whose
one-row step streams a fraction of the bytes (quantized self-speculation: the output stays the float model's).

Each step the draft model first catches up on the tokens committed since its last step (one forward over them,
causal, in its own KV cache, which keeps the committed tokens only), whose last row scores the root's children.
Where the draft is the target's own file in other weights (``share_kv``: the int4 copy drafting for a float target)
it computes none of that: it copies the target's own keys and values of the newly committed tokens (the request's
cache, :attr:`DraftContext.cache`) into its cache, in its own cache dtype, and runs only the root's row. That skips
the draft's prompt prefill and every catch-up (on MT-Bench second turns, whose prompts hold the first answer, they
were half of the drafting time), and the draft sees the exact context. (Attending to the target's fp32 cache in place
was slower: at a 700-token context the int4 draft's one-row step took 4.4 ms on it against 3.75 on its fp16 copy.)
Then :func:`.eagle_tree.grow_tree` expands the best frontier nodes depth by depth, each depth one batched draft
forward of the expanded nodes under a tree mask (a node sees the committed tokens, its expanded ancestors and
itself), and keeps the nodes that maximise expected tokens per second on this machine's verify curve. The drafted
rows never stay in the draft cache (the accepted ones are moved into place at the next step). Children are the
draft's top-k (deterministic); for a sampled request whose tokens are coupled draws (verify.accept_coupled), they
are the draft's top-k of its own log-probabilities plus the target's Gumbel noise at that position
(eagle_tree.coupled_pick): the first is the target's token wherever the two distributions are close. Either way the drafts are guesses the target verifies: greedy output is plain's, sampled
output keeps the target's distribution.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import Tensor

from ..interfaces import DraftContext, TargetModel, request_twin, target_device
from ..tree import TokenTree
from .eagle_tree import COUPLED_SCALE_CLOSE, LatencyCurve, ProbCalibration, coupled_pick, grow_tree_steps
from .steps import DraftForward, Steps, drive, drives_steps


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (another vocabulary); the message says what to change."""


def kv_layout(cache) -> tuple | None:
    """((2 x layers, batch, kv heads), head_dim) of an own-runtime KV cache (None: another kind of cache): the keys and
    values of two caches that agree on it can be copied from one to the other (converting their dtype)."""
    kv = getattr(cache, "kv", None)
    return None if kv is None else (tuple(kv.shape[:3]), kv.shape[4])


class DraftModelDrafter:
    """EAGLE-2 dynamic trees from a draft language model with its own KV cache, kept across steps."""

    name = "draft-model"

    def __init__(
        self,
        model: TargetModel,
        target_vocab: int,
        max_len: int = 4096,
        depth: int = 12,
        topk: int = 1,
        latency: dict[int, float] | None = None,
        draft_latency: dict[int, float] | None = None,
        share_kv: bool = False,
    ) -> None:
        """model: the draft model (a :class:`~treedraft.interfaces.TargetModel`: ``new_cache`` and ``forward`` with
        a tree mask); target_vocab: the target's vocabulary size (the draft's may be smaller, never larger);
        latency: the target's forward seconds per row count (the verify curve the tree is sized on; None keeps the
        whole node budget); draft_latency: the draft model's (what a draft forward of n rows costs; default a
        tenth of the target's one-row step per forward). depth / topk: the deepest draft and the children per
        expanded node; the defaults draft one chain of up to 12 tokens, which measured fastest for a target drafted
        by its own int4 file (SmolLM2 fp32, 5 MT-Bench first turns x 128: 1.89-2.11x plain against 1.71x for
        depth 12 / topk 2 and 1.56x for depth 8 / topk 4; its top token is the target's ~98% of the time). A
        draft that agrees less may pay for siblings: pass topk > 1. share_kv: the draft is the target's own model in
        other weights (same architecture and file): it copies the target's keys and values of the committed tokens
        where a step offers its cache (:meth:`_target_cache`) instead of computing its own."""
        if depth < 1 or topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got {depth}, {topk}")
        if model.vocab_size > target_vocab:
            raise DraftModelError(
                f"the draft model's vocabulary ({model.vocab_size} tokens) is larger than the target's "
                f"({target_vocab}): a draft model must share the target's tokenizer; pick a smaller model of the "
                "target's family"
            )
        self.model = model
        self.depth, self.topk = depth, topk
        self.max_len = max_len
        self.curve = None if latency is None else LatencyCurve(latency)
        self.draft_curve = None if draft_latency is None else LatencyCurve(draft_latency)
        self.cal = ProbCalibration()  # acceptance per conditional draft probability, learned from verified nodes
        self.cal_sampled = ProbCalibration()  # the same for coupled draws (sampled requests): other rates
        self.last_expected = 1.0
        # slots a cache may take: the context and one step's drafted rows, within the draft model's own window (past
        # it the step drafts less, or nothing: see propose)
        self.room = min(max_len + depth * topk + 1, getattr(model, "max_seq_len", None) or 1 << 30)
        self.share_kv = share_kv
        self.kv_layout = kv_layout(model.new_cache(1)) if share_kv else None  # what a target cache must match
        self.cache = self._new_cache()
        self.reset()

    INITIAL_SLOTS = 512  # a cache starts this long and doubles as the context grows (each request has its own)
    PREFILL_ROWS = 512

    def _new_cache(self, need: int = 0):
        """An empty draft cache of at least ``need`` slots: doubling from :data:`INITIAL_SLOTS`, at most ``room``."""
        n = self.INITIAL_SLOTS
        while n < need:
            n *= 2
        return self.model.new_cache(min(n, self.room))

    def _ensure_room(self, need: int) -> None:
        """Grow the draft cache to hold ``need`` slots, keeping what it holds (or, for a cache of another kind than
        the own runtime's, starting over: the next commit recomputes the context)."""
        old = self.cache
        if need <= getattr(old, "max_len", self.room):
            return
        self.cache = self._new_cache(need)
        if hasattr(old, "kv") and hasattr(self.cache, "kv"):  # (2 layers, B, n_kv, slots, head_dim)
            self.cache.kv[:, :, :, : old.max_len] = old.kv  # the drafted slots past length too (_keep_drafted)
            self.cache.length = old.length
        else:
            self.tokens, self.drafted_slots = [], {}

    def reset(self) -> None:
        """Forget the committed tokens (a new sequence starts)."""
        self.cache.length = 0
        self.tokens: list[int] = []  # the tokens in draft cache slots [0, cache.length)
        self.mirrored = 0  # slots [0, mirrored) hold the target's own keys and values (share_kv), not the draft's
        # the last tree's expanded nodes: their tokens after the root -> draft cache slot (past cache.length, where
        # they stay until the next forward): the accepted ones are kept instead of run again
        self.drafted_slots: dict[tuple[int, ...], int] = {}
        self.bad_token: tuple[int, int] | None = None  # (position, id) of a token the draft model cannot embed
        self.cal.reset()
        self.cal_sampled.reset()

    def fresh(self) -> DraftModelDrafter:
        """A copy that has learned nothing yet (new calibration bins; ``treedraft bench``'s fresh drafter state)."""
        return request_twin(self, cache=self._new_cache(), cal=ProbCalibration(), cal_sampled=ProbCalibration())

    def for_request(self) -> DraftModelDrafter:
        """A twin for one request: the same draft model, its own KV cache and calibration."""
        return request_twin(self, cache=self._new_cache(), cal=self.cal.fork(), cal_sampled=self.cal_sampled.fork())

    def _seconds(self, rows: int, context: int) -> float:
        """Estimated seconds of one draft forward of ``rows`` rows at ``context`` cached tokens (an estimate, not a
        timing, so the tree is a function of the inputs)."""
        if self.draft_curve is not None:
            return float(self.draft_curve.at(context)(rows))
        return 0.0 if self.curve is None else float(self.curve(1)) / 10

    def _blocked(self, tokens: list[int]) -> bool:
        """Whether this sequence holds a token id the draft model has no embedding for (a special token of a larger
        target vocabulary, found by an earlier commit): it drafts nothing for the rest of the sequence."""
        at = self.bad_token
        return at is not None and len(tokens) > at[0] and tokens[at[0]] == at[1]

    def _room_for(self, tokens: list[int]) -> int:
        """The root's position in ``tokens``, after growing the draft cache for it and a step's drafted rows (a
        context past the drafter's ``max_len`` is an error)."""
        r = len(tokens) - 1
        if r + 1 > self.max_len:
            raise ValueError(f"draft-model drafter: context {r + 1} exceeds its cache of {self.max_len} tokens")
        self._ensure_room(min(self.room, r + 2 + self.depth * self.topk))
        return r

    def _held(self, tokens: list[int], valid: int) -> int:
        """How many of ``tokens`` (the root excluded) the draft cache already holds: the longest common prefix with
        :attr:`tokens` within its first ``valid`` slots."""
        n, held = 0, min(len(self.tokens), valid, len(tokens) - 1)
        while n < held and self.tokens[n] == tokens[n]:
            n += 1
        return n

    @torch.inference_mode()
    def _commit(self, tokens: list[int]) -> tuple[Tensor, float] | None:
        """Bring the draft cache to ``tokens`` (root last): keep the longest prefix it already holds, run the rest
        (at least the root) causally; return the root row's logits (1, V) float32 and the estimated seconds it costs a
        drafting step, or None where a new token is outside the draft model's vocabulary (:meth:`_blocked`)."""
        r = self._room_for(tokens)
        n = self._held(tokens, self.cache.length)  # the root always runs: its row scores depth 1
        self.mirrored = min(self.mirrored, n)  # (slots a commit rewrites hold the draft's own keys and values)
        n += self._keep_drafted(tokens, n)
        bad = next((i for i in range(n, r + 1) if tokens[i] >= self.model.vocab_size), None)
        if bad is not None:
            self.bad_token = (bad, tokens[bad])
            self.cache.length, self.tokens = n, list(tokens[:n])  # what the cache holds
            return None
        dev = target_device(self.model)
        new = torch.tensor(tokens[n : r + 1], dtype=torch.long, device=dev)
        # decode-sized blocks on a warm cache (the native path); a prompt in blocks of PREFILL_ROWS (its masks,
        # (rows, context) per layer kind, stay small on long prompts)
        chunk = 64 if n > 0 else self.PREFILL_ROWS
        logits = None
        for a in range(0, len(new), chunk):
            block = new[a : a + chunk]
            pos = torch.arange(n + a, n + a + len(block), device=dev)
            logits, _ = self.model.forward(block[None], pos, self.cache, n + a, None, slice(-1, None))
        self.cache.length = r + 1
        self.tokens = list(tokens)
        # what drafting costs per step: a step's accepted tokens and the root (a prompt, or the tokens of steps that
        # skipped drafting, are owed whether this step drafts or not: not this tree's cost)
        return logits[0].float(), self._seconds(min(len(new), self.depth + 1), n)

    def _mirror(self, tokens: list[int], target) -> Steps:
        """:meth:`_commit` for a draft that is the target's own model (``share_kv``): the committed tokens' keys and
        values are the target's (``target``: its cache, holding every token before the root), copied into the draft
        cache where it does not hold them yet (the slots after the longest prefix it mirrored before), converted to
        its dtype; only the root's row runs, as a step (:mod:`.steps`: batched with other requests' draft forwards).
        Same return value."""
        r = self._room_for(tokens)
        if tokens[r] >= self.model.vocab_size:  # (the target's own vocabulary: only a draft cut short has fewer ids)
            return None
        n = self._held(tokens, self.mirrored)
        if n < r:
            self.cache.kv[:, :, :, n:r] = target.kv[:, :, :, n:r]
        self.mirrored, self.drafted_slots = r, {}
        logits = yield DraftForward(self.model, self.cache, [tokens[r]], [r], r, None, last_only=True)
        self.cache.length, self.tokens = r + 1, list(tokens)
        return logits, self._seconds(1, r)

    def _keep_drafted(self, tokens: list[int], n: int) -> int:
        """Move the accepted drafted tokens' keys and values (the last tree's expanded nodes on the committed path,
        the new root excluded) to the slots after the ``n`` held ones; returns how many. They were computed under
        the tree mask over their own path, which is the causal prefix they now sit on."""
        slots, self.drafted_slots = self.drafted_slots, {}
        if not slots or n != self.cache.length:  # another sequence, or a step drafted nothing since
            return 0
        keep: list[int] = []
        for j in range(n, len(tokens) - 1):
            s = slots.get(tuple(tokens[n : j + 1]))
            if s is None:
                break
            keep.append(s - n)
        if keep:
            self.cache.keep(n, keep)
        return len(keep)

    @drives_steps
    def propose(self, ctx: DraftContext) -> TokenTree:
        """A dynamic tree of at most ``ctx.max_nodes`` nodes (root included) and ``ctx.max_depth`` depth."""
        return drive(self.propose_steps(ctx))

    @torch.inference_mode()
    def propose_steps(self, ctx: DraftContext) -> Steps:
        """:meth:`propose` as steps: each draft forward (the root's row where the target's cache is mirrored, then one
        per depth) is yielded as a :class:`~.steps.DraftForward` and its logits sent back, so the batched scheduler
        runs the forwards of every request drafting with this model as one packed forward. The same tree either way.
        """
        budget = ctx.max_nodes - 1
        r = len(ctx.tokens) - 1
        # depth d needs (d - 1) x topk draft cache slots past the context: near the end of the draft model's window
        # the tree is shallower, and past it there is none
        depth = min(self.depth, ctx.max_depth, max(1, budget), 1 + (self.room - r - 1) // self.topk)
        pick = self._coupled_pick(ctx)
        cal = self.cal if pick is None else self.cal_sampled
        cal.learn(ctx.tokens)
        stub = TokenTree((ctx.root,), (-1,))
        if cal.skip_step(budget >= 1 and depth >= 1):  # back-off after a tree that did not pay
            self.last_expected, self.drafted_slots = 1.0, {}
            return stub
        self.last_expected = 1.0
        if budget < 1 or depth < 1 or self._blocked(ctx.tokens):
            self.drafted_slots = {}
            return stub
        shared = self._target_cache(ctx)
        if shared is None:
            commit = self._commit(list(ctx.tokens))
        else:
            commit = yield from self._mirror(list(ctx.tokens), shared)
        if commit is None:
            return stub
        logits, first_seconds = commit
        base = self.cache.length
        path_of: dict[int, tuple[int, ...]] = {0: ()}  # an expanded node's tokens after the root
        steps = grow_tree_steps(
            ctx.root,
            logits,
            base=base,
            budget=budget,
            depth=depth,
            topk=self.topk,
            curve=None if self.curve is None else self.curve.at(len(ctx.tokens)),
            cal=cal,
            # the commit, then one draft forward of (at most) topk rows per further depth
            drafting_seconds=lambda forwards: first_seconds + (forwards - 1) * self._seconds(self.topk, base),
            pick=pick,
        )
        try:
            nodes, toks, parents, depths, start, mask = next(steps)
            while True:  # one draft forward per further depth
                out = yield DraftForward(self.model, self.cache, toks, [r + d for d in depths], start, mask)
                for row, (i, p, t) in enumerate(zip(nodes, parents, toks)):  # (written: the forward ran)
                    path_of[i] = path_of[p] + (t,)
                    self.drafted_slots[path_of[i]] = start + row
                nodes, toks, parents, depths, start, mask = steps.send(out)
        except StopIteration as stop:
            tree, expected, probs = stop.value
        self.cache.length = base  # drafts never stay in the cache
        self.last_expected = expected
        cal.drafted(expected - 1.0, r, ctx.root, tree, probs)
        return tree

    def _target_cache(self, ctx: DraftContext):
        """The target's KV cache this step may copy from (:attr:`DraftContext.cache`), or None: ``share_kv`` is off,
        no cache was offered, or its keys and values are not laid out as this draft model's (another kind of cache,
        layer count or head layout), or it does not hold exactly the tokens before the root."""
        c = ctx.cache
        if not self.share_kv or c is None or getattr(c, "length", None) != len(ctx.tokens) - 1:
            return None
        layout = kv_layout(c)
        return c if layout is not None and layout == self.kv_layout else None

    def _coupled_pick(self, ctx: DraftContext):
        """For a sampled request whose tokens are coupled draws (``ctx.coupling``), the children of each expanded
        node: the draft model's top-k of its own log-probabilities plus the target's Gumbel noise at that position
        (:func:`.eagle_tree.coupled_pick`); the first is the target's own token wherever the two distributions are
        close. None: greedy, or not coupled."""
        return coupled_pick(ctx, self.topk, scale=COUPLED_SCALE_CLOSE)


def draft_weights_for(model_path, device: torch.device, weights: str, dtype: torch.dtype) -> tuple[str, str]:
    """(weights, dtype name) a draft model loads with: ``weights`` as given, or for "auto" the GGUF's int4 blocks on
    the CPU where the own runtime runs its architecture (a draft's quality only moves its acceptance, never the
    output) and dense weights elsewhere. Dense weights take the target's ``dtype``; int4 / int8 run in fp32 on the
    CPU only (a DraftModelError says so for another device)."""
    from ..models.gguf_meta import model_architecture
    from ..models.loaders import own_runtime_loads

    if weights == "auto":
        own = own_runtime_loads(model_architecture(model_path), model_path.is_dir())
        weights = "int4" if device.type == "cpu" and own and model_path.is_file() else "fp32"
    if weights in ("int4", "int8"):
        if device.type != "cpu":
            raise DraftModelError(
                f"--draft-weights {weights} runs on the CPU only, and the target is on {device}: give a smaller "
                "--draft-model, in dense weights (--draft-weights fp32 or auto)"
            )
        return weights, "fp32"
    from ..api import DTYPES

    return weights, next((name for name, dt in DTYPES.items() if dt == dtype), "fp32")  # load()'s own name for it


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """Raise :class:`DraftModelError` unless the draft's tokenizer maps every id it has to the target's token."""
    a, b = getattr(target_tok, "hf", None), getattr(draft_tok, "hf", None)
    if a is None or b is None:
        return
    n = min(len(a), len(b))
    ids = list(range(n))
    ta, tb = a.convert_ids_to_tokens(ids), b.convert_ids_to_tokens(ids)
    diff = [i for i in ids if ta[i] != tb[i]]
    if diff:
        i = diff[0]
        raise DraftModelError(
            f"draft model {draft_name!r} has another tokenizer than the target ({len(diff)} of {n} token ids differ, "
            f"e.g. id {i}: {tb[i]!r} against {ta[i]!r}); a draft model must share the target's tokenizer"
        )


def load_draft_model(
    target: TargetModel, tokenizer, model: str | None, weights: str = "auto", target_model: str = ""
) -> DraftModelDrafter:
    """A :class:`DraftModelDrafter` for ``target`` (loaded from ``target_model``) over ``model`` (registry name, .gguf
    or HF directory; None: ``target_model`` itself) loaded beside it on its device, its trees sized by this
    machine's measured latency curves of both models."""
    from ..api import load_model, load_tokenizer
    from ..budget import measured_latency
    from ..models.registry import resolve

    if not callable(getattr(target, "new_cache", None)):
        raise DraftModelError(
            "the draft-model drafter needs a target with a KV cache (the own runtime or transformers)"
        )
    own_file = model is None  # the target's own file: the default on float weights
    model = model or target_model
    if not model:
        raise DraftModelError("no draft model given: pass --draft-model (load(draft_model=...))")
    dev = target_device(target)
    try:
        path = resolve(model)
    except ValueError as e:
        raise DraftModelError(f"draft model (--draft-model): {e}") from None
    params = target.parameters() if callable(getattr(target, "parameters", None)) else iter(())
    first = next(iter(params), None)
    w, dtype = draft_weights_for(path, dev, weights, first.dtype if first is not None else torch.float32)
    tw = (getattr(target, "weights_info", None) or {}).get("resolved", "fp32")
    same_file = bool(target_model) and resolve(target_model).resolve() == path.resolve()
    if same_file and tw == w:
        if dev.type != "cpu":
            hint = f"give a smaller --draft-model (int4 / int8 drafts run on the CPU only, the target is on {dev})"
        elif w == "int4":
            hint = "load the target with --weights fp32 (or int8) to draft with its int4 copy, or give a smaller --draft-model"
        elif w == "int8":
            hint = "give --draft-weights int4, or load the target with --weights fp32, or give a smaller --draft-model"
        else:  # a float target asked to draft with float weights
            hint = (
                "give --draft-weights int4 or int8 (where the own runtime runs the model), or a smaller --draft-model"
            )
        raise DraftModelError(
            f"the draft model would be the target itself in the target's own weights ({w}), which cannot draft "
            f"faster than it decodes: {hint}"
        )
    tok = load_tokenizer(path)
    check_same_tokenizer(tokenizer, tok, model)  # before the weights: a wrong model fails fast
    max_len = getattr(target, "max_seq_len", 4096) or 4096
    if own_file:
        print(
            f"treedraft: drafting with this model's own {w} copy as the draft model (--drafter to choose another)",
            file=sys.stderr,
            flush=True,
        )
    with warnings.catch_warnings():  # the draft's rounding only moves its acceptance, never the output
        warnings.filterwarnings("ignore", message=".*no exact 4-bit mapping")
        net, _, _, _ = load_model(model, device=str(dev), dtype=dtype, max_seq_len=max_len, weights=w, tokenizer=tok)
    n_tok = len(tokenizer.hf) if getattr(tokenizer, "hf", None) is not None else 0
    if n_tok > net.vocab_size:
        raise DraftModelError(
            f"the target's tokenizer has {n_tok} tokens and draft model {model!r} embeds only {net.vocab_size}: "
            "its ids past that would have no row; pick a draft model with the target's whole vocabulary"
        )
    # the target's own file in other weights: it copies the target's keys and values instead of computing its own
    layout = kv_layout(net.new_cache(1)) if same_file else None
    share = layout is not None and layout == kv_layout(target.new_cache(1))
    lat, dlat = measured_latency(target), measured_latency(net)
    if dlat[1] >= 0.6 * lat[1]:
        warnings.warn(
            f"draft model {model!r} ({w}) takes {dlat[1] / lat[1]:.0%} of the target's one-token step on this "
            "machine: drafting will rarely pay (the trees back off); give a smaller --draft-model",
            stacklevel=2,
        )
    return DraftModelDrafter(net, target.vocab_size, max_len=max_len, latency=lat, draft_latency=dlat, share_kv=share)
