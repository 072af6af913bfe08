"""States and the changes a training loop (or a careless caller) makes to them between two
commits: what the memo tests of extents and commits mutate."""

from __future__ import annotations

from typing import Any

import torch

MUTATIONS = 15
"""How many kinds of change :func:`mutate` knows (``op`` is taken modulo this)."""


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, Any] = {f"w{i}": torch.randn(3 + i % 5, generator=g) for i in range(40)}
    model["big"] = torch.randn(5000, generator=g)  # over the pack limit: an extent of its own
    model["grid"] = torch.randn(6, 4, generator=g)
    model["z"] = torch.randn(4, dtype=torch.complex64, generator=g)
    base = torch.randn(64, generator=g)
    model["head"], model["tail"] = base[:16], base[16:40]  # views of one storage: a shared extent
    optim = {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(float(seed))}}, "lr": 0.1}
    return {"model": model, "optim": optim, "step": seed}


def mutate(state: dict[str, Any], op: int, pick: int) -> None:
    """One change a training loop (or a careless caller) can make between two commits."""
    model = state["model"]
    keys = list(model)
    key, other = keys[pick % len(keys)], keys[(pick * 7 + 3) % len(keys)]
    t = model[key]
    if op == 0:
        t.add_(1)  # in place: bytes only
    elif op == 1:
        model[key] = t.clone()  # a new tensor, a new storage
    elif op == 2:
        t.data = torch.zeros(t.numel() + 1, dtype=t.dtype)  # same object, new storage and shape
    elif op == 3 and t.dtype == model[other].dtype and t.numel():
        t.set_(model[other].untyped_storage(), 0, (1,), (1,))  # same object, another leaf's storage
    elif op == 4 and t.dtype == torch.float32 and not t.is_neg() and not t.is_conj():
        model[key] = t.view(torch.int32)  # same bytes, another dtype
    elif op == 5 and t.numel() % 2 == 0 and t.dim() == 1:
        model[key] = t.reshape(2, -1)  # same bytes, another shape
    elif op == 6 and t.dim() == 2:
        model[key] = t.t()  # another stride: not contiguous
    elif op == 7 and t.is_complex():
        model[key] = t.conj()  # the conjugate bit flipped, no byte moved
    elif op == 8 and t.dtype == torch.float32:
        model[key] = torch._neg_view(t)  # the negative bit flipped
    elif op == 9:
        model[f"new{pick}"] = torch.full((pick % 7 + 1,), float(pick))
    elif op == 10 and len(keys) > 3:
        del model[key]
    elif op == 11:
        model[key] = model.pop(key)  # reordered: moved to the end
    elif op == 12 and model[other].numel() > 2:
        model[key] = model[other][1:]  # a view of another leaf's storage
    elif op == 13 and t._base is None and t.untyped_storage().resizable():
        t.resize_(t.numel() + 2)  # same object, resized in place
    else:
        state["step"] += 1  # a plain value: the leaves are as they were
