"""Mirrors (issue 34): named policies that keep another store up to date with selected versions.

- ``mirrors``: one row per mirror of this (the source) store: its name, the destination's
  URL (or path) and key file, its selection (JSON: run names or globs, tag names, keep rules
  in the retention vocabulary), whether deletions on the source propagate, and the outcome of
  its last run (when it started and ended, and the error that stopped it, NULL when none).
- ``mirror_versions``: per mirror, one row per source version a run selected: its state
  (``sent``: the destination holds it; ``failed``: its copy failed, ``error`` says why;
  ``deleted``: deleted on the source and, as the mirror asked, on the destination; ``gone``:
  sent, then deleted by the destination, so not sent again), the
  destination's id of it, the chunks and raw bytes sent for it, and when.

Two new, empty tables; no existing row changes meaning.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mirrors",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("destination", sa.Text, nullable=False),
        sa.Column("key_file", sa.Text, nullable=True),
        sa.Column("selection", sa.Text, nullable=False),
        sa.Column("propagate_deletions", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("run_started_at", sa.Float, nullable=True),
        sa.Column("run_finished_at", sa.Float, nullable=True),
        sa.Column("run_error", sa.Text, nullable=True),
    )
    op.create_table(
        "mirror_versions",
        sa.Column("mirror", sa.String(128), primary_key=True),
        sa.Column("version_id", sa.String(64), primary_key=True),
        sa.Column("run", sa.String(128), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("dest_id", sa.String(64), nullable=True),
        sa.Column("chunks", sa.BigInteger, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("mirror_versions")
    op.drop_table("mirrors")
