"""A plain value ``torch.save`` wrote, loaded without torch's process-wide allow-list.

DCP hands a writer every non-tensor value of a state as the bytes of ``torch.save(value)``.
casckpt keeps only plain values, so it loads those bytes back with :func:`load_plain`: a
restricted unpickler that makes the containers and scalars pickle builds itself and
exactly the globals protocol 2 names for them (``bytes`` and ``bytearray`` through
``_codecs.encode``, an empty ``bytes()``/``bytearray()``, ``collections.OrderedDict`` and
``Counter``, with no attributes).
Anything else -- a tensor's storage, any other class -- raises :class:`RefusedValue`
naming it; nothing is imported or called that is not in that list.

``torch.load(weights_only=True)`` would need ``bytes`` added to
``torch.serialization``'s allow-list, which is one list for the whole process: entering
``safe_globals`` on one thread changes what another thread's load accepts, and leaving it
drops an entry the user had added. This unpickler shares nothing between calls.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from collections.abc import Callable
from typing import Any, cast

_LATIN1 = ("latin1", "latin-1")


class RefusedValue(Exception):
    """The bytes hold something other than a plain value; ``what`` names it."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _encoded(text: object = None, encoding: object = None) -> bytes:
    """``_codecs.encode``, as protocol 2 pickles ``bytes``: text to latin-1 bytes, nothing else."""
    if type(text) is not str or encoding not in _LATIN1:
        raise RefusedValue("a _codecs.encode call other than the one pickle makes of bytes")
    return text.encode("latin-1")


def _empty_bytes(*args: object) -> bytes:
    if args:  # bytes(n) would allocate n bytes: pickle never writes it
        raise RefusedValue("a bytes(...) call other than the one pickle makes of b''")
    return b""


def _byte_array(*args: object) -> bytearray:
    if args and not (len(args) == 1 and type(args[0]) is bytes):
        raise RefusedValue("a bytearray(...) call other than the one pickle makes of a bytearray")
    return bytearray(*args)


class _OrderedDict(collections.OrderedDict[Any, Any]):
    """An ``OrderedDict`` pickle may fill with items but never give attributes (its BUILD)."""

    def __setstate__(self, state: object) -> None:
        raise RefusedValue("an OrderedDict with attributes, which pickle makes of none")


class _Counter(collections.Counter[Any]):
    """A ``Counter`` as pickle makes it (of one dict), never with attributes."""

    def __init__(self, *args: object) -> None:
        if not args:
            super().__init__()
        elif len(args) == 1 and type(args[0]) is dict:
            super().__init__(cast(dict[Any, int], args[0]))
        else:
            raise RefusedValue("a Counter(...) call other than the one pickle makes of a Counter")

    def __setstate__(self, state: object) -> None:
        raise RefusedValue("a Counter with attributes, which pickle makes of none")


_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("_codecs", "encode"): _encoded,
    ("builtins", "bytes"): _empty_bytes,
    ("builtins", "bytearray"): _byte_array,
    ("collections", "OrderedDict"): _OrderedDict,
    ("collections", "Counter"): _Counter,
}
"""What the loaded value may be made of: ``torch.load(weights_only=True)``'s own list less
what no plain value is (tensors, dtypes, sizes, devices, sets, complex numbers)."""


def _is_tensor(module: str, name: str) -> bool:
    """Whether ``module.name`` is a global ``torch.save`` names for a tensor or its storage."""
    return (module.startswith("torch") and name.startswith("_rebuild")) or (
        module == "torch" and name.endswith("Storage")) or (module, name) in {
        ("torch", "Tensor"), ("torch.nn.parameter", "Parameter")}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol 2's name for it
        found = _GLOBALS.get((module, name))
        if _is_tensor(module, name):
            raise RefusedValue("tensor")
        if found is None:
            raise RefusedValue(f"a {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:  # what torch.save makes of a tensor's storage
        raise RefusedValue("tensor")


def load_plain(data: bytes | memoryview) -> Any:
    """The plain value ``torch.save`` wrote into ``data`` (its zip format).

    Raises:
        RefusedValue: ``data`` holds a tensor (``what == "tensor"``), names another global (its
            dotted name, as "a module.name"), or is not a ``torch.save`` zip holding one pickle.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickles = [i for i in archive.infolist()
                       if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            # torch.save stores its members as they are: never inflate (a small deflated
            # member can be gigabytes) or decrypt anything
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED or (
                    pickles[0].flag_bits & 0x1):
                raise RefusedValue("bytes that are not one torch.save pickle")
            pickled = archive.read(pickles[0])
        return _PlainUnpickler(io.BytesIO(pickled)).load()
    except RefusedValue:
        raise
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
            IndexError, AttributeError, OverflowError, MemoryError, UnicodeDecodeError,
            NotImplementedError, RuntimeError) as exc:
        raise RefusedValue(f"bytes that are not a torch.save value ({type(exc).__name__})") from exc
