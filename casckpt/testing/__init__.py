"""Test suites that casckpt's backends, and third-party ones, must pass.

Importing this package needs pytest (install casckpt with the ``test`` extra:
``pip install 'casckpt[test]'``); the rest of casckpt never imports it.
"""

from casckpt.testing.blobstore import BlobStoreConformance

__all__ = ["BlobStoreConformance"]
