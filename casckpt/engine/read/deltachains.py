"""Delta-coded chunks read through their chains: the delta half of every read.

A delta-coded chunk needs its base chunk's raw bytes, and the base may be a delta itself.
:class:`DeltaReader` is the interface: built for one read with the locations the reader
found, its :meth:`DeltaReader.read` fills every wanted delta's destinations with its
verified raw bytes. Inside:

- every chain of the read is located first, all at once (one catalog query per step down,
  for all chains);
- chains are decoded in windows holding about :data:`DELTA_WINDOW` bytes (wanted raw bytes
  and the payloads of their chain nodes);
- the fast path: all of a window's chain nodes are read in one planned pass of coalesced
  ranges (:func:`~casckpt.engine.read.chunkreads.read_located`; keyframes decoded as they
  land, deltas kept as read), then each tree of chains is decoded by one task on the pool,
  root to leaves, so the cost follows the bytes, not the depth. Every wanted chunk is
  verified against its id at the end of its chain;
- the verifying path, on any mismatch: the window decoded again level by level (keyframes
  first), every level verified inside its read, which names the damaged chunk (so a corrupt
  base is reported by the chunks that need it) and, with redundancy, reconstructs its pack.

Both paths decode a node with the same step (:mod:`~casckpt.engine.read.deltadecode`);
the verifying one checks every node, the fast one each wanted chunk. Decoded bases several
chunks share stay in a bounded cache for later windows.

Thread-safety: one reader serves one read; its tree tasks run on the engine's pool and
share nothing but what they return.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from casckpt.catalog import ChunkLocation
from casckpt.engine.context import EngineContext
from casckpt.engine.read.chunkreads import Destination, Slot, locate, pool_results, read_located
from casckpt.engine.read.deltadecode import Rep, decode_delta, decode_keyframe
from casckpt.errors import CorruptChunkError, IntegrityError
from casckpt.format.codecs import Delta, lookup
from casckpt.format.pack import check_entry_header

DELTA_WINDOW = 256 << 20  # raw bytes of delta-coded chunks decoded per window
DECODED_BASES = 256 << 20  # raw bytes of decoded bases kept for chunks of later windows
_TREES_PER_TASK = 8 << 20  # raw bytes of delta chains one pool task decodes
_MAX_CHAIN = 1024  # no sane chain is this long: a cycle in a damaged catalog


class DeltaReader:
    """Decodes the delta chains of one read, window by window (see the module docstring).

    Built with the read's ``locations`` (every wanted chunk located and checked by
    :func:`~casckpt.engine.read.chunkreads.locate`; the reader locates their bases itself),
    ``describe`` (what a wanted chunk belongs to, for messages), ``last_try`` (a pack gone
    mid-read is then missing data, not a retry) and ``heal`` (whether a reconstructed pack
    heals its shards). Call :meth:`read` once.
    """

    def __init__(self, ctx: EngineContext, locations: dict[bytes, ChunkLocation],
                 describe: Callable[[bytes], str], last_try: bool, heal: bool) -> None:
        self.ctx, self.locations, self.last_try, self.heal = ctx, dict(locations), last_try, heal
        self.describe_wanted = describe
        self.needed_by: dict[bytes, bytes] = {}  # base -> a wanted chunk that needs it (for messages)
        self.dependents: dict[bytes, int] = {}  # base -> how many deltas of the whole read need it
        self.decoded: OrderedDict[bytes, Rep] = OrderedDict()  # bounded LRU of decoded bases
        self.decoded_bytes = 0

    def describe(self, cid: bytes) -> str:
        user = self.needed_by.get(cid)
        if user is None:
            return self.describe_wanted(cid)
        return f"the delta base {cid.hex()[:12]} of {self.describe_wanted(user)}"

    def read(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """Fill every destination of every wanted delta-coded chunk with its verified raw bytes;
        returns the bytes read from the blob store.

        Raises:
            MissingDataError: a base is unknown to the catalog, or a pack is gone.
            CorruptChunkError: a chain is damaged (the chunk named is the damaged one), or the
                catalog records a chain no writer makes.
            PackGone: a pack vanished mid-read and this is not the last try.
        """
        self._locate_chains(wanted)
        return sum(self._window(window) for window in self._windows(wanted))

    def _locate_chains(self, ids: Iterable[bytes]) -> None:
        """Locate every base of every chain ``ids`` need, down to their keyframes: all chains at
        once, one catalog query per step down."""
        frontier, seen = list(ids), set[bytes]()
        while frontier:
            missing: list[bytes] = []
            onward: list[bytes] = []
            for cid in frontier:
                base_hex = self.locations[cid].base_id
                if cid in seen or base_hex is None:
                    continue
                seen.add(cid)
                base = bytes.fromhex(base_hex)
                self.dependents[base] = self.dependents.get(base, 0) + 1
                self.needed_by.setdefault(base, self.needed_by.get(cid, cid))
                (onward if base in self.locations else missing).append(base)
            if missing:
                self.locations.update(locate(self.ctx, dict.fromkeys(missing), self.describe))
            frontier = onward + missing

    def _windows(self, wanted: Mapping[bytes, list[Destination]]) -> Iterator[dict[bytes, list[Destination]]]:
        """``wanted`` in windows that hold about :data:`DELTA_WINDOW` bytes at once: the wanted
        chunks' raw bytes and the payloads of the chain nodes they need, each counted once."""
        window: dict[bytes, list[Destination]] = {}
        nodes: set[bytes] = set()
        size = 0
        for cid, destinations in wanted.items():
            window[cid] = destinations
            size += self.locations[cid].raw_len
            for node in self._chain(cid, nodes):
                if node not in nodes:
                    nodes.add(node)
                    size += self.locations[node].stored_len
            if size >= DELTA_WINDOW:
                yield window
                window, nodes, size = {}, set(), 0
        if window:
            yield window

    def _chain(self, cid: bytes, known: Container[bytes]) -> list[bytes]:
        """``cid`` and its bases, until a keyframe, a decoded base, or a node in ``known``.

        Raises:
            CorruptChunkError: the chain is longer than any writer makes (a cycle in a damaged
                catalog), or a base is not as long as the delta coded against it.
        """
        chain, seen = [cid], {cid}
        while chain[-1] not in known:
            loc = self.locations[chain[-1]]
            if loc.base_id is None or bytes.fromhex(loc.base_id) in self.decoded:
                break
            base = bytes.fromhex(loc.base_id)
            if self.locations[base].raw_len != loc.raw_len:
                raise CorruptChunkError(
                    f"chunk {chain[-1].hex()} is delta-coded against {base.hex()}, which the catalog "
                    "records with another length: the catalog is damaged. Run `casckpt check --read-data`.",
                    chunk_id=chain[-1].hex())
            if len(chain) > _MAX_CHAIN or base in seen:
                raise CorruptChunkError(
                    f"chunk {cid.hex()} has a delta chain that loops or is longer than {_MAX_CHAIN}: the "
                    "catalog is damaged. Run `casckpt check --read-data`.", chunk_id=cid.hex())
            chain.append(base)
            seen.add(base)
        return chain

    def _window(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """Decode a window's chains, verifying each wanted chunk once at the end of its chain; on
        any mismatch, decode again level by level verifying every level (which finds the damaged
        chunk and, with redundancy, reconstructs its pack and heals its shards)."""
        try:
            return self._decode_chains(wanted)
        except IntegrityError:
            self.decoded.clear()  # bases decoded on the fast path were not verified
            self.decoded_bytes = 0
            return self._decode_levels(wanted)

    def _decode_chains(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """The fast path: every chain node of the window read in one planned pass (keyframes decoded
        as they land, deltas kept as read), then each tree of chains decoded by one task on the pool,
        from its root to its leaves, in grouped byte order (see :mod:`~casckpt.engine.read.deltadecode`)."""
        trees = self._trees(wanted)
        roots: dict[bytes, Rep] = dict(trees.kept)
        deltas: dict[bytes, Slot] = {}
        lock = threading.Lock()

        def landed(plan: Sequence[Slot]) -> None:
            for slot in plan:
                entry = slot.entry
                if entry.base_id is None:  # verified through its dependents
                    rep = decode_keyframe(self.ctx.crypto.chunk_id, slot, verify=False)
                    with lock:
                        roots[entry.chunk_id] = rep
                else:  # its header now (a damaged one reconstructs the pack here); its payload later
                    check_entry_header(slot.header, entry, slot.pack_id)
                    with lock:
                        deltas[entry.chunk_id] = slot

        targets = {cid: [trees.into[cid]] if cid in trees.into else [] for cid in trees.nodes}
        done = read_located(self.ctx, targets, self.locations, self.describe, None, self.last_try,
                            self.heal, landed)
        decode = partial(self._decode_trees, trees, roots, deltas, wanted)
        for kept in pool_results(self.ctx, decode, self._batches(roots), None):
            for cid, rep in kept:
                self._remember(cid, rep)
        return done

    def _batches(self, roots: Iterable[bytes]) -> list[list[bytes]]:
        """Tree roots in pool tasks of about :data:`_TREES_PER_TASK` raw bytes (a task per 1 MiB
        chain cost more to hand over than to run)."""
        batches: list[list[bytes]] = [[]]
        size = 0
        for root in roots:
            if size >= _TREES_PER_TASK:
                batches.append([])
                size = 0
            batches[-1].append(root)
            size += self.locations[root].raw_len
        return batches

    def _decode_trees(self, trees: _Trees, roots: Mapping[bytes, Rep], deltas: Mapping[bytes, Slot],
                      wanted: Mapping[bytes, list[Destination]], batch: Sequence[bytes],
                      ) -> list[tuple[bytes, Rep]]:
        return [kept for root in batch for kept in self._decode_tree(trees, roots, deltas, wanted, root)]

    def _trees(self, wanted: Mapping[bytes, list[Destination]]) -> _Trees:
        """The window's chains as trees rooted at keyframes and at bases decoded in earlier windows."""
        nodes: dict[bytes, None] = {}
        for cid in wanted:
            nodes.update(dict.fromkeys(self._chain(cid, nodes)))
        children: dict[bytes, list[bytes]] = {}
        kept: dict[bytes, Rep] = {}
        for cid in nodes:
            base_hex = self.locations[cid].base_id
            if base_hex is not None:
                base = bytes.fromhex(base_hex)
                children.setdefault(base, []).append(cid)
                if base not in nodes:
                    kept[base] = self.decoded[base]  # held here: remembering others may evict it
        into: dict[bytes, Destination] = {}
        for cid in nodes:  # a keyframe starting one chain of sparse deltas: decoded into its end
            if self.locations[cid].base_id is None and cid not in wanted:
                end = self._sparse_end(cid, children, wanted)
                if end is not None:
                    into[cid] = wanted[end][0]
        return _Trees(list(nodes), children, kept, into)

    def _sparse_end(self, root: bytes, children: Mapping[bytes, list[bytes]],
                    wanted: Mapping[bytes, list[Destination]]) -> bytes | None:
        """The wanted chunk at the end of the one chain from ``root``, if every delta on it is sparse
        (patched in element order, so the chain can be decoded where its end lands)."""
        node = root
        while node not in wanted:
            after = children.get(node, ())
            if len(after) != 1 or self._shared(node) \
                    or lookup(self.locations[after[0]].codec).delta is not Delta.SPARSE:
                return None
            node = after[0]
        return node if wanted[node] else None

    def _decode_tree(self, trees: _Trees, roots: Mapping[bytes, Rep], deltas: Mapping[bytes, Slot],
                     wanted: Mapping[bytes, list[Destination]], root: bytes) -> list[tuple[bytes, Rep]]:
        """Decode the chains from ``root`` depth first, each wanted chunk verified at its end and
        copied to its destinations; a base that one delta alone needs is patched in place. Returns
        the decoded bases that several deltas of the read need (:meth:`_shared`, in any window), to
        be remembered for later windows."""
        shared = self._shared(root) or root in trees.kept
        kept = [(root, roots[root])] if shared and root not in trees.kept else []
        todo = [(cid, roots[root], not shared) for cid in trees.children[root]]
        while todo:
            cid, base, own = todo.pop()
            slot, after = deltas[cid], trees.children.get(cid, [])
            destinations = wanted.get(cid, [])
            rep = decode_delta(self.ctx.crypto.chunk_id, slot, base, destinations, end=not after, own=own,
                               verify=cid in wanted)  # wanted with nowhere to go: checked all the same
            shared = self._shared(cid) or bool(destinations)
            if after and shared:
                kept.append((cid, rep))
            todo += [(child, rep, not shared) for child in after]
        return kept

    def _shared(self, base: bytes) -> bool:
        """Whether more than one delta of the whole read needs ``base`` (in this window or a later
        one): it is then neither patched in place nor decoded into a destination, and it is kept
        for the windows after this one."""
        return self.dependents.get(base, 0) > 1

    def _decode_levels(self, wanted: Mapping[bytes, list[Destination]]) -> int:
        """The verifying path: the window's chains read and decoded level by level (keyframes first),
        every level verified inside its read, where a mismatch reconstructs the pack it came from."""
        levels = self._levels(wanted)
        needed = {bytes.fromhex(h) for c in levels if (h := self.locations[c].base_id) is not None}
        reps: dict[bytes, Rep] = {}  # decoded bases of the level being decoded
        done = 0
        for level in range(max(levels.values()) + 1):
            todo = {cid: list(wanted.get(cid, ())) for cid, at in levels.items() if at == level}
            made: dict[bytes, Rep] = {}
            done += read_located(self.ctx, todo, self.locations, self.describe, None, self.last_try,
                                 self.heal, self._verifier(reps, needed, made))
            for cid, rep in reps.items():  # a base's dependents are all one level up: done with it
                self._remember(cid, rep)
            reps = made
        for cid, rep in reps.items():
            self._remember(cid, rep)
        return done

    def _levels(self, window: Iterable[bytes]) -> dict[bytes, int]:
        """Each chain node's level in the window (0: a keyframe or a base decoded before)."""
        levels: dict[bytes, int] = {}
        for cid in window:  # iteratively: a damaged catalog's chain may be as long as it likes
            chain = self._chain(cid, levels)
            level = levels.setdefault(chain[-1], 0)
            for node in reversed(chain[:-1]):
                level += 1
                levels[node] = level
        return levels

    def _verifier(self, reps: Mapping[bytes, Rep], needed: set[bytes], made: dict[bytes, Rep],
                  ) -> Callable[[Sequence[Slot]], None]:
        lock = threading.Lock()
        ids = self.ctx.crypto.chunk_id

        def decode(plan: Sequence[Slot]) -> None:
            for slot in plan:  # the fast path's step, every node checked
                entry = slot.entry
                if entry.base_id is None:
                    rep = decode_keyframe(ids, slot, verify=True)
                else:
                    base = reps[entry.base_id] if entry.base_id in reps else self.decoded[entry.base_id]
                    rep = decode_delta(ids, slot, base, slot.destinations, end=entry.chunk_id not in needed,
                                       verify=True)
                if entry.chunk_id in needed:
                    with lock:
                        made[entry.chunk_id] = rep
        return decode

    def _remember(self, cid: bytes, rep: Rep) -> None:
        size = rep[1].nbytes
        if cid in self.decoded or size > DECODED_BASES:
            return
        self.decoded[cid] = rep
        self.decoded_bytes += size
        while self.decoded_bytes > DECODED_BASES:
            _, old = self.decoded.popitem(last=False)
            self.decoded_bytes -= old[1].nbytes


@dataclass(frozen=True, slots=True)
class _Trees:
    """One window's delta chains, as trees: the nodes to read, each base's dependents in the
    window, the bases decoded in earlier windows that some of them need (``kept``), and the
    keyframes decoded straight into the destination of the one chain of sparse deltas they
    start (``into``)."""

    nodes: list[bytes]
    children: dict[bytes, list[bytes]]
    kept: dict[bytes, Rep]
    into: dict[bytes, Destination]
