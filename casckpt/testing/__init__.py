"""Test support for casckpt's backends, third-party ones, and tools.

- :class:`BlobStoreConformance`: the suite every BlobStore passes. Using it
  needs pytest (install casckpt with the ``test`` extra:
  ``pip install 'casckpt[test]'``); it is imported on first use, so the rest
  of this package works without pytest.
- :func:`internals`: a view of an open store's components, for tests and
  tools (unstable; see :mod:`casckpt.testing.internals`).

The rest of casckpt never imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from casckpt.testing.internals import CommitterStats, StoreInternals, internals

if TYPE_CHECKING:
    from casckpt.testing.blobstore import BlobStoreConformance

__all__ = ["BlobStoreConformance", "CommitterStats", "StoreInternals", "internals"]


def __getattr__(name: str) -> Any:
    if name == "BlobStoreConformance":  # imports pytest
        from casckpt.testing.blobstore import BlobStoreConformance

        return BlobStoreConformance
    raise AttributeError(f"module 'casckpt.testing' has no attribute {name!r}")
