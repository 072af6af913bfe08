"""Settings that are store-wide with per-run overrides (redundancy, delta chain length, delta policy).

The store's value is a ``store_info`` row named after the setting, a run's own value the
``runs`` column of that name (NULL: the run follows the store's). Every change that changes
a value is recorded in the audit trail as ``<name>.set``, in its own transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import Connection, select, update

from casckpt.catalog import schema as s
from casckpt.catalog.catalog import Catalog
from casckpt.catalog.database import upsert

V = TypeVar("V", int, str)


@dataclass(frozen=True, slots=True)
class RunSetting(Generic[V]):
    """One setting: ``name`` (its ``store_info`` key, ``runs`` column and audit action) and
    how its stored text is parsed."""

    name: str
    parse: Callable[[str], V]

    def _store_text(self, conn: Connection) -> str | None:
        return conn.execute(select(s.store_info.c.value).where(s.store_info.c.key == self.name)).scalar()

    def stored(self, catalog: Catalog) -> V | None:
        """The store's value as set (None: never set)."""
        with catalog.read() as conn:
            value = self._store_text(conn)
        return None if value is None else self.parse(value)

    def set_store(self, catalog: Catalog, value: V) -> None:
        """Set the store's value: one upsert, so openers seeding a new store's value at once do
        not collide on the row (on PostgreSQL a delete-then-insert does)."""
        with catalog.write() as conn:
            before = self._store_text(conn)
            stmt = upsert(conn, s.store_info).values(key=self.name, value=str(value))
            conn.execute(stmt.on_conflict_do_update(index_elements=["key"], set_={"value": str(value)}))
            if before != str(value):
                catalog.audit_in(conn, f"{self.name}.set", None, {
                    self.name: value, "from": None if before is None else self.parse(before)})

    def own(self, catalog: Catalog, run: str) -> V | None:
        """``run``'s own value (None: it follows the store's, or there is no such run)."""
        with catalog.read() as conn:
            value = conn.execute(select(s.runs.c[self.name]).where(s.runs.c.name == run)).scalar()
        return None if value is None else self.parse(value)

    def runs(self, catalog: Catalog) -> dict[str, V]:
        """Runs with their own value: name -> value."""
        column = s.runs.c[self.name]
        with catalog.read() as conn:
            return {r[0]: self.parse(r[1])
                    for r in conn.execute(select(s.runs.c.name, column).where(column.is_not(None)))}

    def set_run(self, catalog: Catalog, run: str, value: V | None) -> None:
        """Give ``run`` its own value (None: follow the store's); creates the run if new."""
        column = s.runs.c[self.name]
        with catalog.write() as conn:
            run_id = catalog.run_id(conn, run, create=True)
            before = conn.execute(select(column).where(s.runs.c.id == run_id)).scalar()
            conn.execute(update(s.runs).where(s.runs.c.id == run_id).values({column: value}))
            if before != value:
                catalog.audit_in(conn, f"{self.name}.set", f"run:{run}", {self.name: value, "from": before})


REDUNDANCY: RunSetting[str] = RunSetting("redundancy", str)
"""The redundancy spec new packs get (see :mod:`casckpt.engine.packlayer`)."""
DELTA_CHAIN: RunSetting[int] = RunSetting("delta_chain", int)
"""The delta chain length (0: no delta coding; see :mod:`casckpt.catalog.deltas`)."""
DELTA_POLICY: RunSetting[str] = RunSetting("delta_policy", str)
"""The delta policy, ``off``, ``balanced`` or ``max`` (see :mod:`casckpt.engine.write.encodepolicy`)."""
