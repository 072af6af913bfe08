"""A copy's tree nodes between its plan and its publish: ids and sizes kept, bytes read again.

A copy plans every version before it sends anything (:mod:`.copyplan`), and the nodes a
version sends or whose rows the destination lacks are megabytes for a state of thousands of
tensors: held raw for every version of a long run, a plan would hold gigabytes. A plan keeps
each version's nodes as a :class:`NodeBodies` instead -- the ids and sizes of every node of
its tree -- and their bytes are read again from the source when the copy asks for them (to
send them, and for the rows its publish adds: those the destination lacks then, which may
be more than when planned should its gc purge a version sharing them meanwhile), through
ONE :class:`NodeReader` per plan: a cache of at
most :data:`CACHE_BYTES`, filled a version at a time (the copy walks the versions in order),
each node verified against its id as it is read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from casckpt.errors import CorruptManifestError, MissingDataError
from casckpt.format.merkle import NodeSource

__all__ = ["CACHE_BYTES", "NodeBodies", "NodeReader", "node_size"]

CACHE_BYTES = 32 << 20
"""Raw node bytes a plan's :class:`NodeReader` keeps read (at least one version's)."""


class NodeReader:
    """Nodes read again from ``source`` (the source store's catalog, then packs), verified,
    with the most recently read kept up to ``limit`` bytes. Thread-safe: a copy's pipeline
    reads on threads of its own."""

    def __init__(self, source: NodeSource, limit: int = CACHE_BYTES) -> None:
        self._source, self._limit = source, limit
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, node_id: bytes, batch: Iterable[bytes]) -> bytes:
        """Node ``node_id``; on a miss, every node of ``batch`` (its version's) not kept is read
        with it in one call to the source.

        Raises:
            MissingDataError: the source no longer has it (its versions were purged since the
                plan; copy again).
            CorruptManifestError: the source's copy does not match its id.
        """
        with self._lock:
            found = self._cache.get(node_id)
            if found is not None:
                self._cache.move_to_end(node_id)
                return found
            wanted = list(dict.fromkeys([node_id, *(i for i in batch if i not in self._cache)]))
            got = self._source.get_many(wanted)
            for i in wanted:
                raw = got.get(i)
                if raw is None:
                    raise MissingDataError(
                        f"tree node {i.hex()[:12]} is gone from the source since the copy was planned "
                        "(a version holding it was deleted and purged meanwhile): copy again")
                if self._source.chunk_ids(raw) != i:
                    raise CorruptManifestError(
                        f"tree node {i.hex()[:12]} read from the source does not match its id: run "
                        "`casckpt check` on the source, then copy again")
                self._cache[i] = raw
                self._held += len(raw)
            found = self._cache[node_id]
            while self._held > self._limit and len(self._cache) > len(wanted):
                _, dropped = self._cache.popitem(last=False)
                self._held -= len(dropped)
            return found


class NodeBodies(Mapping[bytes, bytes]):
    """One version's tree nodes, by id: every node's size kept, its bytes read through a
    :class:`NodeReader` when asked. ``wanted`` (default: all) are the nodes the copy expects
    to need -- those it sends or whose rows the destination lacked when planned --, read from
    the source together on a miss; any other (a node whose row the destination's gc purged
    since the plan) is read when asked too."""

    __slots__ = ("_reader", "_sizes", "wanted")

    def __init__(self, reader: NodeReader, sizes: dict[bytes, int],
                 wanted: Iterable[bytes] | None = None) -> None:
        self._reader, self._sizes = reader, sizes
        self.wanted: tuple[bytes, ...] = tuple(sizes if wanted is None else wanted)

    def __getitem__(self, node_id: bytes) -> bytes:
        if node_id not in self._sizes:
            raise KeyError(node_id)
        return self._reader.get(node_id, self.wanted)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._sizes

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def size(self, node_id: bytes) -> int:
        """Node ``node_id``'s raw length, without reading it."""
        return self._sizes[node_id]


def node_size(nodes: Mapping[bytes, bytes], node_id: bytes) -> int:
    """The raw length of node ``node_id`` of ``nodes`` (a :class:`NodeBodies` reads nothing)."""
    return nodes.size(node_id) if isinstance(nodes, NodeBodies) else len(nodes[node_id])
