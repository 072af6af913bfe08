"""Bugs the campaign finds in code whose owners are fixing it now.

Keyed by ``target/kind`` (a class of mutation). ``cases`` are case indices
(campaign seed 1) that reproduce the bug today: ``tests/test_fuzz.py`` runs
them as ``xfail(strict=True)``, so once the fix merges they pass, the test
fails, and the lead removes the entry here -- from then on the class is
fuzzed in CI like every other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KnownOpen:
    owner: str
    what: str
    cases: tuple[int, ...]


KNOWN_OPEN: dict[str, KnownOpen] = {
    "config/bytes": KnownOpen(
        "errors (config.py)", "invalid UTF-8 in casckpt.toml: UnicodeDecodeError from read_config_file",
        (0,)),
    "config/deep": KnownOpen(
        "errors (config.py)", "deeply nested arrays/tables: RecursionError from tomllib in read_config_file",
        (1,)),
    "config/types": KnownOpen(
        "errors (config.py)", "a table key of the wrong type (s3 = 1, store = 1): TypeError/AttributeError "
        "in _spec_from_file", (1,)),
    "records/json": KnownOpen(
        "lead (records.py, rebuild.py)", "deeply nested record: RecursionError from read_records; wrong "
        "types: TypeError/ValueError/OverflowError in _restore_tags/_restore_runs", (2,)),
    "records/new-record": KnownOpen(
        "lead (rebuild.py)", "a run record with values of the wrong type: OverflowError in _restore_runs",
        (5,)),
    "records/fifo": KnownOpen(
        "hostile files (storage/local.py)", "a refs record replaced by a FIFO: rebuild hangs", (0,)),
    "records/special-file": KnownOpen(
        "hostile files (storage/local.py)", "a refs record replaced by a symlink to /dev/zero: MemoryError",
        (1,)),
    "objects/fifo": KnownOpen(
        "hostile files (storage/local.py)", "a pack replaced by a FIFO: restore hangs", (0,)),
    "objects/special-file": KnownOpen(
        "hostile files (storage/local.py)", "a pack replaced by a symlink to /dev/zero: MemoryError", (0,)),
    "ec-objects/fifo": KnownOpen(
        "hostile files (storage/local.py)", "a shard replaced by a FIFO: restore hangs", (0,)),
    "ec-objects/special-file": KnownOpen(
        "hostile files (storage/local.py)", "a shard replaced by a symlink to /dev/zero: MemoryError", (1,)),
    "catalog/versions.step-swap": KnownOpen(
        "lead (invariant 9: manifests bound to refs)",
        "steps of two versions swapped: restore('a@1') returns a@2's state", (0,)),
    "catalog/versions.step": KnownOpen(
        "lead (invariant 9: manifests bound to refs)",
        "a version's step changed (1 -> 10): restore('a@10') returns a@1's state", (5,)),
    "catalog/versions.run_id": KnownOpen(
        "lead (invariant 9: manifests bound to refs)",
        "a version moved to another run: restore('b@1') returns a@1's state", (5,)),
    "catalog/versions.manifest": KnownOpen(
        "outage (catalog/catalog.py)", "versions.manifest holding text: TypeError in Catalog.manifest", (4,)),
    "catalog/packs.size": KnownOpen(
        "outage (catalog/shards.py)", "packs.size of another type: ValueError in _layout", (7,)),
    "catalog/ec-packs.layout": KnownOpen(
        "outage (catalog/shards.py)", "packs k/m/stripe/size of another type: ValueError in _layout", (1,)),
    "catalog/shards.size": KnownOpen(
        "outage (catalog/shards.py)", "shards.size of another type: ValueError in layouts", (1,)),
    "catalog/shards.idx": KnownOpen(
        "outage (catalog/shards.py) + hostile files (storage/erasure.py)", "shards.idx of another type: "
        "TypeError in _layout; a negative idx reaches pyeclib reconstruct and segfaults the process", (1, 6)),
    "catalog/contents.chunk_ids": KnownOpen(
        "outage (catalog rows -> values; engine/history.py)", "contents.chunk_ids holding text: TypeError in "
        "history._differing (diff)", (1,)),
    "catalog/tensors.row": KnownOpen(
        "lead (store.py show) / outage (catalog rows)", "tensors.shape of another type: TypeError in "
        "Store.show", (0,)),
}


def known_open(target: str, kind: str) -> str | None:
    """Who is fixing bugs of this class, and what they are (None when the class is not known open)."""
    entry = KNOWN_OPEN.get(f"{target}/{kind}")
    return None if entry is None else f"{entry.owner}: {entry.what}"
