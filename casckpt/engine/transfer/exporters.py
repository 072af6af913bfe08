"""Export a restored version: one safetensors file, or a directory of safetensors, DCP or torch.save.

Format of the file written by :func:`export_safetensors`:

* every tensor of the version under its dotted path (``model.layers.0.weight``),
  numpy arrays converted with ``torch.from_numpy``;
* metadata ``casckpt.version`` (the full version id), ``casckpt.run`` and
  ``casckpt.step``;
* metadata ``casckpt.values``: a JSON object mapping the dotted path of every
  plain value to the value (bytes as base64, NaN/±inf as strings). When that
  JSON is over 64 KiB it goes to a sidecar ``<file stem>.values.json`` instead
  and ``casckpt.values_file`` names it.

:func:`export_dir` writes a version into a directory, in one of :data:`FORMATS`:

* ``safetensors``: ``model.safetensors`` in the format above (a top-level ``__metadata__``
  dict of strings, as a safetensors import gives, becomes the file's own metadata again). A
  version imported from a Hugging Face directory (:func:`casckpt.engine.transfer.importers.read_hf_dir`)
  is written back as one: ``config.json``, ``model.safetensors`` of the model's tensors
  (metadata ``format: pt``) and every other file it had, byte for byte.
* ``dcp``: a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``, no process group).
* ``pt``: ``checkpoint.pt``, ``torch.save`` of the restored state.

In all three, numpy arrays become torch tensors, so every file loads weights-only.

``safetensors-file`` writes the one file of the format above at the path given (and its
sidecar beside it), as ``casckpt restore --to FILE`` does. :func:`check_export` and
:func:`export` take any of :data:`FORMATS`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casckpt.engine.transfer.importers import is_hf_state
from casckpt.errors import InvalidArgumentError, RestoreTargetError, UnsupportedStateError
from casckpt.format.dirsnap import is_snapshot
from casckpt.format.state import iter_leaves, join_path
from casckpt.jsonable import dumps
from casckpt.localfs import replace_atomically
from casckpt.types import Version

if TYPE_CHECKING:  # imported where a tensor is handled, so catalog-only commands never load torch
    import numpy as np
    import torch

MAX_INLINE_VALUES = 64 * 1024
"""Largest ``casckpt.values`` JSON (bytes, UTF-8) kept inside the safetensors header."""


def _as_cpu_tensor(path: str, leaf: torch.Tensor | np.ndarray) -> torch.Tensor:
    import numpy as np
    import torch

    if isinstance(leaf, np.ndarray):
        native = np.ascontiguousarray(leaf, dtype=leaf.dtype.newbyteorder("="))
        if not native.flags.writeable:
            native = native.copy()
        try:
            return torch.from_numpy(native)
        except TypeError as exc:
            raise UnsupportedStateError(
                f"numpy array at {path!r} has dtype {leaf.dtype}, which torch cannot hold: {exc}"
            ) from exc
    return leaf.detach().cpu().contiguous()


def split_state(state: object) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Split a restored state into ``{path: tensor}`` and ``{path: plain value}``.

    Tensors that share storage with an earlier one are cloned, because a
    safetensors file holds each tensor's bytes separately.

    Raises:
        InvalidArgumentError: two leaves have the same dotted path (``{1: a, "1": b}``).
        UnsupportedStateError: a numpy array torch cannot represent.
    """
    import numpy as np
    import torch

    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, object] = {}
    storages: set[int] = set()
    for path, leaf in iter_leaves(state):
        if path in tensors or path in values:
            raise InvalidArgumentError(
                f"two leaves share the dotted path {path!r} (an int and a str key that print "
                "alike); safetensors needs unique names, so restore this version from Python"
            )
        if not isinstance(leaf, (torch.Tensor, np.ndarray)):
            values[path] = leaf
            continue
        tensor = _as_cpu_tensor(path, leaf)
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in storages:
            tensor = tensor.clone()
        elif pointer:
            storages.add(pointer)
        tensors[path] = tensor
    return tensors, values


def _write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """:func:`casckpt.localfs.replace_atomically`, a failure told as the restore target's."""
    try:
        replace_atomically(target, write)
    except OSError as exc:
        raise RestoreTargetError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from exc


def _save(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str], target: Path) -> None:
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        try:
            save_file(dict(tensors), str(tmp), metadata=metadata)
        except KeyError as exc:  # safetensors' answer to a dtype it has no code for
            dtype = exc.args[0] if exc.args else "?"
            paths = [p for p, t in tensors.items() if t.dtype == dtype][:3]
            raise UnsupportedStateError(
                f"safetensors cannot hold dtype {dtype} (tensors {', '.join(paths)}); "
                "restore this version from Python instead"
            ) from exc

    _write_atomically(target, write)


