"""States: validation, flattening into typed JSON nodes, and rebuilding.

A state is nested ``dict`` / ``list`` / ``tuple`` of torch tensors, numpy
arrays and plain values (``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``) with ``str`` or ``int`` dict keys. :func:`encode_state` turns it into
a JSON-able node tree in which every tensor is replaced by an index into a
list of :class:`TensorLeaf`; nothing is pickled, and every value type survives
exactly (int keys, tuples, bytes, ``-0.0``, NaN payloads).

Trees nest at most :data:`MAX_DEPTH` containers deep. The limit sits far below
Python's recursion limit (every walk of a state, here and in the caller's code,
stays clear of it) and far above any real training state; a stored manifest
nesting deeper than a committed state can is corrupt, and is refused before it
is parsed (:func:`json_nesting`), so no forged input can exhaust the stack.

This module does no I/O.
"""

from __future__ import annotations

import base64
import functools
import itertools
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from casckpt.errors import CorruptManifestError, InvalidNameError, UnsupportedStateError

if TYPE_CHECKING:  # imported where states are encoded or manifests read: the CLI's listings need neither
    import numpy as np
    import torch

Node = dict[str, Any]
TensorKind = Literal["torch", "numpy"]

MAX_DEPTH = 64
"""How many dict / list / tuple containers a state may nest (the root counts as one)."""

MAX_MANIFEST_NESTING = 2 * MAX_DEPTH + 8
"""How deeply a manifest's JSON may nest: a container is two levels (node, item list), plus
the document, a ranks root, and the deepest leaf nodes (metadata nests at most MAX_DEPTH + 1)."""

