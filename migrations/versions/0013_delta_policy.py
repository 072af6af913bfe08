"""Delta policy: a run's own ``off`` / ``balanced`` / ``max``.

- ``runs.delta_policy``: the run's delta policy, overriding the store's
  (``store_info['delta_policy']``; unset: ``balanced``). NULL: the run follows the store.

The downgrade drops the column (the store's setting stays in ``store_info``, ignored by
older casckpt). It cannot undo what this release wrote meanwhile: chunks stored with the
byte-planes codec (codec 10), which casckpt before it refuses to read ("written by a newer
casckpt"). Downgrade only a catalog whose store was never committed to by this release.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("delta_policy", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("delta_policy")
