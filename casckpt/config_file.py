"""Reading a store's ``casckpt.toml``: bytes in, a checked document out, or a typed error.

Every way the file can be wrong — unreadable, not a regular file, too big,
not UTF-8, not TOML, a value of the wrong type or an unknown option — is an
:class:`~casckpt.errors.InvalidConfigError` naming the file and what to fix;
a file that is simply absent, or that declares no casckpt store, is a
:class:`~casckpt.errors.NotAStoreError`. Nothing here writes.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from casckpt.errors import InvalidConfigError, NotAStoreError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

STORE_FORMAT = 1
MAX_CONFIG_BYTES = 1 << 20
"""A store's config file is a few lines; a bigger one is not read (memory stays bounded)."""

TEXT, INT, NUMBER = "a string", "a positive integer", "a positive number"
"""The types :func:`check_table` checks option values against."""

STORE_KEYS: Mapping[str, str] = {
    "catalog": TEXT, "cache": TEXT, "redundancy": TEXT, "write_quorum": INT,
    "fast_tier": TEXT, "fast_tier_bytes": INT, "keep_fast_last": INT,
}
"""Typed keys of the ``[store]`` table besides ``format`` and ``blobs`` (others are kept as they are)."""


_LOCATION_KEYS = ("url", "domain", "name")


def read_config_file(file: Path) -> dict[str, Any]:
    """Read and check a store config file.

    Returns:
        The TOML document; ``doc["store"]`` is a table declaring format
        :data:`STORE_FORMAT`, and every key this casckpt reads has its type.

    Raises:
        NotAStoreError: the file is missing, or declares no casckpt store (no
            ``[store]`` format) or a newer store format.
        InvalidConfigError: the file cannot be read or decoded, or holds a bad value.
    """
    raw = _read(file)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(
            f"{file} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8 "
            "(it holds only paths, URLs and numbers), or recreate it with `casckpt init`"
        ) from None
    try:
        doc: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfigError(f"{file} is not valid TOML ({exc}); fix that line") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise InvalidConfigError(
            f"{file} nests arrays or tables too deeply to be a casckpt config; recreate it with "
            "`casckpt init` or fix it by hand") from None
    _check_document(doc, file)
    return doc


def _read(file: Path) -> bytes:
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except FileNotFoundError:
        raise NotAStoreError(
            f"no casckpt store at {file.parent}: {file.name} is missing; create one with "
            "`casckpt init` or casckpt.open()"
        ) from None
    except OSError as exc:
        raise InvalidConfigError(
            f"cannot read {file}: {exc.strerror or exc}; make it a file this user can read"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidConfigError(f"{file} is not a regular file; a store's config must be one")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InvalidConfigError(
            f"cannot read {file}: {exc.strerror or exc}; check the disk, or restore the file"
        ) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidConfigError(
            f"{file} is over {MAX_CONFIG_BYTES} bytes; a store config is a few lines: check it "
            "is the right file"
        )
    return data


def _check_document(doc: dict[str, Any], file: Path) -> None:
    store = doc.get("store")
    if not isinstance(store, dict) or "format" not in store:
        if store is not None and not isinstance(store, dict):
            raise InvalidConfigError(
                f"{file}: store must be a [store] table, not {store!r}; start the file with "
                f"[store] and format = {STORE_FORMAT} on the next line"
            )
        raise NotAStoreError(
            f"{file} is not a casckpt store config: it has no [store] table with "
            f"format = {STORE_FORMAT}. Pass a store's directory or its casckpt.toml"
        )
    form = store["format"]
    if type(form) is not int or form < 1:
        raise InvalidConfigError(
            f"{file}: [store] format must be {STORE_FORMAT}, not {form!r}; write format = {STORE_FORMAT}"
        )
    if form != STORE_FORMAT:
        raise NotAStoreError(
            f"{file} declares store format {form}; this casckpt reads format {STORE_FORMAT}. "
            "Upgrade casckpt."
        )
    check_table(store, STORE_KEYS, "[store]", file, strict=False)
    if "blobs" in store and "locations" in doc:
        raise InvalidConfigError(f"{file} sets both [store] blobs and [[locations]]; keep one")
    if "blobs" in store:
        blobs = store["blobs"]
        _check_locations(blobs if isinstance(blobs, list) else [blobs], "[store] blobs", file)
    if "locations" in doc:
        tables = doc["locations"]
        if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
            raise InvalidConfigError(
                f"{file}: locations must be [[locations]] tables (url = ..., domain = ...), "
                f"not {tables!r}"
            )
        _check_locations(tables, "[[locations]]", file)


def check_table(table: Mapping[str, Any], keys: Mapping[str, str], where: str, file: object,
                *, strict: bool) -> None:
    """Check a table's values against ``keys`` (option -> :data:`TEXT`, :data:`INT` or
    :data:`NUMBER`); ``strict``: an option not in ``keys`` is an error too.

    Raises:
        InvalidConfigError: naming ``file`` (a path, or where the table came from) and ``where``.
    """
    for key, value in table.items():
        want = keys.get(key)
        if want is None:
            if strict:
                raise InvalidConfigError(
                    f"{file}: {where} has no option {key!r}; the options are "
                    f"{', '.join(sorted(keys))}. Fix or remove it"
                )
            continue
        if not _is(value, want):
            raise InvalidConfigError(f"{file}: {where} {key} must be {want}, not {value!r}; fix it")


def _is(value: object, want: str) -> bool:
    if want == TEXT:
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and (want == NUMBER or isinstance(value, int))


def _check_locations(items: list[Any], where: str, file: Path) -> None:
    for item in items:
        if isinstance(item, str):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("url"), str):
            raise InvalidConfigError(
                f"{file}: each location in {where} needs url = \"a directory, file:///dir or "
                f"s3://bucket/prefix\"; got {item!r}"
            )
        for key, value in item.items():
            if key not in _LOCATION_KEYS or not isinstance(value, str):
                raise InvalidConfigError(
                    f"{file}: {where} {key} = {value!r} is not allowed; a location has url, "
                    "domain and name, all strings. Fix it (a misspelt domain would put copies "
                    "meant for different failure domains together)"
                )
