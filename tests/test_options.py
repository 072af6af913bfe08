"""casckpt.Options: how a store is opened, declared once, checked by casckpt.open before
anything is made; keyword overrides and the environment meet it in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import InvalidArgumentError
from casckpt.options import settings


@pytest.mark.parametrize(("field", "value"), [
    ("chunk_size", 0), ("chunk_size", -1), ("chunk_size", 1.5), ("chunk_size", True),
    ("pack_size", "64M"), ("workers", 0), ("max_pending_commits", -2), ("commit_memory", 0),
    ("staging_memory", "a lot"), ("create", "yes"), ("recover", 1), ("backpressure", "drop"),
    ("catalog", 5), ("redundancy", "ec:9"), ("redundancy", 3), ("s3", ["endpoint_url"]),
])
def test_a_bad_option_is_a_typed_error_naming_its_field(tmp_path: Path, field: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=f"Options.{field}"):
        casckpt.open(tmp_path / "s", casckpt.Options(**{field: value}))
    with pytest.raises(InvalidArgumentError, match=f"Options.{field}"):
        casckpt.open(tmp_path / "s", **{field: value})
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_options_and_keywords_open_the_same_store(tmp_path: Path) -> None:
    options = casckpt.Options(chunk_size=4096, workers=2, max_pending_commits=3)
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with casckpt.open(tmp_path / "a", options) as a:
        a.commit(state, run="r", step=1)
        assert (a.ops.stats().chunks, a.resolve("r@1").new_bytes) == (10, 40_000)  # 4 KiB chunks
    with casckpt.open(tmp_path / "b", chunk_size=4096, workers=2, max_pending_commits=3) as b:
        b.commit(state, run="r", step=1)
        assert b.ops.stats().chunks == 10
    with casckpt.open(tmp_path / "a", options, chunk_size=8192) as a:  # a keyword wins
        a.commit({"w": state["w"] + 1}, run="r", step=2)
        assert a.resolve("r@2").new_bytes == 40_000 and a.ops.stats().chunks == 10 + 5


def test_an_option_overrides_the_environment_which_overrides_the_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASCKPT_CHUNK_SIZE", "8192")
    assert settings(casckpt.Options()).chunk_size == 8192
    assert settings(casckpt.Options(chunk_size=4096)).chunk_size == 4096
    monkeypatch.setenv("CASCKPT_CHUNK_SIZE", "nope")
    with pytest.raises(InvalidArgumentError, match="CASCKPT_CHUNK_SIZE"):
        settings(casckpt.Options())


def test_an_unknown_option_is_refused_with_the_closest_field(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no such option: 'chunksize'; did you mean 'chunk_size'"):
        casckpt.open(tmp_path / "s", chunksize=4096)  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="no such option: 'fast_teir'; did you mean 'fast_tier'"):
        casckpt.open(tmp_path / "s", {"fast_teir": "/nvme"})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(InvalidArgumentError, match="no such option: 'speed'; the options are backg"):
        casckpt.open(tmp_path / "s", speed=2)  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="options must be a casckpt.Options"):
        casckpt.open(tmp_path / "s", ["chunk_size"])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="Options.create"):
        casckpt.open(tmp_path / "s", create="no")  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


def test_an_override_replaces_the_option_it_names_and_leaves_the_rest(tmp_path: Path) -> None:
    options = casckpt.Options(chunk_size=4096, create=False)
    with pytest.raises(casckpt.errors.NotAStoreError):
        casckpt.open(tmp_path / "s", options)  # create=False: nothing there
    with casckpt.open(tmp_path / "s", options, create=True) as store:  # the override wins
        store.commit({"w": torch.arange(2048, dtype=torch.float32)}, run="r", step=1)
        assert store.ops.stats().chunks == 2  # chunk_size kept from options
    assert options == {"chunk_size": 4096, "create": False}  # the caller's options are not changed


def test_every_option_field_is_a_keyword_of_open_and_documented() -> None:
    import inspect

    from casckpt.options import FIELDS

    assert FIELDS == set(casckpt.Options.__annotations__)
    doc = inspect.getdoc(casckpt.Options) or ""
    assert all(f"    {name}:" in doc for name in FIELDS), "every field has its line in Options' docstring"
    overrides = inspect.signature(casckpt.open).parameters["overrides"]
    assert overrides.kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("flag", ["create", "recover", "background_drain"])
def test_a_flag_given_as_none_takes_its_default(tmp_path: Path, flag: str) -> None:
    """``open``'s overrides take None for every field (the default then decides): a new
    store is created, opened without recovery, with its drain worker."""
    with casckpt.open(tmp_path / "s", **{flag: None}) as store:
        store.commit({"w": torch.ones(2)}, run="r", step=0)
    with casckpt.open(tmp_path / "s", create=None) as store:
        assert torch.equal(store.restore("r@0")["w"], torch.ones(2))


def _refused_before_writing(tmp_path: Path, match: str, **options: Any) -> None:
    """``casckpt.open`` refuses ``options`` with a typed error and writes nothing; a later
    open with good options creates the store there."""
    store_dir = tmp_path / f"store{len(list(tmp_path.glob('store*')))}"
    fds = len(list(Path("/proc/self/fd").iterdir()))
    with pytest.raises(InvalidArgumentError, match=match):
        casckpt.open(store_dir, **options)
    assert not store_dir.exists() or not any(store_dir.iterdir())
    assert len(list(Path("/proc/self/fd").iterdir())) == fds  # no lock or connection left open
    with casckpt.open(store_dir) as store:
        store.commit({"w": torch.ones(3)}, run="r", step=1)


@pytest.mark.parametrize("catalog", ["notaurl", "nosuchdb://host/x", "sqlite+nosuchdriver:///x.db"])
def test_a_malformed_catalog_url_is_refused_before_writing(tmp_path: Path, catalog: str) -> None:
    _refused_before_writing(tmp_path, "not a database URL", catalog=catalog)


def test_a_location_domain_that_is_not_a_string_is_refused_before_writing(tmp_path: Path) -> None:
    _refused_before_writing(tmp_path, "all strings", blobs=[
        {"url": str(tmp_path / "a"), "domain": 3}, str(tmp_path / "b")])
    _refused_before_writing(tmp_path, "all strings", blobs=[
        casckpt.BlobLocation(str(tmp_path / "a"), name=7), str(tmp_path / "b")])  # type: ignore[arg-type]


def test_the_same_directory_twice_is_refused_before_writing(tmp_path: Path) -> None:
    _refused_before_writing(tmp_path, "same place", blobs=[str(tmp_path / "a"), str(tmp_path / "a")])
    _refused_before_writing(tmp_path, "same place", blobs=[str(tmp_path / "a"), (tmp_path / "a").as_uri()])


def test_a_fast_tier_under_a_regular_file_is_refused_before_writing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    _refused_before_writing(tmp_path, "not a directory", fast_tier=tmp_path / "file" / "tier")


def test_an_unknown_scheme_is_refused_before_writing_naming_the_registered_ones(tmp_path: Path) -> None:
    _refused_before_writing(tmp_path, r"no storage backend serves bogus URLs: use a directory, .*s3://",
                            blobs="bogus://bucket/x")
    _refused_before_writing(tmp_path, "no storage backend serves bogus",
                            blobs=[str(tmp_path / "a"), "bogus://bucket/x"])


def test_a_scheme_is_case_insensitive_and_recorded_in_lower_case(tmp_path: Path) -> None:
    """RFC 3986: ``FILE:///dir`` is ``file:///dir``; the config file records it so, and the
    location opens (it is not kept as unreachable)."""
    blobs = "FILE://" + str(tmp_path / "blobs")
    with casckpt.open(tmp_path / "store", blobs=blobs) as store:
        store.commit({"w": torch.ones(3)}, run="r", step=1)
        assert [loc.url for loc in store.locations.list()] == [(tmp_path / "blobs").as_uri()]
    assert "FILE://" not in (tmp_path / "store" / "casckpt.toml").read_text()
    assert any((tmp_path / "blobs").iterdir())
    with casckpt.open(tmp_path / "store", create=False) as store:
        assert torch.equal(store.restore("r@1")["w"], torch.ones(3))


def test_one_mapping_is_one_location(tmp_path: Path) -> None:
    """``blobs={"url": ..., "domain": ...}`` is one location, not a list of its keys."""
    with casckpt.open(tmp_path / "store", blobs={"url": str(tmp_path / "blobs"), "domain": "rack1"}) as store:
        store.commit({"w": torch.ones(3)}, run="r", step=1)
        assert [(loc.url, loc.domain) for loc in store.locations.list()] == [
            ((tmp_path / "blobs").as_uri(), "rack1")]
    assert not (tmp_path / "store" / "url").exists() and not (tmp_path / "store" / "domain").exists()
    _refused_before_writing(tmp_path, "a location or a list of locations", blobs=5)
