"""PyTorch Distributed Checkpoint (DCP) on a casckpt store.

``dcp.save``, ``dcp.async_save`` and ``dcp.load`` work unchanged::

    store = casckpt.open(...)                     # on every rank
    dcp.save(state, storage_writer=store.dcp_writer(run="llama", step=step))
    dcp.load(state, storage_reader=store.dcp_reader("llama@latest"))

Saving (the call order DCP guarantees; see :mod:`casckpt.engine.write.distributed`
for the protocol): every rank chunks, hashes, dedups and writes its own
pieces of the state in ``write_data``; the coordinator refuses a step the run
already has and takes a GC lease in ``prepare_global_plan``, before any rank
writes, and publishes ONE version in ``finish``, which DCP calls only after
every rank succeeded. A rank that fails or dies means no version; the packs
already written are reclaimed by GC. The writer reaches the store only
through :mod:`casckpt.engine.write.distributed` (``begin_save``, ``save_pieces``,
``publish_save``, ``end_save``); the reader through ``engine.restore.read_ranges``.
DCP's metadata is kept as the version's manifest (JSON), never pickled: each
tensor a list of pieces (one rank's box of it: offsets, sizes, chunks; DCP
calls them chunks or shards), each non-tensor value a plain-value node (so a value must be made
of what :func:`casckpt.Store.commit` accepts: dicts, lists, tuples, numbers,
strings, bytes, None).

Loading: the reader serves DCP's metadata from the manifest, so ``dcp.load``
reshards onto any number of ranks; each rank reads only the chunks holding
the bytes its read items need (by range from the packs), verifying every one.
Non-tensor values are handed to DCP's planner re-serialised from their
plain-value nodes: nothing pickled is ever read from the store. Versions made
by :meth:`casckpt.Store.commit` can be loaded the same way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from casckpt.engine.read.degraded import Shortfall
from casckpt.engine.read.restore import read_ranges
from casckpt.engine.versions.extents import tensor_from_extent
from casckpt.engine.write import commit as commit_engine
from casckpt.engine.write.distributed import (
    SaveStart,
    StoredPiece,
    TensorPiece,
    begin_save,
    end_save,
    publish_save,
    rank_lease_id,
    save_pieces,
)
from casckpt.errors import InvalidArgumentError, RestoreTargetError, UnsupportedStateError
from casckpt.format.dtypes import numpy_dtype, torch_dtype
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry, World, rank_count
from casckpt.format.plainpickle import RefusedValue, load_plain
from casckpt.format.state import (
    MAX_DEPTH,
    Node,
    check_state_key,
    decode_state,
    encode_state,
    join_path,
    too_deep,
)

if TYPE_CHECKING:
    from casckpt.engine.context import EngineContext

log = logging.getLogger(__name__)

__all__ = ["StoreReader", "StoreWriter"]


Wire = tuple[Any, ...]
"""A :class:`StoredPiece` as plain values (strings, ints, bytes, tuples), as it travels to the
coordinator: DCP pickles every rank's results, and plain tuples pickle ~30x faster than the
dataclasses (a state of 500+ tensors: ~0.1 s less on the coordinator's critical path)."""


def _to_wire(piece: StoredPiece) -> Wire:
    e = piece.extent
    return (piece.path, piece.dtype, piece.shape, e.nbytes, e.chunk_size, e.chunks, e.phase, e.packed,
            piece.global_shape, piece.global_offset, piece.offset, piece.digest)


def _from_wire(wire: Wire) -> StoredPiece:
    (path, dtype, shape, nbytes, chunk_size, chunks, phase, packed, global_shape, global_offset,
     offset, digest) = wire
    extent = ExtentEntry(nbytes, chunk_size, tuple(chunks), phase, packed)
    return StoredPiece(path, dtype, tuple(shape), extent,
                       None if global_shape is None else tuple(global_shape),
                       None if global_offset is None else tuple(global_offset), offset, digest)


class _Written(NamedTuple):
    """``WriteResult.storage_data``: what a rank stored for one item (travels to the coordinator)."""

    piece: Wire | None = None  # a tensor's piece (see _to_wire)
    value: Node | None = None  # a plain value's node
    new_bytes: int = 0  # the rank's totals, carried by its first result only
    stored_bytes: int = 0
    degraded: tuple[Shortfall, ...] = ()  # packs the rank wrote below their redundancy (first result)


def _end_lease(ctx: EngineContext, starting: concurrent.futures.Future[SaveStart]) -> None:
    """End the GC lease :func:`begin_save` took, if it took one: now if it has returned, else
    when it returns. Never waits: the writer may be collected on begin_save's own thread (a
    garbage collection inside it), where waiting for its result would wait forever."""

    def end(done: concurrent.futures.Future[SaveStart]) -> None:
        try:
            lease = done.result().lease
        except BaseException:  # noqa: BLE001 - it took none; prepare_global_plan reports why
            return
        end_save(ctx, lease)  # reports, never raises, what the catalog could not do

    starting.add_done_callback(end)


def _in_background(work: Callable[[], SaveStart]) -> concurrent.futures.Future[SaveStart]:
    """``work()`` on a thread of its own, its outcome in the future returned."""
    future: concurrent.futures.Future[SaveStart] = concurrent.futures.Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="casckpt-dcp-begin", daemon=True).start()
    return future


