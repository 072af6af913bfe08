"""Megatron ``ShardedObject`` data as a plain value and tensors, and back, without pickle.

Megatron's objects hold tensors: the RNG state (``torch`` and CUDA RNG states as uint8
tensors, the tracker's states, Python's ``random.getstate()`` tuple, numpy's
``get_state()`` with its uint32 array), Transformer Engine's ``_extra_state`` (a uint8
tensor since TE 2.0, an ``io.BytesIO`` before), a distributed optimizer's tensors.
:func:`encode` splits an object's data with casckpt's one state codec
(:func:`casckpt.format.state.encode_state`) into its tensors, each stored as a tensor of
the version, and a plain value for the rest::

    {"casckpt.megatron.object": 1, "node": <encode_state's node>, "numpy": [leaf indices]}

``node`` is the node tree of the data, tensor ``i`` standing for the version's tensor
:func:`tensor_key` ``(key, i)``; the leaves listed in ``numpy`` were numpy arrays (kept
as tensors of their dtype); an ``io.BytesIO`` is a ``{"t": "bytesio"}`` node of its bytes
and position. :func:`decode` rebuilds the data bit for bit (dtypes, shapes, dict key
types, tuples, ``-0.0``, NaN payloads): nothing is unpickled, only the types above are
made. An object with no tensor, array or ``BytesIO`` stays the plain value it is
(Megatron's list of the key's data), as versions before this format hold them; a value
that is a dict is this format (Megatron's is always a list).

The bytes of a ``BytesIO`` and of a uint8 tensor are kept as they are: Transformer Engine's
are a pickle that TE itself unpickles in ``load_state_dict`` (as it does from ``torch_dist``
files); casckpt does not look inside.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from casckpt.errors import CorruptManifestError, UnsupportedStateError
from casckpt.format.state import MAX_DEPTH, Node, decode_state, encode_state, too_deep

OBJECT = "casckpt.megatron.object"
"""The key of the plain value of an object stored with its tensors apart (its format: 1)."""

_TENSOR_INFIX = "%t"
"""Between an object's stored key and its tensor's number: stored keys escape every ``%``
as ``%25`` or ``%2F``, so no key of a ShardedTensor or object holds ``%t``."""


_DATA_DEPTH = 30
"""About how deep an object holding tensors may nest: its node tree doubles the depth."""


class Encoded(NamedTuple):
    """An object's data as a version holds it."""

    value: Any  # plain values only
    tensors: list[torch.Tensor]  # tensor i of the value's node


def tensor_key(stored_key: str, index: int) -> str:
    """The version's key of tensor ``index`` of the object stored under ``stored_key``."""
    return f"{stored_key}{_TENSOR_INFIX}{index}"


def object_of(stored_key: str) -> str | None:
    """The stored key of the object ``stored_key`` is a tensor of, or None (a key of its own)."""
    found, infix, number = stored_key.rpartition(_TENSOR_INFIX)
    return found if infix and number.isdigit() else None


def _bytes_io(obj: object, path: str) -> Node | None:
    if type(obj) is not io.BytesIO:
        return None
    return {"t": "bytesio", "v": base64.b64encode(obj.getvalue()).decode("ascii"), "p": obj.tell()}


