"""Blob stores: where packs and manifests live. No SQL, no LMDB here."""

from casckpt.storage.base import BlobInfo, BlobStore, check_key
from casckpt.storage.local import LocalBlobStore

__all__ = ["BlobInfo", "BlobStore", "LocalBlobStore", "check_key"]
