"""A location being emptied is ``retiring``, no longer ``draining`` (issue 31: one word per
concept; "drain" is the fast tier's alone).

``locations.state`` ``draining`` becomes ``retiring``; in the audit trail, the action
``location.drain`` becomes ``location.retire`` and a location change's ``{"from":
"draining"}`` detail says ``retiring`` (the same event under its new name, so an audit query
by action finds every one). Who made each change, and when, is untouched. ``refs/locations``
records on the locations are not rewritten here: readers take ``draining`` there as
``retiring`` (``casckpt.engine.versions.records``), and the next location change writes them
anew. The downgrade puts the old names back in the catalog only: records written since
the upgrade say ``retiring``, which casckpt before 0012 cannot read (its ``check`` reports
them, and a catalog rebuild from them would skip a retiring location's entry and leave it
active). After a downgrade, run ``casckpt repair`` with the older casckpt before anything
else: it writes those records again from the catalog.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_LOCATIONS = sa.table("locations", sa.column("state", sa.String(16)))
_AUDIT = sa.table("audit_log", sa.column("id", sa.Integer), sa.column("action", sa.String(64)),
                  sa.column("detail", sa.JSON))
_STATE_ACTIONS = ("location.activate", "location.fail")


def _rename(old_state: str, new_state: str, old_action: str, new_action: str) -> None:
    conn = op.get_bind()
    conn.execute(sa.update(_LOCATIONS).where(_LOCATIONS.c.state == old_state).values(state=new_state))
    conn.execute(sa.update(_AUDIT).where(_AUDIT.c.action == old_action).values(action=new_action))
    rows = conn.execute(sa.select(_AUDIT.c.id, _AUDIT.c.detail).where(
        _AUDIT.c.action.in_((*_STATE_ACTIONS, new_action)))).all()
    for row in rows:  # a few rows per location change ever made: read and written one by one
        detail = row.detail
        if isinstance(detail, dict) and detail.get("from") == old_state:
            conn.execute(sa.update(_AUDIT).where(_AUDIT.c.id == row.id).values(
                detail={**detail, "from": new_state}))


def upgrade() -> None:
    _rename("draining", "retiring", "location.drain", "location.retire")


def downgrade() -> None:
    _rename("retiring", "draining", "location.retire", "location.drain")
