"""Restore: manifest -> extent buffers (filled in place where possible) -> state.

With ``into``, tensors that already exist with the right dtype and shape on
the CPU receive their bytes directly (no second copy of the state is
allocated); modules, optimizers and other objects with ``state_dict`` /
``load_state_dict`` are restored through those methods, so their own checks
(strict keys, shapes) apply.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch

from casckpt.engine.context import EngineContext
from casckpt.engine.read.reader import Destination, read_chunks
from casckpt.engine.read.targets import check_targets
from casckpt.engine.versions.extents import byte_buffer, can_fill_in_place, tensor_from_extent
from casckpt.errors import RestoreTargetError, TensorNotFoundError
from casckpt.format.dtypes import element_size, torch_dtype
from casckpt.format.manifest import Manifest, TensorEntry
from casckpt.format.state import MAX_DEPTH, decode_state, iter_leaves, iter_values, join_path
from casckpt.types import ProgressCallback

Buffer = torch.Tensor | np.ndarray


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _expand(into: object, path: str, stateful: dict[str, str], depth: int = 0) -> object:
    """Replace every stateful object in ``into`` by its state_dict (tensors stay aliased).

    Paths (and type names) of the stateful objects found are added to ``stateful``.

    Raises:
        RestoreTargetError: ``into`` nests deeper than any stored state (or contains itself).
    """
    if _is_stateful(into):
        stateful[path] = type(into).__name__
        return _expand(into.state_dict(), path, stateful, depth)  # type: ignore[attr-defined]
    if not isinstance(into, (Mapping, list, tuple)):
        return into
    if depth == MAX_DEPTH:
        raise RestoreTargetError(
            f"`into` nests deeper than {MAX_DEPTH} containers at {path!r} (or contains itself); "
            "no stored state is that deep. Pass the part to restore, or into=None. "
            "Nothing was restored."
        )
    if isinstance(into, Mapping):
        return {k: _expand(v, join_path(path, k), stateful, depth + 1) for k, v in into.items()}
    return [_expand(v, join_path(path, i), stateful, depth + 1) for i, v in enumerate(into)]


def _stored_leaves(manifest: Manifest) -> dict[str, TensorEntry | None]:
    """Dotted path -> tensor entry (None for a plain value) of every leaf of the stored state;
    a sharded tensor is described whole (its global shape)."""
    leaves: dict[str, TensorEntry | None] = {path: None for path, _ in iter_values(manifest.root)}
    leaves.update((t.path, whole_entry(t)) for t in manifest.tensors)
    return leaves


def whole_entry(entry: TensorEntry) -> TensorEntry:
    """``entry``, or for a shard the tensor it is part of (its dtype and global shape)."""
    if entry.global_shape is None:
        return entry
    return replace(entry, shape=entry.global_shape, global_shape=None, global_offset=None)


def _owner(path: str, stateful: dict[str, str]) -> str | None:
    """The type name of the innermost stateful object ``path`` lies under."""
    owners = [p for p in stateful if p == "" or path == p or path.startswith(p + ".")]
    return stateful[max(owners, key=len)] if owners else None


def _precheck(manifest: Manifest, expanded: object, stateful: dict[str, str]) -> None:
    """Refuse a mismatched ``into`` before a single byte of it is overwritten."""
    stored = _stored_leaves(manifest)
    version = f"{manifest.run}@{manifest.step}"
    for path, target in iter_leaves(expanded):
        owner = _owner(path, stateful)
        where = f"{path!r}" + (f" (in the {owner})" if owner else "")
        if path not in stored:
            if "" in stateful:
                _refuse_unkeyed(manifest, stored, expanded, stateful[""])
            raise RestoreTargetError(
                f"the stored state of {version} has no {where}; remove those keys from `into`, "
                "or restore with into=None and pick what you need. Nothing was restored."
            )
        entry = stored[path]
        if not isinstance(target, (torch.Tensor, np.ndarray)):
            continue
        if entry is None or tuple(target.shape) != entry.shape:
            what = "a plain value" if entry is None else f"{entry.dtype}{entry.shape}"
            raise RestoreTargetError(
                f"{where}: the target is {target.dtype}{tuple(target.shape)} but {version} "
                f"stores {what}; nothing was restored"
            )
        if owner is None and (
            isinstance(target, torch.Tensor) != (entry.kind == "torch")
            or str(target.dtype).removeprefix("torch.") != _numpy_name(entry)
        ):
            raise RestoreTargetError(
                f"{path!r}: the target is {target.dtype} but the stored tensor is {entry.dtype}; "
                "nothing was restored (restore with into=None to get it as stored)"
            )


def _refuse_unkeyed(manifest: Manifest, stored: Mapping[str, object], expanded: object,
                    owner: str) -> None:
    """``into`` is one module or optimizer but the stored state keeps its state under a key
    (``{"model": ..., "optim": ...}``): refuse it, saying under which key to pass it. Returns
    when the stored state is no dict, so the caller's general message applies."""
    root = manifest.root
    if not isinstance(root, Mapping) or root.get("t") != "dict":
        return
    keys = [str(k["i"]) if isinstance(k, Mapping) else str(k) for k in root.get("k", ())]
    if not keys:
        return
    paths = [path for path, _ in iter_leaves(expanded)]
    fits = [k for k in keys if all(join_path(k, p) in stored for p in paths)]
    version, listed = f"{manifest.run}@{manifest.step}", ", ".join(map(repr, keys))
    if fits:
        key = fits[0]
        name = key if key.isidentifier() else "obj"
        where = (f"keeps it under the key {key!r} (its top level holds {listed}); pass "
                 f'into={{"{key}": {name}}}')
    else:
        where = (f"holds {listed} at its top level, and none of them holds the {owner}'s keys; "
                 f'pass a dict naming the key of each object (into={{"{keys[0]}": ...}})')
    raise RestoreTargetError(
        f"`into` is the {owner} itself, but the stored state of {version} {where}, or restore "
        "with into=None. Nothing was restored."
    )


