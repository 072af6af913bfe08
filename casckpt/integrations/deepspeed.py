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
so a job resumes on a machine whose checkpoint directory is gone, and resolves "the newest" from
the catalog, not from ``latest``.

The commit runs on the training thread, inside ``save_checkpoint``: DeepSpeed's decoupled flow
(``is_decoupled``) defers ``commit`` to the next ``step()`` but writes ``latest`` right after it,
and a rank-by-rank commit is a sequence of collectives, so a commit in the background would need
its own process group and a copy of every file's tensors; this engine does not do that yet.
"""

from __future__ import annotations

import hashlib
import json
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
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    InvalidConfigError,
    OptionalDependencyError,
    RefNotFoundError,
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
MARKER_FORMAT = "casckpt.deepspeed-marker/1"
"""The ``format`` of a marker file: JSON naming the version that holds the file."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


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

    Raises:
        InvalidNameError: ``run`` is not a valid run name.
    """

    def __init__(self, store: Store, run: str, global_steps: Callable[[], int], *,
                 group: Any = None, owns_store: bool = False) -> None:
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
        self._loaded: tuple[str, int, dict[str, Any]] | None = None  # (version id, rank, files)

    # -- DeepSpeed's CheckpointEngine ------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """A save of ``info.tag`` begins: files of an earlier save that never committed are dropped."""
        self._info, self._files, self._loaded = info, {}, None

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` (converted to plain values now) for ``commit``; nothing is written.

        Raises:
            UnsupportedStateError: it holds an object a version cannot hold (its key path named).
            InvalidArgumentError: ``path`` is not inside the folder of the tag being saved.
        """
        name = self._file_name(path)
        self._files[name] = encode(state_dict, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        """The dict DeepSpeed saved at ``path`` (``DIR/TAG/FILE``), restored from the store.

        Raises:
            CheckpointPathNotFoundError: no version of this run holds tag ``TAG``, or it holds
                no file ``FILE``.
        """
        where = Path(path)
        name, tag = where.name, where.parent.name
        version = self.resolve_tag(tag)
        files: Mapping[str, int] = version.metadata.get("deepspeed.files", {})
        if name not in files:
            raise CheckpointPathNotFoundError(
                str(path), f"{self.run}@{version.step} (DeepSpeed tag {tag!r}) holds no file {name!r} "
                f"(it holds {sorted(files)}); was it saved with another world size or ZeRO stage?",
                [f"{self.run}@{version.step}"])
        rank = int(files[name])
        if self._loaded is None or self._loaded[:2] != (version.id, rank):
            tree = self.store.restore(version.id, rank=rank, map_location=_device(map_location))
            self._loaded = (version.id, rank, tree)
        return decode(self._loaded[2][name])

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Store every rank's files as ONE version (a collective), then write this rank's markers.

        Raises:
            GroupCommitError: some rank failed (raised on every rank; nothing published).
            VersionExistsError: the run already holds this step (inside GroupCommitError).
        """
        files = self._files
        names: list[list[str]] = [[] for _ in range(dist.get_world_size(self.group))]
        dist.all_gather_object(names, sorted(files), group=self.group)
        where = {name: rank for rank, held in enumerate(names) for name in held}
        metadata = {"deepspeed.tag": info.tag, "deepspeed.save_dir": os.path.abspath(info.save_dir),
                    "deepspeed.files": where}
        version = self.store.commit(files, run=self.run, step=int(self.global_steps()),
                                    metadata=metadata, tags=(self.tag_name(info.tag),),
                                    group=self.group if self.group is not None else dist.group.WORLD)
        self._files, self.last_version = {}, version
        for name in files:
            write_marker(Path(info.save_dir) / info.tag / name, version, name)
        return True

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
        """Write the markers of ``tag`` (None: the run's newest version, from the catalog) into
        ``load_dir`` so that DeepSpeed finds its files, and ``latest`` naming it; return the tag,
        or None when ``tag`` is None and the run has no version yet (a first launch).

        Raises:
            CheckpointPathNotFoundError: ``tag`` names no version of the run.
        """
        if tag is None:
            version = version_to_resume(self.store, f"{self.run}{LATEST}")
            if version is None:
                return None
            tag = str(version.metadata.get("deepspeed.tag", ""))
            if not tag:
                raise CheckpointPathNotFoundError(
                    f"{self.run}@latest", f"{self.run}@{version.step} was not saved through "
                    "DeepSpeed (it has no deepspeed.tag); restore it with Store.restore", [])
        else:
            version = self.resolve_tag(tag)
        for name in version.metadata.get("deepspeed.files", {}):
            write_marker(Path(load_dir) / tag / name, version, name)
        _write_atomically(Path(load_dir) / "latest", tag.encode())
        return tag

    def close(self) -> None:
        """Close the store if :func:`install` opened it (from the DeepSpeed config)."""
        if self.owns_store:
            self.store.close()

    # -- internals ---------------------------------------------------------------

    def _file_name(self, path: str) -> str:
        info = self._info
        folder = os.path.abspath(os.path.join(info.save_dir, info.tag)) if info is not None else None
        name = os.path.relpath(os.path.abspath(path), folder) if folder is not None else ".."
        if name.startswith("..") or os.sep in name:
            raise InvalidArgumentError(
                f"DeepSpeed asked to save {path!r}, which is not a file of the tag being saved "
                f"({folder!r}); CasckptCheckpointEngine stores the files of save_checkpoint only")
        return name


def install(engine: Any, store: Store | None = None, run: str | None = None) -> CasckptCheckpointEngine:
    """Make DeepSpeed ``engine`` save and load its checkpoints through casckpt (on every rank).

    Args:
        engine: what ``deepspeed.initialize`` returned first.
        store: an open store; None opens ``config["casckpt"]["store"]`` of the engine's
            DeepSpeed config (the engine then owns it: :meth:`CasckptCheckpointEngine.close`).
        run: the run; None takes ``config["casckpt"]["run"]``.

    Raises:
        InvalidConfigError: no store or run given, and the DeepSpeed config names none.
    """
    section = getattr(getattr(engine, "_config", None), "_param_dict", {}).get(CONFIG_KEY) or {}
    if not isinstance(section, Mapping):
        raise InvalidConfigError(f'the DeepSpeed config\'s "{CONFIG_KEY}" section must be an object '
                                 f'like {{"store": "file:///ckpt", "run": "llama"}}, not {section!r}')
    run = run if run is not None else section.get("run")
    if not isinstance(run, str):
        raise InvalidConfigError(f'name the run: install(engine, run="...") or "{CONFIG_KEY}": '
                                 '{"run": "..."} in the DeepSpeed config')
    owns = store is None
    if store is None:
        url = section.get("store")
        if not isinstance(url, str):
            raise InvalidConfigError(f'name the store: install(engine, store=casckpt.open(...)) or '
                                     f'"{CONFIG_KEY}": {{"store": "file:///ckpt"}} in the DeepSpeed config')
        store = casckpt.open(url)
    checkpoint_engine = CasckptCheckpointEngine(store, run, lambda: engine.global_steps, owns_store=owns)
    engine.checkpoint_engine = checkpoint_engine
    return checkpoint_engine


def load_checkpoint(engine: Any, load_dir: str | os.PathLike[str], tag: str | None = None,
                    **kwargs: Any) -> tuple[str | None, Any]:
    """``engine.load_checkpoint(load_dir, tag, **kwargs)``, with ``tag=None`` meaning the run's
    newest version in the catalog; on a first launch (no version yet) it loads nothing and
    returns ``(None, None)``, as DeepSpeed does without a ``latest`` file.

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
    result: tuple[str | None, Any] = engine.load_checkpoint(os.fspath(load_dir), tag=found, **kwargs)
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
    tag, files = version.metadata.get("deepspeed.tag"), version.metadata.get("deepspeed.files")
    if not isinstance(tag, str) or not isinstance(files, Mapping):
        raise InvalidArgumentError(f"{version.run}@{version.step} was not saved through DeepSpeed "
                                   "(no deepspeed.tag): export it with Store.export instead")
    target = Path(folder) / tag
    target.mkdir(parents=True, exist_ok=True)
    for rank in sorted(set(files.values())):
        tree = store.restore(version.id, rank=int(rank), map_location="cpu")
        for name in (n for n, r in files.items() if r == rank):
            torch.save(decode(tree[name]), target / name)
    _write_atomically(Path(folder) / "latest", tag.encode())
    return target


def write_marker(path: Path, version: Version, name: str) -> None:
    """Write the marker of file ``name`` of ``version`` at ``path`` (atomically)."""
    marker = {"format": MARKER_FORMAT, "ref": f"casckpt://{version.run}@{version.step}",
              "version": version.id, "file": name, "tag": version.metadata.get("deepspeed.tag")}
    _write_atomically(path, (json.dumps(marker, indent=1) + "\n").encode())


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _device(map_location: Any) -> Any:
    """DeepSpeed passes ``torch.device('cpu')`` or ``lambda storage, loc: storage`` (keep where it
    was): a function or a dict becomes "cpu", from where DeepSpeed copies onto its devices."""
    if map_location is None or callable(map_location) or isinstance(map_location, Mapping):
        return "cpu"
    return map_location if isinstance(map_location, (str, torch.device)) else "cpu"
