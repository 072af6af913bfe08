"""What ``CasckptCheckpointIO`` does, without importing Lightning.

:class:`StoreCheckpointIO` turns Lightning's checkpoint calls into store operations; the
classes Lightning accepts as plugins (:mod:`casckpt.integrations.lightning` for
``lightning.pytorch``, :mod:`casckpt.integrations.pytorch_lightning` for the
``pytorch_lightning`` package) add only the base class of their framework.

How paths become versions. Lightning names a checkpoint by the file path ``ModelCheckpoint``
picks (``.../epoch=0-step=40.ckpt``, ``.../last.ckpt``); the store names a version by
``run@step``. Each save commits the checkpoint dict as version ``run@global_step`` and points
a *path tag* at it: ``lightning.<stem>.<digest>``, where the digest is of the run and the
absolute path (so a tag can name any path, and two runs writing one directory never share
one). The first path a version was saved under is also its metadata ``lightning.path``.

* Several saves at one step (``ModelCheckpoint`` writes ``epoch=..-step=N.ckpt`` and then
  ``last.ckpt`` at the same step): the store holds one version per ``(run, step)``, so the
  first save commits and the later ones only point their path tag at that version. They
  hold the same weights and optimizer state; ``ModelCheckpoint``'s own bookkeeping in the
  later dicts (``last_model_path``) is not kept -- Lightning restores it from the dict it
  loads and it only decides which files to remove next. A later save whose weights or
  optimizer state differ from the stored ones (``StochasticWeightAveraging`` swaps weights
  in at the end of fit without a step; a weights-only save first, a full one second) is
  refused with :class:`~casckpt.errors.VersionExistsError` rather than named: its path would
  load other tensors than were saved. The check is free when the tensors are the very ones
  committed, untouched; otherwise the stored version is read back and compared bit for bit.
* A step already in the run from an earlier training (a restarted job reusing the run
  name) is refused with :class:`~casckpt.errors.VersionExistsError`, unless this plugin
  loaded that very version to resume from (a save right after resuming holds that state).
* A path saved again at a later step (``last.ckpt``, a fixed ``filename``) moves its tag to
  the new version, as a file would be overwritten.
* ``remove_checkpoint(path)``, and an overwrite, delete the version the path named
  (``Store.delete``: soft, undeletable until GC) once no live path tag and no tag of the
  user's own names it. A removal while another path still names the version is
  remembered by this plugin object only: after a restart that version is kept until
  retention or ``casckpt delete`` removes it (space, never data, is what can be lost).

Only plain data is stored: tensors, numbers, strings, bytes, None, lists, tuples and dicts.
Dict subclasses (``AttributeDict`` hyper-parameters, ``OrderedDict`` state dicts) become
plain dicts; a dict whose str keys could not be a tensor path (``ModelCheckpoint``'s
``best_k_models`` is keyed by file paths, and ``/`` is not allowed in a key) is stored as a
``{"casckpt.pairs": [(key, value), ...]}`` node and comes back as the dict it was (so is a
dict holding that key itself, lest it be read back as such a node). Anything
else is refused with its key path, before anything is written.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casckpt.engine.versions.validate import check_name
from casckpt.errors import (
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    InvalidNameError,
    RefNotFoundError,
    UnsupportedStateError,
    VersionExistsError,
)
from casckpt.format.state import key_ok
from casckpt.integrations.resume import LATEST, SCHEME, location_tag, scheme_ref, version_to_resume
from casckpt.types import Version

if TYPE_CHECKING:
    from casckpt.engine.write.commithandle import CommitHandle
    from casckpt.store import Store

log = logging.getLogger(__name__)

PATH_TAG_PREFIX = "lightning."
"""Tags this plugin points at versions, one per checkpoint path."""

LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
"""The key a Lightning checkpoint dict records its Lightning version under."""

PAIRS = "casckpt.pairs"
"""The single key of a node that stands for a dict whose keys cannot be tensor paths."""



@dataclass
class _Pending:
    """A background commit, and the paths to point at its version once it is visible."""

    handle: CommitHandle
    step: int
    names: list[tuple[str, Version | None, str]]  # (path tag, version it named before, reason)


class StoreCheckpointIO:
    """Lightning's ``CheckpointIO`` calls, served by a casckpt store (see the module text).

    Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, and
    ``load_checkpoint`` on every rank; one object serves one trainer at a time (not
    thread-safe). The store stays open and owned by the caller.

    Args:
        store: an open store (``casckpt.open(...)``).
        run: the run the checkpoints are committed to, one version per global step.
        block: with True (default) a save returns once its version is visible. With False
            it returns once the checkpoint's tensors are snapshotted (``Store.commit(...,
            block=False)``: the tensors are copied into reused host staging) and the commit
            finishes in the background while training goes on. At most one commit is in
            flight: a save at another step, a load, a removal of the path being committed
            and ``teardown`` (which Lightning calls at the end of ``fit``) first wait for
            it and raise its error, if any; a second save at the same step only notes its
            path. A checkpoint whose commit had not been published when the process died
            is not in the store (the ones before it are).

    Raises:
        InvalidNameError: ``run`` is not a valid run name.
    """

    lightning_version: str
    """The framework's version (the subclass for each Lightning package sets it): a checkpoint
    dict carries it, and Lightning migrates a dict that names an older one."""

    def __init__(self, store: Store, run: str, *, block: bool = True) -> None:
        self.store = store
        self.run = check_name(run, "run")
        self.block = block
        self._known: set[str] = set()  # ids this object committed or loaded
        self._removed: set[str] = set()  # path tags removed while their version lives on
        self._pending: _Pending | None = None
        self._prints: tuple[int, dict[str, tuple[Any, ...]]] | None = None  # last commit's tensors

    # -- Lightning's CheckpointIO -----------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path,
                        storage_options: Any | None = None) -> None:
        """Commit ``checkpoint`` as version ``run@checkpoint["global_step"]``, named by ``path``.

        Raises:
            UnsupportedStateError: the dict holds an object that is not plain data (its key
                path is named; nothing is written).
            VersionExistsError: the run already holds that step from another training.
            InvalidArgumentError: ``storage_options`` given, or no int ``global_step``.
        """
        if storage_options is not None:
            raise InvalidArgumentError(
                f"CasckptCheckpointIO takes no storage_options (got {storage_options!r}); the "
                "store's options (casckpt.open) decide how checkpoints are stored")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise InvalidArgumentError(
                f"a Lightning checkpoint carries an int 'global_step', this one has {step!r}; "
                "save through Trainer.save_checkpoint or ModelCheckpoint")
        tag = self.path_tag(path)
        reason = f"lightning: {os.fspath(path)} saved again at step {step}"
        if (self._pending is not None and self._pending.step == step
                and self._unchanged(step, checkpoint)):  # named once it is visible
            self._pending.names.append((tag, self._holder(tag), reason))
            return
        self.wait()
        before = self._holder(tag)
        at_step = self._version_at(step)
        if at_step is None:
            committed = self._commit(checkpoint, path, step, tag)
            if not isinstance(committed, Version):
                self._pending = _Pending(committed, step, [(tag, before, reason)])
                return
            version = committed
        elif at_step.id in self._known or tag in at_step.tags:
            self._check_same_weights(checkpoint, at_step, path)
            version = self.store.tag(at_step.id, tag)
        else:
            raise VersionExistsError(
                f"run {self.run!r} already holds step {step} from an earlier training, so "
                f"{os.fspath(path)!r} cannot be stored: resume with "
                f"ckpt_path='{SCHEME}{self.run}@latest', use a new run name, or delete that "
                f"version first (casckpt delete {self.run}@{step})")
        self._published(version, tag, before, reason)

    def load_checkpoint(self, path: str | Path, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict a ``casckpt://REF`` or a path ``ModelCheckpoint`` saved names.

        Nothing is unpickled whatever ``weights_only`` says: the store holds tensors and
        plain values only.

        First launch: ``casckpt://RUN@latest`` of this plugin's run while the run has no version
        yet (and was not forked) warns on rank zero and returns a :class:`NoCheckpoint`, so the
        fit starts from scratch, as Lightning's ``ckpt_path="last"`` does before the first
        save: the first launch and every restart pass the same ``ckpt_path``. Any other ref
        (another run, a step, a tag) must name a version.

        Args:
            path: ``casckpt://run@latest`` (any ref after ``casckpt://``) or a path this run
                saved a checkpoint under (``best_model_path``, ``last_model_path``).
            map_location: None, a device or a device string for the tensors.
            weights_only: accepted for Lightning's signature; loading is always safe.

        Raises:
            CheckpointPathNotFoundError: no live version was saved under ``path``.
            RefNotFoundError, AmbiguousRefError: a bad ref after ``casckpt://``.
            InvalidArgumentError: ``map_location`` is a dict or a function.
        """
        if map_location is not None and (callable(map_location) or isinstance(map_location, Mapping)):
            raise InvalidArgumentError(
                "CasckptCheckpointIO takes map_location as a device or a device string "
                f"(e.g. 'cpu', 'cuda:0'), not {type(map_location).__name__}")
        self.wait()
        if os.fspath(path) == f"{SCHEME}{self.run}{LATEST}":
            found = version_to_resume(self.store, f"{self.run}{LATEST}")
            if found is None:
                self.warn(f"ckpt_path={os.fspath(path)!r} is set, but run {self.run!r} has no "
                          "version yet: no checkpoint will be loaded and training starts from scratch")
                return NoCheckpoint({LIGHTNING_VERSION_KEY: self.lightning_version})
            version = found
        else:
            version = self.resolve(path)
        self._known.add(version.id)
        state = self.store.restore(version.id, map_location=map_location)
        loaded = from_plain(state)
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(
                f"{os.fspath(path)!r} names version {version.run}@{version.step}, which holds a "
                f"{type(loaded).__name__}, not a Lightning checkpoint dict; name a version "
                "committed through CasckptCheckpointIO")
        return loaded

    def remove_checkpoint(self, path: str | Path) -> None:
        """``ModelCheckpoint`` no longer keeps ``path``: delete the version it names once no
        other path or tag names it. A path that names nothing is ignored (as a missing file)."""
        tag = self.path_tag(path)
        if self._pending is not None and any(tag == name[0] for name in self._pending.names):
            self.wait()
        holder = self._holder(tag)
        if holder is None:
            log.debug("remove_checkpoint(%r): no live version saved under it", os.fspath(path))
            return
        self._removed.add(tag)
        self._delete_if_unnamed(holder.id, f"lightning: ModelCheckpoint removed {os.fspath(path)}")

    def teardown(self) -> None:
        """Wait for a background commit (``block=False``); the store stays open (it is the caller's).

        Raises:
            CasckptError: why that commit failed.
        """
        self.wait()

    def wait(self) -> None:
        """Wait until the background commit of the last save (``block=False``) is visible.

        Raises:
            CasckptError: why that commit failed (no version was published for it).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        version = pending.handle.wait()  # the first path's tag came with the commit
        for i, (tag, before, reason) in enumerate(pending.names):
            self._published(version if i == 0 else self.store.tag(version.id, tag), tag, before, reason)

    def warn(self, message: str) -> None:
        """Warn the user (the subclasses warn on global rank zero only, as Lightning does)."""
        warnings.warn(message, stacklevel=3)

    # -- names ------------------------------------------------------------------

    def resolve(self, path: str | Path) -> Version:
        """The version ``path`` names (``casckpt://REF`` or a saved checkpoint path).

        Raises:
            CheckpointPathNotFoundError, RefNotFoundError: as :meth:`load_checkpoint`.
        """
        text = os.fspath(path)
        ref = scheme_ref(text)
        if ref is not None:
            if not ref:
                raise RefNotFoundError(text, "no ref after casckpt://", [f"{SCHEME}{self.run}@latest"])
            return self.store.resolve(ref)
        tag = self.path_tag(path)
        holder = None if tag in self._removed else self._holder(tag)
        if holder is None:
            raise CheckpointPathNotFoundError(
                text, f"run {self.run!r} holds no checkpoint saved under this path (never saved "
                "through casckpt, removed by ModelCheckpoint since, or saved to another run); "
                f"pass ckpt_path='{SCHEME}{self.run}@latest' or '{SCHEME}<ref>' "
                f"(`casckpt log {self.run}` lists the versions)", [f"{SCHEME}{self.run}@latest"])
        return holder

    def path_tag(self, path: str | Path) -> str:
        """The tag naming the version saved under ``path`` in this run."""
        return location_tag(PATH_TAG_PREFIX, os.fspath(path), self.run)

    # -- internals ---------------------------------------------------------------

    def _commit(self, checkpoint: dict[str, Any], path: str | Path, step: int,
                tag: str) -> Version | CommitHandle:
        plain, metadata = to_plain(checkpoint), {"lightning.path": os.fspath(path)}
        try:
            if self.block:
                done: Version | CommitHandle = self.store.commit(
                    plain, run=self.run, step=step, tags=(tag,), metadata=metadata)
            else:
                done = self.store.commit(plain, run=self.run, step=step, tags=(tag,),
                                         metadata=metadata, block=False)
            self._prints = (step, _fingerprint(checkpoint))
            return done
        except (UnsupportedStateError, InvalidNameError) as exc:
            raise type(exc)(
                f"Lightning checkpoint {os.fspath(path)!r} (step {step}) was not stored: {exc} "
                "(casckpt stores tensors and plain values only: return such data from "
                "state_dict / on_save_checkpoint, or leave the object out of save_hyperparameters)"
            ) from exc

    def _unchanged(self, step: int, checkpoint: Mapping[str, Any]) -> bool:
        """Whether ``checkpoint``'s weights and optimizer state are the very tensors this object
        committed at ``step``, untouched since (same storage, same in-place version counter)."""
        return self._prints is not None and self._prints == (step, _fingerprint(checkpoint))

    def _check_same_weights(self, checkpoint: Mapping[str, Any], version: Version,
                            path: str | Path) -> None:
        """A save at a step already stored only names that version: refuse one whose weights or
        optimizer state differ (StochasticWeightAveraging swaps weights at train end, at the
        same step), rather than let its path load the stored ones."""
        step = version.step
        if self._unchanged(step, checkpoint):
            return
        stored = _weights(from_plain(self.store.restore(version.id, map_location="cpu")))
        for where, tensor in _weights(checkpoint).items():
            other = stored.get(where)
            if other is None or not _bitwise_equal(tensor, other):
                raise VersionExistsError(
                    f"{os.fspath(path)!r} holds other weights or optimizer state ({where}) than "
                    f"{self.run}@{step}, which the store already holds for step {step} (weights "
                    "changed without a training step, e.g. by StochasticWeightAveraging at the "
                    "end of fit), and a run holds one version per step, so it was not stored: "
                    f"commit it yourself under another run (store.commit(..., run="
                    f"'{self.run}-final', step={step})) or save it after another step")
        self._prints = (step, _fingerprint(checkpoint))

    def _published(self, version: Version, tag: str, before: Version | None, reason: str) -> None:
        self._known.add(version.id)
        self._removed.discard(tag)
        if before is not None and before.id != version.id:
            self._delete_if_unnamed(before.id, reason)

    def _version_at(self, step: int) -> Version | None:
        try:
            return self.store.resolve(f"{self.run}@{step}")
        except RefNotFoundError:
            return None

    def _holder(self, tag: str) -> Version | None:
        try:
            return self.store.resolve(f"tag:{tag}")  # a deleted version is not found
        except RefNotFoundError:
            return None

    def _delete_if_unnamed(self, version_id: str, reason: str) -> None:
        try:
            version = self.store.resolve(version_id)
        except RefNotFoundError:
            return  # deleted meanwhile
        if all(t in self._removed for t in version.tags):
            self.store.delete(version.id, reason=reason)


def to_plain(obj: Any) -> Any:
    """``obj`` with dict subclasses as plain dicts and path-keyed dicts as pair nodes."""
    if isinstance(obj, dict):
        items = [(key, to_plain(value)) for key, value in obj.items()]
        if any(isinstance(key, str) and (key == PAIRS or not key_ok(key)) for key, _ in items):
            return {PAIRS: [(key, value) for key, value in items]}
        return dict(items)
    if type(obj) is list:
        return [to_plain(v) for v in obj]
    if type(obj) is tuple:
        return tuple(to_plain(v) for v in obj)
    return obj


def from_plain(obj: Any) -> Any:
    """The inverse of :func:`to_plain` (dict subclasses stay plain dicts)."""
    if isinstance(obj, dict):
        pairs = obj.get(PAIRS) if len(obj) == 1 else None
        if isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                   for p in pairs):
            return {key: from_plain(value) for key, value in pairs}
        return {key: from_plain(value) for key, value in obj.items()}
    if type(obj) is list:
        return [from_plain(v) for v in obj]
    if type(obj) is tuple:
        return tuple(from_plain(v) for v in obj)
    return obj


class NoCheckpoint(dict[str, Any]):
    """What :meth:`StoreCheckpointIO.load_checkpoint` returns on a first launch: a checkpoint
    that is false. Lightning restores nothing from a false checkpoint (each of its restore
    steps starts with ``if not self._loaded_checkpoint: return``, the state of a fit given no
    ``ckpt_path``); the only key, the Lightning version, is what its migration reads first."""

    def __bool__(self) -> bool:
        return False


_SAME_STATE = ("state_dict", "optimizer_states")
"""What several saves at one step must share: they are stored as one version."""


def _weights(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors under ``state_dict`` and ``optimizer_states``, by key path."""
    import torch  # Lightning is loaded whenever a checkpoint reaches here

    out: dict[str, Any] = {}

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[where] = obj
        elif isinstance(obj, Mapping):
            for key, value in obj.items():
                walk(value, f"{where}/{key!r}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{where}/{i}")

    for key in _SAME_STATE:
        if key in checkpoint:
            walk(checkpoint[key], key)
    return out


def _fingerprint(checkpoint: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {where: (t.data_ptr(), t._version, tuple(t.shape), t.dtype, tuple(t.stride()), str(t.device))
            for where, t in _weights(checkpoint).items()}


def _bitwise_equal(a: Any, b: Any) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.detach().cpu().reshape(-1).contiguous().view(torch.uint8),
                            b.detach().cpu().reshape(-1).contiguous().view(torch.uint8)))

