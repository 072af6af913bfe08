"""Cutting a state into the nodes of :mod:`casckpt.format.merkle`, reusing what the
previous commit of a run made for unchanged subtrees (:class:`TreeMemo`).

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from casckpt.errors import UnsupportedStateError
from casckpt.format.chunks import ChunkIds, chunk_id
from casckpt.format.merkle import (
    INLINE_MAX,
    MAX_NODE,
    PART_AVERAGE,
    PART_MAX_BYTES,
    PART_MAX_ITEMS,
    PART_MIN_ITEMS,
    SPLIT_ITEMS,
    bloom,
    key_text,
    node_dumps,
    part_ends_after,
)
from casckpt.format.state import Node


@dataclass(slots=True)
class Tree:
    """A state cut into nodes: what a commit stores."""

    root: bytes
    tensors: int
    nbytes: int
    nodes: dict[bytes, bytes]  # every node of the tree, id -> JSON bytes
    shared_extents: list[int]  # the manifest's extents several tensors share, in the document's order
    groups: tuple[tuple[str, int, int], ...] | None = None  # the document's summary (treemanifest)
    values: tuple[tuple[str, Any], ...] | None = None


def extent_json(nbytes: int, chunk_size: int, chunks: Sequence[bytes], phase: int) -> dict[str, Any]:
    """An extent as JSON (the same fields as in manifests of versions 1 and 2)."""
    doc: dict[str, Any] = {"nbytes": nbytes, "chunk_size": chunk_size, "chunks": [c.hex() for c in chunks]}
    if phase:
        doc["phase"] = phase
    return doc


@dataclass(slots=True)
class _Sized:
    value: Any
    tensors: int
    nbytes: int
    size: int  # estimated JSON bytes


@dataclass(slots=True)
class _Made:
    """What encoding one container (or part, or index node) made: its value, the nodes of
    its subtree, and the child values its signature names by id (kept alive with it, so
    no other object can take their ids while the memo holds the signature)."""

    sized: _Sized
    nodes: list[tuple[bytes, bytes]]
    children: list[Any]


class TreeMemo:
    """What one commit's encoding made, for the next commit of the run to reuse: tensor
    entries by what they describe, and containers by a signature of their keys and of
    the *identity* of their child values (values the memo made, so an unchanged subtree
    is recognised in one tuple comparison per container, without encoding it again). A
    memo holds the last commit's values only."""

    def __init__(self, previous: TreeMemo | None = None) -> None:
        self._old_entries = previous._entries if previous is not None else {}
        self._old_made = previous._made if previous is not None else {}
        self._entries: dict[Any, tuple[Any, Any, _Sized]] = {}  # by id of the tensor, and by value
        self._made: dict[tuple[Any, ...], _Made] = {}
        self._old_extents = previous._extents if previous is not None else {}
        self._extents: dict[Any, Any] = {}
        # the tensors of the tree this memo's encoding made, when every one of them went through
        # entry() (set by the encoder's caller; -1: unknown), and the previous memo's
        self.tensors = -1
        self.parent_tensors = previous.tensors if previous is not None else -1

    def parent_entries(self) -> dict[Any, tuple[Any, Any, _Sized]]:
        """The ``(tensor, extent, value)`` of the previous commit's tree by the tensor's path
        (every tensor of it when :attr:`parent_tensors` is not -1)."""
        return {found[0].path: found for found in self._old_entries.values()}

    def extents(self, extents: Sequence[Any]) -> list[Any]:
        """``extents`` (hashable values), each equal to one the previous commit's encoding met
        replaced by that object: a tensor's entry found by identity then checks its extent by
        identity too (one comparison per extent, not one per tensor)."""
        out = []
        for extent in extents:
            found = self._old_extents.get(extent, extent)
            self._extents[found] = found
            out.append(found)
        return out

    def entry(self, tensor: Any, extent: Any, make: Callable[[Any, Any], tuple[dict[str, Any], int]]
              ) -> _Sized:
        """A tensor's value in its parent, ``make(tensor, extent)`` (its entry JSON and logical
        bytes) being a function of ``tensor`` and ``extent`` (hashable values): found by the
        identity of ``tensor`` (a pack's entries come back as the same objects), else by
        value; the same object for the same entry."""
        found = self._old_entries.get(id(tensor))
        if found is None or found[0] is not tensor or not (found[1] is extent or found[1] == extent):
            found = self._old_entries.get((tensor, extent))
            if found is None:
                found = (tensor, extent, tensor_value(*make(tensor, extent)))
            self._entries[(tensor, extent)] = found
        self._entries[id(tensor)] = found
        return found[2]

    def made(self, sig: tuple[Any, ...]) -> _Made | None:
        """What the previous commit made for ``sig`` (kept for the next commit too)."""
        found = self._made.get(sig) or self._old_made.get(sig)
        if found is not None:
            self._made[sig] = found
        return found

    def keep(self, sig: tuple[Any, ...], made: _Made) -> None:
        self._made[sig] = made


