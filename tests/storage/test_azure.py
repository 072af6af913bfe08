"""The Azure Blob backend against Azurite: the shipped conformance suite (opened through the
registry, as a store opens it), staged-block uploads, ranged reads, typed errors, URLs,
options and the roles print-grants prints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import (
    AccessDeniedError,
    BlobNotFoundError,
    InvalidConfigError,
    InvalidNameError,
    RetryableStorageError,
    StorageError,
)
from casckpt.storage import BlobStore, RetryingBlobStore, open_blob_store
from casckpt.storage.azure_names import DELETE, READ, WRITE
from casckpt.testing.blobstore import BlobStoreConformance, blob

MiB = 1024 * 1024
SMALL_BLOCKS = {"max_single_put_size": 2 * MiB, "max_block_size": MiB}


def _store(url: str, **options: Any) -> BlobStore:
    return open_blob_store(url, {"az": {**SMALL_BLOCKS, **options}})


class TestAzureBlobStoreConformance(BlobStoreConformance):
    list_count = 60  # three pages of list_page_size=25
    large_size = 3 * MiB + 5  # above max_single_put_size: four staged blocks

    @pytest.fixture
    def blob_store(self, container: Any) -> Iterator[BlobStore]:
        self.container = container
        store = _store(f"az://{container.container_name}/team/run-1", list_page_size=25)
        yield store
        store.close()

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        blob_client = self.container.get_blob_client(f"team/run-1/{key}")
        if not blob_client.exists():
            return None
        data: bytes = blob_client.download_blob().readall()
        return data


def test_large_put_is_staged_blocks_committed_at_once(container: Any, tmp_path: Path) -> None:
    data = blob(5 * MiB + 3, seed=7)
    with _closing(_store(f"az://{container.container_name}/p")) as store:
        store.put("packs/ab/big", data)
        path = tmp_path / "pack"
        path.write_bytes(data[: 3 * MiB])
        store.put_file("packs/ab/file", path)
        small = blob(1000)
        store.put("packs/ab/small", small)
    committed, uncommitted = container.get_blob_client("p/packs/ab/big").get_block_list("all")
    assert [b.size for b in committed] == [MiB] * 5 + [3] and not uncommitted
    assert container.get_blob_client("p/packs/ab/big").download_blob().readall() == data
    assert len(container.get_blob_client("p/packs/ab/file").get_block_list("all")[0]) == 3
    assert container.get_blob_client("p/packs/ab/small").get_block_list("all")[0] == []  # one Put Blob


class _closing:
    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def __enter__(self) -> BlobStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def test_ranged_reads_fetch_only_the_range(container: Any, azure_proxy: Any, azure_connection: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.testing.azurite import connection_string

    data = blob(3 * MiB, seed=8)
    container.upload_blob("r/packs/ab/x", data)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(azure_proxy.endpoint_url))
    with _closing(_store(f"az://{container.container_name}/r")) as store:
        azure_proxy.reset_counters()
        assert store.get_range("packs/ab/x", MiB + 5, 1000) == data[MiB + 5: MiB + 1005]
        assert store.get_range("packs/ab/x", len(data) - 10, 100) == data[-10:]
        assert store.get_range("packs/ab/x", len(data) + 10, 100) == b""
        buffers = [memoryview(bytearray(300)), memoryview(bytearray(200))]
        assert store.read_into("packs/ab/x", 77, buffers) == 500
        assert b"".join(bytes(b) for b in buffers) == data[77:577]
        assert azure_proxy.response_bytes_by_method()["GET"] < 20_000  # never the 3 MiB object
        with pytest.raises(BlobNotFoundError):
            store.get_range("packs/ab/none", 0, 10)


def test_a_refused_request_is_access_denied_naming_the_data_action(container: Any,
                                                                   azurite_endpoint: str) -> None:
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from casckpt.testing.azurite import ACCOUNT, ACCOUNT_KEY

    container.upload_blob("t/packs/ab/x", b"data")
    sas = generate_container_sas(ACCOUNT, container.container_name, account_key=ACCOUNT_KEY,
                                 permission=ContainerSasPermissions(read=True, list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    reader = (f"BlobEndpoint={azurite_endpoint}/{ACCOUNT};SharedAccessSignature={sas}")
    with _closing(open_blob_store(f"az://{container.container_name}/t",
                                  {"az": {"connection_string": reader}})) as store:
        assert store.get("packs/ab/x") == b"data" and [i.key for i in store.list()] == ["packs/ab/x"]
        with pytest.raises(AccessDeniedError) as put:
            store.put("packs/ab/y", b"new")
        with pytest.raises(AccessDeniedError) as deleted:
            store.delete("packs/ab/x")
    assert put.value.right == f"{WRITE} on az://{container.container_name}/t/packs/ab/y"
    assert "--print-grants writer" in str(put.value)
    assert deleted.value.right is not None and deleted.value.right.startswith(DELETE)
    assert sas.split("sig=")[1].split("&")[0] not in str(put.value) + str(deleted.value)


def test_a_wrong_account_key_is_access_denied(container: Any, azurite_endpoint: str) -> None:
    from casckpt.testing.azurite import ACCOUNT

    wrong = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={'A' * 86}==;"
             f"BlobEndpoint={azurite_endpoint}/{ACCOUNT};")
    with _closing(open_blob_store(f"az://{container.container_name}/t",
                                  {"az": {"connection_string": wrong}})) as store:
        with pytest.raises(AccessDeniedError) as info:
            store.size("packs/ab/x")
    assert info.value.right == f"{READ} on az://{container.container_name}/t/packs/ab/x"
    assert "A" * 20 not in str(info.value)


def test_an_unreachable_endpoint_is_retryable_and_a_missing_container_permanent(
        container: Any, azure_connection: str) -> None:
    from casckpt.testing.azurite import connection_string

    dead = connection_string("http://127.0.0.1:9")
    with _closing(open_blob_store("az://ckpts/x", {"az": {"connection_string": dead,
                                                          "retry_attempts": 1, "sdk_attempts": 1}})) as s:
        with pytest.raises(RetryableStorageError):
            s.put("packs/ab/x", b"x")
    with _closing(_store("az://no-such-container/x")) as store:
        with pytest.raises(StorageError) as info:
            store.put("packs/ab/x", b"x")
    assert not isinstance(info.value, RetryableStorageError)
    assert "ContainerNotFound" in str(info.value) and "never creates containers" in str(info.value)


def test_store_wraps_azure_in_the_retrying_store(container: Any) -> None:
    with _closing(_store(f"az://{container.container_name}/w", retry_attempts=3)) as store:
        assert isinstance(store, RetryingBlobStore) and store.attempts == 3
        assert store.url == f"az://{container.container_name}/w"


@pytest.mark.parametrize("url", ["az://", "az://UPPER/x", "az://ab/x", "az://a--b/x", "az://ckpts/a//b",
                                 "az://ckpts/../x", "az://ckpts/a b"])
def test_malformed_urls_are_invalid_names(url: str, azure_connection: str) -> None:
    with pytest.raises(InvalidNameError):
        open_blob_store(url)


def test_az_options_come_from_the_config_file_and_are_checked(container: Any, tmp_path: Path) -> None:
    url = f"az://{container.container_name}/team"
    with casckpt.open(tmp_path / "store", blobs=url) as store:
        store.commit({"w": blob(100)}, run="r", step=1)
    config = tmp_path / "store" / "casckpt.toml"
    config.write_text(config.read_text() + "\n[az]\nmax_block_size = 1048576\nsdk_attempts = 2\n")
    with casckpt.open(tmp_path / "store", create=False) as store:
        assert store.log("r")[0].step == 1
    config.write_text(config.read_text() + 'connection_string = "AccountKey=secret"\n')
    with pytest.raises(InvalidConfigError) as info:
        casckpt.open(tmp_path / "store", create=False)
    assert "[az] has no option 'connection_string'" in str(info.value) and str(config) in str(info.value)


def test_print_grants_prints_the_azure_role_of_each_container(tmp_path: Path) -> None:
    (tmp_path / "casckpt.toml").write_text(
        '[store]\nformat = 1\n[[locations]]\nurl = "az://ckpts/team/a"\n'
        '[[locations]]\nurl = "s3://bucket/x"\n')
    result = CliRunner().invoke(app, ["init", str(tmp_path), "--print-grants", "writer", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    role = doc["azure_role"]
    assert role["roleDefinition"]["DataActions"] == [READ, WRITE, f"{WRITE[:-6]}/add/action"]
    assert DELETE not in json.dumps(role) and "s3_policy" in doc
    (assignment,) = role["assignments"]
    assert assignment["scope"].endswith("/containers/ckpts")
    assert "StringStartsWith 'team/a/'" in assignment["condition"]
    admin = CliRunner().invoke(app, ["init", str(tmp_path), "--print-grants", "admin"])
    assert admin.exit_code == 0 and "# Azure custom role and assignments of the admin role:" in admin.stdout
    assert DELETE in admin.stdout
    only_local = CliRunner().invoke(app, ["init", str(tmp_path / "new"), "--print-grants", "reader",
                                          "--json"])
    placeholders = json.loads(only_local.stdout)
    assert "CONTAINER" in json.dumps(placeholders["azure_role"]) and "s3_policy" in placeholders


def test_the_azure_guide_names_every_az_option() -> None:
    from casckpt.storage.azure_backend import OPTIONS

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "azure.md").read_text()
    assert [key for key in OPTIONS if f"`{key}`" not in guide] == []


def test_an_azurite_that_does_not_start_is_a_typed_error_naming_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.errors import StorageError
    from casckpt.testing.azurite import azurite_server

    monkeypatch.setenv("AZURITE_BLOB", "/bin/false")  # exits at once
    with pytest.raises(StorageError, match="azurite-blob did not start.*azurite.log"):
        with azurite_server(tmp_path, timeout=30):
            pass
