"""DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` through a casckpt store.

::

    engine, *_ = deepspeed.initialize(model=..., config=ds_config)   # on every rank
    ckpt = casckpt.integrations.deepspeed.install(engine)             # ds_config["casckpt"]
    load_checkpoint(engine, "ckpt")                                   # resume, or start fresh
    ...
    engine.save_checkpoint("ckpt")                                    # a version per tag

:func:`install` puts a :class:`CasckptCheckpointEngine` where DeepSpeed keeps its checkpoint
engine (``engine.checkpoint_engine``; DeepSpeed picks its own engines from the JSON config and
has no hook for others). The store and run come from the ``"casckpt"`` section of the DeepSpeed
config (``{"casckpt": {"store": URL, "run": NAME}}``), or from ``install(engine, store=...,
run=...)``.

How a tag becomes a version. Each ``save_checkpoint(dir, tag)`` hands the engine one dict per
file (the model states on data-parallel rank 0, each rank's ZeRO optimizer partition, ...);
``commit`` stores them as ONE version ``run@engine.global_steps``, saved rank by rank
(``Store.commit(..., group=WORLD)``): every rank's files are that rank's state, ``{file name:
dict}``, chunked and deduplicated across ranks and steps (a chunk two ranks hold is written
once). The version is visible only once every rank's files are in; a rank that dies makes the
others fail and publishes nothing. The version carries the DeepSpeed tag (metadata
``deepspeed.tag``, and a store tag ``deepspeed.<tag>.<digest>`` that a later save of the same
tag moves), the save directory and which rank holds which file (``deepspeed.files``).

Files on disk. DeepSpeed finds checkpoint files with ``glob`` and ``os.path.exists`` and keeps
the tag of the last save in ``DIR/latest``, so once a version is published every rank writes, at
each path DeepSpeed named, a *marker*: a small JSON file naming the version (``casckpt://run@step``)
and the file, no data; DeepSpeed then writes ``latest`` as usual. Loading reads nothing from a
marker: the tag is resolved in the catalog and the file's dict restored from the store (every
byte verified), with its objects rebuilt by :mod:`casckpt.integrations.deepspeed_state`; nothing
is unpickled. :func:`load_checkpoint` first writes the markers (and ``latest``) from the catalog,
so a job resumes on a machine whose checkpoint directory is gone; with no tag it resumes what
DeepSpeed would: ``DIR/latest``'s tag when the run holds it, else the run's most recently
committed version (after a rollback, not the highest step). A save at a step the run already
holds (after a rollback) is refused with VersionExistsError on every rank: fork the run.

The commit runs on the training thread, inside ``save_checkpoint``, unless ``background=True``
(or ``"background": true`` in the config section): ``save_checkpoint`` then returns once this
rank's tensors are copied to host memory, and the commit runs on a thread and a gloo process
group of its own (:mod:`casckpt.integrations.deepspeed_async`); the next save, a load and
:meth:`CasckptCheckpointEngine.close` wait for it and raise its failure.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import casckpt
from casckpt.engine.versions.validate import check_name
from casckpt.errors import (
    CasckptError,
    CheckpointPathNotFoundError,
    GroupCommitError,
    InvalidArgumentError,
    InvalidConfigError,
    OptionalDependencyError,
    RefNotFoundError,
    VersionExistsError,
)
from casckpt.integrations.deepspeed_async import BackgroundCommits, snapshot
from casckpt.integrations.deepspeed_files import (
    MARKER_FORMAT,
    check_tag,
    plain_name,
    refuse_foreign_file,
    stored_files,
    stored_tag,
    write_atomically,
    write_marker,
)
from casckpt.integrations.deepspeed_state import decode, encode
from casckpt.integrations.resume import LATEST, version_to_resume
from casckpt.store import Store
from casckpt.types import Version

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise OptionalDependencyError(
        f"casckpt.integrations.deepspeed needs DeepSpeed 0.19 or later ({exc}): "
        "pip install 'casckpt[deepspeed]'") from exc

ENGINE_NAME = "CasckptCheckpointEngine"
CONFIG_KEY = "casckpt"
"""The section of the DeepSpeed config :func:`install` reads: ``{"store": URL, "run": NAME}``."""
TAG_PREFIX = "deepspeed."
__all__ = ["ENGINE_NAME", "MARKER_FORMAT", "CasckptCheckpointEngine", "export_files", "install",
           "load_checkpoint", "write_marker"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
log = logging.getLogger(__name__)


class CasckptCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """A DeepSpeed checkpoint engine that saves each tag as a version of ``run`` (module text).

    DeepSpeed calls, on every rank: ``create(info)``, ``save(state_dict, path)`` for each file
    of this rank, ``commit(info)`` (a collective: every rank of ``group`` calls it), then
    ``load(path, map_location)`` when loading. One engine serves one DeepSpeed engine; not
    thread-safe. The store stays open; :meth:`close` closes it when this engine opened it.

    Args:
        store: an open store (``casckpt.open(...)``), one per rank.
        run: the run each tag is committed to.
        global_steps: returns the training step a commit is stored at (``install`` passes the
            engine's ``global_steps``).
        group: the process group whose ranks save together (default: the whole world).
        background: commit off the training thread (module text); every rank of the world
            must construct the engine at the same point (it makes a process group).

    Raises:
        InvalidNameError: ``run`` is not a valid run name.
    """

    def __init__(self, store: Store, run: str, global_steps: Callable[[], int], *,
                 group: Any = None, owns_store: bool = False, background: bool = False) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self.store = store
        self.run = check_name(run, "run")
        self.global_steps = global_steps
        self.group = group
        self.owns_store = owns_store
        self.last_version: Version | None = None
        """The version the last ``commit`` published on this rank."""
        self._info: CheckpointCommitInfo | None = None
        self._files: dict[str, Any] = {}  # file name in the tag's folder -> encoded dict
        # (version id, rank, its files): one restore serves them all, until release()
        self._loaded: tuple[str, int, dict[str, Any]] | None = None
        # why a file of this save was refused, or the previous background commit failed
        self._error: Exception | None = None
        self.resumed: Version | None = None
        """The version the last :meth:`prepare_load` resumed."""
        self._background = BackgroundCommits(group) if background else None

    # -- DeepSpeed's CheckpointEngine ------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """A save of ``info.tag`` begins: files of an earlier save that never committed are dropped.

        Raises:
            InvalidArgumentError: the tag is not a plain folder name (``/`` in it, ``..``):
                loading it would read another tag's files.
        """
        check_tag(str(info.tag))
        self._info, self._files, self._loaded, self._error = info, {}, None, None

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` (converted to plain values now) for ``commit``; nothing is written.

        Raises:
            UnsupportedStateError: it holds an object a version cannot hold (its key path named).
            InvalidArgumentError: ``path`` is not inside the folder of the tag being saved.
        """
        if self._error is not None:
            return
        try:
            name = self._file_name(path)
            self._files[name] = encode(state_dict, name)
        except CasckptError as exc:  # raised by commit, on every rank (a raise here would hang the others)
            self._error = exc

    def load(self, path: str, map_location: Any = None) -> Any:
        """The dict DeepSpeed saved at ``path`` (``DIR/TAG/FILE``), restored from the store.

        Raises:
            CheckpointPathNotFoundError: no version of this run holds tag ``TAG``, or it holds
                no file ``FILE``.
            GroupCommitError, CasckptError: the background commit in flight (waited for
                first) failed.
        """
        self.wait()  # DeepSpeed's own load_checkpoint, right after a background save
        where = Path(path)
        name, tag = where.name, where.parent.name
        check_tag(tag)
        version = self.resolve_tag(tag)
        files = stored_files(version)
        if name not in files:
            raise CheckpointPathNotFoundError(
                str(path), f"{self.run}@{version.step} (DeepSpeed tag {tag!r}) holds no file {name!r} "
                f"(it holds {sorted(files)}); was it saved with another world size or ZeRO stage?",
                [f"{self.run}@{version.step}"])
        rank = files[name]
        if self._loaded is None or self._loaded[:2] != (version.id, rank):
            tree = self.store.restore(version.id, rank=rank, map_location=_device(map_location))
            self._loaded = (version.id, rank, tree)
        return decode(self._loaded[2][name])  # kept: DeepSpeed reads the model file twice

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Store every rank's files as ONE version (a collective), then write this rank's markers.

        With ``background``, returns once the files are copied; the commit, then the markers,
        follow on the commit thread (module text), after the commit in flight.

        Raises (on every rank, nothing published):
            UnsupportedStateError, InvalidArgumentError: a file ``save`` refused (on the rank that
                refused it; the other ranks raise GroupCommitError naming it).
            VersionExistsError: the run already holds this step: a save after resuming an
                earlier tag (a rollback); the message says how to go on.
            GroupCommitError: some rank failed.
            CasckptError, OSError: with ``background``, the previous save's commit failed on
                this rank (this save is not made; every other rank raises GroupCommitError
                naming it, rather than waiting for this one in the next collective).
        """
        previous = self._previous_failure()  # consumed whatever this save does
        if self._error is None:
            self._error = previous
        elif previous is not None:  # this save's refusal is raised; the earlier failure is told
            log.error("the previous DeepSpeed checkpoint, committed in the background, failed "
                      "(it was not saved): %s", previous)
        files, step = self._files, int(self.global_steps())
        refused = f"{type(self._error).__name__}: {self._error}" if self._error is not None else None
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (sorted(files), refused), group=self.group)
        held: list[tuple[list[str], str | None]] = gathered
        self._files = {}
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        failed = [f"rank {r}: {why}" for r, (_, why) in enumerate(held) if why]
        if failed:
            raise GroupCommitError(f"DeepSpeed tag {info.tag!r}: {'; '.join(failed)}; nothing was saved")
        self._refuse_existing_step(step, str(info.tag))
        where = {name: rank for rank, (names, _) in enumerate(held) for name in names}
        metadata = {"deepspeed.tag": info.tag, "deepspeed.save_dir": os.path.abspath(info.save_dir),
                    "deepspeed.files": where}
        folder = Path(info.save_dir) / info.tag

        def publish(files: dict[str, Any], group: Any) -> Version:
            version = self.store.commit(files, run=self.run, step=step, metadata=metadata,
                                        tags=(self.tag_name(info.tag),), group=group)
            self.last_version = version
            for name in files:
                write_marker(folder / name, version, name)
            return version

        if self._background is None:
            publish(files, self.group if self.group is not None else dist.group.WORLD)
        else:
            copied, group = snapshot(files), self._background.group
            self._background.submit(lambda: publish(copied, group))
        return True

    def _previous_failure(self) -> Exception | None:
        """The failure of the background commit in flight, once it ended (None: it published)."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - raised by commit on every rank, after the gather
            return exc
        return None

    def wait(self) -> Version | None:
        """The version of the background commit in flight once it is published (None: none,
        or the engine commits in ``save_checkpoint``). Call it on every rank: the commit is
        the group's (a rank's commit ends when every rank's has).

        Raises:
            GroupCommitError, CasckptError: why that commit failed (nothing of it is visible).
        """
        return self._background.wait() if self._background is not None else None

    def _refuse_existing_step(self, step: int, tag: str) -> None:
        """Every rank reads the same catalog, so every rank raises (no collective needed)."""
        try:
            held = self.store.log(self.run, min_step=step, max_step=step, limit=1)
        except RefNotFoundError:  # no such run yet
            return
        if held:
            resumed = f"{self.run}@{self.resumed.step}" if self.resumed is not None else f"{self.run}@<step>"
            raise VersionExistsError(
                f"run {self.run!r} already holds step {step} (DeepSpeed tag "
                f"{held[0].metadata.get('deepspeed.tag')!r}), saved before the job resumed an earlier "
                f"tag; DeepSpeed would overwrite it, a version is never overwritten. To train on "
                f"from the tag you resumed, fork a run from it and save there: "
                f"store.fork('{resumed}', '{self.run}-b'), then "
                f"install(engine, run='{self.run}-b'). Tag {tag!r} was not saved")

    # -- resolving tags ----------------------------------------------------------

    def tag_name(self, tag: str) -> str:
        """The store tag naming the version of DeepSpeed tag ``tag`` in this run."""
        digest = hashlib.sha256(f"{self.run}\0{tag}".encode()).hexdigest()[:16]
        stem = _UNSAFE.sub("_", tag).strip("_-")[:80] or "tag"
        return f"{TAG_PREFIX}{stem}.{digest}"

    def resolve_tag(self, tag: str) -> Version:
        """The version DeepSpeed tag ``tag`` of this run names.

        Raises:
            CheckpointPathNotFoundError: no version of the run holds that tag.
        """
        try:
            return self.store.resolve(f"tag:{self.tag_name(tag)}")
        except RefNotFoundError:
            raise CheckpointPathNotFoundError(
                tag, f"run {self.run!r} holds no DeepSpeed checkpoint tagged {tag!r} (never "
                "committed, its save failed, or it was deleted); `casckpt log "
                f"{self.run}` lists the versions", [f"{self.run}@latest"]) from None

    def prepare_load(self, load_dir: str | os.PathLike[str], tag: str | None = None) -> str | None:
        """Write the markers of ``tag`` into ``load_dir`` so that DeepSpeed finds its files, and
        ``latest`` naming it; return the tag, or None when ``tag`` is None and the run has no
        version yet (a first launch).

        ``tag`` None resumes what DeepSpeed would: the tag ``load_dir/latest`` names when it is
        a tag of this run, else the run's most recently committed version (after a rollback
        that is the version saved since, not the highest step).

        Raises:
            CheckpointPathNotFoundError: ``tag`` names no version of the run.
            InvalidArgumentError: ``load_dir`` holds files of DeepSpeed's own at the paths the
                markers go to (nothing is written then), or ``tag`` is not a plain folder name.
            CorruptManifestError: the version names a file or tag that is not a plain name.
            GroupCommitError, CasckptError: the background commit in flight failed.
        """
        self.wait()
        if tag is None:
            version = self._version_to_resume(Path(load_dir))
            if version is None:
                return None
            tag = version.metadata.get("deepspeed.tag")
            if not tag:
                raise CheckpointPathNotFoundError(
                    f"{self.run}@latest", f"{self.run}@{version.step} was not saved through "
                    "DeepSpeed (it has no deepspeed.tag); restore it with Store.restore", [])
            tag = stored_tag(version)
        else:
            version = self.resolve_tag(check_tag(tag))
        targets = [(Path(load_dir) / tag / name, name) for name in stored_files(version)]
        self.resumed = version
        for path, _ in targets:
            refuse_foreign_file(path)
        for path, name in targets:
            write_marker(path, version, name)
        write_atomically(Path(load_dir) / "latest", tag.encode())
        return tag

    def _version_to_resume(self, load_dir: Path) -> Version | None:
        try:
            named = (load_dir / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = ""
        if named and plain_name(named):
            try:
                return self.resolve_tag(named)
            except CheckpointPathNotFoundError:
                pass  # a tag of another run or of DeepSpeed's own engine: the catalog decides
        first = version_to_resume(self.store, f"{self.run}{LATEST}")
        if first is None:
            return None
        try:
            versions = self.store.log(self.run)
        except RefNotFoundError:  # a fork with no version of its own yet
            return first
        return max(versions, key=lambda v: (v.created_at, v.step)) if versions else first

    def release(self) -> None:
        """Drop the restored files of the last load (:func:`load_checkpoint` calls it once
        DeepSpeed has loaded them)."""
        self._loaded = None

    def close(self) -> None:
        """Wait for the background commit in flight, then close the store if :func:`install`
        opened it (from the DeepSpeed config).

        Raises:
            GroupCommitError, CasckptError: the background commit in flight failed (the store
                is closed all the same).
        """
        try:
            if self._background is not None:
                self._background.close()
        finally:
            if self.owns_store:
                self.store.close()

    # -- internals ---------------------------------------------------------------

    def _file_name(self, path: str) -> str:
        info = self._info
        folder = os.path.abspath(os.path.join(info.save_dir, info.tag)) if info is not None else None
        name = os.path.relpath(os.path.abspath(path), folder) if folder is not None else ".."
        if not plain_name(name):
            raise InvalidArgumentError(
                f"DeepSpeed asked to save {path!r}, which is not a file of the tag being saved "
                f"({folder!r}); CasckptCheckpointEngine stores the files of save_checkpoint only")
        return name


def install(engine: Any, store: Store | None = None, run: str | None = None,
            background: bool | None = None) -> CasckptCheckpointEngine:
    """Make DeepSpeed ``engine`` save and load its checkpoints through casckpt (on every rank).

    Args:
        engine: what ``deepspeed.initialize`` returned first.
        store: an open store; None opens ``config["casckpt"]["store"]`` of the engine's
            DeepSpeed config (the engine then owns it: :meth:`CasckptCheckpointEngine.close`).
        run: the run; None takes ``config["casckpt"]["run"]``.
        background: commit off the training thread (module text); None takes
            ``config["casckpt"]["background"]`` (default false).

    Raises:
        InvalidConfigError: no store or run given, and the DeepSpeed config names none; a
            ``background`` setting that is not true or false.
    """
    section = getattr(getattr(engine, "_config", None), "_param_dict", {}).get(CONFIG_KEY) or {}
    if not isinstance(section, Mapping):
        raise InvalidConfigError(f'the DeepSpeed config\'s "{CONFIG_KEY}" section must be an object '
                                 f'like {{"store": "file:///ckpt", "run": "llama"}}, not {section!r}')
    run = run if run is not None else section.get("run")
    if not isinstance(run, str):
        raise InvalidConfigError(f'name the run: install(engine, run="...") or "{CONFIG_KEY}": '
                                 '{"run": "..."} in the DeepSpeed config')
    background = background if background is not None else section.get("background", False)
    if not isinstance(background, bool):
        raise InvalidConfigError(
            f'"{CONFIG_KEY}": {{"background": ...}} is true or false, not {background!r}')
    owns = store is None
    if store is None:
        url = section.get("store")
        if not isinstance(url, str):
            raise InvalidConfigError(f'name the store: install(engine, store=casckpt.open(...)) or '
                                     f'"{CONFIG_KEY}": {{"store": "file:///ckpt"}} in the DeepSpeed config')
        store = casckpt.open(url)
    checkpoint_engine = CasckptCheckpointEngine(store, run, lambda: engine.global_steps, owns_store=owns,
                                                background=background)
    engine.checkpoint_engine = checkpoint_engine
    return checkpoint_engine


def load_checkpoint(engine: Any, load_dir: str | os.PathLike[str], tag: str | None = None,
                    **kwargs: Any) -> tuple[str | None, Any]:
    """``engine.load_checkpoint(load_dir, tag, **kwargs)``, with ``tag=None`` meaning what
    DeepSpeed would resume (:meth:`CasckptCheckpointEngine.prepare_load`); on a first launch
    (no version yet) it loads nothing and returns ``(None, None)``, as DeepSpeed does without a
    ``latest`` file.

    Raises:
        InvalidArgumentError: ``engine`` has no casckpt engine (call :func:`install` first).
    """
    checkpoint_engine = engine.checkpoint_engine
    if not isinstance(checkpoint_engine, CasckptCheckpointEngine):
        raise InvalidArgumentError("this DeepSpeed engine saves with "
                                   f"{type(checkpoint_engine).__name__}: call install(engine) first")
    found = checkpoint_engine.prepare_load(load_dir, tag)
    if found is None:
        return None, None
    try:
        result: tuple[str | None, Any] = engine.load_checkpoint(os.fspath(load_dir), tag=found, **kwargs)
    finally:
        checkpoint_engine.release()
    return result


def export_files(store: Store, ref: Version | str, folder: str | os.PathLike[str]) -> Path:
    """Write the version ``ref`` names as DeepSpeed's own files: ``folder/TAG/FILE`` with
    ``torch.save`` (what ``TorchCheckpointEngine`` writes) and ``folder/latest``, for tools that
    read ``.pt`` files (``ds_to_universal``, ``zero_to_fp32``). Reading those files unpickles
    them: that is the reader's choice, not the store's (the store hands out tensors and plain
    values only). Returns the tag's folder.

    Raises:
        InvalidArgumentError: the version was not saved through DeepSpeed.
        RefNotFoundError, AmbiguousRefError: a bad ref.
    """
    version = store.resolve(ref)
    if "deepspeed.tag" not in version.metadata:
        raise InvalidArgumentError(f"{version.run}@{version.step} was not saved through DeepSpeed "
                                   "(no deepspeed.tag): export it with Store.export instead")
    tag, files = stored_tag(version), stored_files(version)
    target = Path(folder) / tag
    target.mkdir(parents=True, exist_ok=True)
    for rank in sorted(set(files.values())):
        tree = store.restore(version.id, rank=int(rank), map_location="cpu")
        for name in (n for n, r in files.items() if r == rank):
            torch.save(decode(tree[name]), target / name)
        del tree
    write_atomically(Path(folder) / "latest", tag.encode())
    return target


def _device(map_location: Any) -> Any:
    """DeepSpeed passes ``torch.device('cpu')`` or ``lambda storage, loc: storage`` (keep where it
    was): a function or a dict becomes "cpu", from where DeepSpeed copies onto its devices."""
    if map_location is None or callable(map_location) or isinstance(map_location, Mapping):
        return "cpu"
    return map_location if isinstance(map_location, (str, torch.device)) else "cpu"
