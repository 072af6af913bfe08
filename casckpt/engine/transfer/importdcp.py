"""Read a ``torch.distributed.checkpoint`` directory into a plain state dict, without a process group.

DCP's own loader does the reading (``_load_state_dict`` with ``no_dist=True`` and the
planner that rebuilds the state from the checkpoint's metadata, as DCP's
``format_utils.dcp_to_torch_save`` does), with two changes so that nothing in the
directory can run code:

* ``.metadata`` is a pickle. It is read by a restricted unpickler that admits only
  the classes DCP's metadata is made of (:class:`~.dcpitems.MetadataUnpickler`: the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, torch
  dtypes, layouts and memory formats, ``pathlib`` paths); any other global is refused.
* non-tensor values (saved by DCP with ``torch.save``) are loaded with
  ``torch.load(weights_only=True)``; DCP itself loads them with ``weights_only=False``.

Tensors are read by DCP's ``FileSystemReader`` (``torch.load(weights_only=True)``).
DCP's loader logs each failed metadata read with its traceback on the root logger (which,
with logging unconfigured, prints to stderr); those records are dropped while it runs for
us, as the error raised here says what failed (:class:`_QuietLoader`).
DCP flattens dict keys to strings, so an int key saved by ``dcp.save`` comes back a str.
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
from pathlib import Path
from typing import Any

from casckpt.engine.transfer.dcpitems import MetadataUnpickler, RefusedGlobal
from casckpt.engine.transfer.importlinks import check_inside
from casckpt.errors import CasckptError, UnreadableCheckpointError, UnsafeCheckpointError


def _unsafe(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{str(path)!r} needs code execution to load ({what}); it was not loaded. If you trust "
        "it, convert it yourself in a trusted environment to safetensors or to a DCP checkpoint "
        "of tensors and plain values, then import that",
        path=str(path),
    )


def _check_items(metadata: Any, file: Path) -> None:
    """Refuse metadata whose items name a data file other than a plain name beside it
    (``../other/__0_0.distcp``, an absolute path): the import would read a file outside the
    checkpoint directory), or a data file a link leads out of it."""
    storage = getattr(metadata, "storage_data", None)
    for info in (storage.values() if isinstance(storage, dict) else ()):
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnreadableCheckpointError(
                f"{str(file)!r} names the data file {name!r}, which is not a file beside it (it "
                "points outside the checkpoint directory); the checkpoint is forged or damaged and "
                "was not imported", path=str(file))
        check_inside(file.parent / name, file.parent)


class _QuietLoader(logging.Filter):
    """Drops the root logger's records from DCP's checkpoint package logged by this thread.

    DCP's loader logs a refused ``.metadata`` (and its fallback to a per-rank one that does
    not exist) as warnings with tracebacks; the typed error :func:`read_dcp` raises says what
    failed, so the user sees that alone. Records of other threads (a concurrent DCP save)
    and of other modules pass.
    """

    def __init__(self, package: Path) -> None:
        super().__init__()
        self._package, self._thread = package, threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self._thread or self._package not in Path(record.pathname).parents

    def __enter__(self) -> None:
        logging.getLogger().addFilter(self)

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeFilter(self)


def _reader(path: Path, refused: list[CasckptError]) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """``FileSystemReader`` whose metadata goes through ``dcpitems.MetadataUnpickler``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            file = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(file, "rb") as stream:
                try:
                    try:
                        metadata = MetadataUnpickler(stream).load()
                    except RefusedGlobal as exc:
                        raise _unsafe(Path(file), str(exc)) from exc
                    _check_items(metadata, Path(file))
                except CasckptError as exc:  # DCP words a metadata failure as its own text
                    refused.append(exc)
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _planner(path: Path) -> Any:
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        """Rebuilds the state from the metadata; loads non-tensor values weights-only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise _unsafe(path, f"its value {fqn!r}: {str(exc).splitlines()[0]}") from exc
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return WeightsOnlyPlanner()  # type: ignore[no-untyped-call]


def read_dcp(path: Path) -> dict[str, Any]:
    """The state saved in the DCP checkpoint directory ``path`` (every piece assembled, on CPU).

    Raises:
        UnsafeCheckpointError: the metadata or a value needs code execution to load.
        UnreadableCheckpointError: DCP could not read the directory, or a link leads one of
            its files out of it.
    """
    import torch.distributed.checkpoint as dcp_package
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check_inside(path / ".metadata", path)
    state: dict[str, Any] = {}
    refused: list[CasckptError] = []
    try:
        with _QuietLoader(Path(dcp_package.__file__).parent):
            _load_state_dict(state, storage_reader=_reader(path, refused), planner=_planner(path),
                             no_dist=True)
    except CheckpointException as exc:  # DCP wraps what each step raised, by rank
        if refused:
            raise refused[0] from None
        for failure, _trace in exc.failures.values():
            if isinstance(failure, CasckptError):
                raise failure from None
        raise UnreadableCheckpointError(
            f"DCP could not read {str(path)!r}: {exc}", path=str(path)) from None
    except CasckptError:
        raise
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, AttributeError) as exc:
        raise UnreadableCheckpointError(
            f"DCP could not read {str(path)!r} ({type(exc).__name__}: {exc}); is it a complete "
            "DCP checkpoint directory?", path=str(path)) from exc
    return state
