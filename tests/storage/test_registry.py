"""The backend registry: every registered backend passes the shipped conformance suite, and
declaring backends costs ``import casckpt`` no SDK."""

from __future__ import annotations

import subprocess
import sys

import pytest
import test_azure
import test_local
import test_s3

from casckpt.errors import InvalidArgumentError
from casckpt.storage import open_blob_store
from casckpt.storage.registry import Backend, all_backends, backend, schemes
from casckpt.testing.blobstore import BlobStoreConformance

CONFORMANCE = {"file": test_local.TestLocalBlobStore, "s3": test_s3.TestS3BlobStoreConformance,
               "az": test_azure.TestAzureBlobStoreConformance}  # modules imported: not collected twice
"""The conformance suite each registered backend runs (a backend registered without one fails
the test below)."""


def test_every_registered_backend_runs_the_conformance_suite() -> None:
    assert sorted(CONFORMANCE) == schemes()
    for scheme, suite in CONFORMANCE.items():
        assert issubclass(suite, BlobStoreConformance), scheme
        assert backend(scheme).scheme == scheme and isinstance(backend(scheme), Backend)


def test_every_backend_has_what_the_engine_requires() -> None:
    for declared in all_backends():
        caps = declared.capabilities
        assert caps.atomic_replace and caps.consistent_listing, declared.scheme
        assert caps.local_directory != caps.delete_probe, declared.scheme  # gc can learn its rights
        assert (declared.grants is None) == caps.local_directory, declared.scheme


def test_an_unknown_scheme_names_the_forms_that_work() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        open_blob_store("gs://bucket/x")
    for form in ("a directory", "file:///dir", "s3://bucket/prefix", "az://container/prefix"):
        assert form in str(info.value)


def test_import_casckpt_and_opening_a_directory_load_no_cloud_sdk(tmp_path: object) -> None:
    code = ("import sys, casckpt\n"
            f"casckpt.open({str(tmp_path)!r} + '/store').close()\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'azure'))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
