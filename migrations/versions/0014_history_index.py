"""Tensor history and run listings from index ranges alone.

- ``tensors.changed_bytes``: the bytes of a tensor row's chunks that differ from
  the tensor at the same path in its version's parent (``versions.parent_id``),
  NULL where unknown (``casckpt/catalog/tensorchanges.py`` says who writes it
  and when history may use it). Filled here for existing rows: comparing two
  chunk lists per row once, instead of at every history query, where reading
  the ``contents`` rows of a tensor that changes in every version was most of
  the time (docs/perf/history3.md).
- ``ix_tensors_history`` (migration 0008) also covers ``changed_bytes``.
- ``ix_versions_history`` (SQLite) grows to cover every column a listing of
  versions reads: ``parent_id``, ``created_at``, the byte counts,
  ``duration_s``, ``meta``, ``metrics``, ``message``, ``durability`` and
  ``stall_s``. ``log`` of a run and tensor history then read one range of the
  index, never the table row, whose ``durability`` and ``stall_s`` (added by 0010
  and 0011) lie past the manifest blob's overflow pages: reading them walked that
  chain once per version. PostgreSQL keeps that index as it is: it stores a large
  ``manifest`` out of line (TOAST), so its table rows are small already, and a
  btree entry is limited to about 2.7 KB, which ``meta``, ``metrics`` and
  ``message`` (as large as a caller makes them) must not be held to.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_TENSOR_VALUES = ["digest", "nbytes", "dtype", "shape"]
_VERSION_KEYS = ["run_id", "state", "step", "id", "tree_root"]
_LISTING = [*_VERSION_KEYS, "parent_id", "created_at", "logical_bytes", "new_bytes", "stored_bytes",
            "duration_s", "meta", "metrics", "message", "durability", "stall_s"]


def _tensor_index(values: list[str]) -> None:
    op.drop_index("ix_tensors_history", table_name="tensors")
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_tensors_history", "tensors", ["path", "version_id"], postgresql_include=values)
    else:
        op.create_index("ix_tensors_history", "tensors", ["path", "version_id", *values])


def _version_index(columns: list[str]) -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.drop_index("ix_versions_history", table_name="versions")
        op.create_index("ix_versions_history", "versions", columns)


def upgrade() -> None:
    from casckpt.catalog import tensorchanges

    op.add_column("tensors", sa.Column("changed_bytes", sa.BigInteger, nullable=True))
    tensorchanges.fill(op.get_bind())
    _tensor_index([*_TENSOR_VALUES, "changed_bytes"])
    _version_index(_LISTING)


def downgrade() -> None:
    _version_index(_VERSION_KEYS)
    _tensor_index(_TENSOR_VALUES)
    with op.batch_alter_table("tensors") as batch:
        batch.drop_column("changed_bytes")
