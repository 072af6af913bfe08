"""Targets over a whole store: objects on disk, catalog rows, the config file, refs records.

Each case copies a small template store (see :mod:`benchmarks.fuzzing.seeds`),
changes one thing -- an object's bytes or file type, a catalog row through
SQL, a line of ``casckpt.toml``, a refs record -- then reads the store the
ways users do: ``restore`` of every version, ``load_tensor``, queries, and
``check(read_data=True)``. A version restored must be exactly the state that
was committed under that ref (never another version's, never garbled); a
CasckptError is the only acceptable refusal.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import tomllib
import torch

import casckpt
from benchmarks.fuzzing.formats import SHARD_FIELDS, all_paths, pack_fields
from benchmarks.fuzzing.harness import WrongData
from benchmarks.fuzzing.mutate import (
    boundary_ints,
    forge_field,
    json_text,
    mutate_bytes,
    mutate_json,
    mutate_toml,
)
from benchmarks.fuzzing.seeds import PackSeed, load_expected
from casckpt.format.shard import SHARD_HEADER_SIZE

_TENSOR_PATHS = ("model.w", "model.emb", "model.ids", "model.view", "arr")


# --- comparing restored state ------------------------------------------------------------------


def _same(got: Any, want: Any, where: str) -> None:
    """Raise WrongData unless ``got`` is exactly ``want`` (types, keys, dtypes, shapes, bits)."""
    if type(got) is not type(want):
        raise WrongData(f"{where}: restored a {type(got).__name__}, committed a {type(want).__name__}")
    if isinstance(want, dict):
        if list(got) != list(want):
            raise WrongData(f"{where}: restored keys {list(got)[:5]}, committed {list(want)[:5]}")
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise WrongData(f"{where}: restored {len(got)} items, committed {len(want)}")
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _same(a, b, f"{where}.{i}")
    elif isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(
                got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise WrongData(f"{where}: restored tensor differs from the committed one")
    elif isinstance(want, np.ndarray):
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            raise WrongData(f"{where}: restored array differs from the committed one")
    elif isinstance(want, float):
        if struct.pack("<d", got) != struct.pack("<d", want):
            raise WrongData(f"{where}: restored {got!r}, committed {want!r}")
    elif got != want:
        raise WrongData(f"{where}: restored {got!r:.60}, committed {want!r:.60}")


def _leaf(state: Any, path: str) -> Any:
    for key in path.split("."):
        state = state[key]
    return state


def read_everything(store: Any, expected: dict[str, Any], rng: random.Random,
                    queries: bool = False) -> None:
    """Restore every version, load one tensor, (query,) and check the store with its data.

    Refs never committed (``b@1`` when only ``a@1`` was) must not restore at all: a damaged
    catalog must not hand out a version under another version's name."""
    attempts: list[Callable[[], None]] = []

    def restores(ref: str, want: Any) -> Callable[[], None]:
        return lambda: _same(store.restore(ref), want, ref)

    def phantom(ref: str) -> Callable[[], None]:
        def attempt() -> None:
            store.restore(ref)
            raise WrongData(f"restored {ref}, a ref never committed")
        return attempt

    attempts += [restores(ref, want) for ref, want in expected.items()]
    runs, steps = {r.split("@")[0] for r in expected}, {r.split("@")[1] for r in expected}
    attempts += [phantom(f"{run}@{step}") for run in sorted(runs) for step in sorted(steps)
                 if f"{run}@{step}" not in expected]
    ref = rng.choice(sorted(expected))
    path = rng.choice(_TENSOR_PATHS)
    attempts.append(lambda: _same(store.load_tensor(ref, path), _leaf(expected[ref], path), f"{ref}:{path}"))
    if queries:
        attempts += [lambda: store.show("a@2"), lambda: store.diff("a@1", "a@3"),
                     lambda: store.history("a", "model.w"), lambda: store.log("a"), lambda: store.runs()]
    attempts.append(lambda: store.ops.check(read_data=True))
    all_paths(attempts)


