"""A process-wide count of changes to model structure: the fused decoder's O(1) validity check.

The fused decoder (:mod:`.fused`) is built from a model's modules and weights and must be rebuilt when
one of them is replaced. Checking every slot it depends on costs ~0.15 ms per decode step on a CPU (the
native forward has just evicted those ~600 Python objects from the caches: ~5% of a 3 ms step), so the
full check runs only after something could have changed: PyTorch's global registration hooks count every
submodule, parameter and buffer assignment (``setattr``, ``register_*``) in the process, and the
attributes the decoder reads that are not registered (``NativeLinear.packed``,
``Attention.exact_attention``, listed in their ``WATCHED`` through :class:`WatchedAttrs`) and ``Transformer._apply`` (``.to()`` / ``.half()`` replace buffers in
place of the registration path) count themselves. Writing a module's private ``_modules`` / ``_parameters``
/ ``_buffers`` dicts directly is not seen: replace modules and weights through attribute assignment.
"""

from __future__ import annotations

from torch.nn.modules import module as _module

_count = 0


def bump(*_args) -> None:
    """Record a change (a registration hook: returns None, so the registered value is kept)."""
    global _count
    _count += 1


def count() -> int:
    """Changes recorded so far in this process."""
    return _count


class WatchedAttrs:
    """Mixin (before ``nn.Module``) for a module whose plain attributes named in ``WATCHED`` feed the fused
    decoder: assigning one records a change, as the registration hooks do for modules and tensors."""

    WATCHED: tuple[str, ...] = ()

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in self.WATCHED:
            bump()


_HOOKS = (
    _module.register_module_module_registration_hook(bump),
    _module.register_module_parameter_registration_hook(bump),
    _module.register_module_buffer_registration_hook(bump),
)
