"""Megatron-Core (``megatron.core.dist_checkpointing``): the sharded part of a checkpoint in a store.

::

    import casckpt
    from megatron.core import dist_checkpointing
    from casckpt.integrations.megatron import CasckptLoadStrategy, CasckptSaveStrategy

    store = casckpt.open("ckpts/")                          # on every rank
    dist_checkpointing.save(model.sharded_state_dict(), "out/iter_0000100",
                            sharded_strategy=CasckptSaveStrategy(store, run="gpt"))
    dist_checkpointing.load(model.sharded_state_dict(), "out/iter_0000100",
                            sharded_strategy=CasckptLoadStrategy(store))
    # another version than the directory's, e.g. to reshard a run's newest onto a new layout:
    dist_checkpointing.load(..., "out/iter_0000100",
                            sharded_strategy=CasckptLoadStrategy(store, "casckpt://gpt@latest"))

The strategies are Megatron's ``torch_dist`` ones with casckpt's DCP writer and reader
(:mod:`casckpt.dcp`) in place of the file system: every ``ShardedTensor`` becomes a tensor of
the version (each rank writes its own pieces, only chunks the store does not hold yet), every
``ShardedObject`` a plain value beside its tensors (:mod:`casckpt.integrations.megatron_objects`),
and the version is published in one catalog transaction once
every rank has written, so a save killed part way leaves no version. Loading reshards as
``torch_dist`` does (another TP/PP/DP layout): each rank reads only the chunks its pieces need.

Which version: a save becomes version ``run@step`` (``step`` given, or read from a directory
named like Megatron's ``iter_0000100``), tagged with the checkpoint directory it was saved to
(:func:`directory_tag`, the same tag whichever run saves there, so it names the newest save);
a load reads the version tagged with its directory, or the one a ``casckpt://REF`` (or plain
``REF``) given to :class:`CasckptLoadStrategy` names. The version also records the BLAKE3 of
the directory's ``common.pt`` (read as bytes) that Megatron wrote just before: a load by
directory whose ``common.pt`` is another (a later save into the directory was killed before
its version was published) is refused with :class:`~casckpt.errors.MixedCheckpointError`.
A load by ``casckpt://REF`` is not checked: it combines the directory's ``common.pt`` with
the named version's shards, as asked (e.g. a newer ``common.pt`` over older weights).

The checkpoint directory stays Megatron's: ``dist_checkpointing.save`` itself writes
``common.pt`` (the common, non-sharded state, with ``torch.save``) and ``metadata.json``
(which strategy saved it) there, and ``dist_checkpointing.load`` reads them back with its own
``torch`` common strategy, which Megatron does not let a caller replace on save. casckpt keeps
neither file: nothing of them is in the store, so loading from the store unpickles nothing
(DCP's metadata is the version's JSON manifest, the objects plain-value nodes; see
:mod:`casckpt.dcp`). A ``ShardedObject`` may hold what Megatron puts in one (Transformer
Engine's ``_extra_state``, the RNG state, a distributed optimizer's tensors): tensors, numpy
arrays and ``io.BytesIO`` in dicts, lists and tuples of plain values, each tensor and array
stored as a tensor of the version and rebuilt bit for bit on load. An object holding anything
else (another class, a dict key that is not ``str`` or ``int``) is refused with
:class:`~casckpt.errors.UnsupportedStateError` on every rank before any rank writes.

Needs the extra: ``pip install 'casckpt[megatron]'`` (megatron-core 0.16; the strategies use
helpers of its ``torch_dist`` strategy).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from casckpt.errors import (
    CasckptError,
    CheckpointPathNotFoundError,
    CorruptManifestError,
    InvalidArgumentError,
    MixedCheckpointError,
    OptionalDependencyError,
    ReadOnlyStoreError,
    RefNotFoundError,
)
from casckpt.integrations.resume import SCHEME, location_tag, scheme_ref

try:
    import torch
    from blake3 import blake3
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedStateDict,
        ShardedTensor,
        StateDict,
    )
    from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy, SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from casckpt.integrations import megatron_objects as objects
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise OptionalDependencyError(
        f"casckpt.integrations.megatron needs Megatron-Core ({exc}): pip install 'casckpt[megatron]'"
    ) from exc

if TYPE_CHECKING:
    from casckpt.dcp import StoreReader
    from casckpt.store import Store
    from casckpt.types import Version

__all__ = ["BACKEND", "SCHEME", "CasckptLoadStrategy", "CasckptSaveStrategy", "directory_tag"]

BACKEND = "casckpt"
"""The backend name Megatron records in the checkpoint directory's ``metadata.json``."""

