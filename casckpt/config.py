"""Store layout, the store config file, and every environment override, in one place.

Environment variables (all optional):

``CASCKPT_STORE``        the store the CLI opens when ``--store`` is not given.
``CASCKPT_CHUNK_SIZE``   bytes per chunk (default 1 MiB).
``CASCKPT_PACK_SIZE``    target pack size in bytes (default 64 MiB).
``CASCKPT_WORKERS``      threads for hashing, compression and I/O.
``CASCKPT_COMPRESSION``  ``0`` stores every chunk raw; ``1`` (default) compresses where it pays.
``CASCKPT_ZSTD_LEVEL``   zstd level for compressed chunks (default 1).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from casckpt.errors import InvalidArgumentError, NotAStoreError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

CONFIG_FILE = "casckpt.toml"
DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_PACK_SIZE = 64 << 20
CATALOG_FILE = "catalog.db"
CACHE_DIR = "cache"
STORE_FORMAT = 1

_CONFIG_TEXT = f"""# casckpt store. Packs live under packs/, manifests under manifests/,
# the catalog in {CATALOG_FILE} (SQLite, WAL) and the local index cache under {CACHE_DIR}/.
[store]
format = {STORE_FORMAT}
"""


@dataclass(frozen=True, slots=True)
class Settings:
    """Tuning knobs of the commit and restore pipelines.

    Attributes:
        chunk_size: bytes per chunk (rounded down to whole elements per tensor).
        pack_size: a pack is closed once it holds at least this many bytes.
        workers: threads for hashing, encoding and reading (BLAKE3, zstd and
            file I/O release the GIL).
        compress: False stores every chunk raw.
        zstd_level: zstd level for compressed chunks.
        read_coalesce: the largest single ranged read restore issues.
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = DEFAULT_PACK_SIZE
    workers: int = max(2, min(8, os.cpu_count() or 2))
    compress: bool = True
    zstd_level: int = 1
    read_coalesce: int = 16 << 20


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name}={value!r} is not an integer") from None
    if number <= 0:
        raise InvalidArgumentError(f"{name}={value!r} must be positive")
    return number


def settings(overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] = os.environ) -> Settings:
    """Defaults, then environment variables, then explicit ``overrides``."""
    config = Settings()
    for field, name in (("chunk_size", "CASCKPT_CHUNK_SIZE"), ("pack_size", "CASCKPT_PACK_SIZE"),
                        ("workers", "CASCKPT_WORKERS"), ("zstd_level", "CASCKPT_ZSTD_LEVEL")):
        value = _int_env(env, name)
        if value is not None:
            config = replace(config, **{field: value})  # type: ignore[arg-type]
    if env.get("CASCKPT_COMPRESSION", "1") == "0":
        config = replace(config, compress=False)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgumentError(f"{key} must be a positive int, got {value!r}")
        config = replace(config, **{key: value})  # type: ignore[arg-type]
    return config


def read_store_config(root: Path) -> dict[str, Any]:
    """Read ``casckpt.toml`` of the store at ``root``.

    Raises:
        NotAStoreError: the file is missing or unreadable.
    """
    try:
        with open(root / CONFIG_FILE, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise NotAStoreError(f"{root} is not a casckpt store ({CONFIG_FILE}: {exc})") from exc
    store = doc.get("store", {})
    if store.get("format") != STORE_FORMAT:
        raise NotAStoreError(
            f"{root / CONFIG_FILE} declares store format {store.get('format')!r}; this casckpt "
            f"reads format {STORE_FORMAT}. Upgrade casckpt."
        )
    return dict(store)


def prepare_store_dir(root: Path, *, create: bool) -> None:
    """Make sure ``root`` holds a store, creating one in a new or empty directory.

    Raises:
        NotAStoreError: ``root`` is a file, a non-empty directory without a
            store, or missing while ``create`` is False.
    """
    if (root / CONFIG_FILE).is_file():
        read_store_config(root)
        return
    if root.exists() and not root.is_dir():
        raise NotAStoreError(f"{root} is a file, not a casckpt store directory")
    if root.is_dir() and any(root.iterdir()):
        raise NotAStoreError(
            f"{root} is not a casckpt store (no {CONFIG_FILE}) and is not empty; pass a new or "
            "empty directory to create a store, or the root of an existing one"
        )
    if not create:
        raise NotAStoreError(
            f"no casckpt store at {root}; create one with `casckpt init {root}` or casckpt.open()"
        )
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{CONFIG_FILE}.tmp"
    tmp.write_text(_CONFIG_TEXT)
    os.replace(tmp, root / CONFIG_FILE)
