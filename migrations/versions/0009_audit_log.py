"""The audit trail: ``audit_log``, one row per change someone made to the store.

Who (OS user, host, pid, the PostgreSQL role), when, what action on which target, and
its details as JSON (see ``casckpt.catalog.audit``). A new, empty table: older stores
have no history to backfill, and no existing row changes.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(256), nullable=True),
        sa.Column("detail", sa.JSON, nullable=False),
        sa.Column("os_user", sa.String(128), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("db_user", sa.String(128), nullable=True),
        sa.Column("casckpt_version", sa.String(32), nullable=False),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_action", "audit_log", ["action"])
    op.create_index("ix_audit_log_target", "audit_log", ["target"])


def downgrade() -> None:
    op.drop_table("audit_log")