def _check_id(checkpoint_id: str | os.PathLike[str] | None, expected: str) -> None:
    if checkpoint_id is not None and str(checkpoint_id) != expected:
        raise InvalidArgumentError(
            f"this casckpt DCP object is for {expected}, not {checkpoint_id!r}; get one from "
            "store.dcp_writer(run=, step=) / store.dcp_reader(ref) for each checkpoint instead "
            "of passing checkpoint_id"
        )


def _value_node(fqn: str, data: io.BytesIO) -> Node:
    """A non-tensor value DCP serialised with torch.save, as a plain-value node (no pickle kept)."""
    try:
        value = load_plain(data.getbuffer())
    except RefusedValue as exc:
        if exc.what == "tensor":
            raise UnsupportedStateError(
                f"the value at {fqn!r} holds tensors inside an object DCP saves as opaque bytes; "
                "put tensors at their own keys of the state dict") from exc
        raise UnsupportedStateError(
            f"cannot store the value at {fqn!r} through DCP: casckpt keeps only plain values "
            f"(dicts, lists, tuples, numbers, strings, bytes, None) and tensors, and it holds "
            f"{exc.what}. Convert it (e.g. int(x), x.isoformat(), x.state_dict()) before saving."
        ) from exc
    return plain_node(value, f"the value at {fqn!r}")


