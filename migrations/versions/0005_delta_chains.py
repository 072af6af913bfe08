"""Delta coding: a run's own chain length policy.

- ``runs.delta_chain``: how many deltas deep a chunk of the run may be stored
  before a keyframe (0: no delta coding), overriding the store's policy
  (``store_info['delta_chain']``). Chunks already record their delta base in
  ``chunks.base_id`` (since 0001).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("delta_chain", sa.SmallInteger, nullable=True))
    op.create_index("ix_chunks_base_id", "chunks", ["base_id"])


def downgrade() -> None:
    op.drop_index("ix_chunks_base_id", table_name="chunks")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("delta_chain")
