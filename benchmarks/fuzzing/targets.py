"""Every fuzz target, by name, loaded from a seed directory."""

from __future__ import annotations

from pathlib import Path

from benchmarks.fuzzing.formats import ManifestTarget, PackTarget, ShardTarget
from benchmarks.fuzzing.harness import Target
from benchmarks.fuzzing.seeds import load_format_seeds
from benchmarks.fuzzing.stores import (
    CatalogTarget,
    ConfigTarget,
    EcObjectsTarget,
    ObjectsTarget,
    RecordsTarget,
)

FORMAT_TARGETS = ("pack", "shard", "manifest")
STORE_TARGETS = ("config", "records", "catalog", "objects", "ec-objects")
TARGETS = FORMAT_TARGETS + STORE_TARGETS


def load_targets(seeds_dir: Path) -> dict[str, Target]:
    """Every target, reading its seeds from ``seeds_dir`` (see :func:`seeds.build_seeds`)."""
    formats = load_format_seeds(seeds_dir)
    targets: list[Target] = [
        PackTarget(formats), ShardTarget(formats), ManifestTarget(formats),
        ConfigTarget(seeds_dir), RecordsTarget(seeds_dir), CatalogTarget(seeds_dir),
        ObjectsTarget(seeds_dir), EcObjectsTarget(seeds_dir),
    ]
    return {t.name: t for t in targets}
