"""Where the write items of a DCP checkpoint lie in its ``.distcp`` files, from its ``.metadata``.

``torch.distributed.checkpoint`` pickles its metadata. This reads the user's own file (never
anything from the store) with an unpickler that resolves only the metadata's classes
(those defined in ``torch.distributed.checkpoint.metadata``, the filesystem writer's
``_StorageInfo``), ``torch.Size``, torch dtypes, layouts and memory formats, and ``pathlib``
paths: nothing else can be named, so nothing else can be called. Whatever it cannot read
yields no items, and the ``.distcp`` files are then cut by content like any other file. The
import of a DCP directory (:mod:`casckpt.engine.transfer.importdcp`) reads its metadata with
the same :class:`MetadataUnpickler`.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import pickle
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_METADATA = 256 << 20
"""A ``.metadata`` file larger than this is not read (its checkpoint is cut by content)."""

_CLASS_MODULE = "torch.distributed.checkpoint.metadata"
_NAMED = frozenset({
    ("torch", "Size"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided and friends by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class RefusedGlobal(pickle.UnpicklingError):
    """A ``.metadata`` pickle names a global DCP metadata is not made of."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: only the globals of the module doc (else :class:`RefusedGlobal`)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == _CLASS_MODULE and "." not in name and not name.startswith("__"):
            # a class defined there, by its plain name: a dotted one would walk into what the
            # module imports (its ``os``), and its imported helpers are not metadata either
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in _NAMED:
            return super().find_class(module, name)
        raise RefusedGlobal(f"its metadata names the global {module}.{name}, which DCP metadata "
                            "does not hold")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP metadata holds no persistent ids; not loaded")


def dcp_items(metadata: Path) -> dict[str, list[tuple[int, int]]]:
    """``{".distcp" file name: [(offset, length), ...]}`` of the checkpoint whose metadata file
    is ``metadata``; empty when it cannot be read as DCP metadata (a debug line says why)."""
    try:
        # a regular file of the directory only: not a link out, never a fifo that blocks
        fd = os.open(metadata, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_METADATA:
                return {}
            data = file.read(MAX_METADATA)  # a file grown meanwhile: cut short, unreadable
        loaded = MetadataUnpickler(io.BytesIO(data)).load()
        storage = getattr(loaded, "storage_data", None)
        out: dict[str, list[tuple[int, int]]] = {}
        for info in (storage or {}).values():
            name, offset, length = info.relative_path, info.offset, info.length
            if getattr(info, "transform_descriptors", None) or not (
                    isinstance(name, str) and type(offset) is int and type(length) is int):
                return {}  # transformed (compressed) items: the file holds other bytes
            out.setdefault(name, []).append((offset, length))
        return {name: sorted(items) for name, items in out.items()}
    except Exception as exc:  # noqa: BLE001 - any failure only means: cut the files by content
        log.debug("%s is not readable DCP metadata (%s); its .distcp files are cut by content",
                  metadata, exc)
        return {}