def export_safetensors(state: object, version: Version, target: Path, *,
                       metadata: Mapping[str, str] | None = None) -> DirExport:
    """Write ``state`` (restored from ``version``) to ``target`` as described in the module doc;
    ``metadata`` adds string entries to the file's metadata (the ``casckpt.*`` ones win).

    The file (and sidecar) appear atomically: a failed export leaves no partial file.

    Raises:
        RestoreTargetError: the target cannot be written.
        UnsupportedStateError: a tensor dtype safetensors cannot hold.
        InvalidArgumentError: two leaves with the same dotted path, or ``state`` is a
            directory snapshot.
    """
    refuse_snapshot(state, version)
    tensors, values = split_state(state)
    values_json = dumps(values)
    metadata = {
        **(metadata or {}),
        "casckpt.version": version.id,
        "casckpt.run": version.run,
        "casckpt.step": str(version.step),
    }
    sidecar: Path | None = None
    if len(values_json.encode("utf-8")) > MAX_INLINE_VALUES:
        # x.safetensors -> x.values.json; any other name gets .values.json appended
        sidecar = target.with_name(target.name.removesuffix(".safetensors") + ".values.json")
        payload = values_json
        _write_atomically(sidecar, lambda tmp: tmp.write_text(payload, encoding="utf-8"))
        metadata["casckpt.values_file"] = sidecar.name
    else:
        metadata["casckpt.values"] = values_json
    _save(tensors, metadata, target)
    files = (target.name,) if sidecar is None else (target.name, sidecar.name)
    return DirExport(target.parent, FILE_FORMAT, tuple(sorted(files)), False, len(tensors), len(values))


FILE_FORMAT = "safetensors-file"
"""The format of one safetensors file at the path given (not a directory)."""
FORMATS = ("safetensors", "dcp", "pt", FILE_FORMAT)
"""The formats :func:`export` writes."""


@dataclass(frozen=True, slots=True)
class DirExport:
    """What :func:`export` wrote: the directory, its format, the files written (names
    relative to it, sorted), and whether it holds a Hugging Face model directory; for
    ``safetensors-file`` also how many tensors and plain values the file holds."""

    directory: Path
    format: str
    files: tuple[str, ...]
    huggingface: bool
    tensors: int | None = None
    values: int | None = None


def refuse_snapshot(state: object, version: Version) -> None:
    """Refuse to export a directory snapshot (its files would come out as raw pieces).

    Raises:
        InvalidArgumentError: ``state`` is a snapshot ``Store.add_dir`` stored.
    """
    if is_snapshot(state):
        raise InvalidArgumentError(
            f"{version.run}@{version.step} is a directory snapshot (stored with add_dir): write its "
            "files back with `casckpt checkout REF DIR` (Store.checkout), not export")


def check_export(target: Path, fmt: str, *, overwrite: bool) -> None:
    """Refuse a format or target before any data is read (a file for ``safetensors-file``,
    else a directory).

    Raises:
        InvalidArgumentError: ``fmt`` is not one of :data:`FORMATS`.
        RestoreTargetError: see :func:`check_export_file` and :func:`check_export_dir`.
    """
    if fmt == FILE_FORMAT:
        check_export_file(target, overwrite=overwrite)
    else:
        check_export_dir(target, fmt, overwrite=overwrite)


def check_export_file(target: Path, *, overwrite: bool) -> None:
    """Refuse a target file that cannot or should not be written, before any data is read.

    Raises:
        RestoreTargetError: the directory is missing, the target is a directory, or it
            exists and ``overwrite`` is false.
    """
    if not target.parent.is_dir():
        raise RestoreTargetError(f"directory {str(target.parent)!r} does not exist; create it first")
    if target.is_dir():
        raise RestoreTargetError(f"{str(target)!r} is a directory; name a .safetensors file")
    if target.exists() and not overwrite:
        raise RestoreTargetError(f"{str(target)!r} exists; pass --force (overwrite=True) to overwrite it")


def export(state: object, version: Version, target: Path, fmt: str, *, overwrite: bool = False) -> DirExport:
    """Write ``state`` (restored from ``version``) to ``target`` as ``fmt``: one file
    (``safetensors-file``, :func:`export_safetensors`) or a directory (:func:`export_dir`).

    Raises:
        What :func:`check_export` and the writer raise.
    """
    if fmt != FILE_FORMAT:
        return export_dir(state, version, target, fmt, overwrite=overwrite)
    check_export_file(target, overwrite=overwrite)
    return export_safetensors(state, version, target)


