"""Blob locations, redundancy and shards.

- ``locations``: the places packs live (a directory, an S3 bucket/prefix),
  each with a failure domain and a state (active, draining, failed).
- ``shards``: where each copy or erasure-coded shard of a pack is, its size,
  checksum, health (ok, missing, corrupt) and when it was last verified.
- ``packs.scheme/k/m/algorithm/stripe/data_offset``: how the pack is stored
  (``none``, ``replicate``, ``ec``) and what decoding it needs.
- ``runs.redundancy``: a run's own redundancy, overriding the store's.

Existing packs become single-copy packs (scheme ``none``) on location 1,
whose URL the store fills in from its configuration when it is next opened.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "locations",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("url", sa.Text, nullable=True),
        sa.Column("domain", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "shards",
        sa.Column("pack_id", sa.String(64), sa.ForeignKey("packs.id"), primary_key=True),
        sa.Column("idx", sa.SmallInteger, primary_key=True),
        sa.Column("location_id", sa.Integer, sa.ForeignKey("locations.id"), nullable=False),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("verified_at", sa.Float, nullable=True),
    )
    op.create_index("ix_shards_location", "shards", ["location_id"])
    op.create_index("ix_shards_state", "shards", ["state"])
    with op.batch_alter_table("packs") as batch:
        batch.add_column(sa.Column("scheme", sa.String(16), nullable=False, server_default="none"))
        batch.add_column(sa.Column("k", sa.SmallInteger, nullable=False, server_default="1"))
        batch.add_column(sa.Column("m", sa.SmallInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("algorithm", sa.String(32), nullable=True))
        batch.add_column(sa.Column("stripe", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("data_offset", sa.Integer, nullable=True))
    op.create_index("ix_packs_verified_at", "packs", ["verified_at"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("redundancy", sa.String(32), nullable=True))

    conn = op.get_bind()
    if conn.execute(sa.text("SELECT COUNT(*) FROM packs")).scalar_one():
        conn.execute(sa.text(
            "INSERT INTO locations (id, name, url, domain, state, created_at) "
            "VALUES (1, 'loc0', NULL, 'loc0', 'active', :now)"
        ), {"now": time.time()})
        conn.execute(sa.text(
            "INSERT INTO shards (pack_id, idx, location_id, key, size, checksum, state, verified_at) "
            "SELECT id, 0, 1, key, size, NULL, 'ok', verified_at FROM packs"
        ))
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text(
                "SELECT setval(pg_get_serial_sequence('locations', 'id'), 1)"
            ))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("redundancy")
    op.drop_index("ix_packs_verified_at", "packs")
    with op.batch_alter_table("packs") as batch:
        for column in ("data_offset", "stripe", "algorithm", "m", "k", "scheme"):
            batch.drop_column(column)
    op.drop_table("shards")
    op.drop_table("locations")
