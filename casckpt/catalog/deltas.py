"""Delta coding policy (store and run chain lengths) and what delta coding saved."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, func, select, text, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog

DEFAULT_DELTA_CHAIN = 32  # docs/DEFAULTS.md: unset, keyframes are placed by cost within this depth


def store_delta_chain(catalog: Catalog) -> int:
    """The chain length runs without their own policy get (the default if never set)."""
    value = stored_delta_chain(catalog)
    return value if value is not None else DEFAULT_DELTA_CHAIN


def stored_delta_chain(catalog: Catalog) -> int | None:
    """The store's chain length as set (None: never set, the default applies)."""
    with catalog.read() as conn:
        value = conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == "delta_chain")).scalar()
    return int(value) if value is not None else None


def set_store_delta_chain(catalog: Catalog, chain: int) -> None:
    """Set the store's chain length (0: no delta coding)."""
    with catalog.write() as conn:
        key = s.store_info.c.key == "delta_chain"
        before = conn.execute(select(s.store_info.c.value).where(key)).scalar()
        conn.execute(s.store_info.delete().where(s.store_info.c.key == "delta_chain"))
        conn.execute(s.store_info.insert().values(key="delta_chain", value=str(chain)))
        if before != str(chain):
            catalog.audit_in(conn, "delta_chain.set", None,
                             {"delta_chain": chain, "from": None if before is None else int(before)})


def run_delta_chains(catalog: Catalog) -> dict[str, int]:
    """Runs with their own chain length: name -> length."""
    with catalog.read() as conn:
        return {r[0]: int(r[1]) for r in conn.execute(
            select(s.runs.c.name, s.runs.c.delta_chain).where(s.runs.c.delta_chain.is_not(None)))}


def set_run_delta_chain(catalog: Catalog, run: str, chain: int | None) -> None:
    """Give ``run`` its own chain length (None: follow the store's); creates the run if new."""
    with catalog.write() as conn:
        run_id = catalog.run_id(conn, run, create=True)
        before = conn.execute(select(s.runs.c.delta_chain).where(s.runs.c.id == run_id)).scalar()
        conn.execute(update(s.runs).where(s.runs.c.id == run_id).values(delta_chain=chain))
        if before != chain:
            catalog.audit_in(conn, "delta_chain.set", f"run:{run}", {"delta_chain": chain, "from": before})


def delta_chain_for(catalog: Catalog, run: str) -> int:
    """The chain length commits to ``run`` use."""
    return delta_policy_for(catalog, run)[0]


def delta_policy_for(catalog: Catalog, run: str) -> tuple[int, bool]:
    """``(chain length, by cost)`` for commits to ``run``: by cost when neither the run nor the
    store has a chain length set (the default): keyframes are then placed by each chain's cost
    within :data:`DEFAULT_DELTA_CHAIN`; a chain length that was set is a fixed depth."""
    with catalog.read() as conn:
        own = conn.execute(select(s.runs.c.delta_chain).where(s.runs.c.name == run)).scalar()
    if own is not None:
        return int(own), False
    stored = stored_delta_chain(catalog)
    return (stored, False) if stored is not None else (DEFAULT_DELTA_CHAIN, True)


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
        for i in range(0, len(ids), 5000):
            found, deep = conn.execute(query, {"ids": ids[i : i + 5000]}).one()
            count, longest = count + int(found), max(longest, int(deep))
    return count, longest
