"""Read an existing checkpoint (a file or a directory) into a state ``commit`` can store.

What each kind becomes (:func:`read_checkpoint` picks the kind from the path):

* ``.pt`` / ``.bin`` / ``.ckpt`` / ``.pth``: what ``torch.load(path, map_location="cpu",
  weights_only=True, mmap=True)`` returns, as it is. A pickle that needs code execution is
  refused (:class:`~casckpt.errors.UnsafeCheckpointError`, naming the global torch refused).
* ``.safetensors``: ``{tensor name: tensor}`` in file order, plus ``"__metadata__"``
  (str -> str) when the file has metadata; the header is validated first
  (:mod:`casckpt.engine.transfer.importsafetensors`).
* a DCP checkpoint directory (it has ``.metadata``): the state DCP saved
  (:mod:`casckpt.engine.transfer.importdcp`).
* a Hugging Face model directory (``config.json`` and weights): the layout of
  :func:`read_hf_dir`, which :mod:`casckpt.engine.transfer.exporters` writes back as a directory
  ``transformers`` loads.

Anything else is refused with :class:`~casckpt.errors.UnreadableCheckpointError` listing
what is supported. Nothing here writes anything.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

from casckpt.engine.transfer.importdcp import read_dcp
from casckpt.engine.transfer.importlinks import check_inside
from casckpt.engine.transfer.importsafetensors import read_safetensors
from casckpt.errors import UnreadableCheckpointError, UnsafeCheckpointError

TORCH_SUFFIXES = (".pt", ".bin", ".ckpt", ".pth")
HF_LAYOUT = "huggingface"
"""The value of ``"layout"`` in the state of an imported Hugging Face directory."""
HF_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
"""Weight files (and their indexes) of a Hugging Face directory: not kept as ``files``."""
MAX_HF_FILE = 64 * 1024 * 1024
"""Largest other file of a Hugging Face directory kept (as bytes) in the imported state."""

SUPPORTED = (
    "a .pt, .bin, .ckpt or .pth file (torch.save; loaded weights-only), a .safetensors file, "
    "a torch.distributed.checkpoint directory (with .metadata), or a Hugging Face model "
    "directory (config.json with model.safetensors, sharded model-*.safetensors and "
    "model.safetensors.index.json, or pytorch_model*.bin)"
)


def _unsupported(path: Path, why: str) -> UnreadableCheckpointError:
    return UnreadableCheckpointError(f"cannot import {str(path)!r}: {why}. casckpt imports {SUPPORTED}",
                                     path=str(path))


def load_torch_file(path: Path) -> Any:
    """``torch.load`` of the user's file ``path``, weights-only (mmap'd when the file allows).

    Raises:
        UnsafeCheckpointError: loading it needs code execution (the refused global named).
        UnreadableCheckpointError: it is not a file torch can load.
    """
    import torch

    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            return load(True)
        except RuntimeError as exc:  # a file of the legacy (non-zip) format cannot be mmap'd
            if "mmap" not in str(exc):
                raise
            return load(False)
    except pickle.UnpicklingError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        specific = [line for line in lines if "GLOBAL" in line] + [
            line for line in lines if line.startswith("Unsupported")]  # the refused global, or opcode
        reason = (specific or lines or ["?"])[0]
        raise UnsafeCheckpointError(
            f"{str(path)!r} needs code execution to load (torch.load(weights_only=True) "
            f"refused it: {reason}); it was not loaded. If you "
            "trust it, convert it yourself in a trusted environment to safetensors or to a "
            "weights-only state dict (tensors and plain values), then import that",
            path=str(path),
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise UnreadableCheckpointError(
            f"torch.load could not read {str(path)!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else '?'}); is it a torch.save file?",
            path=str(path),
        ) from exc


def _shard_names(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _unsupported(index, f"its weight index cannot be read ({exc})") from exc
    bad = [n for n in names
           if not isinstance(n, str) or Path(n).name != n or not (index.parent / n).is_file()]
    if bad:
        raise _unsupported(index, f"its weight index names shards that are not files beside it: {bad[:3]}")
    return names


def _hf_weight_files(path: Path) -> list[Path]:
    for stem, suffix in (("model", "safetensors"), ("pytorch_model", "bin")):
        index = path / f"{stem}.{suffix}.index.json"
        if index.is_file():
            return [path / name for name in _shard_names(index)]
        if (path / f"{stem}.{suffix}").is_file():
            return [path / f"{stem}.{suffix}"]
    raise _unsupported(path, "it has config.json but no model.safetensors, model.safetensors.index.json, "
                             "pytorch_model.bin or pytorch_model.bin.index.json")


def _hf_tensors(files: list[Path]) -> dict[str, Any]:
    import torch

    model: dict[str, Any] = {}
    for file in files:
        if file.suffix == ".safetensors":
            tensors: Any = read_safetensors(file)[0]
        else:
            tensors = load_torch_file(file)
            if not (isinstance(tensors, dict)
                    and all(isinstance(t, torch.Tensor) for t in tensors.values())):
                raise _unsupported(file, "a Hugging Face weight file must hold a dict of tensors")
        twice = sorted(set(model) & set(tensors))
        if twice:
            raise _unsupported(file, f"tensors {twice[:3]} are in more than one shard")
        model.update(tensors)
    return dict(sorted(model.items()))  # however sharded: small tensors pack alike, and dedup


def read_hf_dir(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory as ``{"layout": "huggingface", "config": ..., "model": ...,
    "files": ...}``.

    ``config`` is ``config.json`` as plain values; ``model`` maps each tensor name (as in the
    weight files, e.g. ``transformer.h.0.attn.c_attn.weight``) to its tensor, all shards
    merged, sorted by name (so the same weights sharded otherwise store the same chunks);
    ``files`` maps the name of every other top-level file (``generation_config.json``,
    tokenizer files, ...) to its bytes, unchanged. Files are read only inside the directory
    (or its hub cache's ``blobs/``; :mod:`casckpt.engine.transfer.importlinks`). Weight files and
    their indexes are not kept as files (export writes them anew); subdirectories are not
    imported.

    Raises:
        UnreadableCheckpointError: no weights, an unreadable config or index, a tensor in two
            shards, another file over :data:`MAX_HF_FILE` bytes, or a file a link leads out of
            the directory.
        UnsafeCheckpointError: a ``.bin`` weight file needs code execution to load.
    """
    check_inside(path / "config.json", path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unsupported(path / "config.json", f"it is not a JSON file ({exc})") from exc
    weights = _hf_weight_files(path)
    for file in weights:
        check_inside(file, path)
    model = _hf_tensors(weights)
    files: dict[str, bytes] = {}
    for file in sorted(path.iterdir()):
        if not file.is_file() or file.name == "config.json" or HF_WEIGHTS.match(file.name):
            continue
        check_inside(file, path)
        if file.stat().st_size > MAX_HF_FILE:
            raise _unsupported(file, f"it is over {MAX_HF_FILE >> 20} MiB; only the weights of a "
                                     "Hugging Face directory may be that large")
        files[file.name] = file.read_bytes()
    return {"layout": HF_LAYOUT, "config": config, "model": model, "files": files}


def is_hf_state(state: object) -> bool:
    """Whether ``state`` has the layout :func:`read_hf_dir` gives."""
    return (isinstance(state, dict) and state.get("layout") == HF_LAYOUT
            and set(state) == {"layout", "config", "model", "files"}
            and isinstance(state["model"], dict) and isinstance(state["files"], dict))


def read_checkpoint(path: Path) -> Any:
    """The state of the checkpoint at ``path`` (see the module doc for each kind).

    Raises:
        UnsafeCheckpointError: a pickle needs code execution to load.
        UnreadableCheckpointError: ``path`` is missing, of no supported kind, or damaged.
    """
    if path.is_dir():
        if (path / ".metadata").is_file():
            return read_dcp(path)
        if (path / "config.json").is_file():
            return read_hf_dir(path)
        raise _unsupported(path, "the directory has neither .metadata (DCP) nor config.json (Hugging Face)")
    if not path.is_file():
        raise _unsupported(path, "no such file or directory")
    if path.suffix == ".safetensors":
        tensors, metadata = read_safetensors(path)
        return {**tensors, "__metadata__": metadata} if metadata else tensors
    if path.suffix in TORCH_SUFFIXES:
        return load_torch_file(path)
    raise _unsupported(path, f"its suffix {path.suffix or '(none)'!r} is not one casckpt imports")