def tensor_value(entry: dict[str, Any], nbytes: int) -> _Sized:
    """A tensor's value in its parent node (:class:`TreeEncoder`)."""
    return _Sized({"t": "tensor", "e": entry}, 1, nbytes, 160 + 67 * len(entry["blob"].get("chunks", ())))


def _key_sig(keys: Sequence[Any] | None) -> tuple[Any, ...] | None:
    """Dict keys as a hashable signature (``"1"`` and ``1`` told apart)."""
    if keys is None:
        return None
    return tuple(k if type(k) is str else (k["i"],) for k in keys)


class TreeEncoder:
    """Cuts a manifest's state into nodes (see the module docstring), reusing what a
    :class:`TreeMemo` of the previous commit made for unchanged subtrees."""

    def __init__(self, tensor: Callable[[int, TreeMemo], _Sized], memo: TreeMemo | None = None,
                 ids: ChunkIds = chunk_id) -> None:
        # tensor(i, memo) -> the value of the i-th tensor (tensor_value, or memo.entry);
        # ids(raw) -> a node's id (the store's chunk ids: keyed in an encrypted store)
        self._tensor = tensor
        self._ids = ids
        self.memo = memo if memo is not None else TreeMemo()
        self.nodes: dict[bytes, bytes] = {}
        self._log: list[tuple[bytes, bytes]] = []  # nodes in the order made or reused
        self.top: list[tuple[str, int, int]] = []  # the root container's items: (key, tensors, bytes)

    def _store(self, value: Any, tensors: int, nbytes: int) -> bytes:
        """Store one node; returns its id.

        Raises:
            UnsupportedStateError: the node is larger than :data:`MAX_NODE` (no reader would
                accept it): a plain value too large to store.
        """
        raw = node_dumps({"n": tensors, "b": nbytes, "v": value}).encode("utf-8")
        if len(raw) > MAX_NODE:
            raise UnsupportedStateError(
                f"the state's plain values make a tree node of {len(raw)} bytes, more than a node "
                f"may hold ({MAX_NODE}); store large str or bytes values as tensors instead "
                "(torch.frombuffer(bytearray(value), dtype=torch.uint8))")
        node_id = self._ids(raw)
        self.nodes[node_id] = raw
        self._log.append((node_id, raw))
        return node_id

    def _reuse(self, sig: tuple[Any, ...], start: int) -> _Sized | None:
        """The memo's value for ``sig``, its nodes logged from ``start`` on (what was logged
        there, its children's nodes, is among them)."""
        made = self.memo.made(sig)
        if made is None:
            return None
        del self._log[start:]
        self.nodes.update(made.nodes)
        self._log.extend(made.nodes)
        return made.sized

    def _remember(self, sig: tuple[Any, ...], sized: _Sized, start: int, children: list[Any]) -> _Sized:
        self.memo.keep(sig, _Made(sized, self._log[start:], children))
        return sized

    def _ref(self, value: Any, tensors: int, nbytes: int, count: int,
             keys: Sequence[str] | None = None) -> _Sized:
        node_id = self._store(value, tensors, nbytes)
        ref: dict[str, Any] = {"t": "ref", "id": node_id.hex(), "n": tensors, "b": nbytes, "c": count}
        if keys is not None:
            ref["h"] = bloom(keys)
        return _Sized(ref, tensors, nbytes, 120 + len(ref.get("h", "")))

    def encode(self, root: Node) -> tuple[bytes, int, int]:
        """Store every node of ``root``; returns ``(root id, tensors, bytes)``."""
        top = self._value(root, 0)
        if root.get("t") == "tensor":
            self.top = [("", 1, top.nbytes)]
        if top.value.get("t") == "ref":
            node_id = bytes.fromhex(top.value["id"])
        else:
            node_id = self._store(top.value, top.tensors, top.nbytes)
        return node_id, top.tensors, top.nbytes

    def _value(self, node: Node, depth: int) -> _Sized:
        kind = node.get("t")
        if kind == "tensor":
            return self._tensor(node["i"], self.memo)
        if kind in ("dict", "list", "tuple") or (kind == "ranks" and depth == 0):
            return self._container(node, depth + 1)
        if kind == "sharded":  # a tensor saved in pieces: one value, a tensor value per piece
            pieces = [self._tensor(i, self.memo) for i in node["i"]]
            return _Sized({"t": "sharded", "v": [p.value for p in pieces]}, len(pieces),
                          sum(p.nbytes for p in pieces), 24 + sum(p.size + 12 for p in pieces))
        if kind == "ranks":
            raise ValueError("a ranks node may only be the root of a tree")
        return _Sized(node, 0, 0, 24 + len(str(node.get("v", ""))))

    def _container(self, node: Node, depth: int) -> _Sized:
        kind = node["t"]
        start = len(self._log)
        tensor, memo = self._tensor, self.memo  # most children of a large container are tensors
        items = [tensor(child["i"], memo) if child.get("t") == "tensor" else self._value(child, depth)
                 for child in node["v"]]
        keys: list[Any] | None = node["k"] if kind == "dict" else None
        if depth == 1:
            self.top = [(key_text(keys[n]) if keys is not None else str(n), i.tensors, i.nbytes)
                        for n, i in enumerate(items) if i.tensors]
        children = [i.value for i in items]
        sig = ("c", kind, depth <= 1, _key_sig(keys), tuple(map(id, children)))
        reused = self._reuse(sig, start)
        if reused is not None:
            return reused
        if len(items) > SPLIT_ITEMS:
            return self._remember(sig, self._split(kind, keys, items, depth), start, children)
        value: dict[str, Any] = {"t": kind, "v": children}
        if keys is not None:
            value["k"] = keys
        sized = _Sized(value, sum(i.tensors for i in items), sum(i.nbytes for i in items),
                       24 + sum(i.size + 12 for i in items))
        if not (sized.size <= INLINE_MAX or depth <= 1):  # the root is stored by encode()
            sized = self._ref(value, sized.tensors, sized.nbytes, len(items))
        return self._remember(sig, sized, start, children)

    def _split(self, kind: str, keys: list[Any] | None, items: list[_Sized], depth: int) -> _Sized:
        parts: list[_Sized] = []
        start, size = 0, 0
        for i, item in enumerate(items):
            size += item.size + 12
            count = i + 1 - start
            end = i + 1 == len(items) or count >= PART_MAX_ITEMS or size >= PART_MAX_BYTES or (
                count >= PART_MIN_ITEMS and keys is not None and part_ends_after(key_text(keys[i])))
            if kind != "dict" and not end:
                end = count >= PART_AVERAGE
            if end:
                parts.append(self._part(kind, keys[start : i + 1] if keys is not None else None,
                                        items[start : i + 1]))
                start, size = i + 1, 0
        refs = self._index(parts)
        value = {"t": kind, "parts": [r.value for r in refs]}
        sized = _Sized(value, sum(r.tensors for r in refs), sum(r.nbytes for r in refs),
                       24 + sum(r.size for r in refs))
        return self._ref(value, sized.tensors, sized.nbytes, len(items)) if depth > 1 else sized

    def _part(self, kind: str, keys: list[Any] | None, piece: list[_Sized]) -> _Sized:
        children = [p.value for p in piece]
        sig = ("p", kind, _key_sig(keys), tuple(map(id, children)))
        start = len(self._log)
        reused = self._reuse(sig, start)
        if reused is not None:
            return reused
        value: dict[str, Any] = {"t": kind, "v": children}
        names = None
        if keys is not None:
            value["k"] = keys
            names = [key_text(k) for k in keys]
        sized = self._ref(value, sum(p.tensors for p in piece), sum(p.nbytes for p in piece), len(piece),
                          names)
        return self._remember(sig, sized, start, children)

    def _index(self, refs: list[_Sized]) -> list[_Sized]:
        """Group part refs into index nodes until at most SPLIT_ITEMS remain."""
        while len(refs) > SPLIT_ITEMS:
            grouped: list[_Sized] = []
            start = 0
            for i, ref in enumerate(refs):
                count = i + 1 - start
                if i + 1 == len(refs) or count >= PART_MAX_ITEMS or (
                        count >= PART_MIN_ITEMS and int(ref.value["id"][:8], 16) % PART_AVERAGE == 0):
                    grouped.append(self._index_node(refs[start : i + 1]))
                    start = i + 1
            refs = grouped
        return refs

    def _index_node(self, piece: list[_Sized]) -> _Sized:
        children = [p.value for p in piece]
        sig = ("x", tuple(map(id, children)))
        start = len(self._log)
        reused = self._reuse(sig, start)
        if reused is not None:
            return reused
        index = self._ref({"t": "parts", "v": children}, sum(p.tensors for p in piece),
                          sum(p.nbytes for p in piece), sum(p.value["c"] for p in piece))
        index.value["x"] = 1  # an index node: read to find parts, unlike a part
        return self._remember(sig, index, start, children)