FORMAT_VERSION = 1

TAG_PREFIX = "megatron."
"""Tags naming the version saved under each checkpoint directory."""

COMMON_FILE = "common.pt"
"""Megatron's file of the common (non-sharded) state, in the checkpoint directory."""

COMMON_DIGEST = "megatron.common_blake3"
"""The version's metadata key holding the BLAKE3 of the ``common.pt`` saved with it."""

_ITER_DIR = re.compile(r"iter_(\d+)$")


def directory_tag(checkpoint_dir: str | os.PathLike[str]) -> str:
    """The tag naming the newest version saved under ``checkpoint_dir`` (absolute or not), by
    whichever run: a directory saved to again, by the same run or another, moves the tag."""
    return location_tag(TAG_PREFIX, os.fspath(checkpoint_dir))


def _common_digest(checkpoint_dir: str) -> str | None:
    """The BLAKE3 of the directory's ``common.pt``, read as bytes (never unpickled); None if absent."""
    try:
        with open(os.path.join(checkpoint_dir, COMMON_FILE), "rb") as file:
            return blake3(file.read()).hexdigest()
    except FileNotFoundError:
        return None


def _stored_key(key: str) -> str:
    """A Megatron key as a key of the version: ``ShardedObject`` keys hold ``/``
    (``rng/shard_0_2``), which no key of a version may; ``%`` and ``/`` are escaped."""
    return key.replace("%", "%25").replace("/", "%2F")


def _megatron_key(stored: str) -> str:
    return stored.replace("%2F", "/").replace("%25", "%")


class _Expected(NamedTuple):
    """What Megatron's load planner checks of a ShardedTensor, under the version's key."""

    key: str
    global_shape: tuple[int, ...]


def _renamed(tensor: ShardedTensor) -> _Expected:
    return _Expected(_stored_key(tensor.key), tuple(tensor.global_shape))


def _is_object(pieces: list[Any]) -> bool:
    return isinstance(pieces[0], ShardedObject)


def _saved_objects(flat: Mapping[str, list[Any]]) -> tuple[dict[str, Any], CasckptError | None]:
    """This rank's objects as the version keeps them (:mod:`casckpt.integrations.megatron_objects`):
    each key's data (Megatron's list of them) as a plain value, its tensors at their own keys;
    or why one cannot be stored (any casckpt error: it must fail every rank together)."""
    out: dict[str, Any] = {}
    for key, found in flat.items():
        if not _is_object(found):
            continue
        try:
            value, tensors = objects.encode([o.data for o in found], f"ShardedObject {key!r}")
        except CasckptError as exc:
            return {}, exc
        stored = _stored_key(key)
        out[stored] = io.BytesIO()
        torch.save(value, out[stored])  # plain values only: read back with weights_only
        out.update((objects.tensor_key(stored, i), t) for i, t in enumerate(tensors))
    return out, None


def _object_targets(flat: Mapping[str, list[Any]], reader: StoreReader) -> dict[str, Any]:
    """What DCP loads this rank's objects into: each value, and an empty tensor for each of the
    version's tensors of the object."""
    wanted = {_stored_key(k) for k, found in flat.items() if _is_object(found)}
    out: dict[str, Any] = {stored: io.BytesIO() for stored in wanted}  # replaced by the value
    if not wanted:
        return out
    for fqn, meta in reader.read_metadata().state_dict_metadata.items():
        if objects.object_of(fqn) in wanted and isinstance(meta, TensorStorageMetadata):
            out[fqn] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return out


