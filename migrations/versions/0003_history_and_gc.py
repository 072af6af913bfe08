"""History queries and garbage collection.

- ``contents``: the chunk list of each distinct tensor content, keyed by the
  tensor digest. Unchanged tensors of many versions share one row, so diff,
  history and GC's mark phase are served by SQL without reading manifests.
- ``versions.deleted_at`` / ``deleted_reason``: soft delete (undelete
  possible until GC purges the version).
- ``chunks.condemned_at``: when GC's mark phase found a chunk unreferenced.
- ``gc_live``: GC's scratch set of referenced chunk ids (one GC at a time).
- ``gc_runs``: a record of every GC run.
- ``leases``: commits in flight; GC never condemns chunks nor deletes
  unknown objects younger than the oldest live lease.
- indexes for log and history queries.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "contents",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("chunk_size", sa.BigInteger, nullable=False),
        sa.Column("chunk_ids", sa.LargeBinary, nullable=False),
    )
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("deleted_at", sa.Float, nullable=True))
        batch.add_column(sa.Column("deleted_reason", sa.Text, nullable=True))
    with op.batch_alter_table("chunks") as batch:
        batch.add_column(sa.Column("condemned_at", sa.Float, nullable=True))
    op.create_table("gc_live", sa.Column("id", sa.String(64), primary_key=True))
    op.create_table(
        "gc_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("dry_run", sa.Boolean, nullable=False),
        sa.Column("report", sa.JSON, nullable=True),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
    )
    op.create_index("ix_tensors_digest", "tensors", ["digest"])
    op.create_index("ix_tensors_path_version", "tensors", ["path", "version_id"])
    op.create_index("ix_versions_run_state_step", "versions", ["run_id", "state", "step"])
    op.create_index("ix_chunks_state", "chunks", ["state"])
    op.create_index("ix_packs_state", "packs", ["state"])
    op.create_index("ix_tags_version", "tags", ["version_id"])


def downgrade() -> None:
    for name, table in (("ix_tags_version", "tags"), ("ix_packs_state", "packs"),
                        ("ix_chunks_state", "chunks"), ("ix_versions_run_state_step", "versions"),
                        ("ix_tensors_path_version", "tensors"), ("ix_tensors_digest", "tensors")):
        op.drop_index(name, table)
    op.drop_table("leases")
    op.drop_table("gc_runs")
    op.drop_table("gc_live")
    with op.batch_alter_table("chunks") as batch:
        batch.drop_column("condemned_at")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("deleted_reason")
        batch.drop_column("deleted_at")
    op.drop_table("contents")
