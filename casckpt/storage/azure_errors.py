"""Azure SDK errors -> casckpt errors, at the boundary of :mod:`casckpt.storage.azure`.

- a missing blob (404 ``BlobNotFound``) -> :class:`~casckpt.errors.BlobNotFoundError`;
- a refused request (401/403: ``AuthorizationPermissionMismatch``, ``AuthorizationFailure``,
  ``AuthenticationFailed``, ...) -> :class:`~casckpt.errors.AccessDeniedError` naming the data
  action and the blob, and the role whose printed definition grants it;
- throttling (503 ``ServerBusy``, 429), other 5xx, 408, a connection refused, dropped or cut
  mid-body, a body whose MD5 does not match -> :class:`~casckpt.errors.RetryableStorageError`;
- everything else -> :class:`~casckpt.errors.StorageError` with advice.

Messages never hold a credential (account keys and SAS signatures are redacted).
"""

from __future__ import annotations

import concurrent.futures

import requests
from azure.core import exceptions as ace

from casckpt.errors import AccessDeniedError, BlobNotFoundError, RetryableStorageError, StorageError
from casckpt.storage.azure_names import DELETE, READ, WRITE
from casckpt.storage.redact import redact_text

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_NOT_FOUND_CODES = frozenset({"BlobNotFound", "ResourceNotFound"})

# casckpt's operation -> the data action Azure authorizes it under, and the role granting it.
_DATA_ACTIONS = {
    "get": (READ, "reader"), "get_range": (READ, "reader"), "size": (READ, "reader"),
    "list": (READ, "reader"), "put": (WRITE, "writer"), "put_file": (WRITE, "writer"),
    "delete": (DELETE, "admin"),
}
_CREDENTIALS_ADVICE = ("check AZURE_STORAGE_CONNECTION_STRING (its AccountKey or SAS), or the "
                     "identity DefaultAzureCredential found, and the system clock")
_ADVICE = {
    "ContainerNotFound": "check the container name in the URL and that it exists in this "
                         "storage account (casckpt never creates containers)",
    "AccountIsDisabled": "the storage account is disabled; ask its owner",
    "InvalidHeaderValue": "the endpoint may not support this API version",
    "RequestBodyTooLarge": "lower max_block_size or max_single_put_size",
}
_DEFAULT_ADVICE = "look the error code up in the Azure Blob Storage error code list"

def map_azure_error(exc: BaseException, op: str, where: str) -> StorageError | AccessDeniedError:
    """Return the casckpt error for ``exc`` raised while doing ``op`` on ``where``
    (an ``az://container/key`` URL)."""
    if isinstance(exc, ace.HttpResponseError) and exc.status_code is not None:
        return _response_error(exc, op, where)
    if isinstance(exc, ace.ClientAuthenticationError):  # no status: a credential not obtained
        return StorageError(f"Azure {op} of {where} failed: no usable credential "
                            f"({redact_text(str(exc)).splitlines()[0]}); {_CREDENTIALS_ADVICE}")
    # a body cut mid-read escapes the SDK as the transport's own error (ChunkedEncodingError)
    if isinstance(exc, (ace.ServiceRequestError, ace.ServiceResponseError, ace.IncompleteReadError,
                        ace.DecodeError, ConnectionError, TimeoutError,
                        requests.RequestException)) or (
            isinstance(exc, ace.AzureError) and "md5" in str(exc).lower()):
        return RetryableStorageError(f"Azure {op} of {where} failed in transit ({type(exc).__name__}: "
                                     f"{_first_line(exc)}); trying again may succeed")
    if isinstance(exc, concurrent.futures.CancelledError):
        return StorageError(f"Azure {op} of {where} was cancelled: the store is closing")
    return StorageError(f"Azure {op} of {where} failed ({type(exc).__name__}: {_first_line(exc)}); "
                        f"{_DEFAULT_ADVICE}")


def is_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` says the blob does not exist."""
    return isinstance(exc, ace.HttpResponseError) and exc.status_code == 404 \
        and (_code(exc) or "BlobNotFound") in _NOT_FOUND_CODES


def denied(op: str, where: str, detail: str) -> AccessDeniedError:
    """The error for a request of ``op`` on ``where`` that Azure refused (401/403)."""
    action, role = _DATA_ACTIONS.get(op, (None, "admin"))
    if action is None:
        return AccessDeniedError(f"Azure {op} of {where} was refused ({detail}); {_CREDENTIALS_ADVICE}")
    right = f"{action} on {where}"
    return AccessDeniedError(
        f"Azure {op} of {where} was refused ({detail}): these credentials lack {right}; the "
        f"{role} role grants it (`casckpt init --print-grants {role}` prints its role definition "
        f"and assignment). If the role is assigned, {_CREDENTIALS_ADVICE}; role assignments take "
        "a few minutes to apply", right=right)


def _response_error(exc: ace.HttpResponseError, op: str, where: str) -> StorageError | AccessDeniedError:
    status, code = exc.status_code, _code(exc)
    detail = f"{code or 'error'} (HTTP {status})"
    if status in (401, 403):
        return denied(op, where, detail)
    if is_not_found(exc):
        return BlobNotFoundError(f"{where} does not exist (Azure {op}: {detail})")
    if status in _RETRYABLE_STATUS or code in ("ServerBusy", "OperationTimedOut", "InternalError"):
        return RetryableStorageError(f"Azure {op} of {where} failed: {detail}; trying again may succeed")
    return StorageError(f"Azure {op} of {where} failed: {detail}; {_ADVICE.get(code, _DEFAULT_ADVICE)}")


def _code(exc: ace.HttpResponseError) -> str:
    """The storage error code (``x-ms-error-code``), which the storage SDK adds to its errors."""
    return str(getattr(exc, "error_code", None) or "")


def _first_line(exc: BaseException) -> str:
    lines = redact_text(str(exc)).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
