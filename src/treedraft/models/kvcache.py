"""The KV cache of the Llama runtime and the :class:`Segment` that names one request's rows in a packed forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class KVCache:
    """Pre-allocated per-layer key/value buffers: ``(B, n_kv, max_len, head_dim)``.

    ``length`` counts committed positions. :meth:`Transformer.forward` writes new
    entries at slots ``[start, start + T)``; :meth:`keep` compacts a chosen subset
    of those slots (the accepted tree path) down to ``start`` and commits them.
    All layers' keys and values are views of one ``(2 * layers, B, n_kv, max_len, head_dim)``
    tensor, so a compaction is one gather and one copy for the whole cache, not two per layer.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.kv = torch.zeros((2 * num_layers, batch, num_kv_heads, max_len, head_dim), dtype=dtype, device=device)
        self.k = list(self.kv[:num_layers].unbind(0))  # contiguous (B, n_kv, max_len, hd) views
        self.v = list(self.kv[num_layers:].unbind(0))
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v ``(B, n_kv, T, hd)`` at ``start``; return views of slots ``[0, start+T)``."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to {end} > max_len {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def keep(self, start: int, indices: Tensor | Sequence[int]) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; set length accordingly."""
        if isinstance(indices, Tensor):
            indices = indices.tolist()
        n = len(indices)
        if isinstance(indices, range) and indices.start == 0 and indices.step == 1:
            moved = []  # a prefill chunk: already in place
        else:  # an accepted path often starts with 0, 1, ...: those slots stay
            moved = [i for i, j in enumerate(indices) if i != j]
        if moved:
            src = torch.tensor([start + indices[i] for i in moved], dtype=torch.long, device=self.kv.device)
            if len(moved) == moved[-1] - moved[0] + 1:  # one run of slots: a slice assignment
                self.kv[:, :, :, start + moved[0] : start + moved[-1] + 1] = self.kv.index_select(3, src)
            else:
                dst = torch.tensor([start + i for i in moved], dtype=torch.long, device=self.kv.device)
                self.kv.index_copy_(3, dst, self.kv.index_select(3, src))
        self.length = start + n

    def truncate(self, length: int) -> None:
        """Forget everything at or after ``length``."""
        self.length = min(self.length, length)


@dataclass(frozen=True)
class Segment:
    """One request's block of rows in a packed forward (:meth:`Transformer.forward_packed`).

    cache: this request's own KV cache (batch dim 1); start: slot where its new keys/values are written
    (usually ``cache.length``); rows: its number of rows (tokens) in the packed input; mask: bool
    (rows, start + rows), True = may attend, or None = causal over [0, start + rows).
    """

    cache: KVCache
    start: int
    rows: int
    mask: Tensor | None = None
