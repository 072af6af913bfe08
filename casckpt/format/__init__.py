"""Byte formats: chunk ids, chunk codecs, packs, manifests and state trees. No I/O here."""
