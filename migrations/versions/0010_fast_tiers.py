"""Fast tiers: versions committed to a host's local fast tier before their packs drain.

``versions.durability`` (``durable`` for every existing row), ``packs.tier`` (the fast
tier an undrained pack waits on; NULL for every existing pack), ``tiers`` (each host's
fast tier) and ``tier_deps`` (the fast packs each version needed when it was published).
See ``casckpt.engine.tiering.tier``. No existing row changes meaning.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("durability", sa.String(16), nullable=False,
                                   server_default="durable"))
    with op.batch_alter_table("packs") as batch:
        batch.add_column(sa.Column("tier", sa.String(32), nullable=True))
    op.create_index("ix_versions_durability", "versions", ["durability"])
    op.create_index("ix_packs_tier", "packs", ["tier"])
    op.create_table(
        "tiers",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("lost_at", sa.Float, nullable=True),
    )
    op.create_table(
        "tier_deps",
        sa.Column("version_id", sa.String(64), primary_key=True),
        sa.Column("pack_id", sa.String(64), primary_key=True),
    )
    op.create_index("ix_tier_deps_pack", "tier_deps", ["pack_id"])


def downgrade() -> None:
    op.drop_table("tier_deps")
    op.drop_table("tiers")
    op.drop_index("ix_packs_tier", "packs")
    op.drop_index("ix_versions_durability", "versions")
    with op.batch_alter_table("packs") as batch:
        batch.drop_column("tier")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("durability")
