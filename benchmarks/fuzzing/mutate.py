"""Hostile mutations: of byte strings, of JSON documents and of TOML text.

Every mutator takes a ``random.Random`` and returns the mutated value and a
short description of what it did (the reproducer a report shows). Nothing
here knows a casckpt format; targets pass the offsets of length fields and
the checksums to recompute (see :class:`Field`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Mutation = tuple[bytes, str]


def boundary_ints(size: int) -> list[int]:
    """Integers that break length and offset checks, for a structure of ``size`` bytes."""
    return [0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000,
            (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 48), (1 << 63) - 1, 1 << 63,
            (1 << 64) - 1, max(size - 1, 0), size, size + 1, size // 2, size * 2]


def _int_bytes(value: int, width: int) -> bytes:
    return (value % (1 << (8 * width))).to_bytes(width, "little")


@dataclass(frozen=True, slots=True)
class Field:
    """A little-endian field of a binary structure: where, how wide, and what it is called.

    ``fix`` (optional) recomputes the checksum that covers the field after it
    changed, so a forged value gets past the first integrity check.
    """

    name: str
    offset: int
    width: int
    fix: Callable[[bytearray], None] | None = None


def _flip(data: bytearray, rng: random.Random) -> str:
    bits = [rng.randrange(len(data) * 8) for _ in range(rng.choice((1, 1, 2, 8)))]
    for bit in bits:
        data[bit // 8] ^= 1 << (bit % 8)
    return f"flip bits {bits}"


def _byte(data: bytearray, rng: random.Random) -> str:
    at = rng.randrange(len(data))
    value = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    data[at] = value
    return f"byte {at} = {value:#x}"


def _int(data: bytearray, rng: random.Random) -> str:
    width = rng.choice((1, 2, 4, 8))
    at = rng.randrange(max(1, len(data) - width + 1))
    value = rng.choice(boundary_ints(len(data)))
    data[at : at + width] = _int_bytes(value, width)[: len(data) - at]
    return f"u{width * 8} at {at} = {value}"


def _overwrite(data: bytearray, rng: random.Random) -> str:
    at = rng.randrange(len(data))
    n = min(len(data) - at, rng.choice((1, 4, 16, 92, 256, 4096)))
    fill = rng.choice(("zeros", "ones", "random"))
    data[at : at + n] = {"zeros": bytes(n), "ones": b"\xff" * n,
                         "random": rng.randbytes(n)}[fill]
    return f"overwrite {n} bytes at {at} with {fill}"


def _truncate(data: bytearray, rng: random.Random) -> str:
    at = rng.choice((0, 1, len(data) // 2, len(data) - 1, rng.randrange(len(data))))
    del data[at:]
    return f"truncate to {at}"


def _extend(data: bytearray, rng: random.Random) -> str:
    n = rng.choice((1, 8, 32, 100, 4096))
    how = rng.choice(("zeros", "random", "copy"))
    data += {"zeros": bytes(n), "random": rng.randbytes(n), "copy": bytes(data[:n])}[how]
    return f"append {n} {how} bytes"


def _delete(data: bytearray, rng: random.Random) -> str:
    at = rng.randrange(len(data))
    n = rng.choice((1, 4, 32, 92))
    del data[at : at + n]
    return f"delete {n} bytes at {at}"


def _insert(data: bytearray, rng: random.Random) -> str:
    at = rng.randrange(len(data) + 1)
    n = rng.choice((1, 4, 32, 92))
    data[at:at] = rng.randbytes(n)
    return f"insert {n} random bytes at {at}"


def _duplicate(data: bytearray, rng: random.Random) -> str:
    at = rng.randrange(len(data))
    n = rng.choice((8, 92, 200, 1000))
    data[at:at] = data[at : at + n]
    return f"duplicate {n} bytes at {at}"


_BYTE_OPS: dict[str, Callable[[bytearray, random.Random], str]] = {
    "flip": _flip, "byte": _byte, "int": _int, "overwrite": _overwrite, "truncate": _truncate,
    "extend": _extend, "delete": _delete, "insert": _insert, "duplicate": _duplicate,
}


def splice(data: bytes, other: bytes, rng: random.Random) -> Mutation:
    """Replace a range of ``data`` by a range of ``other`` (another valid input of the same kind)."""
    at = rng.randrange(len(data) + 1)
    src = rng.randrange(len(other) + 1)
    n = rng.choice((4, 92, 512, len(other)))
    keep = rng.choice((0, n))
    return data[:at] + other[src : src + n] + data[at + keep :], f"splice {n} bytes of another seed from " \
        f"{src} at {at} (replacing {keep})"


def mutate_bytes(data: bytes, rng: random.Random, ops: int | None = None) -> Mutation:
    """Apply 1-3 random byte-level mutations (bit flips, boundary integers, ranges, cuts, growth)."""
    out = bytearray(data)
    notes = []
    for _ in range(ops or rng.choice((1, 1, 1, 2, 3))):
        if not out:
            out += rng.randbytes(rng.choice((1, 16)))
            notes.append("empty -> random")
            continue
        name = rng.choice(tuple(_BYTE_OPS))
        notes.append(_BYTE_OPS[name](out, rng))
    return bytes(out), "; ".join(notes)


def forge_field(data: bytes, fields: Sequence[Field], rng: random.Random,
                others: Sequence[int] = ()) -> Mutation:
    """Set one structure field to a boundary value (or a value another field of its kind holds),
    then recompute the checksum covering it: the input stays self-consistent but lies."""
    fld = rng.choice(fields)
    out = bytearray(data)
    if fld.width > 8:  # an id: another one, zeros, or random
        value_bytes = rng.choice((bytes(fld.width), b"\xff" * fld.width, rng.randbytes(fld.width)))
        note = f"{fld.name} = {value_bytes[:4].hex()}..."
    else:
        value = rng.choice((*boundary_ints(len(data)), *others, rng.randrange(1 << (8 * fld.width))))
        value_bytes = _int_bytes(value, fld.width)
        note = f"{fld.name} = {value}"
    out[fld.offset : fld.offset + fld.width] = value_bytes
    if fld.fix is not None:
        fld.fix(out)
        note += " (checksum fixed)"
    return bytes(out), note


# --- JSON documents ---------------------------------------------------------------------------

_DEEP = 20_000


def hostile_values(rng: random.Random) -> list[Any]:
    """JSON values of every wrong type and size."""
    return [
        None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, -0.0,
        float("nan"), float("inf"), float("-inf"), 1e308, "", "x", "0", "-1", "nan", "a" * 10_000,
        "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"), "../../etc/passwd",
        [], {}, [1, 2, 3], {"t": "tensor", "i": 0}, {"t": "int", "v": 1}, {"i": 0},
        [0] * rng.choice((2, 1000)), "f" * 64, "0" * 64,
    ]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys / indices) into a JSON document, iteratively, up to 50,000 of them."""
    out: list[tuple[Any, ...]] = []
    stack = [(prefix, doc)]
    while stack and len(out) < 50_000:
        path, node = stack.pop()
        out.append(path)
        if isinstance(node, dict):
            stack.extend((path + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path + (i,), v) for i, v in enumerate(node))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


