"""A mirror keeps what it sent through a failure, and remembers the tags it carried (issue 34).

- ``mirror_versions.owned``: this mirror sent the version (and so may delete it there when
  it propagates deletions). Kept apart from ``state``: a later failure to send the version
  again (``failed``) no longer loses it. Rows before it: owned when ``sent`` or ``deleted``
  (what the state said); a ``failed`` or ``gone`` row's ownership is unknown (``gone`` was
  also written for versions the mirror found ``present``), taken as not: the safe direction,
  as propagating a deletion deletes only what a mirror owns.
- ``mirror_tags``: per mirror, each source tag it last carried to the destination and the
  source version it named then. A tag on a version gone at the destination is reported
  (``stale_tags``) only when the source's tag changed since the mirror carried it, so a
  destination owner's own choice there is not reported on every run.

A new column (default false) and a new, empty table; no existing row changes meaning.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("mirror_versions") as batch:
        batch.add_column(sa.Column("owned", sa.Boolean, nullable=False, server_default=sa.false()))
    op.execute("UPDATE mirror_versions SET owned = TRUE WHERE state IN ('sent', 'deleted')")
    op.create_table(
        "mirror_tags",
        sa.Column("mirror", sa.String(128), primary_key=True),
        sa.Column("tag", sa.String(128), primary_key=True),
        sa.Column("version_id", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mirror_tags")
    with op.batch_alter_table("mirror_versions") as batch:
        batch.drop_column("owned")
