"""Map boto3/botocore errors into casckpt's storage errors, at the S3 boundary.

Four outcomes: ``BlobNotFoundError`` (no such key), ``RetryableStorageError``
(throttling, 5xx, timeouts, connections dropped mid-transfer, bytes damaged in
transit: trying again may succeed), ``AccessDeniedError`` (the request was refused
for want of a right) and ``StorageError`` for everything else (missing bucket, bad
credentials, bad options: trying again will not help, so the message says what to check).

A denial is deliberately not a ``StorageError``: code that treats a location it
cannot read as unreachable, or an object it cannot read as missing, must not take a
refused request for either (a store that cannot be listed is not an empty one). Its
message names the IAM action AWS authorizes the request under (AWS's "Actions,
resources, and condition keys for Amazon S3": ListObjectsV2 needs ``s3:ListBucket``,
HeadObject ``s3:GetObject``, the multipart calls ``s3:PutObject``), the resource and
the statement of :func:`casckpt.storage.iam.s3_policy` that grants it.

Messages name the operation, the object and the S3 error code, and never
carry credentials: only the error code and the server's message text are
used, and both pass through :func:`~casckpt.storage.redact.redact_text` first.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

from botocore import exceptions as bce

from casckpt.errors import AccessDeniedError, BlobNotFoundError, RetryableStorageError, StorageError
from casckpt.storage.iam import s3_policy
from casckpt.storage.redact import redact_text

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

# A HEAD request's 403 has no body, so no code: botocore reports the status as the code.
_DENIED_CODES = frozenset({"AccessDenied", "403"})

# casckpt's S3 operation -> the IAM action AWS authorizes its requests under, and the
# role whose printed policy first grants it.
_IAM_ACTIONS = {
    "get": ("s3:GetObject", "reader"),
    "get_range": ("s3:GetObject", "reader"),
    "size": ("s3:GetObject", "reader"),  # HeadObject
    "list": ("s3:ListBucket", "reader"),  # ListObjectsV2
    "put": ("s3:PutObject", "writer"),  # PutObject, or the multipart calls
    "put_file": ("s3:PutObject", "writer"),
    "delete": ("s3:DeleteObject", "admin"),
}

_CREDENTIALS_ADVICE = (
    "check the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
    "or the instance/role credentials) and that they belong to this endpoint"
)
_REGION_ADVICE = "set the bucket's region (AWS_REGION or region=) and the endpoint URL"
_ADVICE = {
    "AccessDenied": "check that the credentials may s3:GetObject, s3:PutObject, "
                    "s3:DeleteObject and s3:ListBucket on this bucket and prefix "
                    "(IAM policy, bucket policy, KMS key policy)",
    "AllAccessDisabled": "access to this bucket is disabled; ask its owner",
    "AccountProblem": "the AWS account has a problem; check it in the AWS console",
    "NoSuchBucket": "check the bucket name in the URL, and that the bucket exists "
                    "at this endpoint and region",
    "InvalidAccessKeyId": _CREDENTIALS_ADVICE,
    "SignatureDoesNotMatch": "check the AWS secret access key and the system clock",
    "InvalidToken": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "ExpiredToken": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "TokenRefreshRequired": "refresh the session credentials (AWS_SESSION_TOKEN)",
    "RequestTimeTooSkewed": "fix the system clock (enable NTP)",
    "PermanentRedirect": _REGION_ADVICE,
    "AuthorizationHeaderMalformed": _REGION_ADVICE,
    "IllegalLocationConstraintException": _REGION_ADVICE,
    "301": _REGION_ADVICE,
    "InvalidArgument": "check the store's sse=, kms_key_id= and checksum= options; "
                       "the endpoint may not support them",
    "InvalidRequest": "check the store's sse=, kms_key_id= and checksum= options; "
                      "the endpoint may not support them",
    "NotImplemented": "the endpoint does not support this request; try checksum=None "
                      "or no sse= for S3-compatible endpoints",
    "EntityTooLarge": "lower the pack size or the multipart chunk size",
    "EntityTooSmall": "raise multipart_chunksize to at least 5 MiB",
}
_KMS_ADVICE = "check kms_key_id and that the credentials may use the key (kms:GenerateDataKey, " \
            "kms:Decrypt)"
_DEFAULT_ADVICE = "look the error code up in the S3 documentation"

def map_s3_error(exc: BaseException, op: str, where: str,
                 location: str | None = None) -> StorageError | AccessDeniedError:
    """Return the casckpt error for ``exc`` raised while doing ``op`` on ``where``.

    Args:
        exc: what boto3, botocore, s3transfer or the socket layer raised.
        op: the operation, e.g. ``"put"`` or ``"get_range"``.
        where: the object or prefix as an ``s3://bucket/key`` URL.
        location: the location's ``s3://bucket/prefix``, whose policy statement a denial
            names (None: the statement is not named).
    """
    if isinstance(exc, bce.ClientError):
        code, status = error_code(exc.response)
        if code in _DENIED_CODES and status in (403, None):
            return denied(op, where, location, _detail(exc.response))
        return _client_error(exc.response, op, where)
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError,
                        bce.CredentialRetrievalError, bce.NoAuthTokenError,
                        bce.TokenRetrievalError)):
        return StorageError(f"S3 {op} of {where} failed: no usable AWS credentials "
                            f"({type(exc).__name__}); {_CREDENTIALS_ADVICE}")
    if isinstance(exc, (bce.NoRegionError, bce.InvalidRegionError)):
        return StorageError(f"S3 {op} of {where} failed: {type(exc).__name__}; {_REGION_ADVICE}")
    if isinstance(exc, bce.SSLError) and "CERTIFICATE" in str(exc).upper():
        return StorageError(f"S3 {op} of {where} failed: the endpoint's TLS certificate was "
                            "rejected; check the endpoint URL and AWS_CA_BUNDLE")
    if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError,
                        bce.ChecksumError, bce.FlexibleChecksumError,
                        ConnectionError, TimeoutError)):
        return RetryableStorageError(
            f"S3 {op} of {where} failed in transit ({type(exc).__name__}: "
            f"{redact_text(str(exc))}); trying again may succeed"
        )
    if isinstance(exc, concurrent.futures.CancelledError):
        return StorageError(f"S3 {op} of {where} was cancelled: the store is closing")
    return StorageError(f"S3 {op} of {where} failed ({type(exc).__name__}: "
                        f"{redact_text(str(exc))}); {_DEFAULT_ADVICE}")


def error_code(response: dict[str, Any]) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of a ClientError response."""
    code = str(response.get("Error", {}).get("Code", "") or "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status if isinstance(status, int) else None


def denied(op: str, where: str, location: str | None, detail: str = "AccessDenied") -> AccessDeniedError:
    """The error for a request of ``op`` on ``where`` (an ``s3://`` URL) that S3 refused.

    ``right`` is the IAM action and the resource (for a listing, with its ``s3:prefix``);
    the message adds the statement of the printed policy that allows it.
    """
    bucket, _, key = where.removeprefix("s3://").partition("/")
    action, role = _IAM_ACTIONS.get(op, (None, "admin"))
    if action is None:  # not one of the blob store's operations: name what is known
        return AccessDeniedError(f"S3 {op} of {where} was refused: {detail}; {_ADVICE['AccessDenied']}")
    if action == "s3:ListBucket":
        right = f"s3:ListBucket on arn:aws:s3:::{bucket} with s3:prefix {key!r}"
    else:
        right = f"{action} on arn:aws:s3:::{bucket}/{key}"
    grant = f"`casckpt init --print-grants {role}` prints the policy that grants it"
    if location is not None:
        statement = next(st for st in s3_policy(role, [location])["Statement"] if action in st["Action"])
        grant = (f"statement {statement['Sid']} of the {role} role's policy grants it "
                 f"(`casckpt init --print-grants {role}` prints it all): "
                 f"{json.dumps(statement, separators=(',', ':'))}")
    return AccessDeniedError(
        f"S3 {op} of {where} was refused ({detail}): these credentials lack {right}; {grant}. "
        "If the policy is attached, look for a bucket policy, SCP or KMS key policy that denies it",
        right=right)


def _detail(response: dict[str, Any]) -> str:
    code, status = error_code(response)
    message = redact_text(str(response.get("Error", {}).get("Message", "") or "")).strip().rstrip(".")
    return f"{code or 'error'} (HTTP {status})" + (f": {message}" if message else "")


def _client_error(response: dict[str, Any], op: str, where: str) -> StorageError:
    code, status = error_code(response)
    detail = _detail(response)
    if code in _NOT_FOUND_CODES or (status == 404 and not code.startswith("NoSuch")):
        return BlobNotFoundError(f"{where} does not exist (S3 {op}: {detail})")
    if code in _RETRYABLE_CODES or (status in _RETRYABLE_STATUS and code not in _ADVICE):
        return RetryableStorageError(f"S3 {op} of {where} failed: {detail}; "
                                     "trying again may succeed")
    advice = _KMS_ADVICE if code.startswith("KMS") else _ADVICE.get(code, _DEFAULT_ADVICE)
    return StorageError(f"S3 {op} of {where} failed: {detail}; {advice}")