def plain_node(value: Any, what: str,
               advice: str = "put tensors at their own keys of the state dict") -> Node:
    """``value``, a non-tensor value of a DCP state, as a plain-value node; ``what`` names it in
    the errors (the check every integration saving through DCP makes of its objects).

    Raises:
        UnsupportedStateError: ``value`` is not plain, or holds a tensor or array (``advice``
            says what to do).
        InvalidNameError: a key in ``value`` no key of a version may be (e.g. one holding ``/``).
    """
    deep = too_deep(value, MAX_DEPTH - 1)  # a value sits one level below the version's root
    if deep is not None:
        raise UnsupportedStateError(
            f"{what} nests deeper than {MAX_DEPTH - 1} containers (dict, list, tuple) at {deep!r}: "
            f"a value of a DCP save sits one level below the version's root, and casckpt stores "
            f"states up to {MAX_DEPTH} levels deep. Flatten that part (join its keys into one "
            "dotted name) or store it as str or bytes.")
    root, leaves = encode_state(value)
    if leaves:
        raise UnsupportedStateError(
            f"{what} holds tensors inside an object DCP saves as opaque bytes "
            f"(at {leaves[0].path!r}); {advice}"
        )
    return root


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves one version ``run@step`` of a casckpt store.

    Get it from :meth:`casckpt.Store.dcp_writer` on every rank; each writer
    saves one checkpoint (DCP's ``checkpoint_id``, if given, must be
    ``"run@step"``). Thread-safety: one save at a time per writer.
    """

    def __init__(self, ctx: EngineContext, request: commit_engine.CommitRequest) -> None:
        super().__init__()
        self._ctx, self._request = ctx, request
        self._coordinator = False
        self._starting: concurrent.futures.Future[SaveStart] | None = None  # begin_save, running
        self._lease: Callable[[], object] | None = None  # ends the GC lease (weakref.finalize)
        self._start: SaveStart | None = None  # set by the coordinator before any rank writes
        self._busy = 0  # write_data / finish running: the store must stay open
        self._busy_lock = threading.Lock()

    @property
    def checkpoint_id(self) -> str:
        """``run@step``: the version this writer saves."""
        return f"{self._request.run}@{self._request.step}"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a save (DCP calls this first); ends the lease a failed earlier save left."""
        self._ctx.refuse_forked()  # a writer made before a fork: the pools are the parent's
        _check_id(checkpoint_id, self.checkpoint_id)
        self.release()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Learn this rank's role; the coordinator starts :func:`begin_save` (catalog round trips,
        a durable lease) on a thread, so it overlaps DCP's planning instead of following it."""
        self._ctx.refuse_forked()
        if kwargs.get("use_collectives") is False:
            raise InvalidArgumentError(
                "casckpt publishes a version only after every rank wrote its part, which needs "
                "DCP's collectives: call dcp.save without use_collectives=False"
            )
        self._coordinator = is_coordinator
        if is_coordinator:
            self.release()  # a writer set up twice without reset: one lease at a time
            ctx, request = self._ctx, self._request
            self._starting = _in_background(lambda: begin_save(ctx, request))
            # DCP tells no one when a save fails: a writer dropped after a failure ends its
            # lease when it is collected (or the store closes, or it is reused)
            self._lease = weakref.finalize(self, _end_lease, ctx, self._starting)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Each rank stores what DCP planned for it, once every key is one a commit takes
        (:func:`casckpt.format.state.check_state_key`): refused here, before any rank writes."""
        for item in plan.items:
            check_state_key(item.index.fqn, "")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator, before any rank writes: the step refused if taken, the GC lease held
        (``begin_save``, started in :meth:`set_up_storage_writer`, has returned)."""
        if self._starting is None:
            raise InvalidArgumentError("DCP called prepare_global_plan before set_up_storage_writer "
                                       "on the coordinator; save with dcp.save / dcp.async_save")
        self._start = self._starting.result()  # raises what begin_save raised (e.g. VersionExistsError)
        # each rank writes under a lease of its own that the save's end ends too (rank_lease)
        return [dataclasses.replace(plan, storage_data=rank_lease_id(self._start.lease, i))
                for i, plan in enumerate(plans)]

    @property
    def busy(self) -> bool:
        """Whether this writer is writing or publishing right now (e.g. from ``dcp.async_save``)."""
        return self._busy > 0

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Store this rank's items: tensors as chunks (only new ones written), values as nodes."""
        self._ctx.refuse_forked()
        with self._working():
            return self._write(plan, planner)

    def _write(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        values, pieces, indices = [], [], []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = cast(io.BytesIO, planner.resolve_data(item))
                values.append(WriteResult(item.index, data.getbuffer().nbytes,
                                          _Written(value=_value_node(item.index.fqn, data))))
                continue
            tensor = cast(torch.Tensor, planner.resolve_data(item)).detach()
            chunk = item.tensor_data.chunk if item.tensor_data is not None else None
            whole = tuple(item.tensor_data.size) if item.tensor_data is not None else tuple(tensor.shape)
            offsets = tuple(chunk.offsets) if chunk is not None else (0,) * tensor.dim()
            pieces.append(TensorPiece(item.index.fqn, tensor, whole, offsets))
            indices.append(item.index)
        told = plan.storage_data if isinstance(plan.storage_data, str) else ""  # "": a fresh lease id
        lease = None if self._coordinator else told
        wrote = save_pieces(self._ctx, self._request, pieces, lease)
        results = [
            WriteResult(index, piece.extent.nbytes, _Written(piece=_to_wire(piece)))
            for index, piece in zip(indices, wrote.pieces, strict=True)
        ] + values
        if results:
            first = results[0]
            totals = cast(_Written, first.storage_data)._replace(
                new_bytes=wrote.new_bytes, stored_bytes=wrote.stored_bytes, degraded=wrote.degraded)
            results[0] = WriteResult(first.index, first.size_in_bytes, totals)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: publish the version in one transaction."""
        self._ctx.refuse_forked()
        with self._working():
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            written = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data
                       for rank in results for r in rank}
            keys: list[str] = []
            nodes: list[Node] = []
            pieces: list[StoredPiece] = []
            for fqn, meta in metadata.state_dict_metadata.items():
                keys.append(fqn)
                if isinstance(meta, BytesStorageMetadata):
                    nodes.append(cast(Node, written[(fqn, ())].value))
                    continue
                first = len(pieces)
                pieces.extend(_from_wire(cast(Wire, written[(fqn, tuple(c.offsets))].piece))
                              for c in meta.chunks)
                nodes.append({"t": "sharded", "i": list(range(first, len(pieces)))})
            parts = [cast(_Written, r.storage_data) for rank in results for r in rank]
            if self._start is None:
                raise InvalidArgumentError("DCP called finish before prepare_global_plan on the "
                                           "coordinator; save with dcp.save / dcp.async_save")
            publish_save(self._ctx, self._request, self._start, World(len(results), "dcp"),
                         {"t": "dict", "k": keys, "v": nodes}, pieces,
                         sum(p.new_bytes for p in parts), sum(p.stored_bytes for p in parts),
                         [s for p in parts for s in p.degraded])
        finally:
            self.release()

    def release(self) -> None:
        """End the GC lease of a save that did not finish (DCP has no failure hook), once
        ``begin_save`` returned. Idempotent."""
        if self._lease is not None:
            lease, self._lease, self._starting = self._lease, None, None
            lease()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """casckpt writers are never picked from a path: get one from ``store.dcp_writer``."""
        return False


def _box(entry: TensorEntry) -> tuple[int, ...]:
    return entry.global_offset if entry.global_offset is not None else (0,) * len(entry.shape)


def _element_type(entry: TensorEntry) -> torch.dtype:
    """The torch dtype of a stored tensor (a numpy array's native-order equivalent)."""
    if entry.kind == "numpy":
        return torch.from_numpy(np.empty(0, dtype=numpy_dtype(entry.dtype))).dtype
    return torch_dtype(entry.dtype)


def _loadable(entry: TensorEntry) -> bool:
    """Whether DCP can be handed this tensor (not a byte-swapped or otherwise foreign numpy array)."""
    if entry.kind != "numpy":
        return True
    dtype = numpy_dtype(entry.dtype)
    return dtype.isnative and dtype.kind in "biufc"


def _tensor_metadata(entries: Sequence[TensorEntry]) -> TensorStorageMetadata:
    first = entries[0]
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=_element_type(first)),
        size=torch.Size(first.global_shape if first.global_shape is not None else first.shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(_box(t)), sizes=torch.Size(t.shape))
                for t in entries],
    )


