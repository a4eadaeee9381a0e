"""Medusa draft heads (Cai et al. 2024, arXiv:2401.10774) and their tree drafter.

Head k (0-based) reads the target's final hidden state h_i at position i and
predicts token i+k+2 (the target's own lm_head predicts i+1, which is the tree
root). Each head is ``n`` residual blocks x + SiLU(W x) (W zero-initialised, so a
fresh head starts as the base lm_head) followed by a vocabulary projection:
either the base model's frozen lm_head (shared) or a projection of its own.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..interfaces import DraftContext, TargetModel
from ..kernels import topk_rows
from ..models.llama import bf16_gemm_available, linear_bf16, matmul, pack_bf16
from ..penalties import penalize_draft_
from ..tree import TokenTree
from .eagle_tree import coupled_pick

if TYPE_CHECKING:
    from .medusa_native import NativeDraft

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# A small default tree (Medusa-style choices) for heads that carry neither choices nor rank accuracies;
# shipped heads carry accuracies, and the tree is chosen per machine (training/calibrate.machine_tree).
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (1, 0),
    (0, 1),
    (0, 0, 0),
    (2, 0),
    (0, 2),
    (1, 1),
    (0, 0, 1),
    (0, 1, 0),
    (0, 0, 0, 0),
    (3,),
    (1, 0, 0),
)


class HeadsMismatchError(ValueError):
    """Heads trained for another base model."""


@dataclass(frozen=True)
class MedusaConfig:
    base_model: str  # registry name or file identity of the base model
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    choices: tuple[tuple[int, ...], ...] = ()  # a fixed tree; () = chosen per machine (see machine_tree)
    draft_vocab: int = 0  # >0: heads score only the first N ids of `vocab_map` (a frequency-ranked subset)
    # True: each head also reads the root token's input embedding (h + P_k e(root), P_k zero-initialised).
    # The root is known when drafting (the target chose it), so heads need not guess token t+1 first.
    root_conditioned: bool = False
    extra: dict = field(default_factory=dict)  # training/eval facts (accuracy, data, calibration)

    @staticmethod
    def from_json(d: dict) -> MedusaConfig:
        """From a medusa.json dict; unknown or missing keys raise HeadsMismatchError naming them."""
        if not isinstance(d, dict):
            raise HeadsMismatchError(f"medusa.json must hold a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(MedusaConfig)}
        required = {f.name for f in fields(MedusaConfig) if f.default is f.default_factory is MISSING}
        unknown, missing = sorted(set(d) - known), sorted(required - set(d))
        if unknown or missing:
            what = [f"unknown keys {unknown}"] if unknown else []
            what += [f"missing keys {missing}"] if missing else []
            raise HeadsMismatchError(
                f"medusa.json does not match this version of treedraft: {'; '.join(what)} (expected keys: "
                f"{sorted(known)}). Retrain the heads with `treedraft train-heads`, or use the treedraft version "
                "that wrote them."
            )
        d = dict(d)
        d["choices"] = tuple(tuple(c) for c in d.get("choices", ()))
        return MedusaConfig(**d)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads; ``forward(h)`` -> logits (..., K, V') over the draft vocabulary."""

    _draft_w: Tensor | None = None  # bf16 copy of the shared projection (pack_for_drafting)
    _native: NativeDraft | None = None  # int8 copies of the drafting weights (pack_for_drafting)

    def __init__(
        self,
        cfg: MedusaConfig,
        lm_head_weight: Tensor | None = None,
        vocab_map: Tensor | None = None,
        embed_weight: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.root_proj = None
        if cfg.root_conditioned:
            if embed_weight is None:
                raise ValueError("root-conditioned heads need the base model's input embedding weight")
            self.root_proj = nn.ModuleList(
                nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False) for _ in range(cfg.num_heads)
            )
            for lin in self.root_proj:
                nn.init.zeros_(lin.weight)
        self.register_buffer("embed_weight", None if embed_weight is None else embed_weight.detach(), persistent=False)
        # distinct modules per head and per block (no `[m] * n` weight sharing)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)]) for _ in range(cfg.num_heads)
        )
        if cfg.shared_lm_head:
            self.proj = None
            if lm_head_weight is None:
                raise ValueError("shared_lm_head heads need the base model's lm_head weight")
        else:
            # one projection per head over the same vocabulary the shared variant scores (the draft
            # vocabulary when there is one: training targets are indices into it), lm_head rows to start
            if cfg.draft_vocab and (vocab_map is None or len(vocab_map) < cfg.draft_vocab):
                raise ValueError(f"draft_vocab={cfg.draft_vocab} needs a vocab_map of at least that many token ids")
            rows = vocab_map[: cfg.draft_vocab] if cfg.draft_vocab else None
            self.proj = nn.ModuleList(
                nn.Linear(cfg.hidden_size, len(rows) if rows is not None else cfg.vocab_size, bias=False)
                for _ in range(cfg.num_heads)
            )
            if lm_head_weight is not None:
                init = (
                    lm_head_weight.detach() if rows is None else lm_head_weight.detach()[rows.to(lm_head_weight.device)]
                )
                for p in self.proj:
                    p.weight.data.copy_(init)
        self.set_base(lm_head_weight, vocab_map)

    def set_base(self, lm_head_weight: Tensor | None, vocab_map: Tensor | None) -> None:
        """Attach the frozen base lm_head (not saved with the heads) and the draft-vocab subset."""
        if vocab_map is not None and self.config.draft_vocab:
            vocab_map = vocab_map[: self.config.draft_vocab]
        # non-persistent buffers: .to(device / dtype) moves them with the heads, save() never writes them
        self.register_buffer("vocab_map", vocab_map, persistent=False)  # (V',) token ids or None = full vocabulary
        self._columns: np.ndarray | None = None  # target id -> column of V' (target_columns), built on first use
        w = None
        if lm_head_weight is not None:
            w = lm_head_weight.detach()
            if vocab_map is not None:
                w = w[vocab_map.to(w.device)]
            p = next(self.parameters(), None)
            if p is not None:  # converted to the heads' dtype once here, not in every forward
                w = w.to(dtype=p.dtype)
            w = w.contiguous()  # (V', H)
        self.register_buffer("base_weight", w, persistent=False)

    def hidden(self, h: Tensor, root: Tensor | None = None, num_heads: int | None = None) -> Tensor:
        """(..., H) hidden states [+ (...,) root token ids] -> (..., K, H) per-head features.

        ``num_heads``: only the first n heads (drafting a tree of depth n needs no more).
        """
        blocks = self.blocks[: num_heads or len(self.blocks)]
        if self.root_proj is None:
            return torch.stack([blk(h) for blk in blocks], dim=-2)
        if root is None:
            raise ValueError("these heads are root-conditioned: pass the root token ids")
        e = self.embed_weight[root.to(self.embed_weight.device)].to(h.dtype)  # (..., H)
        return torch.stack([blk(h + p(e)) for blk, p in zip(blocks, self.root_proj)], dim=-2)

    def pack_for_drafting(self, proj_format: str = "q8") -> bool:
        """Keep a rounded copy of the drafting weights: native int8 (``treedraft.kernels``), else bf16.

        Drafting streams the (draft vocabulary x hidden) projection every step. With the native kernels
        on a CPU the heads draft through int8 copies of it and of their blocks (:mod:`.medusa_native`:
        a quarter of the float32 bytes, and ~30x faster than oneDNN's bf16 where bf16 is emulated); else
        on a CPU with bf16 GEMM, through a oneDNN-packed bf16 copy of the projection (half the bytes).
        Draft scores only rank candidates (the target verifies every token), so rounding them cannot
        change any output. Returns whether a rounded copy is on. proj_format: the native projection's format
        ("q8", or "q4": half the bytes; :mod:`.medusa_native`).
        """
        from .medusa_native import NativeDraft

        self._draft_w = None
        self._native = NativeDraft.build(self, proj_format)
        if self._native is not None:
            return True
        w = self.base_weight
        if self.proj is None and w is not None and w.device.type == "cpu" and bf16_gemm_available():
            try:
                self._draft_w = pack_bf16(w)
            except RuntimeError:  # a oneDNN build that reports bf16 but cannot pack: keep float32
                self._draft_w = None
        return self._draft_w is not None

    def project(self, z: Tensor, draft_copy: bool = False) -> Tensor:
        """(..., n, H) features of the first n heads -> (..., n, V') logits.

        draft_copy: use the bf16 copy made by :meth:`pack_for_drafting` when there is one.
        """
        if self.proj is not None:
            return torch.stack([p(z[..., k, :]) for k, p in enumerate(self.proj[: z.shape[-2]])], dim=-2)
        rows = z.numel() // z.shape[-1]
        if draft_copy and self._draft_w is not None:
            y = linear_bf16(z.reshape(rows, -1), self._draft_w)
        elif not torch.is_grad_enabled() and rows <= 64:  # drafting/eval: the skinny-GEMM kernel (3x here)
            y = matmul("wxt", z.reshape(rows, -1), self.base_weight, None)
        else:
            return z @ self.base_weight.T  # same dtype as the heads (see set_base)
        return y.reshape(*z.shape[:-1], y.shape[-1])

    @property
    def draft_path(self) -> str:
        """Which weights drafting streams: "native-q8", "bf16" or the heads' own dtype (a tree cache key part)."""
        if self._native is not None:
            return "native-q8" if self._native.proj_format == "q8" else f"native-q8-proj-{self._native.proj_format}"
        if self._draft_w is not None:
            return "bf16"
        return str(next(self.parameters()).dtype).removeprefix("torch.")

    def target_columns(self) -> np.ndarray | None:
        """Each target token id's column in the draft vocabulary (-1: not in it); None when the heads score the
        whole vocabulary. For adjusting draft logits by target ids (:func:`treedraft.penalties.penalize_draft_`)."""
        vm = self.vocab_map
        if vm is None:
            return None
        if self._columns is None:
            ids = vm.cpu().numpy().astype(np.int64)
            cols = np.full(int(ids.max()) + 1, -1, np.int64)
            cols[ids] = np.arange(len(ids))
            self._columns = cols
        return self._columns

    @torch.inference_mode()
    def draft_logits(self, h: Tensor, root: Tensor | None, num_heads: int) -> Tensor:
        """(H,) hidden state [+ root id] -> (num_heads, V') scores of the first ``num_heads`` heads."""
        if self._native is not None:
            return self._native.logits(self, h, root, num_heads)
        return self.project(self.hidden(h, root, num_heads), draft_copy=True)

    def forward(self, h: Tensor, root: Tensor | None = None) -> Tensor:
        """(..., H) [+ (...,) root ids] -> (..., K, V') logits (float32 projection: training, calibration)."""
        return self.project(self.hidden(h, root))

    # ---- persistence ---------------------------------------------------
    def save(self, d: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write heads.safetensors (weights in ``dtype`` if given, e.g. fp16 to halve a shipped file)
        + medusa.json into directory d."""
        from ..models.cache import atomic_write_text, save_tensors

        d = Path(d)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        if self.vocab_map is not None:
            sd["vocab_map"] = self.vocab_map.to(torch.int32).cpu()
        cfg = asdict(self.config)
        cfg["choices"] = [list(c) for c in self.config.choices]
        if not cfg["choices"]:
            del cfg["choices"]  # no fixed tree: each machine chooses its own
        # the config goes first and comes back last: interrupted in between, the directory has no medusa.json (said
        # so when loaded, and the reproduce scripts redo the step), never new weights under an old config
        (d / "medusa.json").unlink(missing_ok=True)
        save_tensors(sd, d / "heads.safetensors")
        atomic_write_text(d / "medusa.json", json.dumps(cfg, indent=1))

    @staticmethod
    def load(
        d: str | Path,
        lm_head_weight: Tensor | None,
        base_model: str | None = None,
        hidden_size: int | None = None,
        vocab_size: int | None = None,
        embed_weight: Tensor | None = None,
    ) -> MedusaHeads:
        """Load heads from a directory, refusing heads made for a different base model."""
        from safetensors.torch import load_file

        d = Path(d)
        check_heads_dir(d)
        try:
            raw = json.loads((d / "medusa.json").read_text())
        except json.JSONDecodeError as e:
            raise HeadsMismatchError(
                f"{d / 'medusa.json'} is not valid JSON ({e}); rewrite it with `treedraft train-heads`"
            ) from e
        try:
            cfg = MedusaConfig.from_json(raw)
        except HeadsMismatchError as e:
            raise HeadsMismatchError(f"{d / 'medusa.json'}: {e}") from None
        except (TypeError, ValueError) as e:  # a value of the wrong type (e.g. choices not a list of lists)
            raise HeadsMismatchError(
                f"{d / 'medusa.json'}: invalid value ({e}); rewrite it with `treedraft train-heads`"
            ) from e
        problems = []
        if base_model is not None and cfg.base_model != base_model:
            problems.append(f"base model {cfg.base_model!r} != {base_model!r}")
        if hidden_size is not None and cfg.hidden_size != hidden_size:
            problems.append(f"hidden size {cfg.hidden_size} != {hidden_size}")
        if vocab_size is not None and cfg.vocab_size != vocab_size:
            problems.append(f"vocab size {cfg.vocab_size} != {vocab_size}")
        if problems:
            raise HeadsMismatchError(
                f"heads in {d} were trained for another model: "
                + "; ".join(problems)
                + ". Train heads for this model with `treedraft train-heads`."
            )
        try:
            sd = load_file(str(d / "heads.safetensors"))
        except Exception as e:  # safetensors' own error: a torn or foreign file
            raise HeadsMismatchError(
                f"{d / 'heads.safetensors'} cannot be read ({type(e).__name__}: {e}); rewrite it with `treedraft "
                "train-heads`, or restore it"
            ) from None
        vocab_map = sd.pop("vocab_map", None)
        vocab_map = None if vocab_map is None else vocab_map.long()
        where = d / "heads.safetensors"
        if cfg.draft_vocab:
            if vocab_map is None or vocab_map.dim() != 1 or len(vocab_map) < cfg.draft_vocab:
                has = "no vocab_map" if vocab_map is None else f"a vocab_map of shape {tuple(vocab_map.shape)}"
                raise HeadsMismatchError(
                    f"{where}: medusa.json says draft_vocab={cfg.draft_vocab} but the file has {has}"
                )
            if int(vocab_map.min()) < 0 or int(vocab_map.max()) >= cfg.vocab_size:
                raise HeadsMismatchError(f"{where}: vocab_map has token ids outside [0, {cfg.vocab_size})")
        heads = MedusaHeads(cfg, lm_head_weight, vocab_map, embed_weight)
        want = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in sd.items()}
        wrong = [
            f"{k}: {got[k]} (config needs {want[k]})" for k in sorted(want.keys() & got.keys()) if got[k] != want[k]
        ]
        missing, unexpected = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        if wrong or missing or unexpected:
            details = "; ".join(
                ([f"wrong shapes {wrong[:4]}"] if wrong else [])
                + ([f"missing tensors {missing[:4]}"] if missing else [])
                + ([f"unexpected tensors {unexpected[:4]}"] if unexpected else [])
            )
            raise HeadsMismatchError(
                f"{where} does not match {d / 'medusa.json'} (hidden_size={cfg.hidden_size}, "
                f"vocab_size={cfg.vocab_size}, num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, "
                f"shared_lm_head={cfg.shared_lm_head}): {details}. Both files must come from the same "
                "`treedraft train-heads` run."
            )
        heads.load_state_dict(sd)
        return heads.eval().requires_grad_(False)


def top_k_rows(scores: Tensor, k: int) -> list[list[int]]:
    """Indices of the k largest scores of every row of (n, V) ``scores``, best first (ties: lower index first).

    On the CPU through :func:`treedraft.kernels.topk_rows` (one native pass per row; torch.topk parallelises over
    OpenMP threads and took 2.5-13 ms for (4, 16384) on a loaded 2-core machine).
    """
    k = min(k, scores.shape[-1])
    if scores.device.type != "cpu" or k > 16:
        return scores.topk(k, dim=-1).indices.tolist()
    return topk_rows(scores.detach().float(), k)[1].tolist()


def check_heads_dir(d: Path) -> None:
    """FileNotFoundError unless ``d`` is a directory ``treedraft train-heads`` wrote (one holding medusa.json), saying
    what it is instead (what :meth:`MedusaHeads.load` reads, checked before a model load too)."""
    if not d.is_dir():
        what = "is a file" if d.exists() else "does not exist"
        raise FileNotFoundError(f"heads directory {d} {what}; give the directory `treedraft train-heads` wrote")
    if not (d / "medusa.json").is_file():
        if (d / "eagle.json").is_file():  # (the error named only train-heads: an EAGLE directory is no mistake)
            raise FileNotFoundError(
                f"{d}: an EAGLE drafter (eagle.json), not Medusa heads (no medusa.json): pick a drafter that reads it, "
                "--drafter eagle, eagle-lookup or hybrid-eagle (treedraft.load(drafter=...)); Medusa heads are what "
                "`treedraft train-heads` writes"
            )
        raise FileNotFoundError(f"{d}: no medusa.json; expected a directory written by `treedraft train-heads`")


def shipped_heads_for(model_name: str) -> Path | None:
    """Directory of heads shipped in the package for a registry model name, if any."""
    d = HEADS_DIR / model_name
    return d if (d / "medusa.json").is_file() else None


@dataclass
class MedusaDrafter:
    """Proposes a Medusa tree: root = target's token; depth d+1 = top-k of head d."""

    heads: MedusaHeads
    choices: tuple[tuple[int, ...], ...] = ()
    name: str = "medusa"
    # what a propose costs (seconds, on the scale of the target's latency curve); the hybrid drafter weighs
    # it against the heads' expected accepted tokens (node_values) before asking for a tree
    draft_cost: float = 0.0
    _values: dict[int, list[float] | None] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.choices = tuple(tuple(c) for c in (self.choices or self.heads.config.choices or DEFAULT_CHOICES))
        given = set(self.choices)
        orphans = [list(c) for c in self.choices if not c or (len(c) > 1 and c[:-1] not in given)]
        if orphans:
            raise ValueError(
                f"tree choices must be non-empty and prefix-closed (each choice's parent is a choice "
                f"too); these are not: {orphans[:4]}"
            )
        depth = max(len(c) for c in self.choices)
        if depth > self.heads.config.num_heads:
            raise ValueError(f"tree depth {depth} needs {depth} heads; these heads have {self.heads.config.num_heads}")
        self.topk = [1 + max((c[d] for c in self.choices if len(c) > d), default=0) for d in range(depth)]

    def ordered_choices(self, max_depth: int) -> list[tuple[int, ...]]:
        """The choices down to ``max_depth``, in the order :meth:`propose` places them (by depth, then ranks)."""
        return sorted((c for c in self.choices if len(c) <= max_depth), key=lambda c: (len(c), tuple(c)))

    def node_values(self, max_depth: int) -> list[float] | None:
        """Each node's expected acceptance, in :meth:`ordered_choices` order: the product of the shipped
        per-depth rank accuracies along its path (the rule the machine tree is grown by); None without them."""
        # (every depth past the deepest choice gives the same list: the scheduler's max_depth changes every step)
        max_depth = min(max_depth, max(len(c) for c in self.choices))
        if max_depth in self._values:
            return self._values[max_depth]
        from ..training.calibrate import shipped_accuracies

        acc = shipped_accuracies(self.heads.config)
        out: list[float] | None = None
        if acc is not None:
            out = []
            for c in self.ordered_choices(max_depth):
                v = 1.0
                for d, r in enumerate(c):
                    v *= acc[d][r] if r < len(acc[d]) else 0.0
                out.append(v)
        self._values[max_depth] = out
        return out

    @staticmethod
    def for_target(
        target: TargetModel,
        heads_dir: str | Path,
        model_name: str | None = None,
        proj_format: str | None = None,
        latency: dict[int, float] | None = None,
    ) -> MedusaDrafter:
        """Load the heads in ``heads_dir`` for ``target``, refusing heads trained for another model.

        model_name: the target's registry name, checked against the heads' base model when given.
        proj_format: the native drafting copy of the shared projection, "q8" or "q4"; None = with ``latency``
        (the target's measured curve, as the paid hybrids have it), whichever drafts faster on this machine,
        measured as in decoding and cached (:mod:`.draft_format`); without it q8.
        """
        lm = target.output_projection_weight()
        if lm is None:
            raise ValueError(
                f"the medusa drafter needs the target's output projection; {type(target).__name__} "
                "has none (use prompt-lookup or a callable drafter with this target)"
            )
        h = MedusaHeads.load(
            heads_dir,
            lm,
            model_name,
            target.hidden_size,
            target.vocab_size,
            embed_weight=target.input_embedding_weight(),
        )
        h = h.to(lm.device)
        if h.pack_for_drafting(proj_format or "q8") and proj_format is None and latency and h._native is not None:
            _pack_cheapest(target, h, latency)
        from ..training.calibrate import machine_tree

        return MedusaDrafter(h, machine_tree(target, h, Path(heads_dir), model_name or ""))

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> TokenTree:
        if ctx.hidden is None:
            raise ValueError("the medusa drafter needs the target's hidden state; this target does not provide it")
        root = torch.tensor(ctx.root)
        h = ctx.hidden.to(self.heads.blocks[0][0].linear.weight.dtype)
        # prefix-closed choices always include a depth-1 one, and the engine asks for max_depth >= 1;
        # from_choices places them by (depth, ranks): the first max_nodes - 1 of that order are the tree,
        # so only the heads down to their depth run (a batch's small per-request trees draft cheaply)
        choices = self.ordered_choices(ctx.max_depth)[: max(1, ctx.max_nodes - 1)]
        depth = max(len(c) for c in choices)
        logits = self.heads.draft_logits(h, root, depth)  # (depth, V')
        if ctx.penalty is not None:  # candidates from the penalised distribution the target will verify with
            penalize_draft_(logits, ctx.penalty, self.heads.target_columns())
        ks = self.topk[:depth]
        vm = self.heads.vocab_map
        rows = top_k_rows(logits, max(ks))  # (depth, max k) ranked ids
        # sampled and coupled: the first head's top-k of its log-probabilities plus the target's noise at its
        # position (eagle_tree.coupled_pick). Only the first: a later head's q is a marginal over the paths it does
        # not see, and its perturbed top-k were accepted less often than its top-k (session 38: depth 3 at T 0.7
        # 0.22 -> 0.13)
        pick = coupled_pick(ctx, ks[0], vm)
        first = None if pick is None else pick(logits[:1], [0])[1][0]
        if first is not None and len(first) == ks[0]:  # else a row keeps fewer tokens than the ranks (top-k / top-p)
            rows[0] = first.tolist() + [c for c in rows[0] if c not in first][: max(ks) - ks[0]]
        if vm is not None:
            rows = vm[torch.tensor(rows, device=vm.device)].tolist()
        cands = [row[:k] for row, k in zip(rows, ks)]
        return TokenTree.from_choices(ctx.root, choices, cands).truncated(ctx.max_nodes)


def _pack_cheapest(target: TargetModel, heads: MedusaHeads, latency: dict[int, float]) -> None:
    """Leave ``heads`` packed in the projection format whose one-node propose costs least on this machine (as in
    decoding, after a target forward; cached per machine and format; ``latency``: the target's curve)."""
    from .draft_format import MEDUSA_FORMATS, cheapest
    from .registry import draft_cost_on_curve

    packed = {}  # format -> its native copy: each packed once, the winner kept

    def cost(fmt: str) -> float:
        if heads._native is None or heads._native.proj_format != fmt:
            heads.pack_for_drafting(fmt)
        packed[fmt] = heads._native
        return draft_cost_on_curve(target, MedusaDrafter(heads, ((0,),)), latency)

    heads._native = packed[cheapest(MEDUSA_FORMATS, cost)]
