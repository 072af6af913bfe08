"""Walking the nodes of :mod:`casckpt.format.merkle`: a whole tree, one path, two trees
side by side (diff), and what a tree references (gc's mark).

This module does no I/O: nodes come through :class:`~casckpt.format.merkle.Nodes`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from casckpt.errors import CorruptManifestError
from casckpt.format.merkle import Nodes, NodeSource, is_count, key_text, may_hold
from casckpt.format.state import MAX_DEPTH, Node, join_path, rank_path

_MAX_LEVELS = 8  # index levels above the parts of one container: 256^8 items is far past any state
_WORK_FLOOR = 1 << 18  # values any walk may visit, plus _WORK_PER_BYTE per byte of nodes read
_WORK_PER_BYTE = 4
_CONTAINERS = ("dict", "list", "tuple")
LEAVES = ("tensor", "sharded")
"""Tree values that are one tensor: whole, or saved in pieces."""


def child_path(kind: str, path: str, key: Any, index: int) -> str:
    """The path of a container's ``index``-th item (``key`` in a dict; under a ``ranks`` root,
    the rank's prefix :func:`~casckpt.format.state.rank_path`)."""
    if kind == "ranks":
        return rank_path(index, "")
    return join_path(path, key_text(key) if kind == "dict" else index)


def _ref_id(ref: Any) -> bytes:
    if not (isinstance(ref, dict) and ref.get("t") == "ref" and isinstance(ref.get("id"), str)
            and len(ref["id"]) == 64):
        raise CorruptManifestError("tree holds a malformed node reference")
    try:
        return bytes.fromhex(ref["id"])
    except ValueError as exc:
        raise CorruptManifestError("tree holds a malformed node reference") from exc


