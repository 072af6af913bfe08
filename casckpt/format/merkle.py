"""Tree manifests: a version's state as content-addressed nodes (like git trees).

A manifest of version 3 holds the version's description and the id of the
*root node* of its state; the tree is cut into nodes, each stored once
(as a chunk in the packs, and a row in the catalog) and shared by every
version that has it. A version that changes k tensors writes O(k x depth)
new nodes; an unchanged re-commit writes none.

A node is canonical JSON ``{"n": tensors, "b": bytes, "v": value}`` (tensor
count and logical bytes below it), its id is the chunk id of those bytes. A
value is a plain-value node of :mod:`casckpt.format.state`, or:

- ``{"t": "tensor", "e": {...}}``: a tensor inline, with its extent (``nbytes``,
  ``chunk_size``, ``chunks``, ``phase``) inline under the key ``"blob"`` (the
  historical name of an extent, see :mod:`casckpt.format.manifest`), or
  ``{"s": i}`` for an extent several tensors share (views of one storage),
  listed in the manifest;
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
are the dotted join of the keys on the way down, as in :mod:`casckpt.format.state`.

This module holds the node format (and reads nodes); :mod:`casckpt.format.treeencode`
cuts a state into nodes, :mod:`casckpt.format.treeread` walks them. No I/O: nodes come
from a :class:`NodeSource`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import zstandard

from casckpt.errors import CorruptManifestError
from casckpt.format.chunks import ChunkIds, chunk_id
from casckpt.format.manifestmodel import MAX_MANIFEST_JSON, decompress_capped
from casckpt.format.state import MAX_MANIFEST_NESTING, json_nesting

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

Encoder = Callable[[Any], str]
node_dumps: Encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False,
                                   check_circular=False).encode


class NodeSource:
    """Where nodes come from (the catalog, packs): ``get(id)`` returns a node's JSON bytes;
    ``chunk_ids`` is how the store hashes them (keyed in an encrypted store)."""

    chunk_ids: ChunkIds = staticmethod(chunk_id)

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
            self.cache[node_id] = decode_node(raw, node_id, self.source.chunk_ids)
            self.loaded_bytes += len(raw)


def decode_node(raw: bytes, node_id: bytes, ids: ChunkIds = chunk_id) -> dict[str, Any]:
    """Parse and check one node's JSON bytes (they must hash to ``node_id`` by ``ids``).

    Raises:
        CorruptManifestError: forged, truncated or malformed.
    """
    if len(raw) > MAX_NODE or ids(raw) != node_id:
        raise CorruptManifestError(
            f"tree node {node_id.hex()[:12]} does not match its id: it is corrupt or forged. "
            "Restore another version, and run `casckpt check` to find what else is damaged")
    if json_nesting(raw) > MAX_MANIFEST_NESTING:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} nests impossibly deep")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CorruptManifestError(f"tree node {node_id.hex()[:12]} is not JSON: {exc}") from exc
    if not (isinstance(doc, dict) and set(doc) == {"n", "b", "v"} and is_count(doc["n"])
            and is_count(doc["b"]) and isinstance(doc["v"], dict)):
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


def is_count(value: object) -> TypeGuard[int]:
    """A non-negative int (not a bool): a node's counts."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- keys ----------------------------------------------------------------------------------


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


def part_ends_after(text: str) -> bool:
    """Whether a dict part ends after the key ``text`` (content-defined boundaries)."""
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
