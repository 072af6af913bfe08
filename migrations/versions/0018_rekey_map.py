"""Copies across chunk-id keys remember what each source chunk is called here (issue 34).

- ``rekey_map``: one row per chunk a copy between stores keyed differently wrote or found
  in this (the destination) store: ``key``, this store's keyed digest of the source store's
  identity and the source's chunk id (never the source's id itself), and ``chunk_id``, this
  store's id of the same bytes. The next such copy reads from the source only the chunks it
  cannot name here (see docs/ARCHITECTURE.md, "Copying between stores").

One new, empty table; no existing row changes meaning. A PostgreSQL writer role granted
before it lacks rights on the table and still commits (``schema.OPTIONAL_TABLES``); its
re-keyed copies do without the map until ``casckpt init --print-grants writer`` is re-run.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rekey_map",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("chunk_id", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("rekey_map")
