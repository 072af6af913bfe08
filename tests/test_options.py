"""casckpt.Options: how a store is opened, checked once; keyword arguments and the
environment meet it in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import InvalidArgumentError


@pytest.mark.parametrize(("field", "value"), [
    ("chunk_size", 0), ("chunk_size", -1), ("chunk_size", 1.5), ("chunk_size", True),
    ("pack_size", "64M"), ("workers", 0), ("max_pending_commits", -2), ("commit_memory", 0),
    ("staging_memory", "a lot"), ("create", "yes"), ("recover", 1), ("backpressure", "drop"),
    ("catalog", 5), ("redundancy", "ec:9"), ("redundancy", 3), ("s3", ["endpoint_url"]),
])
def test_a_bad_option_is_a_typed_error_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=f"Options.{field}"):
        casckpt.Options(**{field: value})


def test_options_and_keywords_open_the_same_store(tmp_path: Path) -> None:
    options = casckpt.Options(chunk_size=4096, workers=2, max_pending_commits=3)
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with casckpt.open(tmp_path / "a", options) as a:
        a.commit(state, run="r", step=1)
        assert (a.stats().chunks, a.resolve("r@1").new_bytes) == (10, 40_000)  # 4 KiB chunks
    with casckpt.open(tmp_path / "b", chunk_size=4096, workers=2, max_pending_commits=3) as b:
        b.commit(state, run="r", step=1)
        assert b.stats().chunks == 10
    with casckpt.open(tmp_path / "a", options, chunk_size=8192) as a:  # a keyword wins
        a.commit({"w": state["w"] + 1}, run="r", step=2)
        assert a.resolve("r@2").new_bytes == 40_000 and a.stats().chunks == 10 + 5


def test_an_option_overrides_the_environment_which_overrides_the_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASCKPT_CHUNK_SIZE", "8192")
    assert casckpt.Options().settings().chunk_size == 8192
    assert casckpt.Options(chunk_size=4096).settings().chunk_size == 4096
    monkeypatch.setenv("CASCKPT_CHUNK_SIZE", "nope")
    with pytest.raises(InvalidArgumentError, match="CASCKPT_CHUNK_SIZE"):
        casckpt.Options().settings()


def test_options_refuse_what_is_not_an_option(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no such option: speed"):
        casckpt.Options().with_given(speed=2)
    with pytest.raises(InvalidArgumentError, match="casckpt.Options"):
        casckpt.open(tmp_path / "s", {"chunk_size": 4096})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="Options.create"):
        casckpt.open(tmp_path / "s", create="no")  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()
