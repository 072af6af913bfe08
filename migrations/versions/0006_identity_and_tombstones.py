"""Store identity on both sides, and tombstones for manifests that must not come back.

- ``store_info['created_at']`` and ``store_info['generation']``: with the store
  id (since 0002), the identity every blob location also carries
  (``casckpt-identity``); a catalog rebuild raises the generation, so a catalog
  from before the rebuild is refused. Existing stores start at generation 1,
  created when their first version was (or now).
- ``tombstones``: versions whose manifest object GC may delete -- purged
  versions, and commits that wrote a manifest but never published it (a
  failed or killed commit). A manifest on a location that is neither a
  version nor tombstoned makes GC refuse to delete anything: the catalog is
  missing published versions (lost, stale or damaged).
- ``leases.version_id``: the version a commit in flight is about to publish,
  written before its manifest object is; when the lease ends without the
  version being published, the version is tombstoned.
- ``contents`` rows of versions committed before 0003 (which created the
  table empty) are derived from their manifests, as commits derive them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    conn = op.get_bind()
    info = sa.table("store_info", sa.column("key", sa.String), sa.column("value", sa.Text))
    versions = sa.table("versions", sa.column("created_at", sa.Float))
    have = set(conn.execute(sa.select(info.c.key)).scalars())
    first = conn.execute(sa.select(sa.func.min(versions.c.created_at))).scalar()
    rows = []
    if "created_at" not in have:
        rows.append({"key": "created_at", "value": repr(float(first if first is not None else time.time()))})
    if "generation" not in have:
        rows.append({"key": "generation", "value": "1"})
    if rows:
        op.bulk_insert(info, rows)
    op.create_table(
        "tombstones",
        sa.Column("version_id", sa.String(64), primary_key=True),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("version_id", sa.String(64), nullable=True))
    _backfill_contents(conn)


def _backfill_contents(conn: sa.Connection) -> None:
    """Content rows for tensors that have none, from their versions' manifests."""
    from casckpt.engine.versions.tensorrows import tensor_rows
    from casckpt.errors import CasckptError
    from casckpt.format.manifest import decode_manifest

    lacking = list(conn.execute(sa.text(
        "SELECT DISTINCT t.version_id FROM tensors t WHERE NOT EXISTS "
        "(SELECT 1 FROM contents c WHERE c.digest = t.digest)")).scalars())
    for version_id in lacking:
        data = conn.execute(sa.text("SELECT manifest FROM versions WHERE id = :id"),
                            {"id": version_id}).scalar()
        if data is None:
            continue  # `casckpt check` reports it
        try:
            manifest = decode_manifest(bytes(data), version_id)
        except (CasckptError, TypeError):
            continue  # `casckpt check` reports it
        _, contents = tensor_rows(version_id, manifest.tensors, manifest.extents)
        for row in contents:
            conn.execute(sa.text(
                "INSERT INTO contents (digest, nbytes, chunk_size, chunk_ids) "
                "VALUES (:digest, :nbytes, :chunk_size, :chunk_ids) ON CONFLICT (digest) DO NOTHING"), row)


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("version_id")
    op.drop_table("tombstones")
    op.execute("DELETE FROM store_info WHERE key IN ('created_at', 'generation')")