class TreeReader:
    """Reads a tree through :class:`Nodes`: whole (:meth:`expand`), one path, or two at once."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self.visited: set[bytes] = set()  # every node read through this reader
        self.work = 0

    def _tick(self) -> None:
        """Count one value walked. A tree's walk is bounded by the nodes it reads (each value
        is a few bytes of some node, shared subtrees aside); a forged tree of nodes naming one
        another many times over would expand exponentially: refused instead."""
        self.work += 1
        if self.work > _WORK_FLOOR + _WORK_PER_BYTE * self.nodes.loaded_bytes:
            raise CorruptManifestError(
                f"tree expands to over {self.work} values from {self.nodes.loaded_bytes} bytes of "
                "nodes: it is forged or corrupt. Run `casckpt check`")

    def node(self, node_id: bytes) -> dict[str, Any]:
        self.visited.add(node_id)
        return self.nodes.get(node_id)

    def resolve(self, value: Any) -> Any:
        """``value`` with a top-level ref replaced by the value of the node it names."""
        hops = 0
        while isinstance(value, dict) and value.get("t") == "ref":
            value = self.node(_ref_id(value))["v"]
            hops += 1
            if hops > 1:
                raise CorruptManifestError("tree node reference points to another reference")
        return value

    def items(self, value: Any) -> Iterator[tuple[Any, Any]]:
        """``(key, child)`` of a container value (``key`` None in lists and tuples), parts read in order."""
        kind = value.get("t")
        if "parts" in value:
            for part in self._parts(value["parts"], 0):
                if part.get("t") != kind or "parts" in part:
                    raise CorruptManifestError(f"tree part of a {kind!r} holds a {part.get('t')!r}")
                yield from self._own_items(part)
            return
        yield from self._own_items(value)

    @staticmethod
    def _own_items(value: Any) -> Iterator[tuple[Any, Any]]:
        children = value.get("v")
        if not isinstance(children, list):
            raise CorruptManifestError(f"tree {value.get('t')!r} node has no item list")
        if value.get("t") == "dict":
            keys = value.get("k")
            if not isinstance(keys, list) or len(keys) != len(children):
                raise CorruptManifestError("tree dict node's keys and values disagree")
            yield from zip(keys, children, strict=True)
        else:
            for child in children:
                yield None, child

    def _parts(self, refs: Any, level: int) -> Iterator[dict[str, Any]]:
        if not isinstance(refs, list) or level > _MAX_LEVELS:
            raise CorruptManifestError("tree container has a malformed list of parts")
        self.nodes.prefetch([_ref_id(r) for r in refs])
        for ref in refs:
            part = self.node(_ref_id(ref))["v"]
            if part.get("t") == "parts":
                yield from self._parts(part.get("v"), level + 1)
            else:
                yield part

    def part_refs(self, value: Any) -> Iterator[dict[str, Any]]:
        """The refs of a split container's parts (index nodes read, parts not)."""
        stack: list[tuple[Any, int]] = [(value["parts"], 0)]
        while stack:
            refs, level = stack.pop()
            if not isinstance(refs, list) or level > _MAX_LEVELS:
                raise CorruptManifestError("tree container has a malformed list of parts")
            if not all(isinstance(r, dict) for r in refs):
                raise CorruptManifestError("tree container has a malformed list of parts")
            self.nodes.prefetch([_ref_id(r) for r in refs if r.get("x") == 1])
            for i, ref in enumerate(refs):
                if ref.get("x") == 1:
                    inner = self.node(_ref_id(ref))["v"]
                    if inner.get("t") != "parts":
                        raise CorruptManifestError("tree index reference points to a part")
                    stack.append((refs[i + 1:], level))
                    stack.append((inner.get("v"), level + 1))
                    break
                yield ref

    def expand(self, root: bytes) -> tuple[Node, list[tuple[str, dict[str, Any], int | None]]]:
        """The whole tree as a :mod:`casckpt.format.state` node tree, and ``(path, entry, rank)``
        of every tensor (piece) in order (the node's ``i`` indexes that list; ``rank`` None but
        under a ``ranks`` root, where paths are each rank's own)."""
        tensors: list[tuple[str, dict[str, Any], int | None]] = []
        rank: list[int | None] = [None]  # the rank whose tree is being built

        def piece(value: Any, path: str) -> int:
            entry = value.get("e") if isinstance(value, dict) and value.get("t") == "tensor" else None
            if not isinstance(entry, dict):
                raise CorruptManifestError(f"tree tensor at {path!r} is malformed")
            tensors.append((path, entry, rank[0]))
            return len(tensors) - 1

        def build(value: Any, path: str, depth: int) -> Node:
            self._tick()
            value = self.resolve(value)
            if not isinstance(value, dict):
                raise CorruptManifestError(f"tree node at {path!r} is not an object")
            kind = value.get("t")
            if kind == "tensor":
                return {"t": "tensor", "i": piece(value, path)}
            if kind == "sharded":
                pieces = value.get("v")
                if not isinstance(pieces, list) or not pieces:
                    raise CorruptManifestError(f"tree tensor at {path!r} has no pieces")
                return {"t": "sharded", "i": [piece(p, path) for p in pieces]}
            if kind == "ranks" and depth == 0:
                out: list[Node] = []
                for n, (_, child) in enumerate(self.items(value)):
                    rank[0] = n
                    out.append(build(child, "", depth + 1))
                rank[0] = None
                return {"t": "ranks", "v": out}
            if kind in _CONTAINERS:
                if depth >= MAX_DEPTH:
                    raise CorruptManifestError(f"tree nests deeper than {MAX_DEPTH} containers at {path!r}")
                keys: list[Any] = []
                values: list[Node] = []
                for i, (key, child) in enumerate(self.items(value)):
                    name = key_text(key) if kind == "dict" else i
                    if kind == "dict":
                        keys.append(key)
                    values.append(build(child, join_path(path, name), depth + 1))
                return {"t": kind, "k": keys, "v": values} if kind == "dict" else {"t": kind, "v": values}
            if kind in ("ref", "parts", "ranks"):
                raise CorruptManifestError(f"tree holds a misplaced {kind!r} node at {path!r}")
            return value

        root_value = self.node(root)["v"]
        return build(root_value, "", 0), tensors

    def find_tensor(self, root: bytes, path: str) -> tuple[str, Any] | None:
        """The tensor at ``path`` (None: there is none), reading as few nodes as it can: at
        each dict the longest key ``path`` may continue with is tried first (a state's dotted
        path names one tensor at most: commits refuse two), and only the parts whose filters
        may hold it are read, in one batch."""
        def walk(value: Any, prefix: str, depth: int) -> tuple[str, Any] | None:
            value = self.resolve(value)
            if prefix == path:
                return (prefix, value) if isinstance(value, dict) and value.get("t") in LEAVES else None
            kind = value.get("t") if isinstance(value, dict) else None
            if kind == "ranks" and depth == 0:
                child = self._rank_child(value, path)
                return None if child is None else walk(child[1], child[0], depth + 1)
            if kind not in _CONTAINERS or depth > MAX_DEPTH:
                return None
            rest = _rest(path, prefix)
            if kind != "dict":
                head = rest.split(".", 1)[0]
                if not (head.isascii() and head.isdigit() and str(int(head)) == head):
                    return None
                child = self._at(value, int(head))
                return None if child is None else walk(child, join_path(prefix, int(head)), depth + 1)
            keys = [rest] + [rest[:i] for i in range(len(rest) - 1, 0, -1) if rest[i] == "."]
            for key in keys:
                for found_key, child in self._keyed(value, {key}):
                    hit = walk(child, join_path(prefix, key_text(found_key)), depth + 1)
                    if hit is not None:
                        return hit
            return None

        return walk(self.node(root)["v"], "", 0)

    def _rank_child(self, value: Any, path: str) -> tuple[str, Any] | None:
        """``(prefix, tree)`` of the rank a ``rank<N>/...`` path names under a ranks root."""
        head, slash, _ = path.partition("/")
        number = head.removeprefix("rank")
        if not (slash and head.startswith("rank") and number.isascii() and number.isdigit()
                and str(int(number)) == number):
            return None
        child = self._at(value, int(number))
        return None if child is None else (rank_path(int(number), ""), child)

    def _keyed(self, value: Any, wanted: set[str]) -> Iterator[tuple[Any, Any]]:
        if "parts" not in value:
            yield from ((k, c) for k, c in self._own_items(value) if key_text(k) in wanted)
            return
        maybe = []
        for ref in self.part_refs(value):
            filter_hex = ref.get("h")
            if isinstance(filter_hex, str) and not any(may_hold(filter_hex, w) for w in wanted):
                continue
            maybe.append(_ref_id(ref))
        self.nodes.prefetch(maybe)
        for part_id in maybe:
            part = self.node(part_id)["v"]
            yield from ((k, c) for k, c in self._own_items(part) if key_text(k) in wanted)

    def _at(self, value: Any, index: int) -> Any:
        if "parts" not in value:
            children = value.get("v")
            return children[index] if isinstance(children, list) and index < len(children) else None
        for ref in self.part_refs(value):
            count = ref.get("c")
            if not is_count(count):
                raise CorruptManifestError("tree part reference has no item count")
            if index < count:
                children = self.node(_ref_id(ref))["v"].get("v")
                return children[index] if isinstance(children, list) and index < len(children) else None
            index -= count
        return None

    def differences(self, a: bytes, b: bytes) -> Iterator[tuple[str, Any, Any]]:
        """``(path, value in a, value in b)`` for every tensor and plain value that differs
        (None where one side lacks it), walking only into subtrees whose ids differ."""
        stack: list[tuple[str, Any, Any, int]] = [("", self.node(a)["v"], self.node(b)["v"], 0)]
        while stack:
            path, x, y, depth = stack.pop()
            self._tick()
            if x == y:  # the same ref (same id), or equal inline values
                continue
            x, y = self.resolve(x) if x is not None else None, self.resolve(y) if y is not None else None
            kx = x.get("t") if isinstance(x, dict) else None
            ky = y.get("t") if isinstance(y, dict) else None
            containers = (*_CONTAINERS, "ranks")
            if kx in containers and kx == ky and depth < MAX_DEPTH:
                stack.extend((p, cx, cy, depth + 1) for p, cx, cy in reversed(list(self._pairs(path, x, y))))
                continue
            yield from self._leaves_pair(path, x, y, depth)

    def _pairs(self, path: str, x: Any, y: Any) -> Iterator[tuple[str, Any, Any]]:
        kind = x["t"]
        if kind == "dict":
            changed = self._changed_parts(x, y), self._changed_parts(y, x)
            self.nodes.prefetch([_ref_id(r) for refs in changed for r in refs or ()])  # one read
            left = self._dict_items(x, changed[0])
            right = self._dict_items(y, changed[1])
            for key in dict.fromkeys([*left, *right]):
                yield join_path(path, key), left.get(key), right.get(key)
        else:
            xs = [c for _, c in self.items(x)]
            ys = [c for _, c in self.items(y)]
            for i in range(max(len(xs), len(ys))):
                yield (child_path(kind, path, None, i), xs[i] if i < len(xs) else None,
                       ys[i] if i < len(ys) else None)

    def _changed_parts(self, value: Any, other: Any) -> list[dict[str, Any]] | None:
        """The part refs of a split dict the other side does not hold (same id); None: not split."""
        if "parts" not in value:
            return None
        same = {_ref_id(r) for r in self.part_refs(other)} if "parts" in other else set()
        return [r for r in self.part_refs(value) if _ref_id(r) not in same]

    def _dict_items(self, value: Any, parts: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Items of a dict: its own, or those of ``parts`` (:meth:`_changed_parts`)."""
        if parts is None:
            return {key_text(k): c for k, c in self._own_items(value)}
        out: dict[str, Any] = {}
        for ref in parts:
            part = self.node(_ref_id(ref))["v"]
            if part.get("t") != "dict" or "parts" in part:
                raise CorruptManifestError(f"tree part of a dict holds a {str(part.get('t'))[:20]!r}")
            out.update((key_text(k), c) for k, c in self._own_items(part))
        return out

    def _leaves_pair(self, path: str, x: Any, y: Any, depth: int) -> Iterator[tuple[str, Any, Any]]:
        """Leaves under two values that are not comparable containers: each side's leaves."""
        left = dict(self.leaves(x, path, depth)) if x is not None else {}
        right = dict(self.leaves(y, path, depth)) if y is not None else {}
        for p in dict.fromkeys([*left, *right]):
            if left.get(p) != right.get(p):
                yield p, left.get(p), right.get(p)

    def leaves(self, value: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
        """``(path, leaf value)`` of every tensor and plain value under ``value``."""
        stack: list[tuple[Any, str, int]] = [(value, path, depth)]
        while stack:
            v, p, d = stack.pop()
            self._tick()
            v = self.resolve(v)
            kind = v.get("t") if isinstance(v, dict) else None
            if kind in _CONTAINERS or (kind == "ranks" and d == 0):
                if d >= MAX_DEPTH:
                    raise CorruptManifestError(f"tree nests deeper than {MAX_DEPTH} containers at {p!r}")
                children = list(self.items(v))
                for i, (key, child) in reversed(list(enumerate(children))):
                    stack.append((child, child_path(str(kind), p, key, i), d + 1))
            else:
                yield p, v


def referenced(source: NodeSource, root: bytes, seen: set[bytes],
               tensors: list[dict[str, Any]] | None = None) -> Iterator[bytes]:
    """Every node and chunk id the tree under ``root`` references -- its nodes, and the chunks
    of the extents inline in them (a tree manifest lists its shared extents itself) -- reading
    each node once: a node in ``seen`` is skipped with everything under it (nodes are
    content-addressed, so its subtree was walked already), and every node read is added.
    ``tensors``: where each tensor value met (``{"t": "tensor", "e": ...}``, its extent checked)
    is appended, for callers that need more of it than its chunks (a copy: their dtypes).

    What gc marks through a tree: ``seen`` shared by every version of one mark makes the
    work O(distinct nodes), not O(versions x tensors). Nodes are read a level at a time
    (one call to the source per level) and verified against their ids; none is kept.

    Raises:
        CorruptManifestError: a node is missing, forged, or malformed.
    """
    level = [] if root in seen else [root]
    seen.update(level)
    while level:
        nodes = Nodes(source)
        nodes.prefetch(level)
        below: list[bytes] = []
        for node_id in level:
            yield node_id
            stack: list[Any] = [nodes.get(node_id)["v"]]
            while stack:
                value = stack.pop()
                if not isinstance(value, dict):
                    raise CorruptManifestError(f"tree node {node_id.hex()[:12]} holds a malformed value")
                kind = value.get("t")
                if kind == "ref":
                    child = _ref_id(value)
                    if child not in seen:
                        seen.add(child)
                        below.append(child)
                elif kind == "tensor":
                    yield from _extent_chunks(value, node_id)
                    if tensors is not None:
                        tensors.append(value)
                elif kind == "sharded":
                    pieces = value.get("v")
                    if not isinstance(pieces, list):
                        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} has no piece list")
                    stack.extend(pieces)
                elif kind in ("dict", "list", "tuple", "parts", "ranks"):
                    items = value.get("parts", value.get("v"))
                    if not isinstance(items, list):
                        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} has no item list")
                    stack.extend(items)
        level = below


def _extent_chunks(value: dict[str, Any], node_id: bytes) -> list[bytes]:
    """The chunk ids of a tensor's inline extent (none for a shared one, ``{"s": i}``)."""
    entry = value.get("e")
    extent = entry.get("blob") if isinstance(entry, dict) else None
    if not isinstance(extent, dict):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} holds a malformed tensor")
    chunks = extent.get("chunks", [])
    if not isinstance(chunks, list):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} holds a malformed extent")
    try:
        out = [bytes.fromhex(c) for c in chunks]
    except (TypeError, ValueError) as exc:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} names a malformed chunk id") from exc
    if any(len(c) != 32 for c in out):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} names a malformed chunk id")
    return out


def _rest(path: str, prefix: str) -> str:
    """What of ``path`` follows ``prefix`` (and its dot; a rank's prefix ends in ``/``)."""
    if not prefix:
        return path
    return path[len(prefix):] if prefix[-1] == "/" else path[len(prefix) + 1:]
