"""The audit trail: one ``audit_log`` row per change someone made to the store.

Who (OS user, host, pid, and on PostgreSQL the database role), when (UTC epoch seconds),
what (an action name from :data:`ACTIONS`, or another component's own, such as the
encryption work's ``key.add``), on what (``target``: a version id, ``run:NAME``,
``tag:NAME``, ``location:NAME``, or None for the whole store) and the details (JSON).

Rows are written by :func:`record` inside the transaction that makes the change, so a change
is recorded exactly when it commits: a commit killed before it published leaves neither a
version nor an audit row. Nothing in casckpt deletes audit rows (gc included): the table
grows by one row per change, a few hundred bytes each.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, func, or_, select

from casckpt._version import __version__
from casckpt.catalog import schema as s
from casckpt.errors import InvalidArgumentError
from casckpt.types import AuditEntry

ACTIONS = (
    "commit", "delete", "undelete", "tag", "run.create", "run.fork", "gc", "retention.set",
    "retention.clear", "redundancy.set", "delta_chain.set", "delta_policy.set", "location.add",
    "location.retire", "location.fail", "location.activate",
    "repair", "catalog.rebuild", "catalog.migrate", "trees.migrate", "drill",
)
"""The actions casckpt itself records (other components add their own, e.g. ``key.rotate``)."""


@dataclass(frozen=True, slots=True)
class Who:
    """The process making a change: its OS user, host and pid."""

    os_user: str
    host: str
    pid: int


def who() -> Who:
    """This process, as the audit trail, gc runs and leases name it.

    The OS user falls back to ``uid:N`` where there is no passwd entry and no ``USER``-like
    variable (a container running under an arbitrary uid).
    """
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (OSError since Python 3.13)
        user = f"uid:{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return Who(os_user=user[:128], host=socket.gethostname()[:255], pid=os.getpid())


def add(conn: Connection, action: str, target: str | None = None,
           detail: Mapping[str, object] | None = None) -> None:
    """Add one audit row inside ``conn``'s (write) transaction: it commits, or rolls back, with
    the change it records."""
    if not isinstance(action, str) or not action or len(action) > 64:
        raise InvalidArgumentError(
            f"an audit action is a non-empty str of at most 64 characters, got {action!r}")
    me = who()
    values: dict[str, Any] = {
        "at": time.time(), "action": action,
        "target": None if target is None else str(target)[:256],
        "detail": dict(detail) if detail else {}, "os_user": me.os_user, "host": me.host,
        "pid": me.pid, "casckpt_version": __version__,
    }
    if conn.dialect.name == "postgresql":  # the role the catalog knows this client as
        values["db_user"] = func.current_user()
    conn.execute(s.audit_log.insert().values(**values))


def _target_clause(target: str) -> Any:
    """A target matches exactly; a hex string of 4+ digits also matches version ids it starts."""
    exact = s.audit_log.c.target == target
    if len(target) >= 4 and all(c in "0123456789abcdef" for c in target):
        return or_(exact, s.audit_log.c.target.startswith(target))
    return exact


def entries(conn: Connection, *, since: float | None, until: float | None, action: str | None,
            target: str | None, limit: int | None) -> list[AuditEntry]:
    """Audit rows, oldest first (with ``limit``: the newest ``limit``, still oldest first).

    ``action`` matches exactly, or every action under it: ``location`` matches ``location.add``.
    """
    log = s.audit_log
    query = select(log)
    if since is not None:
        query = query.where(log.c.at >= since)
    if until is not None:
        query = query.where(log.c.at <= until)
    if action is not None:
        query = query.where(or_(log.c.action == action, log.c.action.startswith(action + ".")))
    if target is not None:
        query = query.where(_target_clause(target))
    query = query.order_by(log.c.id.desc())
    if limit is not None:
        query = query.limit(limit)
    rows = list(conn.execute(query))
    return [
        AuditEntry(id=int(r.id), at=datetime.fromtimestamp(float(r.at), timezone.utc), action=str(r.action),
                   target=r.target, detail=dict(r.detail or {}), os_user=str(r.os_user),
                   host=str(r.host), pid=int(r.pid), db_user=r.db_user,
                   casckpt_version=str(r.casckpt_version))
        for r in reversed(rows)
    ]