def _bytes_io_back(node: Node, path: str) -> object:
    position, text = node.get("p"), node.get("v")
    if (set(node) != {"t", "v", "p"} or node["t"] != "bytesio" or type(position) is not int
            or position < 0 or type(text) is not str):
        raise CorruptManifestError(f"a Megatron object's node at {path!r} is not one casckpt writes")
    try:
        found = io.BytesIO(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise CorruptManifestError(f"a Megatron object's BytesIO at {path!r} is malformed: {exc}") from exc
    found.seek(position)
    return found


def _from_numpy(array: Any, path: str, what: str) -> torch.Tensor:
    if not array.dtype.isnative:
        raise UnsupportedStateError(
            f"{what} holds a numpy array of byte order {array.dtype.byteorder!r} at {path!r}, which "
            "a tensor of the version cannot keep: convert it (array.astype(array.dtype.newbyteorder('=')))")
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = array.copy()  # the same values, in an order torch takes
    return torch.from_numpy(array)


def encode(data: Any, what: str) -> Encoded:
    """``data`` (a ShardedObject key's list of data) as a plain value and its tensors.

    Raises:
        UnsupportedStateError: ``data`` holds an object of another type than tensors, numpy
            arrays (numeric), ``io.BytesIO``, None, bool, int, float, str, bytes in nested
            dict (str or int keys) / list / tuple; its path is named. Or it holds tensors,
            arrays or ``BytesIO`` and nests deeper than its node tree can (about 30 levels).
        InvalidNameError: a dict key holds ``/``, a control character, or is empty.
    """
    others: list[str] = []

    def other(obj: object, path: str) -> Node | None:
        found = _bytes_io(obj, path)
        if found is not None:
            others.append(path)
        return found

    try:
        root, leaves = encode_state(data, other)
    except UnsupportedStateError as exc:
        raise UnsupportedStateError(
            f"{what} cannot be stored: {exc} casckpt keeps an object's tensors, numpy arrays and "
            "io.BytesIO with plain values and never pickles; a class of another kind (e.g. a "
            "torch.dtype or an optimizer's own object) must become plain data in the object, or "
            "a ShardedTensor (a distributed optimizer: a fully reshardable sharding_type)") from exc
    if not leaves and not others:
        return Encoded(data, [])
    tensors = [_from_numpy(leaf.value, leaf.path, what) if leaf.kind == "numpy"
               else cast(torch.Tensor, leaf.value).detach() for leaf in leaves]
    numpy = [i for i, leaf in enumerate(leaves) if leaf.kind == "numpy"]
    wrapped = {OBJECT: 1, "node": root, "numpy": numpy}
    # the writer's limit (the value sits one level below the version's root), refused here
    # before any rank writes
    if too_deep(wrapped, MAX_DEPTH - 1) is not None:
        raise UnsupportedStateError(
            f"{what} holds tensors, numpy arrays or io.BytesIO and nests too deeply to keep them "
            f"apart (at {too_deep(data, _DATA_DEPTH) or '<root>'!r}): its structure is kept as a "
            f"node tree of at most {MAX_DEPTH} levels, about {_DATA_DEPTH} of the object's own. "
            "Flatten that part (join its keys into one dotted name)")
    return Encoded(wrapped, tensors)


def _wrapped(value: Any) -> bool:
    """Whether ``value`` is this format (a dict); raises if it is a dict but not one of ours."""
    if not isinstance(value, dict):
        return False
    form, numpy = value.get(OBJECT), value.get("numpy")
    if type(form) is int and form > 1 and OBJECT in value:
        raise CorruptManifestError(f"a Megatron object was saved in format {form} by a newer "
                                   "casckpt; upgrade casckpt to load this version")
    if (set(value) != {OBJECT, "node", "numpy"} or type(form) is not int or form != 1
            or not isinstance(value["node"], dict) or type(numpy) is not list
            or not all(type(i) is int and i >= 0 for i in numpy) or len(set(numpy)) != len(numpy)):
        raise CorruptManifestError(f"a Megatron object's value is not one casckpt writes (keys "
                                   f"{sorted(map(str, value))}); read it with the casckpt that saved it")
    return True


def _as_array(found: torch.Tensor, index: int) -> object:
    try:
        return found.numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype numpy has not (bfloat16): not ours
        raise CorruptManifestError(f"a Megatron object's tensor {index} is listed as a numpy array, "
                                   f"which a {found.dtype} tensor cannot be: {exc}") from exc


def decode(value: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    """The data :func:`encode` made ``value`` of; ``tensor(i)`` is the version's tensor ``i``.

    Raises:
        CorruptManifestError: ``value`` is not one :func:`encode` makes.
    """
    if not _wrapped(value):
        return value
    numpy = set(value["numpy"])

    def leaf(index: int, path: str) -> object:
        found = tensor(index)
        return _as_array(found, index) if index in numpy else found

    return decode_state(value["node"], leaf, other=_bytes_io_back)