def _numpy_name(entry: TensorEntry) -> str:
    return entry.dtype if entry.kind == "torch" else str(np.dtype(entry.dtype))


def _extent_buffers(
    manifest: Manifest, wanted: set[int], targets: Mapping[str, object]
) -> tuple[dict[int, Buffer], dict[int, object]]:
    users = Counter(t.extent for t in manifest.tensors)
    buffers: dict[int, Buffer] = {}
    in_place: dict[int, object] = {}
    for t in manifest.tensors:
        if t.extent not in wanted or t.extent in buffers:
            continue
        target = targets.get(t.path)
        if target is not None and can_fill_in_place(t, target, users[t.extent]):
            in_place[t.extent] = target
            buffers[t.extent] = target  # type: ignore[assignment]
        elif t.kind == "numpy":
            buffers[t.extent] = np.empty(manifest.extents[t.extent].nbytes, dtype=np.uint8)
        else:
            buffers[t.extent] = torch.empty(manifest.extents[t.extent].nbytes, dtype=torch.uint8)
    return buffers, in_place


def _fill(
    ctx: EngineContext, manifest: Manifest, buffers: Mapping[int, Buffer],
    progress: ProgressCallback | None, *, heal: bool = True,
) -> None:
    wanted: dict[bytes, list[Destination]] = {}
    owner: dict[bytes, str] = {}
    paths: dict[int, list[str]] = {}
    for t in manifest.tensors:
        paths.setdefault(t.extent, []).append(t.path)
    for index, buffer in buffers.items():
        extent = manifest.extents[index]
        view = byte_buffer(buffer)
        for cid, (start, end) in zip(extent.chunks, extent.spans(), strict=True):
            wanted.setdefault(cid, []).append(view[start:end])
            owner.setdefault(cid, f"{_tensors(paths[index])} of {manifest.run}@{manifest.step}")
    read_chunks(ctx, wanted, lambda cid: owner[cid], progress, heal=heal)


def _tensors(paths: list[str], shown: int = 10) -> str:
    """``tensor 'a'``, or ``tensors 'a', 'b'`` (an extent several tensors share or are packed in)."""
    if len(paths) == 1:
        return f"tensor {paths[0]!r}"
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return "tensors " + ", ".join(repr(p) for p in paths[:shown]) + more