_DEEP_MARK = "\x00deep:"


def _deep(depth: int) -> str:
    """A placeholder :func:`json_text` spells as ``depth`` nested list nodes (too deep for
    Python's recursive JSON encoder to write)."""
    return f"{_DEEP_MARK}{depth}"


def _spell_deep(text: str) -> str:
    marker = json.dumps(_DEEP_MARK)[:-1]  # the opening quote and the escaped mark
    while (at := text.find(marker)) >= 0:
        end = text.index('"', at + 1)
        depth = int(text[at + len(marker) : end])
        text = text[:at] + '{"t":"list","v":[' * depth + '{"t":"none"}' + "]}" * depth + text[end + 1 :]
    return text


def mutate_json(doc: Any, rng: random.Random) -> tuple[Any, str]:
    """One structural mutation of a parsed JSON document (a deep copy is mutated):
    wrong types, huge and special numbers, deep nesting, removed or added keys, swapped values."""
    doc = json.loads(json.dumps(doc))
    paths = _paths(doc)
    path = rng.choice(paths)
    op = rng.choice(("replace", "replace", "replace", "delete", "add", "swap", "wrap", "deep",
                     "grow", "retype"))
    if not path and op in ("delete", "swap"):
        op = "replace"
    if op == "replace":
        value = rng.choice(hostile_values(rng))
        if not path:
            return value, f"document = {_short(value)}"
        _get(doc, path[:-1])[path[-1]] = value
        return doc, f"{_where(path)} = {_short(value)}"
    if op == "delete":
        parent = _get(doc, path[:-1])
        del parent[path[-1]]
        return doc, f"delete {_where(path)}"
    if op == "add":
        node = _get(doc, path)
        value = rng.choice(hostile_values(rng))
        if isinstance(node, dict):
            key = rng.choice(("t", "v", "k", "i", "h", "extra", "version", "phase", "rank"))
            node[key] = value
            return doc, f"{_where(path + (key,))} = {_short(value)} (added)"
        if isinstance(node, list):
            node.insert(rng.randrange(len(node) + 1), value)
            return doc, f"insert {_short(value)} into {_where(path)}"
        return mutate_json(doc, rng)
    if op == "swap":
        other = rng.choice(paths)
        if other[: len(path)] == path or path[: len(other)] == other or not other:
            return mutate_json(doc, rng)
        a, b = _get(doc, path), _get(doc, other)
        _get(doc, path[:-1])[path[-1]] = b
        _get(doc, other[:-1])[other[-1]] = a
        return doc, f"swap {_where(path)} and {_where(other)}"
    if op == "wrap":
        node = _get(doc, path)
        wrapped = rng.choice(([node], {"v": node}, [node, node]))
        if not path:
            return wrapped, "wrap the document"
        _get(doc, path[:-1])[path[-1]] = wrapped
        return doc, f"wrap {_where(path)}"
    if op == "deep":
        depth = rng.choice((100, 1000, _DEEP))
        if not path:
            return _deep(depth), f"document = {depth} nested lists"
        _get(doc, path[:-1])[path[-1]] = _deep(depth)
        return doc, f"{_where(path)} = {depth} nested list nodes"
    if op == "grow":
        node = _get(doc, path)
        if isinstance(node, list) and node:
            n = rng.choice((2, 100, 100_000))
            node.extend(node[-1:] * n)
            return doc, f"repeat the last item of {_where(path)} {n} times"
        return mutate_json(doc, rng)
    node = _get(doc, path)  # retype: the same value as another JSON type
    retype: dict[type, Callable[[Any], Any]] = {
        int: str, float: str, str: _maybe_number, bool: int, list: tuple_text, dict: list_of_items,
        type(None): lambda _: 0}
    retyped = retype[type(node)](node)
    if not path:
        return retyped, "retype the document"
    _get(doc, path[:-1])[path[-1]] = retyped
    return doc, f"{_where(path)} retyped to {type(retyped).__name__}"


