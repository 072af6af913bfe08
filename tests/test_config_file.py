"""A store's casckpt.toml: every way it can be wrong is a typed error naming the file (issue 13).

A non-UTF-8 file used to escape as a UnicodeDecodeError; wrong-typed values
as TypeErrors from deep inside open (an unknown [s3] option, a string where
a number belongs) or were silently misread (``format = true``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import casckpt
from casckpt.config_file import MAX_CONFIG_BYTES, read_config_file
from casckpt.errors import InvalidArgumentError, InvalidConfigError, NotAStoreError

BAD_CONFIGS = {
    "not-utf8": b"[store]\nformat = 1\n# caf\xe9\n",
    "utf16": "[store]\nformat = 1\n".encode("utf-16"),
    "not-toml": b"[store\nformat = 1\n",
    "store-not-a-table": b"store = 5\n",
    "format-a-string": b'[store]\nformat = "1"\n',
    "format-a-bool": b"[store]\nformat = true\n",
    "format-a-float": b"[store]\nformat = 1.0\n",
    "format-zero": b"[store]\nformat = 0\n",
    "catalog-a-number": b"[store]\nformat = 1\ncatalog = 5\n",
    "cache-a-list": b"[store]\nformat = 1\ncache = []\n",
    "redundancy-a-number": b"[store]\nformat = 1\nredundancy = 3\n",
    "quorum-a-string": b'[store]\nformat = 1\nwrite_quorum = "2"\n',
    "quorum-zero": b"[store]\nformat = 1\nwrite_quorum = 0\n",
    "blobs-a-number": b"[store]\nformat = 1\nblobs = 5\n",
    "blobs-and-locations": b'[store]\nformat = 1\nblobs = "b"\n[[locations]]\nurl = "c"\n',
    "locations-not-tables": b'locations = ["a"]\n[store]\nformat = 1\n',
    "location-without-url": b'[store]\nformat = 1\n[[locations]]\ndomain = "d"\n',
    "location-misspelt-key": b'[store]\nformat = 1\n[[locations]]\nurl = "a"\ndomian = "d"\n',
    "location-url-a-number": b"[store]\nformat = 1\n[[locations]]\nurl = 5\n",
    "s3-not-a-table": b'[store]\nformat = 1\n[[s3]]\nregion = "x"\n',
    "s3-unknown-option": b'[store]\nformat = 1\n[s3]\nendpoint = "http://x"\n',
    "s3-region-a-number": b"[store]\nformat = 1\n[s3]\nregion = 5\n",
    "s3-size-a-string": b'[store]\nformat = 1\n[s3]\nmultipart_threshold = "64MB"\n',
    "s3-timeout-negative": b"[store]\nformat = 1\n[s3]\nread_timeout = -1.5\n",
}


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    casckpt.open(tmp_path / "store").close()
    return tmp_path / "store"


@pytest.mark.parametrize("text", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_bad_config_is_invalid_config_naming_the_file(store_dir: Path, text: bytes) -> None:
    config = store_dir / "casckpt.toml"
    config.write_bytes(text)
    with pytest.raises(InvalidConfigError) as info:
        casckpt.open(store_dir, create=False)
    assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)
    assert str(config) in str(info.value)
    assert config.read_bytes() == text, "a refused open changed the config file"


@pytest.mark.parametrize(("text", "words"), [
    (b"", ["no [store] table"]),
    (b'[tool.other]\nx = 1\n', ["no [store] table"]),
    (b"[store]\nblobs = 'x'\n", ["no [store] table with format"]),
    (b"[store]\nformat = 2\n", ["format 2", "Upgrade casckpt"]),
])
def test_config_of_no_store_or_a_newer_one_is_not_a_store(store_dir: Path, text: bytes,
                                                           words: list[str]) -> None:
    (store_dir / "casckpt.toml").write_bytes(text)
    with pytest.raises(NotAStoreError) as info:
        casckpt.open(store_dir, create=False)
    for word in words:
        assert word in str(info.value)


def test_every_option_the_file_may_hold_is_accepted(store_dir: Path) -> None:
    config = store_dir / "casckpt.toml"
    config.write_text(config.read_text() + "write_quorum = 1\nfuture_key = [1, 2]\n"
                      '[s3]\nregion = "eu"\nmultipart_threshold = 67108864\nread_timeout = 30\n'
                      "connect_timeout = 2.5\n")
    doc = read_config_file(config)
    assert doc["s3"]["read_timeout"] == 30 and doc["store"]["future_key"] == [1, 2]
    casckpt.open(store_dir, create=False).close()


def test_missing_file_is_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(NotAStoreError) as info:
        read_config_file(tmp_path / "casckpt.toml")
    assert "casckpt init" in str(info.value)


def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(InvalidConfigError) as info:
        read_config_file(fifo)
    assert "not a regular file" in str(info.value)
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(InvalidConfigError):
        read_config_file(tmp_path / "dir.toml")


def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "casckpt.toml"
    big.write_bytes(b"[store]\nformat = 1\n" + b"#" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(InvalidConfigError) as info:
        read_config_file(big)
    assert "few lines" in str(info.value)