def materialize(
    ctx: EngineContext, manifest: Manifest, *, targets: Mapping[str, object] | None = None,
    map_location: Any = None, progress: ProgressCallback | None = None, heal: bool = True,
    skip: frozenset[int] = frozenset(),
) -> object:
    """Read every tensor of ``manifest`` and rebuild the state. ``heal=False`` leaves the
    damaged shards a read meets to ``repair`` (a restore drill changes nothing it finds).

    ``skip``: extents (indices into ``manifest.extents``) not read: their tensors are zeros
    of their shape, for a caller that never uses their bytes (a copy across keys that knows
    their chunks' ids at the destination already, :mod:`casckpt.engine.copying.rekeymap`)."""
    buffers, in_place = _extent_buffers(manifest, set(range(len(manifest.extents))), targets or {})
    _fill(ctx, manifest, {i: b for i, b in buffers.items() if i not in skip}, progress, heal=heal)
    for i in skip:
        buffers[i][:] = 0  # never uninitialised memory, even unread
    if map_location is not None:
        buffers = {
            i: b.to(map_location) if isinstance(b, torch.Tensor) and i not in in_place else b
            for i, b in buffers.items()
        }

    def tensor(i: int, path: str) -> object:
        entry = manifest.tensors[i]
        if entry.extent in in_place:
            return in_place[entry.extent]
        return _tensor(manifest, entry, buffers[entry.extent])

    def sharded(indices: list[int], path: str) -> object:
        return _assemble([manifest.tensors[i] for i in indices], buffers)

    return decode_state(manifest.root, tensor, sharded)


def _tensor(manifest: Manifest, entry: TensorEntry, buffer: Buffer) -> Buffer:
    """The tensor ``entry`` over its filled extent buffer; from a packed extent, over a copy of its
    own bytes (not a view sharing its neighbours' storage)."""
    if not manifest.extents[entry.extent].packed:
        return tensor_from_extent(entry, buffer)
    end = entry.offset + entry.numel * element_size(entry.kind, entry.dtype)
    part = buffer[entry.offset : end]
    own = part.clone() if isinstance(part, torch.Tensor) else part.copy()
    return tensor_from_extent(replace(entry, offset=0), own)


def _assemble(shards: list[TensorEntry], buffers: Mapping[int, Buffer]) -> torch.Tensor:
    """The whole tensor a list of shards covers, copied together (a box at a time)."""
    first = shards[0]
    shape = first.global_shape or first.shape
    device = next((b.device for t in shards if isinstance(b := buffers[t.extent], torch.Tensor)), None)
    whole = torch.zeros(shape, dtype=torch_dtype(first.dtype), device=device)  # never uninitialised
    for t in shards:
        box = whole
        for dim, (start, size) in enumerate(zip(t.global_offset or (), t.shape, strict=True)):
            box = box.narrow(dim, start, size)
        box.copy_(cast(torch.Tensor, tensor_from_extent(t, buffers[t.extent])))
    return whole


def load_tensor(
    ctx: EngineContext, manifest: Manifest, path: str, map_location: Any = None
) -> torch.Tensor | np.ndarray:
    """Read one tensor, fetching only its own chunks (of every shard, for a sharded one)."""
    entries = _find_tensor(manifest, path)
    buffers, _ = _extent_buffers(manifest, {t.extent for t in entries}, {})
    _fill(ctx, manifest, buffers, None)
    first = entries[0]
    out = _assemble(entries, buffers) if first.is_shard else \
        _tensor(manifest, first, buffers[first.extent])
    if isinstance(out, torch.Tensor) and map_location is not None:
        return out.to(map_location)
    return out


def _find_tensor(manifest: Manifest, path: str) -> list[TensorEntry]:
    found = [t for t in manifest.tensors if t.path == path]
    if found:
        return found
    near = difflib.get_close_matches(path, sorted({t.path for t in manifest.tensors}), n=3)
    suggestion = f" Did you mean: {', '.join(near)}?" if near else ""
    raise TensorNotFoundError(
        f"version {manifest.run}@{manifest.step} has no tensor at {path!r}.{suggestion}"
    )


def restore_into(
    ctx: EngineContext, manifest: Manifest, into: object, *, map_location: Any = None,
    progress: ProgressCallback | None = None,
) -> object:
    """Restore into existing objects (see module docstring); returns the updated ``into``."""
    stateful: dict[str, str] = {}
    expanded = _expand(into, "", stateful)
    targets = {p: v for p, v in iter_leaves(expanded) if isinstance(v, (torch.Tensor, np.ndarray))}
    check_targets(manifest, targets)
    _precheck(manifest, expanded, stateful)
    state = materialize(ctx, manifest, targets=targets, map_location=map_location, progress=progress)
    return _merge(into, state, "")


