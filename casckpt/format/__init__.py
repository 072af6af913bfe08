"""Byte formats: chunk ids, chunk codecs, packs, manifests and states. No I/O here."""
