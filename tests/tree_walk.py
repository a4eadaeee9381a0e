"""Checks shared by the transformers-adapter and the own-runtime tests: transformers' own logits as the reference,
the comparison against them, and decoding through trees past a window."""

from __future__ import annotations

import torch

from treedraft.tree import TokenTree, full_attention_mask, tree_positions

ATOL = 2e-4  # float32 logits of the tiny models against transformers'


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' own no-cache forward (its own causal / sliding masks) of ``ids``: logits (T, V) float32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def assert_logits_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """``a`` and ``b`` within :data:`ATOL` everywhere; the message names ``what`` and the largest difference."""
    err = (a - b).abs().max().item()
    assert err < ATOL, f"{what}: max abs diff {err:.2e}"


def walk_trees(target, cache, seq: list[int], ref: torch.Tensor, vocab: int) -> None:
    """From ``cache`` (holding seq's first ``cache.length`` tokens) to the end of ``seq``, one tree a step: the
    second branch is seq's continuation, the first a decoy. The true path's logits must equal ``ref``'s rows
    (:func:`assert_logits_close`); the path is kept, so the cache ends holding all of seq."""
    n = cache.length
    while n < len(seq):
        true = seq[n : n + 4]
        decoy = [(t + 1) % vocab for t in true[1:]]
        tree = TokenTree.from_sequences(true[0], [decoy, true[1:]])
        start = cache.length
        lt, _ = target.forward(
            torch.tensor([tree.tokens]), tree_positions(tree, start), cache, start, full_attention_mask(tree, start)
        )
        path = tree.path_to(len(tree) - 1)
        assert_logits_close(lt[0, path], ref[n : n + len(path)], f"tree at {n} vs transformers")
        cache.keep(start, path)
        n += len(path)
    assert cache.length == len(seq)