def check_export_dir(target: Path, fmt: str, *, overwrite: bool) -> None:
    """Refuse a format or target directory before any data is read.

    Raises:
        InvalidArgumentError: ``fmt`` is not one of :data:`FORMATS`.
        RestoreTargetError: the parent directory is missing, the target is a file, or a
            non-empty directory and ``overwrite`` is false.
    """
    if fmt not in FORMATS or fmt == FILE_FORMAT:
        raise InvalidArgumentError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if target.is_symlink():
        raise RestoreTargetError(f"{str(target)!r} is a link; export writes into a real directory "
                                 "(never through a link, out of the place named): name the "
                                 "directory itself")
    if not target.parent.is_dir():
        raise RestoreTargetError(f"directory {str(target.parent)!r} does not exist; create it first")
    if target.exists() and not target.is_dir():
        raise RestoreTargetError(f"{str(target)!r} is a file; name a directory to export into")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise RestoreTargetError(f"{str(target)!r} is not empty; pass --force (overwrite=True) to "
                                 "write into it, replacing the files of the same names")


def _write_hf(state: dict[str, Any], tmp: Path) -> None:
    tensors, _ = split_state(state["model"])
    _save(tensors, {"format": "pt"}, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(state["config"], indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    for name, data in state["files"].items():
        if not isinstance(data, bytes) or Path(name).name != name or name in (".", ".."):
            raise UnsupportedStateError(f"files.{name} is not a file's bytes; export as dcp or pt")
        (tmp / name).write_bytes(data)


def _write_dcp(state: object, tmp: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    if not isinstance(state, dict):
        raise UnsupportedStateError("DCP saves a dict; this version's state is not one: export as pt")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)


def torch_arrays(state: object, path: str = "") -> object:
    """``state`` with every numpy array made a torch tensor (``torch.load(weights_only=True)``
    refuses numpy arrays, and both ``pt`` and ``dcp`` files are read that way)."""
    import numpy as np

    if isinstance(state, np.ndarray):
        return _as_cpu_tensor(path, state)
    if isinstance(state, dict):
        return {k: torch_arrays(v, join_path(path, k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        items = [torch_arrays(v, join_path(path, i)) for i, v in enumerate(state)]
        return items if isinstance(state, list) else tuple(items)
    return state


def _write(state: object, version: Version, fmt: str, tmp: Path) -> bool:
    import torch

    if fmt == "pt":
        torch.save(torch_arrays(state), tmp / "checkpoint.pt")
    elif fmt == "dcp":
        _write_dcp(torch_arrays(state), tmp)
    elif is_hf_state(state):
        _write_hf(state, tmp)  # type: ignore[arg-type]
        return True
    else:
        extra: dict[str, str] = {}
        if isinstance(state, dict) and isinstance(state.get("__metadata__"), dict):
            found = state["__metadata__"]
            if all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
                extra = dict(found)
                state = {k: v for k, v in state.items() if k != "__metadata__"}
        export_safetensors(state, version, tmp / "model.safetensors", metadata=extra)
    return False


def _new_dir(target: Path) -> Path:
    """A new, empty directory beside ``target`` (mode from the umask, as ``mkdir`` gives), under
    a name nobody else uses: a fixed name could be an existing directory of someone else's.

    Raises:
        RestoreTargetError: nothing can be created beside ``target``.
    """
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.export")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise RestoreTargetError(f"cannot write beside {str(target)!r}: {exc.strerror or exc}") from exc
    raise RestoreTargetError(f"cannot create a temporary directory beside {str(target)!r}")


def export_dir(state: object, version: Version, target: Path, fmt: str, *,
               overwrite: bool = False) -> DirExport:
    """Write ``state`` (restored from ``version``) into directory ``target`` as ``fmt`` (module doc).

    Everything is written to a temporary directory beside ``target`` first, then moved in: a
    failed export leaves ``target`` as it was.

    Raises:
        InvalidArgumentError, RestoreTargetError: see :func:`check_export_dir`; or the
            target cannot be written.
        UnsupportedStateError: the state cannot be held by the format (a dtype safetensors
            lacks, a state DCP cannot save).
        InvalidArgumentError: ``state`` is a directory snapshot (use checkout).
    """
    target = Path(os.path.abspath(target))  # ``.`` has no name to put the temporary beside
    check_export_dir(target, fmt, overwrite=overwrite)
    refuse_snapshot(state, version)
    tmp = _new_dir(target)  # our own: only what this export created is removed below
    try:
        huggingface = _write(state, version, fmt, tmp)
        files = tuple(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()))
        if not target.exists():
            os.replace(tmp, target)
        else:
            in_the_way = [n for n in files if (target / n).is_dir() and not (target / n).is_symlink()]
            if in_the_way:  # refused before any file is replaced: never half old, half new
                raise RestoreTargetError(
                    f"{str(target)!r} holds directories named like files the export writes "
                    f"({', '.join(in_the_way[:3])}); move them away, then export again. Nothing "
                    "was replaced.")
            for name in files:
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / name, target / name)
    except OSError as exc:
        raise RestoreTargetError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return DirExport(target, fmt, files, huggingface)
