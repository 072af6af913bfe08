"""Initial catalog: runs, versions, tags, tensors, packs, chunks.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("parent_version", sa.String(64), nullable=True),
        sa.Column("retention", sa.JSON, nullable=True),
    )
    op.create_table(
        "versions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("committed_at", sa.Float, nullable=False),
        sa.Column("logical_bytes", sa.BigInteger, nullable=False),
        sa.Column("new_bytes", sa.BigInteger, nullable=False),
        sa.Column("stored_bytes", sa.BigInteger, nullable=False),
        sa.Column("duration_s", sa.Float, nullable=False),
        sa.Column("meta", sa.JSON, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("manifest", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("run_id", "step", name="uq_versions_run_step"),
    )
    op.create_table(
        "tags",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version_id", sa.String(64), sa.ForeignKey("versions.id"), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "tensors",
        sa.Column("version_id", sa.String(64), sa.ForeignKey("versions.id"), primary_key=True),
        sa.Column("path", sa.Text, primary_key=True),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("shape", sa.JSON, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("chunks", sa.Integer, nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
    )
    op.create_index("ix_tensors_path", "tensors", ["path"])
    op.create_table(
        "packs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("chunks", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("verified_at", sa.Float, nullable=True),
    )
    op.create_table(
        "chunks",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("pack_id", sa.String(64), sa.ForeignKey("packs.id"), nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("stored_len", sa.BigInteger, nullable=False),
        sa.Column("raw_len", sa.BigInteger, nullable=False),
        sa.Column("codec", sa.SmallInteger, nullable=False),
        sa.Column("base_id", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_chunks_pack_id", "chunks", ["pack_id"])


def downgrade() -> None:
    for table in ("chunks", "packs", "tensors", "tags", "versions", "runs"):
        op.drop_table(table)
