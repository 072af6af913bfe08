"""Restore drills and commit stalls: the ``drills`` table and ``versions.stall_s``.

``drills``: one row per version a restore drill read back (``casckpt drill``,
``store.ops.drill``): which version, how many bytes, how long, whether it restored and why not.
A new, empty table. ``versions.stall_s``: how long the commit held the training loop up (a
blocking commit: its wall time; a background one: until ``commit()`` returned), what the
interval advisor (``casckpt advise``) reads; NULL for every existing version (unknown). No
existing row changes meaning.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("stall_s", sa.Float, nullable=True))
    op.create_table(
        "drills",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("drill_id", sa.String(32), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("version_id", sa.String(64), nullable=False),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("seconds", sa.Float, nullable=False),
        sa.Column("ok", sa.Boolean, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index("ix_drills_at", "drills", ["at"])
    op.create_index("ix_drills_version_id", "drills", ["version_id"])


def downgrade() -> None:
    op.drop_table("drills")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("stall_s")
