"""What each tree version changed against its parent, for tensor history (issue 32).

- ``tree_paths``: tensor paths interned (an id per path; rows are never deleted, so an id
  never changes meaning and a process may cache it).
- ``tree_changes``: one row per tensor path whose leaf a tree version did not reuse from its
  parent's tree (``versions.parent_id``): the tensor's dtype, shape (JSON text), logical
  bytes, digest (``tensors.digest``'s 64 hex digits as 32 bytes) and the bytes that differ from the parent's
  tensor at the path (NULL where the parent had none); a path the version removed has a row
  with NULL dtype and digest. Keyed by (path, version key): one path's history is one range.
- ``tree_indexed``: the versions whose rows are recorded, each with a small integer key
  that its rows name (a version id is 64 characters: rows keyed by it took twice the space)
  and the version its rows are against (``base_id``: its parent when committed; NULL: none).
  Versions committed before this migration have none: ``casckpt migrate-trees`` (or a catalog
  rebuild) records them, where the store's key is at hand to read their nodes
  (``casckpt/catalog/treechanges.py``).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tree_paths",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("path", sa.Text, nullable=False, unique=True),
        sqlite_autoincrement=True,
    )
    op.create_table(
        "tree_indexed",
        sa.Column("key", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("version_id", sa.String(64), sa.ForeignKey("versions.id"), nullable=False, unique=True),
        sa.Column("base_id", sa.String(64), nullable=True),
        sqlite_autoincrement=True,  # a key is never reused: rows name their version by it
    )
    op.create_table(
        "tree_changes",
        sa.Column("path_id", sa.Integer, primary_key=True),
        sa.Column("version_key", sa.Integer, primary_key=True),
        sa.Column("dtype", sa.String(32), nullable=True),
        sa.Column("shape", sa.Text, nullable=True),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("digest", sa.LargeBinary, nullable=True),
        sa.Column("changed_bytes", sa.BigInteger, nullable=True),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_tree_changes_version", "tree_changes", ["version_key"])


def downgrade() -> None:
    op.drop_index("ix_tree_changes_version", table_name="tree_changes")
    op.drop_table("tree_changes")
    op.drop_table("tree_indexed")
    op.drop_table("tree_paths")
