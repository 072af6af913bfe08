"""``store.retention``: which versions each run keeps (``store.gc()`` applies the policies).

:class:`Retention` is the namespace of :class:`casckpt.Store` for retention policies: set,
get, clear, and plan (what gc would delete, with reasons, writing nothing). The rules and
their semantics are :mod:`casckpt.engine.maintenance.retention`; the policies live in the catalog.
"""

from __future__ import annotations

from typing import Any

from casckpt.catalog import retention as retention_sql
from casckpt.engine.maintenance import retention as retention_engine
from casckpt.engine.versions import records
from casckpt.engine.versions.refs import check_run, run_not_found
from casckpt.engine.versions.validate import check_name
from casckpt.retention_rules import make_policy, policy_from_json, policy_to_json
from casckpt.store_core import StoreCore
from casckpt.types import RetentionPlan, RetentionPolicy


class Retention:
    """The retention policies of one open store's runs (``store.retention``); thread-safe as
    the store is."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def set(self, run: str, **rules: Any) -> RetentionPolicy:
        """Store the retention policy of ``run`` (replacing any); ``store.gc()`` applies it.

        ``rules`` are the keep rules of :class:`casckpt.RetentionPolicy` by name (declared once
        in :mod:`casckpt.retention_rules`). Rules combine as in restic's ``forget``: a version
        is kept if ANY rule keeps it. ``keep_within`` is a timedelta, seconds, or a string like
        ``"7d"``; ``keep_best`` is ``(metric, n, "min" | "max")``. Fork points of live runs are
        always kept. A run that does not exist yet is created, so a training script may set its
        policy before its first commit.

        Raises:
            InvalidNameError: bad run name.
            InvalidArgumentError: an unknown rule, a value that is not positive, or no keep rule
                (``keep_tagged`` alone would delete every untagged version).
        """
        self._core.refuse_write("store.retention.set", "the catalog")
        check_name(run, "run")
        policy = make_policy(**rules)
        retention_sql.store_policy(self._core.catalog, run, policy_to_json(policy), create=True)
        records.record_run(self._core.locations, self._core.catalog, run)
        return policy

    def get(self, run: str) -> RetentionPolicy | None:
        """The retention policy of ``run``; None when it has none (it keeps every version).

        Raises:
            RefNotFoundError: there is no such run.
        """
        stored = retention_sql.run_policies(self._core.catalog, self._existing(run)).get(run)
        return None if stored is None else policy_from_json(stored, run)

    def clear(self, run: str) -> None:
        """Remove the retention policy of ``run``: it keeps every version again. Idempotent.

        Raises:
            RefNotFoundError: there is no such run.
        """
        self._core.refuse_write("store.retention.clear", "the catalog")
        if not retention_sql.store_policy(self._core.catalog, self._existing(run), None, create=False):
            raise run_not_found(self._core.catalog, run)
        records.record_run(self._core.locations, self._core.catalog, run)

    def plan(self, run: str | None = None) -> list[RetentionPlan]:
        """What retention would do, writing nothing: a decision per visible version, with reasons.

        With ``run``: that run's plan (every version kept when it has no
        policy); without: a plan for every run that has a policy, by name.
        Bytes freed need a mark over the whole store: ``gc(dry_run=True)`` reports them.

        Raises:
            RefNotFoundError: there is no such run.
            CatalogError: a stored policy is malformed.
        """
        if run is not None:
            self._existing(run)
        with self._core.catalog.read() as conn:
            histories = retention_sql.load_histories(conn, run)
        return [retention_engine.plan(history) for history in histories]

    def _existing(self, run: str) -> str:
        check_run(self._core.catalog, check_name(run, "run"))
        return run
