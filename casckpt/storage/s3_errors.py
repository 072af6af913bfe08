"""Map boto3/botocore errors into casckpt's storage errors, at the S3 boundary.

Three outcomes: ``BlobNotFoundError`` (no such key), ``RetryableStorageError``
(throttling, 5xx, timeouts, connections dropped mid-transfer, bytes damaged in
transit: trying again may succeed) and ``StorageError`` for everything else
(permissions, missing bucket, bad credentials, bad options: trying again will
not help, so the message says what to check).

Messages name the operation, the object and the S3 error code, and never
carry credentials: only the error code and the server's message text are
used, and both pass through :func:`redact` first.
"""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any

from botocore import exceptions as bce

from casckpt.errors import BlobNotFoundError, RetryableStorageError, StorageError
from casckpt.storage.urls import redact_text

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})

_RETRYABLE_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "SlowDownRead", "SlowDownWrite",
    "RequestTimeout", "RequestTimeoutException", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "PriorRequestNotComplete", "EC2ThrottledException", "OperationAborted",
    "ConditionalRequestConflict", "IncompleteBody", "BadDigest", "XAmzContentSHA256Mismatch",
    "InvalidChunkSizeError", "500", "502", "503", "504",
})
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

_CREDENTIALS_HINT = (
    "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "or the instance/role credentials) and that they belong to this endpoint"
)
_REGION_HINT = "set the bucket's region (AWS_REGION or region=) and the endpoint URL"
_HINTS = {
    "AccessDenied": "check that the credentials may s3:GetObject, s3:PutObject, "
                    "s3:DeleteObject and s3:ListBucket on this bucket and prefix "
                    "(IAM policy, bucket policy, KMS key policy)",
    "AllAccessDisabled": "access to this bucket is disabled; ask its owner",
    "AccountProblem": "the AWS account has a problem; check it in the AWS console",
    "NoSuchBucket": "check the bucket name in the URL, and that the bucket exists "
                    "at this endpoint and region",
    "InvalidAccessKeyId": _CREDENTIALS_HINT,
    "SignatureDoesNotMatch": "check the AWS secret access key and the system clock",
    "InvalidToken": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "ExpiredToken": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "TokenRefreshRequired": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "RequestTimeTooSkewed": "fix the system clock (enable NTP)",
    "PermanentRedirect": _REGION_HINT,
    "AuthorizationHeaderMalformed": _REGION_HINT,
    "IllegalLocationConstraintException": _REGION_HINT,
    "301": _REGION_HINT,
    "InvalidArgument": "check the store's sse=, kms_key_id= and checksum= options; "
                       "the endpoint may not support them",
    "InvalidRequest": "check the store's sse=, kms_key_id= and checksum= options; "
                      "the endpoint may not support them",
    "NotImplemented": "the endpoint does not support this request; try checksum=None "
                      "or no sse= for S3-compatible endpoints",
    "EntityTooLarge": "lower the pack size or the multipart chunk size",
    "EntityTooSmall": "raise multipart_chunksize to at least 5 MiB",
}
_KMS_HINT = "check kms_key_id and that the credentials may use the key (kms:GenerateDataKey, " \
            "kms:Decrypt)"
_DEFAULT_HINT = "look the error code up in the S3 documentation"

_ACCESS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|ANPA)[A-Z0-9]{12,}\b")
_CREDENTIAL_FIELD = re.compile(r"(Credential=|Signature=|X-Amz-Security-Token=)[^\s,&\"']+")


def redact(text: str) -> str:
    """Remove anything that looks like a credential from ``text``."""
    text = _ACCESS_KEY_ID.sub("***", text)
    text = _CREDENTIAL_FIELD.sub(r"\1***", text)
    return redact_text(text)


def map_s3_error(exc: BaseException, op: str, where: str) -> StorageError:
    """Return the casckpt error for ``exc`` raised while doing ``op`` on ``where``.

    Args:
        exc: what boto3, botocore, s3transfer or the socket layer raised.
        op: the operation, e.g. ``"put"`` or ``"get_range"``.
        where: the object or prefix as an ``s3://bucket/key`` URL.
    """
    if isinstance(exc, bce.ClientError):
        return _client_error(exc.response, op, where)
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError,
                        bce.CredentialRetrievalError, bce.NoAuthTokenError,
                        bce.TokenRetrievalError)):
        return StorageError(f"S3 {op} of {where} failed: no usable AWS credentials "
                            f"({type(exc).__name__}); {_CREDENTIALS_HINT}")
    if isinstance(exc, (bce.NoRegionError, bce.InvalidRegionError)):
        return StorageError(f"S3 {op} of {where} failed: {type(exc).__name__}; {_REGION_HINT}")
    if isinstance(exc, bce.SSLError) and "CERTIFICATE" in str(exc).upper():
        return StorageError(f"S3 {op} of {where} failed: the endpoint's TLS certificate was "
                            "rejected; check the endpoint URL and AWS_CA_BUNDLE")
    if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError,
                        bce.ChecksumError, bce.FlexibleChecksumError,
                        ConnectionError, TimeoutError)):
        return RetryableStorageError(
            f"S3 {op} of {where} failed in transit ({type(exc).__name__}: "
            f"{redact(str(exc))}); trying again may succeed"
        )
    if isinstance(exc, concurrent.futures.CancelledError):
        return StorageError(f"S3 {op} of {where} was cancelled: the store is closing")
    return StorageError(f"S3 {op} of {where} failed ({type(exc).__name__}: "
                        f"{redact(str(exc))}); {_DEFAULT_HINT}")


def error_code(response: dict[str, Any]) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a ClientError response."""
    code = str(response.get("Error", {}).get("Code", "") or "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def _client_error(response: dict[str, Any], op: str, where: str) -> StorageError:
    code, status = error_code(response)
    message = redact(str(response.get("Error", {}).get("Message", "") or "")).strip().rstrip(".")
    detail = f"{code or 'error'} (HTTP {status})" + (f": {message}" if message else "")
    if code in _NOT_FOUND_CODES or (status == 404 and not code.startswith("NoSuch")):
        return BlobNotFoundError(f"{where} does not exist (S3 {op}: {detail})")
    if code in _RETRYABLE_CODES or (status in _RETRYABLE_STATUS and code not in _HINTS):
        return RetryableStorageError(f"S3 {op} of {where} failed: {detail}; "
                                     "trying again may succeed")
    hint = _KMS_HINT if code.startswith("KMS") else _HINTS.get(code, _DEFAULT_HINT)
    return StorageError(f"S3 {op} of {where} failed: {detail}; {hint}")
