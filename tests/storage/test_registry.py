"""The backend registry: every registered backend passes the shipped conformance suite, and
declaring backends costs ``import casckpt`` no SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


PLUGIN = '''
from casckpt.storage.local import BACKEND as LOCAL
from casckpt.storage.registry import Backend, Capabilities

WEAK = Backend(scheme="weak", example="weak://x", open=LOCAL.open,
               capabilities=Capabilities(consistent_listing=False))
ELSE = Backend(scheme="other", example="other://x", open=LOCAL.open, capabilities=Capabilities())
'''
CHECK = '''
import sys
from casckpt.errors import InvalidArgumentError
from casckpt.storage import open_blob_store
from casckpt.storage.registry import schemes
assert {"weak", "wrong", "file", "s3", "az"} <= set(schemes()), schemes()
for url, words in (("weak://x", "lacks consistent_listing"), ("wrong://x", "not the casckpt")):
    try:
        open_blob_store(url)
    except InvalidArgumentError as exc:
        assert words in str(exc), exc
    else:
        sys.exit(url + " opened")
'''


def test_a_plugin_backend_registers_by_entry_point_and_is_held_to_the_required_capabilities(
        tmp_path: Path) -> None:
    """A package outside casckpt adds schemes the way casckpt declares its own; one lacking a
    capability the engine needs, or naming something that is not a Backend, is refused."""
    (tmp_path / "weakplugin.py").write_text(PLUGIN)
    meta = tmp_path / "weakplugin-1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: weakplugin\nVersion: 1.0\n")
    (meta / "entry_points.txt").write_text(
        "[casckpt.backends]\nweak = weakplugin:WEAK\nwrong = weakplugin:ELSE\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr + done.stdout


def test_a_bad_s3_option_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    import casckpt
    from casckpt.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError) as info:
        casckpt.open(tmp_path / "store", blobs="s3://bucket/x", s3={"regoin": "eu-west-1"})
    assert "[s3] has no option 'regoin'" in str(info.value) and "endpoint_url" in str(info.value)
    assert not (tmp_path / "store").exists()
