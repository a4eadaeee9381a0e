"""A check shared by the transformers-adapter and the own-runtime tests: decoding through trees past a window."""

from __future__ import annotations

from collections.abc import Callable

import torch

from treedraft.tree import TokenTree, full_attention_mask, tree_positions


def walk_trees(target, cache, seq: list[int], ref: torch.Tensor, vocab: int, close: Callable) -> None:
    """From ``cache`` (holding seq's first ``cache.length`` tokens) to the end of ``seq``, one tree a step: the
    second branch is seq's continuation, the first a decoy. The true path's logits must equal ``ref``'s rows
    (``close(a, b, what)``); the path is kept, so the cache ends holding all of seq."""
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
        close(lt[0, path], ref[n : n + len(path)], f"tree at {n} vs transformers")
        cache.keep(start, path)
        n += len(path)
    assert cache.length == len(seq)
