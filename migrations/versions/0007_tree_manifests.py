"""Tree manifests: versions whose state is stored as shared, content-addressed nodes.

- ``tree_nodes``: every node of a tree manifest (zstd-compressed JSON, by its
  chunk id). A node is also a chunk in the packs (so a catalog rebuild gets
  it back, and gc keeps it while a version needs it); this table is what
  queries read. An unchanged re-commit adds no row; a commit changing k
  tensors adds O(k x depth).
- ``versions.tree_root``: the root node of a tree manifest (NULL for versions
  of manifest format 1 and 2, which keep their ``tensors`` rows and read as
  before).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tree_nodes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("body", sa.LargeBinary, nullable=False),
    )
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("tree_root", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("tree_root")
    op.drop_table("tree_nodes")