# --- one copy of a template store per case ------------------------------------------------------


class _Template:
    def __init__(self, seeds_dir: Path, name: str) -> None:
        self.root = seeds_dir / "stores" / name / "store"
        self.expected = load_expected(seeds_dir, name)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"scratch-{name}-", dir=seeds_dir.parent))
        self.files = sorted(p.relative_to(self.root) for p in self.root.rglob("*") if p.is_file())
        self.serial = 0

    @contextmanager
    def copy(self) -> Iterator[Path]:
        self.serial += 1
        root = self.scratch / str(self.serial)
        shutil.copytree(self.root, root, symlinks=True)
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def objects(self, pattern: str) -> list[Path]:
        return [p for p in self.files if p.match(pattern)]


def _hostile_file(path: Path, rng: random.Random, outside: Path, fifo: bool) -> str:
    """Replace an object by something that is not a regular file of the location: a FIFO (a
    reader that opens it waits forever), or a symlink out of it, a symlink loop, a directory,
    or a symlink to /dev/zero (endless)."""
    path.unlink()
    how = "fifo" if fifo else rng.choice(("symlink-out", "symlink-loop", "directory", "dev-zero"))
    if how == "fifo":
        os.mkfifo(path)
    elif how == "symlink-out":
        outside.write_bytes(b"outside the location" * 100)
        path.symlink_to(outside)
    elif how == "symlink-loop":
        path.symlink_to(path.name)
    elif how == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return f"replaced by a {how}"


_HOSTILE = ("fifo", "special-file")
_HOSTILE_WEIGHTS = {"fifo": 0.15, "special-file": 0.25}  # a FIFO costs a timeout until storage refuses it


def _open(root: Path, *, recover: bool = False) -> Any:
    return casckpt.open(root, create=False, workers=2, recover=recover)


# --- objects on disk ------------------------------------------------------------------------------