def _loaded_objects(pyt_state: dict[str, Any], flat: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Each object's data rebuilt from its value and tensors, by Megatron key (the objects' values
    and tensors taken out of ``pyt_state``)."""
    tensors: dict[str, torch.Tensor] = {fqn: pyt_state.pop(fqn) for fqn in list(pyt_state)
                                        if objects.object_of(fqn) is not None}
    out: dict[str, Any] = {}
    for key, found in flat.items():
        if _is_object(found):
            stored = _stored_key(key)
            tensor = functools.partial(_object_tensor, tensors, stored)
            out[key] = objects.decode(pyt_state.pop(stored), tensor)
    return out


def _object_tensor(tensors: Mapping[str, torch.Tensor], stored: str, index: int) -> torch.Tensor:
    try:
        return tensors[objects.tensor_key(stored, index)]
    except KeyError:
        raise CorruptManifestError(f"the version has no tensor {index} of object "
                                   f"{_megatron_key(stored)!r}, which its value refers to") from None


def _object_keys(metadata: Metadata) -> list[str]:
    """The stored keys of the version's objects. DCP's reader lists every value inside an object
    too (``shared%2Fshard_0_1.0.epoch``, for a DCP load of a nested state): those are left out."""
    values = {k for k, meta in metadata.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    return [k for k in metadata.state_dict_metadata if k in values
            and not any(k[:i] in values for i, c in enumerate(k) if c == ".")]


class _SavePlanner(MCoreSavePlanner):  # type: ignore[misc]
    """torch_dist's planner, failing every rank's save in DCP's planning step (before any rank
    writes) when one rank's objects cannot be stored: a rank raising alone would leave the
    others waiting in DCP's collectives."""

    def __init__(self, refused: CasckptError | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._refused = refused

    def create_local_plan(self) -> Any:
        if self._refused is not None:
            raise self._refused
        return super().create_local_plan()


@contextlib.contextmanager
def _typed_errors() -> Iterator[None]:
    """DCP wraps every rank's failure in a CheckpointException: re-raise the first casckpt error
    among them (a rank's typed error, with its message saying what to do)."""
    try:
        yield
    except CheckpointException as exc:
        for rank in sorted(exc.failures):
            found = exc.failures[rank][0]
            if isinstance(found, CasckptError):
                raise found from exc
        raise


def _step_of(checkpoint_dir: str | os.PathLike[str]) -> int:
    found = _ITER_DIR.search(Path(os.fspath(checkpoint_dir)).name)
    if found is None:
        raise InvalidArgumentError(
            f"cannot tell the step of {os.fspath(checkpoint_dir)!r}: its name is not Megatron's "
            "iter_NNNNNNN; pass CasckptSaveStrategy(store, run=..., step=N) for each save"
        )
    return int(found.group(1))


class CasckptSaveStrategy(SaveShardedStrategy):  # type: ignore[misc]
    """Megatron's ``torch_dist`` save strategy with a casckpt store in place of the files.

    Pass it as ``dist_checkpointing.save(..., sharded_strategy=...)`` on every rank (each rank
    with its own open store). Each save becomes version ``run@step``, tagged with
    :func:`directory_tag`; a directory saved to again moves its tag to the new version.

    Args:
        store: an open store, on every rank.
        run: the run the checkpoints become versions of.
        step: the step of the next save; None reads it from the directory name
            (``iter_0000100`` is step 100) at every save.
        keep_only_main_replica: as ``torch_dist``: only the main replica of each piece is saved
            (False: every replica goes into the plan and DCP's central plan saves each once,
            from whichever rank it picks, so replicas must be equal, as Megatron requires: an
            object holding tensors could otherwise come back from pieces of two replicas).
        metadata: recorded on every version (with ``megatron.checkpoint_dir`` added).
        metrics: recorded on every version.
        tags: pointed at every version (besides the directory's tag).

    Raises:
        VersionExistsError: (``save``) ``run`` already has a version at the step.
        UnsupportedStateError: (``save``) a ``ShardedObject`` holds something other than tensors,
            numpy arrays, ``io.BytesIO`` and plain values; raised on every rank, before any rank
            writes.
        InvalidNameError: (``save``) a ``ShardedObject`` holds a key no version may (e.g. with
            ``/``); raised on every rank, before any rank writes.
        InvalidArgumentError: (``save``) no step given and the directory is not named ``iter_N``.
        ReadOnlyStoreError: the store was opened read-only (raised here, before Megatron writes
            anything into the checkpoint directory).
    """

    def __init__(self, store: Store, run: str, step: int | None = None, *,
                 keep_only_main_replica: bool = True, metadata: Mapping[str, Any] | None = None,
                 metrics: Mapping[str, float] | None = None, tags: Iterable[str] = ()) -> None:
        super().__init__(BACKEND, FORMAT_VERSION)
        if store.read_only is not None:  # refused here, not in save after common.pt is written
            raise ReadOnlyStoreError(
                f"CasckptSaveStrategy needs write access to the store; it was opened read-only "
                f"because {store.read_only}. Open it writable to save checkpoints into it")
        self.store, self.run, self.step = store, run, step
        self.keep_only_main_replica = keep_only_main_replica
        self.metadata, self.metrics, self.tags = dict(metadata or {}), metrics, tuple(tags)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are saved as plain values of the version, their tensors as tensors."""
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Save every rank's pieces as one version (DCP's collective save; call on every rank)."""
        step = self.step if self.step is not None else _step_of(checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                self.keep_only_main_replica)
        saved, refused = _saved_objects(flat)
        sharded = {k: v for k, v in flat.items() if not _is_object(v)}
        pyt_state = {_stored_key(k): v for k, v in mcore_to_pyt_state_dict(sharded, False).items()}
        pyt_state.update(saved)
        where = os.path.abspath(os.fspath(checkpoint_dir))
        metadata = {**self.metadata, "megatron.checkpoint_dir": where}
        # dist_checkpointing.save has rank 0 (DCP's coordinator, whose metadata the version gets)
        # write common.pt before it calls this strategy: record which common.pt the shards go with
        common = _common_digest(where) if torch.distributed.get_rank() == 0 else None
        if common is not None:
            metadata[COMMON_DIGEST] = common
        writer = self.store.dcp_writer(
            run=self.run, step=step, metrics=self.metrics, metadata=metadata,
            tags=(*self.tags, directory_tag(where)))
        # every replica in the plan: DCP's central global plan dedups them (Megatron's own
        # decentralized plan asserts it is given only main replicas)
        planner = _SavePlanner(refused,
                               dedup_replicated_tensors=not self.keep_only_main_replica,
                               can_run_decentralized_global_plan=self.keep_only_main_replica,
                               flatten_state_dict=False)
        with _typed_errors():
            dcp_save(pyt_state, storage_writer=writer, planner=planner)


class CasckptLoadStrategy(LoadShardedStrategy):  # type: ignore[misc]
    """Megatron's ``torch_dist`` load strategy reading a version of a casckpt store.

    Pass it as ``dist_checkpointing.load(..., sharded_strategy=...)`` on every rank. The
    version is the one ``ref`` names (``casckpt://REF`` or ``REF``: ``gpt@latest``,
    ``gpt@100``, a tag, an id), or else the newest one saved under the checkpoint directory
    (by whichever run saved there last). Loads reshard onto any
    layout whose global shapes match, as ``torch_dist`` does.

    Raises:
        InvalidArgumentError: ``casckpt://`` with no ref after it; (``load``) the ranks'
            resolves of ``ref`` named different versions (a save moved ``run@latest`` between
            them: each rank resolves ``ref`` itself, and DCP's coordinator refuses a mix). To
            be sure, resolve it once (``store.resolve``) and pass ``casckpt://<version id>``.
        CheckpointPathNotFoundError: (``load``) no version was saved under the directory.
        RefNotFoundError, AmbiguousRefError: (``load``) a bad ``ref``.
        MixedCheckpointError: (``load`` by directory) the directory's ``common.pt`` is not the
            one saved with the directory's version (a later save there did not finish).
    """

    def __init__(self, store: Store, ref: str | None = None) -> None:
        super().__init__()
        self.store = store
        self.ref = ref if ref is None else (scheme_ref(ref) if ref.startswith(SCHEME) else ref)
        if self.ref == "":
            raise InvalidArgumentError(f"no ref after {SCHEME}: name a version, e.g. {SCHEME}gpt@latest")

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are rebuilt from the version's plain values and tensors."""
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Any backend's directory: the sharded part is read from the store, not from it."""

    def check_version_compatibility(self, loaded_version: int) -> None:
        """See :meth:`check_backend_compatibility`."""

    def version(self, checkpoint_dir: str | os.PathLike[str]) -> Version:
        """The version a load of ``checkpoint_dir`` reads (see the class text)."""
        if self.ref is not None:
            return self.store.resolve(self.ref)
        where = os.path.abspath(os.fspath(checkpoint_dir))
        try:
            found = self.store.resolve(f"tag:{directory_tag(where)}")
        except RefNotFoundError:
            raise CheckpointPathNotFoundError(
                where, "no version of the store was saved under this checkpoint directory (saved "
                "without CasckptSaveStrategy, or to another store); pass "
                f"CasckptLoadStrategy(store, '{SCHEME}<run>@<step>') to name one", []) from None
        recorded = found.metadata.get(COMMON_DIGEST)
        if recorded is not None and recorded != _common_digest(where):
            raise MixedCheckpointError(
                f"{where}/{COMMON_FILE} is not the one saved with version {found.run}@{found.step} "
                f"({found.id[:12]}), the newest this directory was saved to: a later save into the "
                "directory stopped after Megatron wrote its common state, before its version was "
                "published. Save again, or load a version on purpose with "
                f"CasckptLoadStrategy(store, '{SCHEME}{found.run}@{found.step}') (the directory's "
                f"{COMMON_FILE} is then loaded with that version's shards as they are)")
        return found

    def _reader(self, checkpoint_dir: str | os.PathLike[str]) -> StoreReader:
        return self.store.dcp_reader(self.version(checkpoint_dir).id)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """Fill ``sharded_state_dict``'s pieces from the version (DCP's collective load)."""
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        sharded = {k: v for k, v in flat.items() if not _is_object(v)}
        pyt_state = {_stored_key(k): v for k, v in mcore_to_pyt_state_dict(sharded, True).items()}
        reader = self._reader(checkpoint_dir)
        pyt_state.update(_object_targets(flat, reader))
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[_renamed(t) for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={_stored_key(t.key): _renamed(t)
                                                  for t in tensors if t.allow_shape_mismatch})
        with _typed_errors():
            dcp_load(pyt_state, storage_reader=reader, planner=planner)
        rebuilt = _loaded_objects(pyt_state, flat)
        loaded = {_megatron_key(k): _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state.items()}
        loaded.update(rebuilt)
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded

    def _metadata(self, checkpoint_dir: str | os.PathLike[str]) -> Metadata:
        return self._reader(checkpoint_dir).read_metadata()

    def load_tensors_metadata(self, checkpoint_dir: str | Path,
                              metadata: Metadata | None = None) -> dict[str, Any]:
        """Every tensor's global shape and dtype, as ``torch_dist`` gives them (no data)."""
        found = metadata if metadata is not None else self._metadata(checkpoint_dir)
        out: dict[str, Any] = {}
        for stored, meta in found.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata) and objects.object_of(stored) is None:
                key = _megatron_key(stored)
                empty = torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Every tensor's and object's metadata, as ``torch_dist`` gives them (no data)."""
        metadata = self._metadata(checkpoint_dir)
        found = [ShardedObject.empty_from_unique_key(_megatron_key(k)) for k in _object_keys(metadata)]
        return {**{o.unique_key: o for o in found}, **self.load_tensors_metadata(checkpoint_dir, metadata)}
