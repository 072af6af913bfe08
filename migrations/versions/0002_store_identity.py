"""Store identity and time-ordered version listing.

Adds ``store_info`` (the store's uuid, which local index caches check so a
cache from another store, or from before a catalog rebuild, is never trusted)
and an index on ``versions.created_at`` for time-range queries.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    info = op.create_table(
        "store_info",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )
    op.bulk_insert(info, [{"key": "store_id", "value": uuid.uuid4().hex}])
    op.create_index("ix_versions_created_at", "versions", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_versions_created_at", "versions")
    op.drop_table("store_info")
