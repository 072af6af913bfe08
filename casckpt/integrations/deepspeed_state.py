"""DeepSpeed's checkpoint dicts as plain values, and back, without pickle.

A DeepSpeed checkpoint file (``mp_rank_00_model_states.pt``,
``zero_pp_rank_N_mp_rank_00_optim_states.pt``) is a dict of tensors and plain values plus a
few objects of DeepSpeed's and PyTorch's own: ``OrderedDict`` state dicts, ``torch.Size``
parameter shapes, ``torch.dtype``, the ``LossScaler`` / ``DynamicLossScaler`` of the optimizer, the
``ZeroStageEnum`` stage, ``fragment_address`` slice mappings. :func:`encode` turns each of
them into a node ``{"casckpt.deepspeed": KIND, "value": ...}`` made of plain values, which a
version can hold; :func:`decode` builds the object again from the node. The kinds are a fixed
list (:data:`KINDS`): the store names a kind, never a module or a class, so reading a version
imports and calls only the constructors listed here, and nothing stored is unpickled.

A dict whose keys could not be state keys (``/`` in a key, an empty key) or that holds the
node key itself is stored as a ``pairs`` node and comes back as the dict it was. Anything
else (an object of a class not listed) is refused with its key path before anything is
written: return plain data from ``client_state``.

This module imports neither torch nor DeepSpeed at import time (``import casckpt`` must not).
"""

from __future__ import annotations

import enum
import importlib
from collections import OrderedDict
from typing import Any

from casckpt.errors import CorruptManifestError, UnsupportedStateError
from casckpt.format.state import key_ok

NODE = "casckpt.deepspeed"
"""The key of a node that stands for an object a version cannot hold as it is."""

_PLAIN = (int, float, str, bytes, bool, type(None))

KINDS: dict[str, tuple[str, str, str]] = {
    # kind: (module, class, how it is stored)
    "loss_scaler": ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "attrs"),
    "dynamic_loss_scaler": ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", "attrs"),
    "zero_stage": ("deepspeed.runtime.zero.config", "ZeroStageEnum", "enum"),
    "fragment_address": ("deepspeed.utils.tensor_fragment", "fragment_address", "attrs"),
}
"""The DeepSpeed objects a checkpoint may hold, by the kind name a node records."""

DTYPES = frozenset((
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
))
"""The torch dtypes a node may name: a fixed list, so a stored name never reaches another
attribute of ``torch`` (some import submodules when read)."""

_BY_CLASS = {(module, name): kind for kind, (module, name, _) in KINDS.items()}


def encode(obj: Any, where: str = "") -> Any:
    """``obj`` with every object DeepSpeed puts in a checkpoint as a plain-value node.

    Raises:
        UnsupportedStateError: an object of a class :data:`KINDS` does not list (its key path
            is named).
    """
    import torch

    if isinstance(obj, (torch.Tensor, *_PLAIN)) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, torch.Size):
        return {NODE: "size", "value": [int(n) for n in obj]}
    if isinstance(obj, torch.dtype):  # DynamicLossScaler holds one
        return {NODE: "dtype", "value": str(obj).removeprefix("torch.")}
    if type(obj) is OrderedDict:
        return {NODE: "odict", "value": [(k, encode(v, f"{where}/{k}")) for k, v in obj.items()]}
    if type(obj) is dict:
        items = [(k, encode(v, f"{where}/{k}")) for k, v in obj.items()]
        if any(isinstance(k, str) and (k == NODE or not key_ok(k)) for k, _ in items):
            return {NODE: "pairs", "value": items}
        return dict(items)
    if type(obj) is list:
        return [encode(v, f"{where}/{i}") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(encode(v, f"{where}/{i}") for i, v in enumerate(obj))
    kind = _BY_CLASS.get((type(obj).__module__, type(obj).__qualname__))
    if kind is None:
        raise UnsupportedStateError(
            f"{where or '<root>'} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a "
            "casckpt version cannot hold (tensors, numbers, strings, bytes, None, lists, tuples "
            "and dicts, and the DeepSpeed objects of casckpt.integrations.deepspeed_state.KINDS): "
            "put plain data in client_state")
    if KINDS[kind][2] == "enum":
        return {NODE: kind, "value": encode(obj.value, where)}
    return {NODE: kind, "value": {k: encode(v, f"{where}/{k}") for k, v in vars(obj).items()}}


def decode(obj: Any) -> Any:
    """The inverse of :func:`encode`.

    Raises:
        CorruptManifestError: a node names a kind this version of casckpt does not know.
    """
    if type(obj) is dict:
        kind = obj.get(NODE) if len(obj) == 2 and "value" in obj else None
        if kind is None:
            return {k: decode(v) for k, v in obj.items()}
        return _node(kind, obj["value"])
    if type(obj) is list:
        return [decode(v) for v in obj]
    if type(obj) is tuple:
        return tuple(decode(v) for v in obj)
    return obj


def _node(kind: Any, value: Any) -> Any:
    if kind == "size":
        import torch

        return torch.Size(value)
    if kind == "dtype":
        import torch

        dtype = getattr(torch, value) if isinstance(value, str) and value in DTYPES else None
        if not isinstance(dtype, torch.dtype):  # a name this torch lacks (float8 in an old one)
            raise CorruptManifestError(f"a DeepSpeed checkpoint node names dtype {value!r}, which "
                                       "this torch does not have; read it with the torch that saved it")
        return dtype
    if kind == "odict":
        return OrderedDict((k, decode(v)) for k, v in value)
    if kind == "pairs":
        return {k: decode(v) for k, v in value}
    if not isinstance(kind, str) or kind not in KINDS:
        raise CorruptManifestError(
            f"a DeepSpeed checkpoint node names kind {kind!r}, which this casckpt does not know "
            f"(it knows size, dtype, odict, pairs, {', '.join(KINDS)}); read it with the casckpt "
            "that saved it")
    module, name, how = KINDS[kind]
    cls = getattr(importlib.import_module(module), name)
    if how == "enum":
        return cls(decode(value))
    made = object.__new__(cls)
    made.__dict__.update({k: decode(v) for k, v in value.items()})
    return made
