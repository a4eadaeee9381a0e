"""What every layer codes against: the target model, its cache, drafters and their context.

Nothing here imports the engine, the API or a model implementation, so drafters, training and
the models can depend on this module without depending on each other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from .tree import TokenTree


class GenerationError(ValueError):
    """Invalid generation request (empty prompt, too long, bad limits); the message names the limit."""


@runtime_checkable
class Cache(Protocol):
    """Per-sequence state a target writes during ``forward`` (a KV cache, or token slots).

    ``length`` counts committed positions; :meth:`keep` compacts the accepted tree path in place.
    """

    length: int

    def keep(self, start: int, indices: Tensor | Sequence[int]) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; set ``length`` accordingly."""
        ...

    def truncate(self, length: int) -> None:
        """Forget every slot at or after ``length``."""
        ...


@runtime_checkable
class TargetModel(Protocol):
    """What the engine and the drafters need from a target (reference: models/llama.py ``Transformer``).

    ``device`` is where the engine builds the inputs of ``forward`` (tokens, positions, mask).
    The weight accessors return None for a target that has no such weight (e.g. a callable target);
    drafters that need one say so in their error.
    """

    vocab_size: int
    max_seq_len: int
    hidden_size: int

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, max_len: int | None = None) -> Cache:
        """An empty cache for up to ``max_len`` positions (default: ``max_seq_len``)."""
        ...

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: Cache | None = None,
        start: int | None = None,
        mask: Tensor | None = None,
        logits_for: Tensor | slice | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, T) tokens at (T,) positions [+ (T, start+T) tree mask] -> (B, T', V) logits, (B, T, H) hidden."""
        ...

    def input_embedding_weight(self) -> Tensor | None:
        """(V, H) input embedding matrix, or None."""
        ...

    def output_projection_weight(self) -> Tensor | None:
        """(V, H) output projection (lm_head) weight, or None."""
        ...


def device_sync(dev: torch.device) -> Callable[[], None]:
    """What a timing waits on before reading the clock: on CUDA (asynchronous) the work queued on ``dev`` itself (a
    bare ``torch.cuda.synchronize()`` waits on the current device, not necessarily this one); elsewhere nothing."""
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def target_device(model: object) -> torch.device:
    """The device a target wants its inputs on: its ``device`` attribute, else its first parameter's, else cpu."""
    dev = getattr(model, "device", None)
    if dev is not None:
        return torch.device(dev)
    params = getattr(model, "parameters", None)
    if callable(params):
        p = next(iter(params()), None)
        if p is not None:
            return p.device
    return torch.device("cpu")


@dataclass
class DraftContext:
    """What a drafter sees each step."""

    tokens: list[int]  # prompt + generated so far; tokens[-1] is the root (chosen, not yet verified)
    hidden: Tensor | None  # (H,) target's final hidden state at the position that produced the root
    max_nodes: int  # tree size budget, root included
    max_depth: int  # deepest useful draft depth
    prompt_len: int = 0
    # (n, H) target's final hidden states at the n positions committed since the previous propose (the
    # whole prompt at the first), in order; the last row is ``hidden``. None when the target gives none.
    accepted_hidden: Tensor | None = None
    # The rest of a batched step this tree joins (the scheduler's row budget granted ``max_nodes``): the other
    # requests' and prompts' rows, the tokens they give, and the seconds the step costs beyond the latency
    # curve. 0 rows: a lone request. A drafter that prices its own nodes (the hybrid's paid members) then
    # weighs them against the whole step, where one more row or a propose delays every request in it.
    step_rows: int = 0
    step_tokens: float = 0.0
    step_fixed: float = 0.0
    # The request's penalties / logit bias (treedraft.penalties.PenaltyState), None when off: a drafter that scores
    # the vocabulary may adjust its scores as the target's will be (penalize_draft_); verification is exact anyway.
    penalty: Any = None
    # Predicted output (OpenAI's ``prediction``): token ids the caller expects the answer to be close to, e.g. the
    # file an edit rewrites. Text drafters (prompt lookup, suffix) search it as well; () when none was given.
    reference: Sequence[int] = ()
    # A sampled request's sampling parameters (treedraft.sampling.SamplingParams; None: greedy or not told) and,
    # where its tokens are coupled draws (verify.accept_coupled), their key: the token at position t will be
    # sampling.coupled_sample(target row, sampling, coupling, t). A drafter that draws its own children the same way
    # from a distribution close to the target's proposes the target's own draws (the drafts stay mere guesses:
    # the output does not depend on them). None when not coupled.
    sampling: Any = None
    coupling: int | None = None
    # The request's own target KV cache, to read only (None: not offered). Where ``cache.length`` is len(tokens) - 1
    # (a consumer checks), slots [0, len(tokens) - 1) hold the target's keys and values of every token before the
    # root. A drafter that runs the target's own architecture and file in other weights (the int4 copy drafting for a
    # float target) copies them instead of computing its own.
    cache: Any = None

    @property
    def root(self) -> int:
        """The token the tree is rooted at (the target's own choice, not a draft)."""
        return self.tokens[-1]


class Drafter(Protocol):
    """Proposes a tree rooted at ``ctx.root``. Never verifies.

    A drafter that runs a draft model may also offer ``propose_steps(ctx)``: the same tree as a generator that yields
    each draft forward and is sent its logits, so the batched scheduler packs several requests' forwards into one
    (:mod:`treedraft.drafters.steps`). A subclass or instance that overrides ``propose`` alone is driven through it.
    """

    name: str

    def propose(self, ctx: DraftContext) -> TokenTree:
        """A token tree rooted at ``ctx.root`` of at most ``ctx.max_nodes`` nodes."""
        ...


def request_twin(drafter: Any, **fresh: Any) -> Any:
    """A shallow copy of ``drafter`` with the attributes ``fresh`` replaced, then ``reset()`` (when it has one).

    What a drafter's ``for_request`` builds on: the twin shares the heavy parts (weights, stores) and gets its own
    per-request state; see :func:`request_drafter`.
    """
    twin = copy.copy(drafter)
    for name, value in fresh.items():
        setattr(twin, name, value)
    reset = getattr(twin, "reset", None)
    if callable(reset):
        reset()
    return twin


def request_drafter(drafter: Drafter | None) -> Drafter | None:
    """The drafter one request drafts with: ``drafter.for_request()`` when it keeps per-request state, else itself.

    A drafter that keeps the current request's state between steps (the suffix drafter's index of the request's
    own tokens and its acceptance model, EAGLE's draft KV cache) sees another request at every call when one
    instance serves a batch: it rebuilds that state each step (slow), records half-finished outputs into its
    store, and its trees (so a seeded typical-acceptance request's text) depend on the batch. ``for_request``
    gives a twin with its own request state over the same shared parts (weights, suffix store, tenant).
    """
    fork = getattr(drafter, "for_request", None)
    return fork() if callable(fork) else drafter
