"""Small records of the catalog's mutable state, kept on every blob location.

Manifests and packs describe themselves, so ``catalog rebuild`` recovers
versions, lineage, metrics and commit-time tags from them alone. What
changes after a commit -- a tag moved later, a run forked, a run's
retention or redundancy policy, the store's redundancy -- is mirrored here
as JSON objects:

    refs/tags/<hex of name>   {"name", "version", "at"}
    refs/runs/<hex of name>   {"name", "created_at", "parent_version", "retention", "redundancy"}
    refs/store                {"redundancy"}

Records are written after the catalog change succeeds (the catalog stays
authoritative); a failed write is logged, not raised: it only makes a
future rebuild less complete. Soft deletions are not recorded: after a
rebuild such versions are visible again, and the next ``gc`` re-applies
the runs' retention policies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select

from casckpt.catalog import schema as s
from casckpt.catalog import shards as shard_sql
from casckpt.errors import CasckptError
from casckpt.storage.locations import LocationSet

log = logging.getLogger(__name__)

TAGS = "refs/tags/"
RUNS = "refs/runs/"
STORE = "refs/store"


def _key(prefix: str, name: str) -> str:
    return prefix + name.encode("utf-8").hex()


def _put(locations: LocationSet, key: str, doc: dict[str, Any]) -> None:
    try:
        locations.put_everywhere(key, json.dumps(doc, sort_keys=True).encode())
    except CasckptError as exc:
        log.warning("could not record %s on the blob locations (%s); a catalog rebuild "
                    "would miss it", key, exc)


def record_tag(locations: LocationSet, name: str, version_id: str) -> None:
    """Mirror tag ``name`` -> ``version_id``."""
    _put(locations, _key(TAGS, name), {"name": name, "version": version_id, "at": time.time()})


def record_run(locations: LocationSet, catalog: Any, run: str) -> None:
    """Mirror a run's fork point and policies, as the catalog has them now."""
    with catalog.read() as conn:
        row = conn.execute(select(s.runs).where(s.runs.c.name == run)).first()
    if row is not None:
        _put(locations, _key(RUNS, run), {
            "name": row.name, "created_at": row.created_at, "parent_version": row.parent_version,
            "retention": row.retention, "redundancy": row.redundancy,
        })


def record_store(locations: LocationSet, catalog: Any) -> None:
    """Mirror store-wide settings (its redundancy)."""
    _put(locations, STORE, {"redundancy": shard_sql.store_redundancy(catalog)})


_COMPARED = {TAGS: ("name", "version"),
             RUNS: ("name", "created_at", "parent_version", "retention", "redundancy"),
             STORE: ("redundancy",)}


def expected(catalog: Any) -> dict[str, dict[str, Any]]:
    """The records the catalog implies now, by key: every tag, every run with a fork point or
    a policy, and the store's settings (what ``check`` compares and ``repair`` writes)."""
    out: dict[str, dict[str, Any]] = {}
    with catalog.read() as conn:
        for name, version in conn.execute(select(s.tags.c.name, s.tags.c.version_id)):
            out[_key(TAGS, name)] = {"name": name, "version": version}
        for row in conn.execute(select(s.runs)):
            if row.parent_version is not None or row.retention is not None or row.redundancy is not None:
                out[_key(RUNS, row.name)] = {
                    "name": row.name, "created_at": row.created_at, "parent_version": row.parent_version,
                    "retention": row.retention, "redundancy": row.redundancy}
    redundancy = shard_sql.store_redundancy(catalog)
    if redundancy is not None:
        out[STORE] = {"redundancy": redundancy}
    return out


def agrees(key: str, doc: object, want: dict[str, Any]) -> bool:
    """Whether a record read from a location says what the catalog implies (times of writing aside)."""
    prefix = next(p for p in _COMPARED if key.startswith(p))
    return isinstance(doc, dict) and all(doc.get(field) == want.get(field) for field in _COMPARED[prefix])


def read_records(locations: LocationSet, prefix: str) -> Iterator[dict[str, Any]]:
    """Every record under ``prefix``, read from any location that has it (newest tag wins later)."""
    seen: set[str] = set()
    for _, info in locations.list_all(prefix):
        if info.key in seen:
            continue
        seen.add(info.key)
        try:
            doc = json.loads(locations.get_anywhere(info.key))
        except (CasckptError, ValueError) as exc:
            log.warning("skipping unreadable record %s: %s", info.key, exc)
            continue
        if isinstance(doc, dict):
            yield doc


def read_store_record(locations: LocationSet) -> dict[str, Any]:
    """The store record, or {} when none is readable."""
    try:
        doc = json.loads(locations.get_anywhere(STORE))
    except (CasckptError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
