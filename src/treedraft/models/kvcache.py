"""The KV cache of the Llama runtime and the :class:`Segment` that names one request's rows in a packed forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class KVCache:
    """Pre-allocated per-layer key/value buffers: ``(B, n_kv, max_len, head_dim)``.

    ``length`` counts committed positions. :meth:`Transformer.forward` writes new
    entries at slots ``[start, start + T)``; :meth:`keep` compacts a chosen subset
    of those slots (the accepted tree path) down to ``start`` and commits them.
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
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
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

    def keep(self, start: int, indices: Tensor | list[int]) -> None:
        """Keep slots ``start + indices`` (in order) at ``start ...``; set length accordingly."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.k[0].device)
        n = int(idx.numel())
        contiguous = bool(n == 0 or torch.equal(idx, torch.arange(n, device=idx.device)))
        if not contiguous:
            src = idx + start
            for buf in (*self.k, *self.v):
                buf[:, :, start : start + n] = buf.index_select(2, src)
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
