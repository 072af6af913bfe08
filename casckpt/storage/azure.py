"""A blob store in an Azure Blob Storage container, through ``azure-storage-blob``.

Location: ``az://container/prefix``; every key is a block blob under ``prefix/``. Which storage
account, and as whom, the Azure SDK's usual ways decide, in this order:

1. ``AZURE_STORAGE_CONNECTION_STRING`` (an account key or a SAS, and the endpoint: also how
   Azurite and sovereign clouds are reached);
2. the ``account_url`` option, else ``https://$AZURE_STORAGE_ACCOUNT.blob.core.windows.net``,
   with ``DefaultAzureCredential`` (environment, workload and managed identity, Azure CLI
   login, ...) -- only if the optional ``azure-identity`` package is installed.

Each store holds one container client (thread-safe, with its own connection pool), made in
``__init__`` and released by ``close()``.

- Uploads send an MD5 of each request's body, which Azure checks before it stores anything.
  Objects above ``max_single_put_size`` go up as staged blocks of ``max_block_size``
  (``max_concurrency`` at once), then one Put Block List commits them: like a single Put Blob,
  all or nothing, and a blob's uncommitted blocks are discarded by Azure within a week. Keys
  are content-addressed, so a put retried after a failure writes the same bytes again.
- ``get_range`` asks for ``x-ms-range`` and the range's MD5, so readers fetch only what they
  need and a byte damaged in transit is caught (``RetryableStorageError``).
- The SDK retries each request (5xx, 408, connection errors) up to ``sdk_attempts`` times in
  all, with a short linear backoff; whole operations are retried by wrapping the store in
  :class:`~casckpt.storage.retry.RetryingBlobStore`, as for S3 (Azure throttles with 503
  ``ServerBusy``, retried at both levels).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from azure.core import MatchConditions
from azure.storage.blob import ContainerClient, LinearRetry

from casckpt.errors import InvalidArgumentError, InvalidNameError, OversizedObjectError, StorageError
from casckpt.storage.azure_errors import map_azure_error
from casckpt.storage.azure_names import split_az_url
from casckpt.storage.base import RemoteBlobStore, check_object_name, location_prefix, wants_bytes
from casckpt.storage.redact import redact_text

MiB = 1024 * 1024
MAX_BLOCK = 4000 * MiB  # Azure's largest block (API version 2019-12-12 and later)


def parse_az_url(url: str) -> tuple[str, str]:
    """``az://container[/prefix]`` -> ``(container, "prefix/")`` (prefix empty or ending in ``/``).

    Raises:
        InvalidNameError: not such a URL, or a prefix segment that is empty, ``.``/``..`` or
            uses characters other than letters, digits and ``._=+-``.
    """
    try:
        container, prefix = split_az_url(url) if isinstance(url, str) else split_az_url("")
    except InvalidArgumentError as exc:
        raise InvalidNameError(str(exc)) from None
    return container, location_prefix(prefix, url, "Azure")


def _client(container: str, account_url: str | None, kwargs: dict[str, Any],
            connection_string: str | None) -> ContainerClient:
    """The container client, credentials found as the module docstring says."""
    conn = connection_string or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        return ContainerClient.from_connection_string(conn, container, **kwargs)
    account = os.environ.get("AZURE_STORAGE_ACCOUNT")
    url = account_url or (f"https://{account}.blob.core.windows.net" if account else None)
    if url is None:
        raise StorageError(
            "no Azure storage account to use: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT (or account_url in the config file's [az] table) with an "
            "identity DefaultAzureCredential can find (pip install azure-identity)")
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise StorageError(
            f"no credential for {url}: set AZURE_STORAGE_CONNECTION_STRING, or install "
            "azure-identity (pip install azure-identity) to sign in with DefaultAzureCredential"
        ) from None
    return ContainerClient(url, container, credential=DefaultAzureCredential(), **kwargs)


class AzureBlobStore(RemoteBlobStore):
    """Blobs under ``az://container/prefix``. Thread-safe; see the module docstring.

    Args:
        url: ``az://container/prefix``.
        account_url: the account's blob endpoint, when no connection string is set.
        connection_string: instead of ``AZURE_STORAGE_CONNECTION_STRING`` (never recorded in a
            config file: it holds the account key or a SAS).
        max_single_put_size: objects above this go up as staged blocks.
        max_block_size: the block size (at most 4000 MiB).
        max_concurrency: blocks uploaded at once, per upload.
        connect_timeout, read_timeout: seconds, as for S3 (5 and 15; see docs/DEFAULTS.md).
        sdk_attempts: tries per HTTP request inside the SDK (1 = no SDK retry).
        list_page_size: blobs per List Blobs request (at most 5000).

    Raises:
        InvalidNameError: ``url`` is not a valid Azure location.
        InvalidArgumentError: an option is out of range.
        StorageError: no account or credential could be found, or the client not built.
    """

    service = "Azure"

    def __init__(self, url: str, *, account_url: str | None = None, connection_string: str | None = None,
                 max_single_put_size: int = 64 * MiB, max_block_size: int = 16 * MiB,
                 max_concurrency: int = 8, connect_timeout: float = 5.0, read_timeout: float = 15.0,
                 sdk_attempts: int = 3, list_page_size: int = 5000) -> None:
        self.container, self.prefix = parse_az_url(url)
        self.url = f"az://{self.container}/{self.prefix.rstrip('/')}".rstrip("/")
        self._root = f"az://{self.container}/"
        problems = [f"{name} must be at least 1, not {value}" for name, value in (
            ("max_single_put_size", max_single_put_size), ("max_block_size", max_block_size),
            ("max_concurrency", max_concurrency), ("sdk_attempts", sdk_attempts),
            ("list_page_size", list_page_size)) if value < 1]
        if max_block_size > MAX_BLOCK or list_page_size > 5000:
            problems.append("max_block_size is at most 4000 MiB and list_page_size at most 5000")
        if problems:
            raise InvalidArgumentError("invalid Azure store options: " + "; ".join(problems))
        self._concurrency = max_concurrency
        self._page_size = list_page_size
        kwargs = dict(
            max_single_put_size=max_single_put_size, max_block_size=max_block_size,
            connection_timeout=connect_timeout, read_timeout=read_timeout, user_agent="casckpt",
            retry_policy=LinearRetry(backoff=0.2, random_jitter_range=0.2,  # type: ignore[arg-type]
                                     retry_total=sdk_attempts - 1),
        )
        try:
            self._client = _client(self.container, account_url, kwargs, connection_string)
        except StorageError:
            raise
        except Exception as exc:  # a malformed connection string or URL: ValueError and others
            raise StorageError(f"cannot set up the Azure client for {self.url}: {type(exc).__name__}: "
                               f"{redact_text(str(exc))}; check AZURE_STORAGE_CONNECTION_STRING or "
                               "account_url") from None

    def _map_error(self, exc: Exception, op: str, where: str) -> Exception:
        return map_azure_error(exc, op, where)

    # writes ----------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Upload ``data`` (as staged blocks above ``max_single_put_size``)."""
        check_object_name(key)
        body = data if isinstance(data, bytes) else bytes(data)
        self._call("put", key, lambda: self._upload(key, body, len(body)))

    def put_file(self, key: str, path: Path) -> None:
        """Upload the file at ``path``; the file is left in place (not consumed)."""
        size = self._file_size(key, path)

        def upload() -> None:
            with open(path, "rb") as f:
                self._upload(key, f, size)

        self._call("put_file", key, upload)

    def _upload(self, key: str, body: Any, size: int) -> None:
        self._client.upload_blob(self.prefix + key, body, length=size, overwrite=True,
                                 validate_content=True, max_concurrency=self._concurrency)

    # reads -----------------------------------------------------------------

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        """Fetch the whole object; one larger than ``max_size`` is refused from its
        properties, before its bytes are read (then read only if it is still that blob)."""
        check_object_name(key)

        def fetch() -> bytes:
            kwargs: dict[str, Any] = {}
            if max_size is not None:
                props = self._client.get_blob_client(self.prefix + key).get_blob_properties()
                if props.size > max_size:
                    raise OversizedObjectError(
                        f"{self._where(key)} is {props.size} bytes, more than the {max_size} "
                        "expected; it was not read. Run `casckpt check` (it is damaged or not "
                        "casckpt's)")
                kwargs = {"etag": props.etag, "match_condition": MatchConditions.IfNotModified}
            return self._download(key, None, None, **kwargs)

        return self._call("get", key, fetch)

    def _download(self, key: str, offset: int | None, length: int | None, **kwargs: Any) -> bytes:
        # Azure sends an MD5 only of a range up to 4 MiB: the SDK reads in such ranges then
        stream = self._client.download_blob(self.prefix + key, offset=offset, length=length,
                                            validate_content=True, max_concurrency=1, **kwargs)
        data: bytes = stream.readall()
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Fetch ``length`` bytes from ``offset`` with ranged GETs (fewer at the end)."""
        if not wants_bytes(self, key, offset, length, self._where(key)):
            return b""

        def fetch() -> bytes:
            try:
                return self._download(key, offset, length)
            except Exception as exc:
                if getattr(exc, "status_code", None) == 416:  # exists, and ends at or before offset
                    return b""
                raise

        return self._call("get_range", key, fetch)

    def size(self, key: str) -> int | None:
        check_object_name(key)
        return self._unless_missing("size", key, lambda: int(self._client.get_blob_client(
            self.prefix + key).get_blob_properties().size), None)

    def _pages(self, prefix: str) -> Iterator[Any]:
        return iter(self._client.list_blobs(name_starts_with=prefix,
                                            results_per_page=self._page_size).by_page())

    def _entries(self, page: Any) -> list[tuple[str, int, float]]:
        return [(blob.name, int(blob.size), blob.last_modified.timestamp()) for blob in page]

    # deletes and lifecycle -------------------------------------------------

    def delete(self, key: str) -> None:
        check_object_name(key)
        self._unless_missing("delete", key, lambda: self._client.delete_blob(
            self.prefix + key, delete_snapshots="include"), None)

    def close(self) -> None:
        """Release the client's connections. Idempotent; the store must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._client.close()
