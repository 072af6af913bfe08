"""Checks on the tensors of a restore's ``into``, made before any of them is written.

A target must be able to hold the stored values: plain dense memory (not
meta, sparse, nested or quantized; not an inference tensor outside inference
mode; not a read-only array), no element sharing memory with another
(``expand()`` makes stride-0 views), and no memory shared with another target
unless the stored tensors share it the same way (tied weights restored into
tied weights). Two targets viewing one memory in any other way would each be
written with different bytes, leaving one of them wrong — or, filled in place
concurrently, failing chunk verification and blaming a healthy pack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from casckpt.engine.versions.extents import contiguous_strides
from casckpt.errors import RestoreTargetError
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import Manifest, TensorEntry

Target = torch.Tensor | np.ndarray

_TOO_HARD: type[Exception] = getattr(np, "exceptions", np).TooHardError  # numpy < 1.25: np.TooHardError
_OVERLAP_WORK = 1 << 16
"""Effort np.shares_memory may spend on one pair of strided footprints; past it they count as overlapping."""


@dataclass(frozen=True, slots=True)
class _Footprint:
    """Where a target's bytes are: its first element's address, byte strides, element size."""

    path: str
    device: str
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def bounds(self) -> tuple[int, int]:
        """``[low, high)``: the byte addresses between which every element lies."""
        low = sum(min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides, strict=True))
        high = sum(max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides, strict=True))
        return self.address + low, self.address + high + self.itemsize


def check_targets(manifest: Manifest, targets: Mapping[str, Target]) -> None:
    """Refuse targets that cannot receive the stored tensors faithfully (see module docstring).

    ``targets`` maps each tensor path of ``into`` to its tensor or array. Called
    before their shapes are compared with the stored ones (a nested tensor has none).

    Raises:
        RestoreTargetError: naming the target (or the two targets) and what to pass instead.
    """
    version = f"{manifest.run}@{manifest.step}"
    footprints = []
    for path, target in targets.items():
        _check_writable(path, target)
        footprint = _footprint(path, target)
        if footprint is None:
            continue
        if _self_overlapping(footprint):
            raise RestoreTargetError(
                f"tensor {path!r} of `into` has elements that share memory (shape "
                f"{footprint.shape}, byte strides {footprint.strides}, as expand() makes), so it cannot "
                f"hold the distinct values {version} stores; pass a tensor with memory of its own "
                "(.clone()), or restore with into=None. Nothing was restored."
            )
        footprints.append(footprint)
    entries = {t.path: t for t in manifest.tensors if not t.is_shard}
    for a, b in _intersecting(footprints):
        if _as_stored(manifest, entries.get(a.path), a, entries.get(b.path), b):
            continue
        if _share_memory(a, b):
            raise RestoreTargetError(
                f"tensors {a.path!r} and {b.path!r} of `into` share memory, but {version} does "
                "not store them as views of one tensor laid out that way: restoring both would "
                "leave one of them wrong. Pass tensors with memory of their own (.clone() one of "
                "them), or restore with into=None. Nothing was restored."
            )


def _check_writable(path: str, target: Target) -> None:
    problem = None
    if isinstance(target, np.ndarray):
        if not target.flags.writeable:
            problem = "is a read-only array; pass a writable one (a.copy())"
    elif target.is_nested or target.layout != torch.strided:
        problem = (f"is a {'nested' if target.is_nested else str(target.layout)} tensor; pass "
                   "a dense tensor")
    elif target.is_quantized:
        problem = f"is quantized ({target.dtype}); pass a dense tensor of the stored dtype"
    elif target.device.type == "meta":
        problem = ("is on the meta device and has no memory to restore into; materialise it "
                   "first (e.g. module.to_empty(device='cpu'))")
    elif target.is_inference() and not torch.is_inference_mode_enabled():
        problem = ("was made in inference mode and cannot be written outside it; restore "
                   "inside torch.inference_mode(), or pass a normal tensor")
    if problem is not None:
        raise RestoreTargetError(
            f"{path!r} of `into` {problem}, or restore with into=None. Nothing was restored."
        )


def _footprint(path: str, target: Target) -> _Footprint | None:
    """The target's footprint in bytes, or None when it has no elements (nothing is written)."""
    if isinstance(target, np.ndarray):
        if target.size == 0:
            return None
        address = int(target.__array_interface__["data"][0])
        return _Footprint(path, "cpu", address, tuple(target.shape), tuple(target.strides),
                       target.itemsize)
    if target.numel() == 0:
        return None
    itemsize = target.element_size()
    return _Footprint(path, str(target.device), int(target.data_ptr()), tuple(target.shape),
                   tuple(s * itemsize for s in target.stride()), itemsize)


