"""Delta coding policy (store and run chain lengths and delta policies) and what delta coding saved."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select, text

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import batches
from casckpt.catalog.settings import DELTA_CHAIN, DELTA_POLICY

DEFAULT_DELTA_CHAIN = 32  # docs/DEFAULTS.md: unset, keyframes are placed by cost within this depth
DELTA_POLICIES = ("off", "balanced", "max")  # restore of a chain's end: 1x, <= 1.2x, <= 2x a keyframe's
DEFAULT_DELTA_POLICY = "balanced"  # docs/DEFAULTS.md


def delta_policy_name(catalog: Catalog, run: str | None) -> str:
    """The delta policy commits to ``run`` use: its own, else the store's, else the default
    (``run`` None: the store's)."""
    value = DELTA_POLICY.own(catalog, run) if run is not None else None
    if value is None:
        value = DELTA_POLICY.stored(catalog)
    return value if value in DELTA_POLICIES else DEFAULT_DELTA_POLICY


def store_delta_chain(catalog: Catalog) -> int:
    """The chain length runs without their own policy get (the default if never set)."""
    value = DELTA_CHAIN.stored(catalog)
    return value if value is not None else DEFAULT_DELTA_CHAIN


def delta_policy_for(catalog: Catalog, run: str) -> tuple[int, bool]:
    """``(chain length, by cost)`` for commits to ``run``: by cost when neither the run nor the
    store has a chain length set (the default): keyframes are then placed by each chain's cost
    within :data:`DEFAULT_DELTA_CHAIN`; a chain length that was set is a fixed depth."""
    chain = DELTA_CHAIN.own(catalog, run)
    if chain is None:
        chain = DELTA_CHAIN.stored(catalog)
    return (chain, False) if chain is not None else (DEFAULT_DELTA_CHAIN, True)


@dataclass(frozen=True, slots=True)
class DeltaTotals:
    """Live delta-coded chunks: how many, their raw and stored bytes, chain lengths."""

    chunks: int
    raw_bytes: int
    stored_bytes: int
    longest_chain: int
    mean_chain: float


_CHAIN_DEPTHS = text("""
WITH RECURSIVE depth(id, n) AS (
    SELECT id, 0 FROM chunks WHERE base_id IS NULL
    UNION ALL
    SELECT c.id, depth.n + 1 FROM chunks c JOIN depth ON c.base_id = depth.id WHERE depth.n < 1000
)
SELECT COALESCE(MAX(n), 0), COALESCE(AVG(n), 0) FROM depth WHERE n > 0
""")


def delta_totals(catalog: Catalog) -> DeltaTotals:
    """What delta coding stores now (chain lengths walk every chain: a few seconds per million chunks)."""
    c = s.chunks
    with catalog.read() as conn:
        count, raw, stored = conn.execute(select(
            func.count(), func.coalesce(func.sum(c.c.raw_len), 0), func.coalesce(func.sum(c.c.stored_len), 0)
        ).where(c.c.base_id.is_not(None))).one()
        longest, mean = conn.execute(_CHAIN_DEPTHS).one() if count else (0, 0.0)
    return DeltaTotals(int(count), int(raw), int(stored), int(longest), float(mean))


def dependents(catalog: Catalog, ids: list[str]) -> set[str]:
    """Every chunk delta-coded, directly or through other deltas, on one of ``ids``."""
    if not ids:
        return set()
    query = text("""
    WITH RECURSIVE dep(id, n) AS (
        SELECT id, 1 FROM chunks WHERE base_id IN :ids
        UNION
        SELECT c.id, dep.n + 1 FROM chunks c JOIN dep ON c.base_id = dep.id WHERE dep.n < 1000
    )
    SELECT DISTINCT id FROM dep
    """).bindparams(bindparam("ids", expanding=True))
    with catalog.read() as conn:
        return {row[0] for row in conn.execute(query, {"ids": ids})}


def any_deltas(catalog: Catalog) -> bool:
    """Whether the store holds any delta-coded chunk."""
    with catalog.read() as conn:
        return conn.execute(select(s.chunks.c.id).where(s.chunks.c.base_id.is_not(None)).limit(1)).first() \
            is not None


def version_deltas(catalog: Catalog, ids: list[str]) -> tuple[int, int]:
    """Of the chunks ``ids`` (a version's): how many are deltas, and the longest chain among them."""
    if not ids:
        return 0, 0
    query = text("""
    WITH RECURSIVE up(id, start, n) AS (
        SELECT base_id, id, 1 FROM chunks WHERE id IN :ids AND base_id IS NOT NULL
        UNION ALL
        SELECT c.base_id, up.start, up.n + 1 FROM chunks c JOIN up ON c.id = up.id
        WHERE c.base_id IS NOT NULL AND up.n < 1000
    )
    SELECT COUNT(DISTINCT start), COALESCE(MAX(n), 0) FROM up
    """).bindparams(bindparam("ids", expanding=True))
    count = longest = 0
    with catalog.read() as conn:
        for batch in batches(ids, 5000):
            found, deep = conn.execute(query, {"ids": batch}).one()
            count, longest = count + int(found), max(longest, int(deep))
    return count, longest