class ObjectsTarget:
    """One pack or manifest object of a single-copy store damaged, forged, swapped or replaced."""

    name = "objects"
    kinds: tuple[str, ...] = (
        "pack-bytes", "pack-forge", "pack-swap", "pack-truncate", "pack-missing", "manifest-bytes", *_HOSTILE)
    weights = _HOSTILE_WEIGHTS

    def __init__(self, seeds_dir: Path) -> None:
        self.template = _Template(seeds_dir, "plain")
        self.packs = self.template.objects("packs/*/*")
        self.manifests = self.template.objects("manifests/*")

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        with self.template.copy() as root:
            rel = rng.choice(self.manifests if kind == "manifest-bytes" else self.packs)
            path = root / rel
            data = path.read_bytes()
            if kind in ("pack-bytes", "manifest-bytes"):
                new, what = mutate_bytes(data, rng)
            elif kind == "pack-forge":
                head, foot, trailer, values = pack_fields(PackSeed(rel.name, data, {}))
                new, what = forge_field(data, rng.choice((head, foot, trailer)), rng, values)
            elif kind == "pack-swap":
                other = rng.choice([p for p in self.packs if p != rel])
                new, what = (root / other).read_bytes(), f"holds the bytes of {other.name[:12]}"
            elif kind == "pack-truncate":
                cut = rng.choice((0, 24, len(data) // 2, len(data) - 32, len(data) - 1))
                new, what = data[:cut], f"truncated to {cut}"
            elif kind == "pack-missing":
                new, what = b"", "deleted"
                path.unlink()
            else:
                outside = root.parent / f"{root.name}-outside"
                new, what = b"", _hostile_file(path, rng, outside, kind == "fifo")
            if kind not in ("pack-missing", *_HOSTILE):
                path.write_bytes(new)
            note(f"{rel}: {what}")
            with closing(_open(root)) as store:
                read_everything(store, self.template.expected, rng)


class EcObjectsTarget:
    """Shard objects of an ec:2+1 store damaged, forged (header CRC fixed), swapped, removed."""

    name = "ec-objects"
    kinds: tuple[str, ...] = (
        "shard-bytes", "shard-forge", "shard-swap", "shard-truncate", "two-shards", "shard-missing",
        *_HOSTILE)
    weights = _HOSTILE_WEIGHTS

    def __init__(self, seeds_dir: Path) -> None:
        self.template = _Template(seeds_dir, "ec")
        self.shards = self.template.objects("l*/packs/*/*.s*")

    def _damage(self, root: Path, rel: Path, kind: str, rng: random.Random) -> str:
        path = root / rel
        data = path.read_bytes()
        if kind == "shard-bytes":
            new, what = mutate_bytes(data, rng)
        elif kind == "shard-forge":
            values = [2, 1, 3, SHARD_HEADER_SIZE, len(data), len(data) - SHARD_HEADER_SIZE]
            new, what = forge_field(data, SHARD_FIELDS, rng, values)
        elif kind == "shard-swap":
            other = rng.choice([p for p in self.shards if p != rel])
            new, what = (root / other).read_bytes(), f"holds the bytes of {other}"
        elif kind == "shard-truncate":
            cut = rng.choice((0, SHARD_HEADER_SIZE - 1, SHARD_HEADER_SIZE, len(data) // 2, len(data) - 1))
            new, what = data[:cut], f"truncated to {cut}"
        elif kind in _HOSTILE:
            return _hostile_file(path, rng, root.parent / f"{root.name}-outside", kind == "fifo")
        else:
            path.unlink()
            return "deleted"
        path.write_bytes(new)
        return what

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        with self.template.copy() as root:
            rel = rng.choice(self.shards)
            what = f"{rel}: {self._damage(root, rel, kind if kind != 'two-shards' else 'shard-bytes', rng)}"
            if kind == "two-shards":  # beyond what ec:2+1 survives, when both belong to one pack
                pack = rel.name.split(".")[0]
                siblings = [p for p in self.shards if p.name.split(".")[0] == pack and p != rel]
                other = rng.choice(siblings)
                what += f"; {other}: {self._damage(root, other, rng.choice(self.kinds[:4]), rng)}"
            note(what)
            with closing(_open(root)) as store:
                read_everything(store, self.template.expected, rng)


# --- catalog rows ---------------------------------------------------------------------------------

_COLUMNS: dict[str, tuple[str, str, str]] = {  # kind -> (store, table, column)
    "chunks.offset": ("plain", "chunks", "offset"),
    "chunks.stored_len": ("plain", "chunks", "stored_len"),
    "chunks.raw_len": ("plain", "chunks", "raw_len"),
    "chunks.codec": ("plain", "chunks", "codec"),
    "chunks.base_id": ("plain", "chunks", "base_id"),
    "chunks.pack_id": ("plain", "chunks", "pack_id"),
    "packs.size": ("plain", "packs", "size"),
    "packs.key": ("plain", "packs", "key"),
    "ec-packs.layout": ("ec", "packs", "k|m|stripe|data_offset|size|scheme|algorithm"),
    "shards.size": ("ec", "shards", "size"),
    "shards.key": ("ec", "shards", "key"),
    "shards.checksum": ("ec", "shards", "checksum"),
    "shards.idx": ("ec", "shards", "idx"),
    "chunks.swap": ("plain", "chunks", "pack_id|offset|stored_len|raw_len|codec|base_id"),
    "versions.step": ("plain", "versions", "step"),
    "versions.run_id": ("plain", "versions", "run_id"),
    "versions.manifest": ("plain", "versions", "manifest"),
    "contents.chunk_ids": ("plain", "contents", "chunk_ids"),
    "tree_nodes.body": ("plain", "tree_nodes", "body"),
    "tensors.row": ("plain", "tensors", "shape|dtype|nbytes|chunks|digest"),
}


def _sql_values(column_values: list[Any], rng: random.Random) -> list[Any]:
    ints = [v for v in column_values if isinstance(v, int)]
    size = max(ints, default=0)
    ints = [v for v in boundary_ints(size) if v < 1 << 63]  # SQLite holds 64-bit integers only
    return [*ints, -1, -(1 << 63), None, "", "abc", "0" * 64, "f" * 64, 1.5, float("nan"),
            b"\x00" * 32, *rng.sample(column_values, min(3, len(column_values)))]


class CatalogTarget:
    """One catalog row changed through SQL: a wrong number, type, id or another row's value."""

    name = "catalog"
    kinds = tuple(_COLUMNS) + ("versions.step-swap", "versions.manifest-swap")

    def __init__(self, seeds_dir: Path) -> None:
        self.templates = {"plain": _Template(seeds_dir, "plain"), "ec": _Template(seeds_dir, "ec")}

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        template = self.templates["plain" if kind.startswith("versions.") else _COLUMNS[kind][0]]
        with template.copy() as root:
            with closing(sqlite3.connect(root / "catalog.db")) as db, db:
                what = self._mutate(db, kind, rng)
            note(what)
            with closing(_open(root)) as store:
                read_everything(store, template.expected, rng, queries=True)

    def _mutate(self, db: sqlite3.Connection, kind: str, rng: random.Random) -> str:
        if kind in ("versions.step-swap", "versions.manifest-swap"):
            column = kind.split(".")[1].removesuffix("-swap")
            (a, va), (b, vb) = rng.sample(db.execute(f"SELECT id, {column} FROM versions").fetchall(), 2)
            if column == "step":  # through a free value: (run, step) is unique
                db.execute("UPDATE versions SET step = -999 WHERE id = ?", (a,))
            db.execute(f"UPDATE versions SET {column} = ? WHERE id = ?", (va, b))
            db.execute(f"UPDATE versions SET {column} = ? WHERE id = ?", (vb, a))
            return f"versions: {column} of {a[:12]} and {b[:12]} swapped"
        if kind == "chunks.swap":  # two chunks of one length trade places: every number consistent
            columns = _COLUMNS[kind][2].replace("|", ", ")
            sizes = db.execute("SELECT raw_len FROM chunks GROUP BY raw_len HAVING count(*) > 1").fetchall()
            raw_len = rng.choice(sizes)[0]
            rows = db.execute(f"SELECT rowid, {columns} FROM chunks WHERE raw_len = ?", (raw_len,)).fetchall()
            (a, *va), (b, *vb) = rng.sample(rows, 2)
            setter = ", ".join(f"{c} = ?" for c in columns.split(", "))
            db.execute(f"UPDATE chunks SET {setter} WHERE rowid = ?", (*vb, a))
            db.execute(f"UPDATE chunks SET {setter} WHERE rowid = ?", (*va, b))
            return f"chunks: rows {a} and {b} ({raw_len} bytes) trade locations"
        _, table, columns = _COLUMNS[kind]
        column = rng.choice(columns.split("|"))
        rows = db.execute(f"SELECT rowid, {column} FROM {table}").fetchall()
        if not rows:  # tensors and contents rows exist for versions of the format before trees
            return f"{table}: no rows to damage"
        rowid, old = rng.choice(rows)
        if kind in ("versions.manifest", "contents.chunk_ids", "tree_nodes.body"):
            new: Any = rng.choice((mutate_bytes(old, rng)[0], b"", rng.choice(rows)[1], "text"))
        else:
            new = rng.choice(_sql_values([r[1] for r in rows], rng))
        for value in (new, -999, "0" * 64):  # a unique or NOT NULL column refuses some values
            try:
                db.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (value, rowid))
                new = value
                break
            except sqlite3.IntegrityError:
                continue
        return f"{table}.{column} of row {rowid}: {_short(old)} -> {_short(new)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 50 else text[:47] + "..."


# --- the config file --------------------------------------------------------------------------------


def _safe_paths(doc: Any) -> bool:
    """Whether every string in a parsed config stays inside the store (no absolute paths, no
    parent directories, no network URLs): the fuzzer must not write outside its scratch space
    nor wait on a network that is not there."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            text = node.strip()
            if text.startswith(("/", "~", "\\")) or ".." in text or ("://" in text and not text.startswith(
                    ("sqlite:///:memory:", "file://."))) or ":" in text[:3]:
                return False
    return True


class ConfigTarget:
    """``casckpt.toml`` mutated (wrong types, duplicate keys, tables as values, deep nesting,
    bytes), then the store opened, restored and checked."""

    name = "config"
    kinds: tuple[str, ...] = ("types", "deep", "bytes")

    def __init__(self, seeds_dir: Path) -> None:
        self.templates = {"plain": _Template(seeds_dir, "plain"), "ec": _Template(seeds_dir, "ec")}
        self.texts = {k: (t.root / "casckpt.toml").read_text() for k, t in self.templates.items()}

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        which = rng.choice(sorted(self.templates))
        for _ in range(20):
            data, what = mutate_toml(self.texts[which], rng, kind)
            try:
                if not _safe_paths(tomllib.loads(data.decode("utf-8"))):
                    continue
            except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
                pass
            break
        else:
            data, what = self.texts[which].encode(), "unchanged (no safe mutation drawn)"
        template = self.templates[which]
        with template.copy() as root:
            (root / "casckpt.toml").write_bytes(data)
            note(f"{which} store config: {what}")
            cwd = os.getcwd()
            os.chdir(root)  # relative paths a mutation invents land in the scratch copy
            try:
                with closing(_open(root)) as store:
                    ref = rng.choice(sorted(template.expected))
                    all_paths([lambda: _same(store.restore(ref), template.expected[ref], ref),
                                lambda: store.ops.check()])
            finally:
                os.chdir(cwd)


# --- refs records, read by a catalog rebuild -------------------------------------------------------


class RecordsTarget:
    """A refs record (tag, run, store) mutated, added or replaced, then the catalog rebuilt from
    the blobs alone and the store used: every version must still restore exactly."""

    name = "records"
    kinds: tuple[str, ...] = ("json", "bytes", "new-record", *_HOSTILE)
    weights = _HOSTILE_WEIGHTS

    def __init__(self, seeds_dir: Path) -> None:
        self.template = _Template(seeds_dir, "plain-empty")
        self.records = [p for p in self.template.files if p.parts[0] == "refs"]

    def run(self, rng: random.Random, kind: str, note: Callable[[str], None]) -> None:
        with self.template.copy() as root:
            rel = rng.choice(self.records)
            path = root / rel
            if kind == "json":
                doc, what = mutate_json(json.loads(path.read_bytes()), rng)
                text, trick = json_text(doc, rng)
                path.write_bytes(text.encode("utf-8", "surrogatepass"))
                what += f"; {trick}" if trick else ""
            elif kind == "bytes":
                data, what = mutate_bytes(path.read_bytes(), rng)
                path.write_bytes(data)
            elif kind == "new-record":  # under a name no tag or run has (or the store record)
                name = rng.choice(("store", "00", "zz", "2e2e", "ff" * 40))
                rel = Path("refs/store") if name == "store" else rel.parent / name
                doc, what = mutate_json(json.loads((root / rng.choice(self.records)).read_bytes()), rng)
                (root / rel).write_text(json_text(doc, rng)[0])
            else:
                what = _hostile_file(path, rng, root.parent / f"{root.name}-outside", kind == "fifo")
            note(f"{rel}: {what}")
            with closing(_open(root, recover=True)) as store:
                store.ops.rebuild_catalog()
                rebuilt = [lambda: store.runs(), lambda: store.lineage(), lambda: store.log("a"),
                           lambda: store.retention.get("a"), lambda: store.retention.get("b"),
                           lambda: store.retention.plan(), lambda: store.resolve("tag:best"),
                           lambda: store.gc(dry_run=True)]
                all_paths(rebuilt)
                read_everything(store, self.template.expected, rng)