def _merge(into: object, stored: object, path: str) -> object:
    if _is_stateful(into):
        try:
            into.load_state_dict(stored)  # type: ignore[attr-defined]
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise RestoreTargetError(
                f"{type(into).__name__} at {path or '<root>'!r} refused the stored state: {exc}"
            ) from exc
        return into
    if isinstance(into, dict):
        return _merge_dict(into, stored, path)
    if isinstance(into, (list, tuple)):
        if not isinstance(stored, (list, tuple)) or len(stored) != len(into):
            raise RestoreTargetError(
                f"{path or '<root>'!r} holds a sequence of {len(into)} items but the stored state "
                f"has {type(stored).__name__}; pass a matching structure or into=None"
            )
        merged = [_merge(a, b, join_path(path, i)) for i, (a, b) in enumerate(zip(into, stored, strict=True))]
        if isinstance(into, list):
            into[:] = merged
            return into
        return tuple(merged)
    if isinstance(into, torch.Tensor):
        return _merge_tensor(into, stored, path)
    if isinstance(into, np.ndarray) and isinstance(stored, np.ndarray):
        if stored is not into:
            if stored.shape != into.shape or stored.dtype != into.dtype:
                raise RestoreTargetError(f"array at {path!r}: stored {stored.dtype}{stored.shape}, "
                                         f"target {into.dtype}{into.shape}")
            np.copyto(into, stored)
        return into
    return stored


def _merge_dict(into: dict[Any, Any], stored: object, path: str) -> object:
    if not isinstance(stored, dict):
        raise RestoreTargetError(
            f"{path or '<root>'!r} is a dict in `into` but the stored state has "
            f"{type(stored).__name__}; pass a matching structure or into=None"
        )
    missing = [k for k in into if k not in stored]
    if missing:
        raise RestoreTargetError(
            f"the stored state has no {', '.join(repr(join_path(path, k)) for k in missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; remove those keys from `into` or restore "
            "another version"
        )
    for key, value in stored.items():
        into[key] = _merge(into[key], value, join_path(path, key)) if key in into else value
    return into


def _merge_tensor(into: torch.Tensor, stored: object, path: str) -> torch.Tensor:
    if stored is into:
        return into
    if not isinstance(stored, torch.Tensor) or stored.shape != into.shape or stored.dtype != into.dtype:
        desc = (f"{stored.dtype}{tuple(stored.shape)}" if isinstance(stored, torch.Tensor)
                else type(stored).__name__)
        raise RestoreTargetError(
            f"tensor at {path!r}: stored {desc}, target {into.dtype}{tuple(into.shape)}; "
            "restore with into=None to get the stored tensor as is"
        )
    with torch.no_grad():
        into.copy_(stored)
    return into


def read_ranges(ctx: EngineContext, manifest: Manifest, requests: Sequence[tuple[int, int, int]],
                progress: ProgressCallback | None = None,
                into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Bytes ``[start, end)`` of extent ``index`` for each ``(index, start, end)``, verified.

    Only the chunks holding the requested bytes are read (by range from their
    packs); a chunk cut by a request's edge is read whole, verified, then
    trimmed. Returns one uint8 tensor per request: ``into[i]`` itself when
    given (a contiguous CPU tensor of that many bytes, filled in place).
    """
    given = into if into is not None else [None] * len(requests)
    outs = [t.view(-1).view(torch.uint8) if t is not None else torch.empty(end - start, dtype=torch.uint8)
            for t, (_, start, end) in zip(given, requests, strict=True)]
    wanted: dict[bytes, list[Destination]] = {}
    whole: dict[bytes, memoryview] = {}
    trims: list[tuple[memoryview, int, int, memoryview]] = []
    names: dict[bytes, str] = {}
    paths = {t.extent: t.path for t in manifest.tensors}
    for (index, start, end), out in zip(requests, outs, strict=True):
        extent, view = manifest.extents[index], byte_buffer(out)
        spans = extent.spans()
        for i in extent.covering(start, end):
            cid, (lo, hi) = extent.chunks[i], spans[i]
            names.setdefault(cid, f"tensor {paths.get(index)!r} of {manifest.run}@{manifest.step}")
            if start <= lo and hi <= end:
                wanted.setdefault(cid, []).append(view[lo - start : hi - start])
                continue
            if cid not in whole:
                whole[cid] = memoryview(bytearray(hi - lo))
                wanted.setdefault(cid, []).append(whole[cid])
            a, b = max(lo, start), min(hi, end)
            trims.append((whole[cid], a - lo, b - lo, view[a - start : b - start]))
    read_chunks(ctx, wanted, lambda cid: names[cid], progress)
    for chunk, a, b, dst in trims:
        dst[:] = chunk[a:b]
    return outs

