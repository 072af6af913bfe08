"""Mirrors hold their slot and know their destination (review of issue 34).

- ``mirrors.dest_store_id``: the identity of the destination store the mirror last ran
  into (NULL: it never ran). A destination found with another identity (wiped and made
  again, replaced) has none of what the mirror recorded: every selected version is sent
  again.
- ``mirror_versions.created_at`` and ``metrics`` (JSON): what the keep rules read of a
  version, so that a version the mirror selected still holds its slot (the first of its
  1000 steps, the best, the first of its day) once the source's own retention deleted it.
- ``mirror_versions.state`` gains ``present`` (the destination held the version already,
  this mirror did not send it: never deleted there by it).

Nullable columns; no existing row changes meaning (rows before it have no time and
metrics: they hold their slot by step alone).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("mirrors") as batch:
        batch.add_column(sa.Column("dest_store_id", sa.String(64), nullable=True))
    with op.batch_alter_table("mirror_versions") as batch:
        batch.add_column(sa.Column("created_at", sa.Float, nullable=True))
        batch.add_column(sa.Column("metrics", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("mirror_versions") as batch:
        batch.drop_column("metrics")
        batch.drop_column("created_at")
    with op.batch_alter_table("mirrors") as batch:
        batch.drop_column("dest_store_id")
