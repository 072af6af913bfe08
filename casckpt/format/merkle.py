"""Tree manifests: a version's state tree as content-addressed nodes (like git trees).

A manifest of version 3 holds the version's description and the id of the
*root node* of its state tree; the tree is cut into nodes, each stored once
(as a chunk in the packs, and a row in the catalog) and shared by every
version that has it. A version that changes k tensors writes O(k x depth)
new nodes; an unchanged re-commit writes none.

A node is canonical JSON ``{"n": tensors, "b": bytes, "v": value}`` (tensor
count and logical bytes below it), its id is the chunk id of those bytes. A
value is a plain-value node of :mod:`casckpt.format.tree`, or:

- ``{"t": "tensor", "e": {...}}``: a tensor inline, with its blob (``nbytes``,
  ``chunk_size``, ``chunks``, ``phase``) inline, or ``{"s": i}`` for a blob
  several tensors share (views of one storage), listed in the manifest;
- ``{"t": "dict", "k": [...], "v": [...]}`` / ``{"t": "list" | "tuple", "v": [...]}``;
- ``{"t": "ref", "id": hex, "n", "b", "c"}``: a container stored as its own
  node (a container is inline while its encoding is small, :data:`INLINE_MAX`);
- ``{"t": "dict" | "list" | "tuple", "parts": [ref, ...]}``: a container of
  more than :data:`SPLIT_ITEMS` items cut into parts. A dict is cut where a
  hash of the key says (content-defined, so adding or removing a key moves
  one boundary, not every one after it); each part's ref carries ``c`` (its
  item count) and for dicts ``h``, a Bloom filter of its keys, so one key is
  found by reading the parts that may hold it. A part holds ``k``/``v`` of its
  items; more than :data:`SPLIT_ITEMS` parts are grouped by index nodes
  (``{"t": "parts", "v": [ref, ...]}``), as in a B-tree.

Tensor paths are not stored in nodes (a node can sit at several paths): they
are the dotted join of the keys on the way down, as in :mod:`casckpt.format.tree`.

This module does no I/O: nodes come from a :class:`NodeSource`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zstandard

from casckpt.errors import CorruptManifestError, UnsupportedStateError
from casckpt.format.chunks import chunk_id
from casckpt.format.dtypes import element_size
from casckpt.format.manifest import MAX_MANIFEST_JSON, decompress_capped
from casckpt.format.tree import MAX_DEPTH, MAX_MANIFEST_NESTING, Node, join_path, json_nesting

INLINE_MAX = 2048
"""A container whose encoding is estimated at most this many bytes stays inside its parent's node."""
SPLIT_ITEMS = 256
"""A container (or a list of parts) of more items is cut into parts."""
PART_AVERAGE = 128  # a dict part ends after a key whose hash is 0 modulo this (items per part, on average)
PART_MAX_ITEMS = 512
PART_MAX_BYTES = 256 << 10  # a part also ends once its estimated encoding passes this
PART_MIN_ITEMS = 16
MAX_NODE = MAX_MANIFEST_JSON
"""No node is larger (decoded JSON): a larger one is corrupt. As large as a document may be:
a node holds part of what a document of format 1 held (a plain value of any size a document
could hold, which a migrated version's tree must hold too), and no commit writes a larger one."""
_BLOOM_BITS_PER_KEY = 10
_BLOOM_HASHES = 3
_MAX_LEVELS = 8  # index levels above the parts of one container: 256^8 items is far past any state
_WORK_FLOOR = 1 << 18  # values any walk may visit, plus _WORK_PER_BYTE per byte of nodes read
_WORK_PER_BYTE = 4

Encoder = Callable[[Any], str]
_dumps: Encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False,
                                   check_circular=False).encode


class NodeSource:
    """Where nodes come from (the catalog, packs): ``get(id)`` returns a node's JSON bytes."""

    def get_many(self, ids: Sequence[bytes]) -> Mapping[bytes, bytes]:  # pragma: no cover - protocol
        raise NotImplementedError