_INT64 = 1 << 63
_ESCAPED_STRINGS = re.compile(rb'"(?:[^"\\]++|\\.)*+"?|\\\\|\\"', re.DOTALL)
"""What :func:`json_nesting` drops from a text with escaped quotes: a string (to its unescaped
closing quote, or to the end of an unterminated one), and outside strings a backslash pair
or an escaped quote. Possessive, so linear on any input."""
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_NESTING_WINDOW = 1 << 18  # bytes of structure split at a time (see _structure_nesting)
_BRACKET_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))
_FORBIDDEN_KEY = re.compile(r"[/\\\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    """A tensor found in a state, with the dotted path that names it."""

    path: str
    kind: TensorKind
    value: torch.Tensor | np.ndarray


def join_path(prefix: str, key: str | int) -> str:
    """Extend a dotted tensor path (``model.layers.0.weight``) by one key (a prefix ending in
    ``/`` is a rank's, :func:`rank_path`: no key holds ``/``, so no other prefix does)."""
    return f"{prefix}.{key}" if prefix and prefix[-1] != "/" else f"{prefix}{key}"


def check_state_key(key: str, where: str) -> None:
    """Refuse dict keys that could escape a directory if a path were ever built from them.

    Raises:
        InvalidNameError: ``key`` is empty, ``.``/``..``, or holds ``/``, ``\\``
            or a control character.
    """
    if not key_ok(key):
        raise InvalidNameError(
            f"state key {key!r} under {where or '<root>'!r} cannot be stored: keys must be valid "
            "UTF-8, not empty, '.' or '..', nor contain '/', '\\' or control characters, because "
            "tensor paths are used as names on export. Rename the key."
        )


@functools.lru_cache(maxsize=1 << 20)  # a state's keys come back in every commit
def key_ok(key: str) -> bool:
    """Whether :func:`check_state_key` accepts ``key`` (codecs that keep other keys in pair
    nodes ask this)."""
    return key not in ("", ".", "..") and _FORBIDDEN_KEY.search(key) is None and _utf8(key)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be stored in the catalog
        return False
    return True


def _float_bits(value: float) -> str:
    return struct.pack(">d", value).hex()


def _float_from_bits(bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(bits))[0]
    return value


def _describe(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_tensor(t: torch.Tensor, path: str) -> None:
    """Refuse a tensor casckpt cannot store (the common case is decided by encode_state)."""
    import torch

    if t.is_nested:
        raise UnsupportedStateError(
            f"tensor at {path!r} is a nested (ragged) tensor; only dense tensors can be stored. "
            "Store its components instead: list(t.unbind()), or t.to_padded_tensor(0.0) and "
            "the lengths."
        )
    if t.layout != torch.strided:
        raise UnsupportedStateError(
            f"tensor at {path!r} has layout {t.layout}; only dense (strided) tensors can be "
            "stored. Convert it with .to_dense() before committing."
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"tensor at {path!r} is quantized ({t.dtype}); store its int_repr(), scale and "
            "zero_point instead."
        )
    if t.is_meta:
        raise UnsupportedStateError(
            f"tensor at {path!r} is on the meta device and holds no data; materialise it first."
        )
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"tensor at {path!r} is a {_describe(t)}; only plain torch.Tensor and "
            "nn.Parameter are supported in this version. Convert it to a local tensor first."
        )


def _check_array(a: np.ndarray, path: str) -> None:
    if a.dtype.kind not in "biufc" or a.dtype.fields is not None:
        raise UnsupportedStateError(
            f"numpy array at {path!r} has dtype {a.dtype}; only bool, integer, float and "
            "complex arrays can be stored (object and structured arrays cannot be loaded "
            "without executing code). Convert it to a numeric array."
        )


def encode_state(state: object, other: Callable[[object, str], Node | None] | None = None,
                 ) -> tuple[Node, list[TensorLeaf]]:
    """Validate ``state`` and encode it as a JSON-able node tree.

    ``other(obj, path)``, if given, encodes a leaf of no type listed here as a node of its own
    (a ``"t"`` no node of this module has; :func:`decode_state`'s ``other`` rebuilds it), or
    returns None to refuse it. A version's manifest holds no such node: codecs that keep a
    node inside a plain value use it (the Megatron integration's objects).

    Returns:
        ``(root, leaves)``: ``root`` is the node tree, in which every tensor is
        ``{"t": "tensor", "i": n}`` with ``leaves[n]`` the tensor found there.

    Raises:
        UnsupportedStateError: an object of an unsupported type, naming its path and type;
            or containers nested deeper than :data:`MAX_DEPTH`, naming the path.
        InvalidNameError: a dict key that could escape a directory.
    """
    import numpy as np
    import torch

    plain_tensors, strided = (torch.Tensor, torch.nn.Parameter), torch.strided
    leaves: list[TensorLeaf] = []
    paths: dict[str, int] = {}
    active: set[int] = set()

    def enc(obj: object, path: str, depth: int = 0) -> Node:
        kind = type(obj)
        if kind in plain_tensors:  # most leaves of a large state
            t: torch.Tensor = obj  # type: ignore[assignment]  # kind says so (no cast() call per leaf)
            if not (t.is_cpu and t.layout is strided and not (t.is_nested or t.is_quantized)):
                _check_tensor(t, path)  # the common case is decided here, in few calls
            return leaf(TensorLeaf(path, "torch", t))
        if obj is None:
            return {"t": "none"}
        if kind is bool:
            return {"t": "bool", "v": obj}
        if kind is int:
            value = cast(int, obj)
            if -_INT64 <= value < _INT64:
                return {"t": "int", "v": value}
            return {"t": "int", "h": format(value, "x")}  # JSON tools mangle huge numbers
        if kind is float:
            return {"t": "float", "v": _float_bits(cast(float, obj))}
        if kind is str:
            return {"t": "str", "v": obj}
        if kind is bytes or kind is bytearray:
            return {"t": "bytes", "v": base64.b64encode(cast(bytes, obj)).decode("ascii")}
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
            return leaf(TensorLeaf(path, "torch", obj))
        if kind is np.ndarray:
            _check_array(cast(np.ndarray, obj), path)
            return leaf(TensorLeaf(path, "numpy", cast(np.ndarray, obj)))
        if isinstance(obj, dict) or kind is list or kind is tuple:
            if id(obj) in active:
                raise UnsupportedStateError(
                    f"the state contains itself at {path!r}; remove the cycle."
                )
            if depth == MAX_DEPTH:
                raise UnsupportedStateError(
                    f"the state nests deeper than {MAX_DEPTH} containers (dict, list, tuple) "
                    f"at {path!r}; casckpt stores states up to {MAX_DEPTH} levels deep. Flatten "
                    "that part (join its keys into one dotted name) or store it as str or bytes."
                )
            active.add(id(obj))
            try:
                return enc_container(cast(Any, obj), path, depth + 1)
            finally:
                active.discard(id(obj))
        found = None if other is None else other(obj, path)
        if found is not None:
            return found
        raise UnsupportedStateError(
            f"cannot store the {_describe(obj)} at {path or '<root>'!r}: supported leaves are "
            "torch tensors, numpy arrays, None, bool, int, float, str and bytes (exactly those "
            "types, not subclasses such as numpy scalars, enums or namedtuples), in nested "
            "dict/list/tuple. Convert it (float(x), int(x), tuple(x), x.state_dict()) first."
        )

    def leaf(found: TensorLeaf) -> Node:
        n = len(leaves)
        if paths.setdefault(found.path, n) != n:
            raise InvalidNameError(
                f"two tensors would both be named {found.path!r} (keys such as 'a.b' and "
                "'a' -> 'b', or 0 and '0', join to the same dotted path); rename one of them"
            )
        leaves.append(found)
        return {"t": "tensor", "i": n}

    def enc_container(obj: dict[Any, Any] | list[Any] | tuple[Any, ...], path: str,
                      depth: int) -> Node:
        prefix = f"{path}." if path and path[-1] != "/" else path  # join_path, once per container
        if isinstance(obj, dict):
            keys: list[Any] = []
            values: list[Node] = []
            for key, value in obj.items():
                if type(key) is str:  # most keys: checked once per process (key_ok is cached)
                    if not key_ok(key):
                        check_state_key(key, path)
                    keys.append(key)
                elif isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise UnsupportedStateError(
                        f"dict key {key!r} ({_describe(key)}) under {path or '<root>'!r} is not "
                        "supported: keys must be str or int."
                    )
                elif isinstance(key, str):
                    check_state_key(key, path)
                    keys.append(str(key))
                else:
                    keys.append({"i": int(key)})
                values.append(enc(value, f"{prefix}{key}", depth))
            return {"t": "dict", "k": keys, "v": values}
        items = [enc(v, f"{prefix}{i}", depth) for i, v in enumerate(obj)]
        return {"t": "tuple" if isinstance(obj, tuple) else "list", "v": items}

    return enc(state, ""), leaves


def too_deep(state: object, limit: int = MAX_DEPTH) -> str | None:
    """The dotted path of the first dict / list / tuple nested deeper than ``limit`` in
    ``state`` (None if there is none); iterative, so any depth (or a cycle) is safe."""
    stack: list[tuple[object, str, int]] = [(state, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Iterator[tuple[object, object]] = iter(node.items())
        elif isinstance(node, (list, tuple)):
            children = enumerate(node)
        else:
            continue
        if depth == limit:
            return path or "<root>"
        stack.extend((value, join_path(path, cast(Any, key)), depth + 1) for key, value in children)
    return None


def json_nesting(text: bytes) -> int:
    """How deeply arrays and objects nest in JSON ``text``, counted without parsing it.

    Brackets inside strings are skipped (a quote ends a string unless an odd run of
    backslashes precedes it). Used to refuse a forged document before ``json.loads``
    recurses into it: a parser's recursion is bounded by Python's recursion limit only,
    which a program may have raised past what its stack holds. Every pass runs in C (a
    byte filter, a split at the quotes, a running sum; a regular expression first where a
    quote is escaped), as fast as the numpy count it replaced and without importing numpy
    (``casckpt show`` reads a manifest without it).
    """
    if b'\\"' in text:  # some quote may be escaped: drop the strings one by one (slower, rare)
        text = _ESCAPED_STRINGS.sub(b"", text)
    structure = text.translate(None, _NOT_STRUCTURE)  # quotes and brackets, now none escaped
    return _structure_nesting(structure, _NESTING_WINDOW)


def _structure_nesting(structure: bytes, window: int) -> int:
    """The deepest nesting of ``structure`` (quotes and brackets only, no quote escaped), counted
    ``window`` bytes at a time: splitting at the quotes makes an object per quote (~40 bytes
    each), so a forged document of quotes is split a window at a time, carrying whether the
    window starts inside a string and the depth it starts at."""
    depth, deepest, inside = 0, None, False
    for at in range(0, len(structure), window):
        runs = structure[at : at + window].split(b'"')
        outside = b"".join(runs[1::2] if inside else runs[::2])  # every other run is a string's
        inside ^= len(runs) % 2 == 0  # an odd number of quotes
        if outside:
            top = depth + max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, outside)))
            deepest = top if deepest is None else max(deepest, top)
            depth += sum(map(_BRACKET_STEP.__getitem__, outside))
    return 0 if deepest is None else deepest


def decode_state(root: Node, tensor: Callable[[int, str], object],
                 sharded: Callable[[list[int], str], object] | None = None,
                 other: Callable[[Node, str], object] | None = None) -> object:
    """Rebuild a state from ``root``; ``tensor(i, path)`` supplies tensor ``i``,
    ``sharded(indices, path)`` a tensor assembled from the shards ``indices``, and
    ``other(node, path)`` the value of a node :func:`encode_state`'s ``other`` made.

    Raises:
        CorruptManifestError: a node is malformed (or sharded where ``sharded`` is None).
    """

    def dec(node: Any, path: str) -> object:
        if not isinstance(node, dict):
            raise CorruptManifestError(f"manifest node at {path!r} is not an object")
        kind = node.get("t")
        try:
            if kind == "none":
                return None
            if kind == "bool":
                return bool(node["v"])
            if kind == "int":
                if "h" in node:
                    return int(str(node["h"]), 16)
                if not isinstance(node["v"], int) or isinstance(node["v"], bool):
                    raise TypeError("int node without an int")
                return int(node["v"])
            if kind == "float":
                return _float_from_bits(node["v"])
            if kind == "str":
                return str(node["v"])
            if kind == "bytes":
                return base64.b64decode(node["v"], validate=True)
            if kind == "tensor":
                return tensor(int(node["i"]), path)
            if kind == "sharded" and sharded is not None:
                return sharded([int(i) for i in node["i"]], path)
            if kind == "dict":
                out: dict[Any, Any] = {}
                for key, value in zip(node["k"], node["v"], strict=True):
                    k = int(key["i"]) if isinstance(key, dict) else str(key)
                    out[k] = dec(value, join_path(path, k))
                return out
            if kind in ("list", "tuple"):
                items = [dec(v, join_path(path, i)) for i, v in enumerate(node["v"])]
                return tuple(items) if kind == "tuple" else items
            if other is not None and kind not in _KINDS:
                return other(node, path)
        except (KeyError, TypeError, ValueError, OverflowError, struct.error) as exc:
            raise CorruptManifestError(f"manifest node at {path!r} is malformed: {exc}") from exc
        raise CorruptManifestError(f"manifest node at {path!r} has unknown type {kind!r}")

    return dec(root, "")


def rank_path(rank: int, path: str) -> str:
    """How a path of one rank's state is shown for a version saved by a process group
    (``/`` cannot occur in a key, so this never collides with a real path)."""
    return f"rank{rank}/{path}"


def iter_values(root: Node) -> Iterator[tuple[str, object]]:
    """Yield ``(path, value)`` for every plain (non-tensor, non-container) leaf of ``root``
    (under a ``ranks`` root, paths are :func:`rank_path` of each rank's)."""
    if root.get("t") == "ranks":
        for rank, state in enumerate(root["v"]):
            for path, value in iter_values(state):
                yield rank_path(rank, path), value
        return
    for path, node in iter_value_nodes(root):
        yield path, decode_state(node, _no_tensor)


def iter_value_nodes(root: Node) -> Iterator[tuple[str, Node]]:
    """``(path, node)`` of every plain leaf of a one-process ``root``, the node as encoded
    (tensors are skipped without making their paths)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, node = stack.pop()
        kind = node.get("t")
        if kind == "dict":
            found = [(join_path(path, key["i"] if isinstance(key, dict) else key), value)
                     for key, value in zip(node["k"], node["v"], strict=True)
                     if value.get("t") not in _NOT_VALUES]
        elif kind in ("list", "tuple"):
            found = [(join_path(path, i), value) for i, value in enumerate(node["v"])
                     if value.get("t") not in _NOT_VALUES]
        elif kind not in _NOT_VALUES:
            yield path, node
            continue
        else:
            continue
        stack.extend(reversed(found))


_NOT_VALUES = frozenset({"tensor", "sharded"})
_KINDS = frozenset({"none", "bool", "int", "float", "str", "bytes", "tensor", "sharded", "dict", "list",
                    "tuple", "ranks"})
"""The node types of this module (``other`` of :func:`decode_state` is asked for no other)."""


def _no_tensor(i: int, path: str) -> object:
    raise CorruptManifestError(f"unexpected tensor at {path!r}")


def iter_leaves(state: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Yield ``(dotted_path, leaf)`` for every non-container leaf of a state."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from iter_leaves(value, join_path(prefix, key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from iter_leaves(value, join_path(prefix, i))
    else:
        yield prefix, state
