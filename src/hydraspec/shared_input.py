"""Projections of one input in one kernel call: q/k/v of an attention block, gate/up of a gated MLP.

A decoder layer of the stock transformers classes calls ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)`` one
after another on the same tensor ``h``. :func:`fuse_siblings` joins such sibling weights into one weight
(when their formats allow it, e.g. :meth:`hydraspec.cpu.gguf.GGUFLinear.concat`) and puts a
:class:`Projection` in each sibling's place: the first sibling to see ``h`` runs the joined weight once,
the others take their columns of that result. A sibling called on any other tensor object computes anew,
so the result does not depend on the order or the number of calls (the layer must not change ``h`` in place
between the calls; inference tensors keep no version counter to check, and no stock layer does): each output is exactly the one its own weight
gives (the joined kernel computes every output row as the separate one does). On a CPU a small weight's
call costs more in fixed overhead and short memory streams than in reading it, so fewer, larger calls
make a decode step faster (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["SharedInput", "Projection", "SIBLINGS", "fuse_siblings"]

# sibling projections that the stock transformers decoder layers apply to one input, in call order
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput(nn.Module):
    """One joined weight and the last input it saw: its output is kept until each of the ``parts``
    consumers has taken its columns once (so nothing lingers between layers)."""

    def __init__(self, joined: nn.Module, sizes: list[int]):
        super().__init__()
        self.joined = joined
        self.bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        self._x, self._y, self._left = None, None, 0

    def columns(self, x: torch.Tensor, part: int) -> torch.Tensor:
        # plain attributes set with object.__setattr__: nn.Module's own costs microseconds a call
        if self._x is not x or self._left <= 0:
            object.__setattr__(self, "_y", self.joined(x))
            object.__setattr__(self, "_x", x)
            object.__setattr__(self, "_left", len(self.bounds))
        lo, hi = self.bounds[part]
        y = self._y[..., lo:hi]
        left = self._left - 1
        object.__setattr__(self, "_left", left)
        if left == 0:
            object.__setattr__(self, "_x", None)
            object.__setattr__(self, "_y", None)
        return y


class Projection(nn.Module):
    """Stands in for one sibling projection: part ``part`` of a :class:`SharedInput` (registered as a
    submodule of the first part only, so the joined weight is counted once)."""

    def __init__(self, shared: SharedInput, part: int):
        super().__init__()
        if part == 0:
            self.shared = shared
        else:
            object.__setattr__(self, "shared", shared)
        self.part = part
        lo, hi = shared.bounds[part]
        self.in_features, self.out_features = shared.joined.in_features, hi - lo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.columns(x, self.part)

    def extra_repr(self) -> str:
        lo, hi = self.shared.bounds[self.part]
        return f"columns {lo}:{hi} of a joined weight"


def fuse_siblings(model: nn.Module, can_join, join, after_each=None) -> int:
    """Join each run of consecutive :data:`SIBLINGS` in ``model`` for which ``can_join(modules)`` holds
    (``join(modules)`` builds the joined weight); the longest joinable prefix of a group is taken, so a
    q/k/v whose v differs in format becomes a joined q/k and a separate v. ``after_each()`` runs once the
    separate weights of a group are let go (e.g. to hand their memory back). Returns how many joined weights."""
    done = 0
    parents = [m for m in model.modules() if any(isinstance(getattr(m, g[0], None), nn.Module) for g in SIBLINGS)]
    for parent in parents:  # (a list of all modules would keep the separate weights alive to the end)
        for names in SIBLINGS:
            mods = [getattr(parent, n, None) for n in names]
            for end in range(len(names), 1, -1):
                if all(isinstance(m, nn.Module) for m in mods[:end]) and can_join(mods[:end]):
                    shared = SharedInput(join(mods[:end]), [m.out_features for m in mods[:end]])
                    for i, n in enumerate(names[:end]):
                        setattr(parent, n, Projection(shared, i))
                    done += 1
                    del mods
                    if after_each is not None:
                        after_each()
                    break
    return done