@dataclass(slots=True)
class Nodes:
    """Decoded nodes by id, read through a source and verified against their ids."""

    source: NodeSource
    cache: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    loaded_bytes: int = 0  # JSON bytes of the distinct nodes read (bounds the work of a walk)

    def get(self, node_id: bytes) -> dict[str, Any]:
        found = self.cache.get(node_id)
        if found is None:
            self.prefetch([node_id])
            found = self.cache[node_id]
        return found

    def prefetch(self, ids: Sequence[bytes]) -> None:
        """Read the nodes among ``ids`` not cached yet, in one call to the source."""
        wanted = [i for i in dict.fromkeys(ids) if i not in self.cache]
        if not wanted:
            return
        got = self.source.get_many(wanted)
        for node_id in wanted:
            raw = got.get(node_id)
            if raw is None:
                raise CorruptManifestError(
                    f"tree node {node_id.hex()[:12]} is missing (the catalog and the packs have "
                    "no copy): run `casckpt check`, then `casckpt repair`")
            self.cache[node_id] = decode_node(raw, node_id)
            self.loaded_bytes += len(raw)


def decode_node(raw: bytes, node_id: bytes) -> dict[str, Any]:
    """Parse and check one node's JSON bytes (they must hash to ``node_id``).

    Raises:
        CorruptManifestError: forged, truncated or malformed.
    """
    if len(raw) > MAX_NODE or chunk_id(raw) != node_id:
        raise CorruptManifestError(
            f"tree node {node_id.hex()[:12]} does not match its id: it is corrupt or forged. "
            "Restore another version, and run `casckpt check` to find what else is damaged")
    if json_nesting(raw) > MAX_MANIFEST_NESTING:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} nests impossibly deep")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} is not JSON: {exc}") from exc
    if not (isinstance(doc, dict) and set(doc) == {"n", "b", "v"} and _is_count(doc["n"])
            and _is_count(doc["b"]) and isinstance(doc["v"], dict)):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} is malformed")
    return doc


def compress_node(raw: bytes) -> bytes:
    """A node's JSON bytes as the catalog keeps them (zstd)."""
    return zstandard.ZstdCompressor(level=3).compress(raw)  # one per call: threads commit at once


def node_json(body: bytes) -> bytes:
    """The JSON bytes of a node the catalog keeps (decompressed a piece at a time, at most
    :data:`MAX_NODE`: a frame's declared size is never trusted).

    Raises:
        CorruptManifestError: it does not decompress, or is too large.
    """
    return decompress_capped(body, MAX_NODE, "a tree node in the catalog")


def decompress_node(body: bytes) -> Any:
    """A catalog node body parsed (not checked against its id: for finding references only)."""
    try:
        return json.loads(node_json(body))
    except ValueError as exc:
        raise CorruptManifestError(f"a tree node in the catalog is not JSON: {exc}") from exc


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- encoding ------------------------------------------------------------------------------


@dataclass(slots=True)
class Tree:
    """A state tree cut into nodes: what a commit stores."""

    root: bytes
    tensors: int
    nbytes: int
    nodes: dict[bytes, bytes]  # every node of the tree, id -> JSON bytes
    shared_blobs: list[int]  # the manifest's blobs several tensors share, in the document's order
    groups: tuple[tuple[str, int, int], ...] | None = None  # the document's summary (treemanifest)
    values: tuple[tuple[str, Any], ...] | None = None


def blob_json(nbytes: int, chunk_size: int, chunks: Sequence[bytes], phase: int) -> dict[str, Any]:
    """A blob as JSON (the same fields as in manifests of versions 1 and 2)."""
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

    def entry(self, tensor: Any, blob: Any, make: Callable[[Any, Any], tuple[dict[str, Any], int]]
              ) -> _Sized:
        """A tensor's value in its parent, ``make(tensor, blob)`` (its entry JSON and logical
        bytes) being a function of ``tensor`` and ``blob`` (hashable values): found by the
        identity of ``tensor`` (a pack's entries come back as the same objects), else by
        value; the same object for the same entry."""
        found = self._old_entries.get(id(tensor))
        if found is None or found[0] is not tensor or not (found[1] is blob or found[1] == blob):
            found = self._old_entries.get((tensor, blob))
            if found is None:
                found = (tensor, blob, tensor_value(*make(tensor, blob)))
            self._entries[(tensor, blob)] = found
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
    """Cuts a manifest's state tree into nodes (see the module docstring), reusing what a
    :class:`TreeMemo` of the previous commit made for unchanged subtrees."""

    def __init__(self, tensor: Callable[[int, TreeMemo], _Sized], memo: TreeMemo | None = None) -> None:
        # tensor(i, memo) -> the value of the i-th tensor (tensor_value, or memo.entry)
        self._tensor = tensor
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
        raw = _dumps({"n": tensors, "b": nbytes, "v": value}).encode("utf-8")
        if len(raw) > MAX_NODE:
            raise UnsupportedStateError(
                f"the state's plain values make a tree node of {len(raw)} bytes, more than a node "
                f"may hold ({MAX_NODE}); store large str or bytes values as tensors instead "
                "(torch.frombuffer(bytearray(value), dtype=torch.uint8))")
        node_id = chunk_id(raw)
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
        if kind in ("dict", "list", "tuple"):
            return self._container(node, depth + 1)
        if kind in ("ranks", "sharded"):
            raise ValueError("tree manifests hold one process's state (no ranks, no shards)")
        return _Sized(node, 0, 0, 24 + len(str(node.get("v", ""))))

    def _container(self, node: Node, depth: int) -> _Sized:
        kind = node["t"]
        start = len(self._log)
        items = [self._value(child, depth) for child in node["v"]]
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
                count >= PART_MIN_ITEMS and keys is not None and _cut(key_text(keys[i])))
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