def _maybe_number(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return [text]


def tuple_text(items: list[Any]) -> Any:
    """A list, retyped: its text."""
    return json.dumps(items)[:1000]


def list_of_items(mapping: dict[str, Any]) -> Any:
    """A dict, retyped: its items as pairs."""
    return [[k, v] for k, v in mapping.items()]


def _where(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "document"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_text(doc: Any, rng: random.Random) -> tuple[str, str]:
    """Serialise ``doc`` the way a forger might: sometimes with a duplicated key, a number
    spelled out of range, or NaN, which strict writers never produce."""
    text = _spell_deep(json.dumps(doc, sort_keys=True, separators=(",", ":")))
    trick = rng.choice(("none", "none", "dup", "bignum", "nan"))
    if trick == "dup" and text.startswith("{") and len(text) > 2:
        key = rng.choice(('"version":1,', '"format":"x",', '"run":7,', '"step":"1",', '"root":null,'))
        return "{" + key + text[1:], f"duplicate key {key[:-1]}"
    if trick in ("bignum", "nan"):
        digits = [i for i, ch in enumerate(text) if ch.isdigit() and text[i - 1] in ":[,"]
        if digits:
            at = rng.choice(digits)
            end = at
            while end < len(text) and (text[end].isdigit() or text[end] in ".eE-+"):
                end += 1
            spelled = rng.choice(("1e999", "-1e999", "9" * 400, "NaN", "Infinity", "-0", "1E-400"))
            return text[:at] + spelled + text[end:], f"number at char {at} spelled {spelled[:12]}"
    return text, ""


# --- TOML text ----------------------------------------------------------------------------------

_TOML_VALUES = (
    '""', '"."', '"x"', "0", "-1", "1", "2", "9223372036854775807", "9223372036854775808", "1.5",
    "nan", "inf", "true", "[]", "[1, 2]", '["a", "b"]', "{}", '{ url = "." }', "1979-05-27T07:32:00Z",
    '"sqlite:///:memory:"', '"ec:2+1"', '"none"', '"replicate:2"', '"ec:999+999"', '"\\u0000"',
    "[[1]]", '"' + "a" * 5000 + '"',
)
_TOML_KEYS = ("format", "blobs", "catalog", "cache", "redundancy", "write_quorum", "url", "name",
              "domain", "endpoint_url", "region", "store", "locations", "s3")


def mutate_toml(text: str, rng: random.Random, how: str = "types") -> Mutation:
    """One mutation of TOML text. ``how``: ``types`` (a value of the wrong type, a duplicated or
    unknown key, a table turned into a value, a line dropped), ``deep`` (deeply nested arrays and
    tables) or ``bytes`` (byte-level damage, invalid UTF-8 included)."""
    lines = text.splitlines()
    if how == "bytes":
        return mutate_bytes(text.encode(), rng)
    if how == "deep":
        depth = rng.choice((100, 1000, 5000))
        line = "x = " + rng.choice(("[" * depth + "]" * depth, "{ a = " * depth + "1" + " }" * depth))
        table = rng.choice(("[s3]", "[store]"))
        return (text + f"\n{table}\n" + line + "\n").encode(), f"{table} x = {depth} nested arrays or tables"
    op = rng.choice(("value", "value", "key", "dup", "table", "drop"))
    assigned = [i for i, line in enumerate(lines) if "=" in line and not line.startswith("#")]
    if op == "value" and assigned:
        i = rng.choice(assigned)
        key = lines[i].split("=", 1)[0].strip()
        value = rng.choice(_TOML_VALUES)
        lines[i] = f"{key} = {value}"
        return _toml(lines), f"{key} = {value[:40]}"
    if op == "dup" and assigned:
        i = rng.choice(assigned)
        lines.insert(i + 1, lines[i])
        return _toml(lines), f"duplicate line {i}: {lines[i][:50]}"
    if op == "table":
        line = rng.choice(("[store]", "[s3]", "[[locations]]", "[[store]]", "store = 1", "s3 = 1",
                           "locations = 1", "[store.format]", '[locations]\nurl = "."', "[s3.x.y]"))
        at = rng.randrange(len(lines) + 1)
        lines.insert(at, line)
        return _toml(lines), f"insert line {at}: {line}"
    if op == "drop" and lines:
        i = rng.randrange(len(lines))
        dropped = lines.pop(i)
        return _toml(lines), f"drop line {i}: {dropped[:50]}"
    at = rng.randrange(len(lines) + 1)
    line = f"{rng.choice(_TOML_KEYS)} = {rng.choice(_TOML_VALUES)}"
    lines.insert(at, line)
    return _toml(lines), f"insert line {at}: {line[:50]}"


def _toml(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()
