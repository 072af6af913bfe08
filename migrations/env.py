"""Alembic environment for the casckpt catalog.

casckpt runs migrations programmatically (``casckpt.catalog.migrate``) and
hands Alembic an open connection in ``config.attributes["connection"]``; this
file never builds an engine or reads a URL of its own.
"""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise SystemExit(
        "casckpt migrations run through `casckpt migrate` or casckpt.open(), not the alembic CLI"
    )

context.configure(
    connection=connection,
    target_metadata=None,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