def key_text(key: Any) -> str:
    """A dict key as it appears in dotted paths.

    Raises:
        CorruptManifestError: neither a str nor ``{"i": int}``.
    """
    if isinstance(key, str):
        return key
    if isinstance(key, dict) and isinstance(key.get("i"), int) and not isinstance(key["i"], bool):
        return str(key["i"])
    raise CorruptManifestError(f"tree dict key {str(key)[:40]!r} is neither a str nor an int")


@functools.lru_cache(maxsize=1 << 20)  # keys come back in every commit of a process
def _key_hashes(text: str) -> tuple[int, ...]:
    """Four 32-bit hashes of a key: the first says where parts end, the others place it in
    Bloom filters."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16, person=b"casckpt-keys").digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))


def _cut(text: str) -> bool:
    return _key_hashes(text)[0] % PART_AVERAGE == 0


def _bloom_positions(text: str, bits: int) -> list[int]:
    return [h % bits for h in _key_hashes(text)[1 : 1 + _BLOOM_HASHES]]


def bloom(keys: Sequence[str]) -> str:
    """A Bloom filter of ``keys`` as hex (a multiple of 64 bits)."""
    bits = max(64, -(-len(keys) * _BLOOM_BITS_PER_KEY // 64) * 64)
    field_ = 0
    for key in keys:
        for p in _bloom_positions(key, bits):
            field_ |= 1 << p
    return field_.to_bytes(bits // 8, "little").hex()


def may_hold(filter_hex: str, key: str) -> bool:
    """Whether a Bloom filter made by :func:`bloom` may hold ``key`` (False: it surely does not)."""
    try:
        data = bytes.fromhex(filter_hex)
    except ValueError:
        return True  # a malformed filter says nothing; the part is read (and checked) instead
    bits = len(data) * 8
    if not bits:
        return True
    field_ = int.from_bytes(data, "little")
    return all(field_ >> p & 1 for p in _bloom_positions(key, bits))


# -- reading -------------------------------------------------------------------------------


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

    def resolve(self, value: Any, depth: int = 0) -> Any:
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

    def expand(self, root: bytes) -> tuple[Node, list[tuple[str, dict[str, Any]]]]:
        """The whole tree as a :mod:`casckpt.format.tree` node tree, and ``(path, entry)`` of
        every tensor in order (the node's ``i`` indexes that list)."""
        tensors: list[tuple[str, dict[str, Any]]] = []

        def build(value: Any, path: str, depth: int) -> Node:
            self._tick()
            value = self.resolve(value)
            if not isinstance(value, dict):
                raise CorruptManifestError(f"tree node at {path!r} is not an object")
            kind = value.get("t")
            if kind == "tensor":
                entry = value.get("e")
                if not isinstance(entry, dict):
                    raise CorruptManifestError(f"tree tensor at {path!r} is malformed")
                tensors.append((path, entry))
                return {"t": "tensor", "i": len(tensors) - 1}
            if kind in ("dict", "list", "tuple"):
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
            if kind in ("ref", "parts"):
                raise CorruptManifestError(f"tree holds a misplaced {kind!r} node at {path!r}")
            return value

        root_value = self.node(root)["v"]
        return build(root_value, "", 0), tensors

    def find(self, root: bytes, path: str) -> list[tuple[str, Any]]:
        """The values at ``path`` (a dotted path may name more than one, e.g. keys ``a.b``
        and ``a`` -> ``b``; commits refuse that, so at most one is a tensor), with their paths."""
        out: list[tuple[str, Any]] = []
        stack: list[tuple[Any, str, int]] = [(self.node(root)["v"], "", 0)]
        while stack:
            value, prefix, depth = stack.pop()
            value = self.resolve(value)
            if prefix == path:
                out.append((prefix, value))
                continue
            kind = value.get("t") if isinstance(value, dict) else None
            if kind not in ("dict", "list", "tuple") or depth > MAX_DEPTH:
                continue
            rest = path[len(prefix) + 1:] if prefix else path
            if kind == "dict":
                wanted = {rest[:i] for i, ch in enumerate(rest) if ch == "."} | {rest}
                for key, child in self._keyed(value, wanted):
                    stack.append((child, join_path(prefix, key_text(key)), depth + 1))
            else:
                head = rest.split(".", 1)[0]
                if head.isdigit() and str(int(head)) == head:
                    child = self._at(value, int(head))
                    if child is not None:
                        stack.append((child, join_path(prefix, int(head)), depth + 1))
        return out

    def find_tensor(self, root: bytes, path: str) -> tuple[str, Any] | None:
        """The tensor at ``path`` (None: there is none), reading as few nodes as it can: at
        each dict the longest key ``path`` may continue with is tried first (a state's dotted
        path names one tensor at most: commits refuse two), and only the parts whose filters
        may hold it are read, in one batch."""
        def walk(value: Any, prefix: str, depth: int) -> tuple[str, Any] | None:
            value = self.resolve(value)
            if prefix == path:
                return (prefix, value) if isinstance(value, dict) and value.get("t") == "tensor" else None
            kind = value.get("t") if isinstance(value, dict) else None
            if kind not in ("dict", "list", "tuple") or depth > MAX_DEPTH:
                return None
            rest = path[len(prefix) + 1:] if prefix else path
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
            if not _is_count(count):
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
            containers = ("dict", "list", "tuple")
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
                yield (join_path(path, i), xs[i] if i < len(xs) else None, ys[i] if i < len(ys) else None)

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
            if kind in ("dict", "list", "tuple"):
                if d >= MAX_DEPTH:
                    raise CorruptManifestError(f"tree nests deeper than {MAX_DEPTH} containers at {p!r}")
                children = list(self.items(v))
                for i, (key, child) in reversed(list(enumerate(children))):
                    stack.append((child, join_path(p, key_text(key) if kind == "dict" else i), d + 1))
            else:
                yield p, v


def tensor_nbytes(entry: Mapping[str, Any]) -> int:
    """Logical bytes of a tensor entry (as torch.save counts them)."""
    shape = entry.get("shape")
    n = 1
    for d in shape if isinstance(shape, list) else ():
        n *= int(d)
    return n * element_size(str(entry.get("kind")), str(entry.get("dtype")))


def referenced(source: NodeSource, root: bytes, seen: set[bytes]) -> Iterator[bytes]:
    """Every node and chunk id the tree under ``root`` references -- its nodes, and the chunks
    of the blobs inline in them (a tree manifest lists its shared blobs itself) -- reading
    each node once: a node in ``seen`` is skipped with everything under it (nodes are
    content-addressed, so its subtree was walked already), and every node read is added.

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
                    yield from _blob_chunks(value, node_id)
                elif kind in ("dict", "list", "tuple", "parts"):
                    items = value.get("parts", value.get("v"))
                    if not isinstance(items, list):
                        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} has no item list")
                    stack.extend(items)
        level = below


def _blob_chunks(value: dict[str, Any], node_id: bytes) -> list[bytes]:
    """The chunk ids of a tensor's inline blob (none for a shared one, ``{"s": i}``)."""
    entry = value.get("e")
    blob = entry.get("blob") if isinstance(entry, dict) else None
    if not isinstance(blob, dict):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} holds a malformed tensor")
    chunks = blob.get("chunks", [])
    if not isinstance(chunks, list):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} holds a malformed blob")
    try:
        out = [bytes.fromhex(c) for c in chunks]
    except (TypeError, ValueError) as exc:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} names a malformed chunk id") from exc
    if any(len(c) != 32 for c in out):
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} names a malformed chunk id")
    return out
