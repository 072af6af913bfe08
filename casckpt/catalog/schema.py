"""SQLAlchemy Core tables of the catalog, as of the newest migration.

Schema changes go through Alembic migrations in the top-level ``migrations/``
only; this module mirrors their result for queries. Ids are 64 hex digits.
Times are UTC seconds since the epoch (portable across SQLite and PostgreSQL).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)

metadata = MetaData()

store_info = Table(
    "store_info",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("parent_version", String(64), nullable=True),
    Column("retention", JSON, nullable=True),
    Column("redundancy", String(32), nullable=True),
    Column("delta_chain", SmallInteger, nullable=True),
    Column("delta_policy", String(16), nullable=True),
)

versions = Table(
    "versions",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("parent_id", String(64), nullable=True),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("committed_at", Float, nullable=False),
    Column("logical_bytes", BigInteger, nullable=False),
    Column("new_bytes", BigInteger, nullable=False),
    Column("stored_bytes", BigInteger, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("meta", JSON, nullable=False),
    Column("metrics", JSON, nullable=False),
    Column("message", Text, nullable=True),
    Column("manifest", LargeBinary, nullable=False),
    Column("deleted_at", Float, nullable=True),
    Column("deleted_reason", Text, nullable=True),
    Column("tree_root", String(64), nullable=True),  # a tree manifest's root node (see tree_nodes)
    # "durable" (every pack on the locations), "fast" (some pack only on a host's fast tier,
    # see tier_deps), "lost" (a fast tier was lost before it drained); migration 0010
    Column("durability", String(16), nullable=False, server_default="durable"),
    # the training-visible stall of the commit, seconds (blocking: its wall time; background:
    # until commit() returned); NULL before migration 0011, and for versions a rebuild restored
    Column("stall_s", Float, nullable=True),
    UniqueConstraint("run_id", "step", name="uq_versions_run_step"),
)
Index("ix_versions_created_at", versions.c.created_at)
# covering (migration 0014, SQLite): a run's version listing is one range of the index, never
# the table row, whose later columns lie past the manifest's overflow pages. PostgreSQL keys
# only the first five: it keeps large values out of line, and its index entries are bounded
Index("ix_versions_history", versions.c.run_id, versions.c.state, versions.c.step, versions.c.id,
      versions.c.tree_root, versions.c.parent_id, versions.c.created_at, versions.c.logical_bytes,
      versions.c.new_bytes, versions.c.stored_bytes, versions.c.duration_s, versions.c.meta,
      versions.c.metrics, versions.c.message, versions.c.durability, versions.c.stall_s)

tags = Table(
    "tags",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("version_id", String(64), ForeignKey("versions.id"), nullable=False),
    Column("created_at", Float, nullable=False),
)
Index("ix_tags_version", tags.c.version_id)

tensors = Table(
    "tensors",
    metadata,
    Column("version_id", String(64), ForeignKey("versions.id"), primary_key=True),
    Column("path", Text, primary_key=True),
    Column("dtype", String(32), nullable=False),
    Column("shape", JSON, nullable=False),
    Column("nbytes", BigInteger, nullable=False),
    Column("chunks", Integer, nullable=False),
    Column("digest", String(64), nullable=False),
    # bytes that differ from the tensor at this path in the version's parent; NULL: unknown
    # (catalog/tensorchanges.py; migration 0014)
    Column("changed_bytes", BigInteger, nullable=True),
)
Index("ix_tensors_digest", tensors.c.digest)
# covering: one path's history is one range of the index (migrations 0008, 0014; PostgreSQL
# keys path, version_id and INCLUDEs the rest, since JSON has no btree order)
Index("ix_tensors_history", tensors.c.path, tensors.c.version_id, tensors.c.digest, tensors.c.nbytes,
      tensors.c.dtype, tensors.c.shape, tensors.c.changed_bytes)

contents = Table(
    "contents",
    metadata,
    Column("digest", String(64), primary_key=True),
    Column("nbytes", BigInteger, nullable=False),
    Column("chunk_size", BigInteger, nullable=False),
    Column("chunk_ids", LargeBinary, nullable=False),
)

tree_nodes = Table(  # the nodes of tree manifests (each also a chunk in the packs), zstd JSON
    "tree_nodes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("body", LargeBinary, nullable=False),
)

tree_paths = Table(  # tensor paths interned for tree_changes (never deleted: ids keep their path)
    "tree_paths",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("path", Text, nullable=False, unique=True),
    sqlite_autoincrement=True,
)

tree_indexed = Table(  # tree versions whose tree_changes rows are recorded (migration 0015)
    "tree_indexed",
    metadata,
    Column("key", Integer, primary_key=True, autoincrement=True),  # what its tree_changes rows name
    Column("version_id", String(64), ForeignKey("versions.id"), nullable=False, unique=True),
    Column("base_id", String(64), nullable=True),  # the version its rows are against (NULL: none)
    sqlite_autoincrement=True,  # a key is never reused: rows name their version by it
)

tree_changes = Table(  # per tree version, the tensors it did not reuse from its parent's tree
    "tree_changes",
    metadata,
    Column("path_id", Integer, primary_key=True),
    Column("version_key", Integer, primary_key=True),  # tree_indexed.key
    Column("dtype", String(32), nullable=True),  # NULL (with digest): removed in this version
    Column("shape", Text, nullable=True),  # JSON text
    Column("nbytes", BigInteger, nullable=False),
    Column("digest", LargeBinary, nullable=True),  # 32 bytes: tensors.digest's hex, as bytes
    Column("changed_bytes", BigInteger, nullable=True),  # against the parent's tensor at the path
    sqlite_with_rowid=False,
)
Index("ix_tree_changes_version", tree_changes.c.version_key)

packs = Table(
    "packs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("key", String(256), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("chunks", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("verified_at", Float, nullable=True),
    Column("scheme", String(16), nullable=False, server_default="none"),
    Column("k", SmallInteger, nullable=False, server_default="1"),
    Column("m", SmallInteger, nullable=False, server_default="0"),
    Column("algorithm", String(32), nullable=True),
    Column("stripe", BigInteger, nullable=True),
    Column("data_offset", Integer, nullable=True),
    # state "fast": on the fast tier ``tier`` only, not yet drained to the locations (no shard
    # rows; scheme, k, m say the redundancy the drain gives it); "lost": that tier was lost
    Column("tier", String(32), nullable=True),
)
Index("ix_packs_state", packs.c.state)
Index("ix_packs_verified_at", packs.c.verified_at)

locations = Table(
    "locations",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("url", Text, nullable=True),
    Column("domain", String(128), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
)

shards = Table(
    "shards",
    metadata,
    Column("pack_id", String(64), ForeignKey("packs.id"), primary_key=True),
    Column("idx", SmallInteger, primary_key=True),
    Column("location_id", Integer, ForeignKey("locations.id"), nullable=False),
    Column("key", String(256), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("checksum", String(64), nullable=True),
    Column("state", String(16), nullable=False),
    Column("verified_at", Float, nullable=True),
)
Index("ix_shards_location", shards.c.location_id)
Index("ix_shards_state", shards.c.state)

chunks = Table(
    "chunks",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("pack_id", String(64), ForeignKey("packs.id"), nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("stored_len", BigInteger, nullable=False),
    Column("raw_len", BigInteger, nullable=False),
    Column("codec", SmallInteger, nullable=False),
    Column("base_id", String(64), nullable=True),
    Column("state", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("condemned_at", Float, nullable=True),
)
Index("ix_chunks_pack_id", chunks.c.pack_id)
Index("ix_chunks_state", chunks.c.state)
Index("ix_chunks_base_id", chunks.c.base_id)

leases = Table(
    "leases",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("version_id", String(64), nullable=True),
)

tombstones = Table(
    "tombstones",
    metadata,
    Column("version_id", String(64), primary_key=True),
    Column("reason", String(32), nullable=False),
    Column("created_at", Float, nullable=False),
)

gc_live = Table("gc_live", metadata, Column("id", String(64), primary_key=True))

gc_runs = Table(
    "gc_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("started_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("dry_run", Boolean, nullable=False),
    Column("report", JSON, nullable=True),
)

audit_log = Table(  # the audit trail (casckpt.catalog.audit): appended to, never deleted from
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("action", String(64), nullable=False),
    Column("target", String(256), nullable=True),
    Column("detail", JSON, nullable=False),
    Column("os_user", String(128), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("db_user", String(128), nullable=True),  # PostgreSQL's current_user; NULL on SQLite
    Column("casckpt_version", String(32), nullable=False),
)
Index("ix_audit_log_at", audit_log.c.at)
Index("ix_audit_log_action", audit_log.c.action)
Index("ix_audit_log_target", audit_log.c.target)

tiers = Table(  # the fast tiers of hosts (one directory each), see casckpt.engine.tiering.tier
    "tiers",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("path", Text, nullable=False),
    Column("state", String(16), nullable=False),  # "active" or "lost"
    Column("created_at", Float, nullable=False),
    Column("lost_at", Float, nullable=True),
)

tier_deps = Table(  # the fast packs a version needed when it was published
    "tier_deps",
    metadata,
    Column("version_id", String(64), primary_key=True),
    Column("pack_id", String(64), primary_key=True),
)
Index("ix_tier_deps_pack", tier_deps.c.pack_id)
Index("ix_versions_durability", versions.c.durability)
Index("ix_packs_tier", packs.c.tier)

drills = Table(  # restore drills (casckpt.engine.maintenance.drill): one row per version read back
    "drills",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("drill_id", String(32), nullable=False),  # one per drill run (store.ops.drill)
    Column("at", Float, nullable=False),
    Column("version_id", String(64), nullable=False),
    Column("run", String(128), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("seconds", Float, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("error", Text, nullable=True),
)
Index("ix_drills_at", drills.c.at)
Index("ix_drills_version_id", drills.c.version_id)

mirrors = Table(  # mirrors of this store into others (casckpt.store_mirrors; migration 0016)
    "mirrors",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("destination", Text, nullable=False),  # the destination store's path or URL, as given
    Column("key_file", Text, nullable=True),  # the destination's master key file (never the key)
    Column("selection", Text, nullable=False),  # JSON: casckpt.mirror_rules.MirrorSelection
    Column("propagate_deletions", Boolean, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("run_started_at", Float, nullable=True),  # the last run of the mirror
    Column("run_finished_at", Float, nullable=True),
    Column("run_error", Text, nullable=True),  # what stopped it (the destination), NULL: nothing
    Column("dest_store_id", String(64), nullable=True),  # the destination's identity (0017), NULL: never ran
)

mirror_versions = Table(  # per mirror, each source version its runs selected, and its fate
    "mirror_versions",
    metadata,
    Column("mirror", String(128), primary_key=True),
    Column("version_id", String(64), primary_key=True),  # the source's id (no FK: gc sweeps versions)
    Column("run", String(128), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("state", String(16), nullable=False),  # sent | present | failed | deleted | gone | unselected
    Column("dest_id", String(64), nullable=True),  # the destination's id (another one across keys)
    Column("chunks", BigInteger, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("at", Float, nullable=False),
    Column("error", Text, nullable=True),
    Column("created_at", Float, nullable=True),  # the version's, and its metrics (JSON): its slot
    Column("metrics", Text, nullable=True),  # under the keep rules once deleted here (0017)
    Column("owned", Boolean, nullable=False, server_default=false()),  # this mirror sent it (0019)
)

mirror_tags = Table(  # per mirror, each source tag it last carried there and its version then (0019)
    "mirror_tags",
    metadata,
    Column("mirror", String(128), primary_key=True),
    Column("tag", String(128), primary_key=True),
    Column("version_id", String(64), nullable=False),  # the source's id (no FK: gc sweeps versions)
)

rekey_map = Table(  # copies across chunk-id keys: a source chunk's id here (casckpt.catalog.rekeymap; 0018)
    "rekey_map",
    metadata,
    Column("key", String(64), primary_key=True),  # our keyed digest of (source store id, its chunk id)
    Column("chunk_id", String(64), nullable=False),  # our id of the same bytes (no FK: gc sweeps chunks)
)

GC_TABLES = frozenset({"gc_live", "gc_runs"})
"""gc's own tables: the admin role writes them; a writer role only reads them."""

OPTIONAL_TABLES = frozenset({"rekey_map", "mirror_tags"})
"""Tables a writer may lack rights on and still commit (a role granted before they existed):
a re-keyed copy then does without the map, with a warning (casckpt.catalog.rekeymap.denied);
a mirror run refuses before it starts, saying to grant them (store_mirrors.Mirrors)."""