def _self_overlapping(footprint: _Footprint) -> bool:
    """Whether two elements may share a byte: each dimension's stride, smallest first, must
    step over everything the smaller ones span. (Sufficient for every footprint views of dense
    memory have; a hand-made as_strided interleaving that passes no such test is refused.)"""
    span = footprint.itemsize
    dims = sorted((abs(s), n) for n, s in zip(footprint.shape, footprint.strides, strict=True) if n > 1)
    for stride, size in dims:
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def _intersecting(footprints: Sequence[_Footprint]) -> list[tuple[_Footprint, _Footprint]]:
    """Pairs of footprints on one device whose byte bounds intersect (a sweep over sorted bounds,
    so thousands of disjoint targets cost a sort, not a comparison of every pair)."""
    pairs: list[tuple[_Footprint, _Footprint]] = []
    ordered = sorted(footprints, key=lambda footprint: (footprint.device, footprint.bounds))
    open_: list[_Footprint] = []
    for footprint in ordered:
        low = footprint.bounds[0]
        open_ = [o for o in open_ if o.device == footprint.device and o.bounds[1] > low]
        pairs.extend((o, footprint) for o in open_)
        open_.append(footprint)
    return pairs


def _as_stored(manifest: Manifest, ea: TensorEntry | None, a: _Footprint,
               eb: TensorEntry | None, b: _Footprint) -> bool:
    """Whether two targets map the stored bytes of their tensors to memory by one shift: then
    any byte they share receives the same stored byte from both (tied weights, views)."""
    if ea is None or eb is None:
        return False
    if ea.digest is not None or eb.digest is not None:  # packed: equal when their own bytes are
        return ea.digest == eb.digest and _matches(ea, a) and _matches(eb, b) and a.address == b.address
    same_bytes = ea.extent == eb.extent or manifest.extents[ea.extent] == manifest.extents[eb.extent]
    return same_bytes and _matches(ea, a) and _matches(eb, b) and \
        a.address - b.address == ea.offset - eb.offset


def _matches(entry: TensorEntry, footprint: _Footprint) -> bool:
    """Whether ``footprint`` lays elements out as ``entry`` does in its extent (dims of one element aside)."""
    itemsize = element_size(entry.kind, entry.dtype)
    strides = entry.stride if entry.stride is not None else contiguous_strides(entry.shape)
    return itemsize == footprint.itemsize and entry.shape == footprint.shape and all(
        n == 1 or s * itemsize == t for n, s, t in zip(entry.shape, strides, footprint.strides, strict=True)
    )


def _share_memory(a: _Footprint, b: _Footprint) -> bool:
    """Whether two strided footprints share a byte, solved exactly by numpy from their addresses
    and strides alone, over a placeholder that is never read."""
    origin = min(a.bounds[0], b.bounds[0])
    span = max(a.bounds[1], b.bounds[1]) - origin
    placeholder = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (span,), (1,))
    views = [
        np.lib.stride_tricks.as_strided(
            placeholder[x.address - origin:], (*x.shape, x.itemsize), (*x.strides, 1))
        for x in (a, b)
    ]
    try:
        # numpy documents a positive max_work (candidate solutions to try); its stubs allow 0 / -1 only
        return bool(np.shares_memory(views[0], views[1], max_work=_OVERLAP_WORK))  # type: ignore[arg-type]
    except _TOO_HARD:
        return True