def _leaves(node: Node, path: str) -> list[tuple[str, Node]]:
    """``(fqn, node)`` DCP may ask for: tensors, plain values, and containers holding no tensor."""
    kind = node.get("t")
    if kind in ("tensor", "sharded"):
        return [(path, node)]
    if kind not in ("dict", "list", "tuple"):
        return [(path, node)]
    keys: Sequence[str | int] = range(len(node["v"]))
    if kind == "dict":
        keys = [k["i"] if isinstance(k, dict) else k for k in node["k"]]
    out: list[tuple[str, Node]] = []
    for key, child in zip(keys, node["v"], strict=True):
        out.extend(_leaves(child, join_path(path, key)))
    if path and not any(n.get("t") in ("tensor", "sharded") for _, n in out):
        out.append((path, node))
    return out


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` that loads one version of a casckpt store, onto any number of ranks.

    Get it from :meth:`casckpt.Store.dcp_reader` on every rank. Every rank must
    name the same version: the coordinator checks, so a ref such as
    ``run@latest`` that moved between ranks fails the load instead of mixing versions.
    """

    def __init__(self, ctx: EngineContext, version_id: str, manifest: Manifest) -> None:
        super().__init__()
        if rank_count(manifest) is not None:
            raise RestoreTargetError(
                f"{manifest.run}@{manifest.step} was saved rank by rank with Store.commit(group=); "
                "restore it with store.restore(ref, group=...) instead of dcp.load"
            )
        self._ctx, self._version_id, self._manifest = ctx, version_id, manifest
        self._fqns: dict[str, Node] = {}
        self._pieces: dict[tuple[str, tuple[int, ...]], TensorEntry] = {}

    @property
    def checkpoint_id(self) -> str:
        """The id of the version this reader loads."""
        return self._version_id

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a load (DCP calls this first)."""
        self._ctx.refuse_forked()  # a reader made before a fork: the pools are the parent's
        _check_id(checkpoint_id, self._version_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's view of the version: every tensor's pieces, every value, from the manifest."""
        state: dict[str, Any] = {}
        for fqn, node in _leaves(self._manifest.root, ""):
            self._fqns[fqn] = node
            kind = node.get("t")
            if kind in ("tensor", "sharded"):
                indices = node["i"] if kind == "sharded" else [node["i"]]
                entries = [self._manifest.tensors[i] for i in indices]
                if not _loadable(entries[0]):
                    continue  # a byte-swapped numpy array: torch has no such dtype
                state[fqn] = _tensor_metadata(entries)
                self._pieces.update(((fqn, _box(t)), t) for t in entries)
            else:
                state[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=state)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """Nothing to set up: the manifest is at hand."""
        if not self._fqns:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tag the plan with the version id, for the coordinator's check."""
        return dataclasses.replace(plan, storage_data=self._version_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: refuse a load in which ranks named different versions."""
        named = sorted({str(p.storage_data) for p in plans})
        if len(named) > 1:
            raise InvalidArgumentError(
                f"ranks are loading different versions ({', '.join(n[:12] for n in named)}): a ref "
                "such as run@latest moved between ranks. Resolve it once (store.resolve) and pass "
                "the version id to every rank's dcp_reader"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the bytes each item needs (only the chunks holding them), verified, into DCP's tensors."""
        self._ctx.refuse_forked()
        tensors: list[tuple[ReadItem, TensorEntry]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value_bytes(item.storage_index.fqn))
            else:
                tensors.append((item, self._entry(item.storage_index)))
        requests = [_rows(item, entry, self._manifest) for item, entry in tensors]
        targets = [planner.resolve_tensor(item).detach() for item, _ in tensors]
        direct = [target if _reads_into(item, entry, target) else None
                  for (item, entry), target in zip(tensors, targets, strict=True)]
        datas = read_ranges(self._ctx, self._manifest, [r[0] for r in requests], into=direct)
        for (item, entry), (_, start_row), data, target, filled in zip(
                tensors, requests, datas, targets, direct, strict=True):
            if filled is None:
                if entry.stride is not None or not entry.shape:
                    found = tensor_from_extent(entry, data)
                    source = torch.from_numpy(found) if isinstance(found, np.ndarray) else found
                else:
                    source = data.view(_element_type(entry)).reshape(-1, *entry.shape[1:])
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    source = source.narrow(dim, offset - (start_row if dim == 0 else 0), length)
                target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _entry(self, index: MetadataIndex) -> TensorEntry:
        try:
            return self._pieces[(index.fqn, tuple(index.offset or ()))]
        except KeyError:
            raise RestoreTargetError(
                f"{self._manifest.run}@{self._manifest.step} holds no piece of {index.fqn!r} at "
                f"{tuple(index.offset or ())}"
            ) from None

    def _value_bytes(self, fqn: str) -> io.BytesIO:
        node = self._fqns.get(fqn)
        if node is None:
            raise RestoreTargetError(f"{self._manifest.run}@{self._manifest.step} has no value at {fqn!r}")
        buffer = io.BytesIO()
        torch.save(decode_state(node, _no_tensor), buffer)  # DCP's planner torch.loads what it is given
        buffer.seek(0)
        return buffer

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """casckpt readers are never picked from a path: get one from ``store.dcp_reader``."""
        return False


def _no_tensor(index: int, path: str) -> object:
    raise RestoreTargetError(f"{path!r} is a tensor, asked for as a value")


def _reads_into(item: ReadItem, entry: TensorEntry, target: torch.Tensor) -> bool:
    """Whether the item's bytes can be read straight into ``target`` (whole rows of the stored
    piece, landing in a contiguous CPU tensor of the stored dtype): no second copy."""
    return (entry.stride is None and bool(entry.shape) and target.device.type == "cpu"
            and target.is_contiguous() and target.dtype == _element_type(entry)
            and tuple(target.shape) == tuple(item.lengths)
            and all(o == 0 for o in item.storage_offsets[1:])
            and tuple(item.lengths[1:]) == entry.shape[1:])


def _rows(item: ReadItem, entry: TensorEntry, manifest: Manifest) -> tuple[tuple[int, int, int], int]:
    """The byte range of ``entry``'s extent holding the rows ``item`` reads, and its first row.

    A view committed sharing its storage with others is read whole (its extent). A tensor
    packed with small neighbours starts ``entry.offset`` bytes into its extent.
    """
    if entry.stride is not None or not entry.shape:
        return (entry.extent, 0, manifest.extents[entry.extent].nbytes), 0
    itemsize = torch.empty((), dtype=_element_type(entry)).element_size()
    row = entry.numel // entry.shape[0] * itemsize if entry.shape[0] else 0
    first, count = item.storage_offsets[0], item.lengths[0]
    start = entry.offset + first * row
    return (entry.extent, start, start + count * row), first
