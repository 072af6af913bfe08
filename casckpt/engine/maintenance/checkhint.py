"""``check --read-data``'s verdict on change hints: each fingerprint a commit recorded for a
tensor it reused on its caller's hint (:mod:`casckpt.engine.write.hint`) is recomputed from
the stored chunks (:mod:`casckpt.format.hintsample`); a mismatch is a ``hint`` problem: the
hint was wrong, and the version holds its parent's bytes for that tensor. Nothing is changed.

Chunks are read through the reader (verified; deltas decoded). Fingerprints are verified in
groups whose samples take at most :data:`SAMPLES` bytes; within a group each chunk is read
once, however many versions sample it (a frozen tensor's chunks serve every version), at most
:data:`READ` bytes of chunks at a time, and only the sampled bytes are kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from casckpt.engine.context import EngineContext
from casckpt.engine.maintenance.checkmeta import Findings
from casckpt.engine.read.reader import read_chunks
from casckpt.errors import IntegrityError, MissingDataError, StoreUnavailableError
from casckpt.format.hintsample import fingerprint, sample_spans
from casckpt.format.manifest import ExtentEntry, Manifest

SAMPLES = 256 << 20
"""Sampled bytes held at once: the fingerprints of a group are verified together."""
READ = 64 << 20
"""Raw bytes of chunks read at once."""


@dataclass(slots=True)
class _Sample:
    """One recorded fingerprint, and the bytes of its spans as they are read."""

    version_id: str
    manifest: Manifest
    path: str
    recorded: bytes
    extent: ExtentEntry
    spans: list[tuple[int, int]]
    chunk_spans: list[tuple[int, int]]  # the extent's chunks' byte spans, made once
    pieces: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (span, chunk) -> bytes
    unread: str | None = None  # why it could not be verified; "" when the packs report it

    @property
    def label(self) -> str:
        return f"{self.manifest.run}@{self.manifest.step}:{self.path}"

    def take(self, index: int, chunk: bytearray) -> None:
        """Keep what the sampled spans hold of the extent's chunk ``index`` (its raw bytes)."""
        first, last = self.chunk_spans[index]
        for k, (start, end) in enumerate(self.spans):
            if start < last and end > first:
                self.pieces[k, index] = bytes(chunk[max(start, first) - first : min(end, last) - first])

    def stored(self) -> list[bytes]:
        return [b"".join(self.pieces[k, i] for i in self.extent.covering(start, end))
                for k, (start, end) in enumerate(self.spans)]


def check_hints(ctx: EngineContext, found: Findings) -> None:
    """Verify every recorded fingerprint of ``found``'s verified manifests (module docstring)."""
    group: list[_Sample] = []
    held = 0
    for sample in _samples(found.manifests):
        group.append(sample)
        held += sum(end - start for start, end in sample.spans)
        if held >= SAMPLES:
            _verify(ctx, group, found)
            group, held = [], 0
    if group:
        _verify(ctx, group, found)


def _samples(manifests: list[tuple[str, Manifest]]) -> Iterator[_Sample]:
    for version_id, manifest in manifests:
        if not manifest.hinted:
            continue
        by_path = {t.path: t for t in manifest.tensors}
        for path, recorded in sorted(manifest.hinted.items()):
            extent = manifest.extents[by_path[path].extent]  # decoding checked it names one
            yield _Sample(version_id, manifest, path, recorded, extent,
                          sample_spans(manifest.run, manifest.step, path, extent.nbytes),
                          list(extent.spans()))


def _verify(ctx: EngineContext, group: list[_Sample], found: Findings) -> None:
    users: dict[bytes, list[tuple[_Sample, int]]] = {}  # chunk id -> (sample, index in its extent)
    for sample in group:
        for i in sorted({i for start, end in sample.spans for i in sample.extent.covering(start, end)}):
            users.setdefault(sample.extent.chunks[i], []).append((sample, i))
    _sized(ctx, users)
    batch: list[bytes] = []
    size = 0
    for cid, needing in users.items():
        if batch and size + _length(needing[0]) > READ:
            _read(ctx, batch, users)
            batch, size = [], 0
        batch.append(cid)
        size += _length(needing[0])
    if batch:
        _read(ctx, batch, users)
    for sample in group:
        if sample.unread:
            found.add("hint", sample.label, f"the change hint could not be verified: {sample.unread}; "
                      "check again")
        elif sample.unread is None and fingerprint(ctx.crypto.chunk_id, sample.stored()) != sample.recorded:
            found.add("hint", sample.label, _wrong(sample))


def _sized(ctx: EngineContext, users: dict[bytes, list[tuple[_Sample, int]]]) -> None:
    """Drop from ``users`` the chunks the catalog does not hold, or holds at another length
    than the manifest states, leaving their samples unverified: nothing is allocated from a
    damaged manifest's lengths."""
    rows = ctx.catalog.find_chunks([cid.hex() for cid in users], live_only=False)
    for cid in list(users):
        row = rows.get(cid.hex())
        claimed = _length(users[cid][0])
        if row is None or row.raw_len != claimed:
            why = (f"its chunk {cid.hex()[:12]} is not in the catalog" if row is None else
                   f"its manifest says chunk {cid.hex()[:12]} holds {claimed} bytes, the catalog "
                   f"{row.raw_len}: the manifest is damaged")
            for sample, _ in users.pop(cid):
                sample.unread = sample.unread or why


def _length(user: tuple[_Sample, int]) -> int:
    start, end = user[0].chunk_spans[user[1]]
    return end - start


def _read(ctx: EngineContext, batch: list[bytes], users: dict[bytes, list[tuple[_Sample, int]]]) -> None:
    """Read ``batch``'s chunks and hand each to the samples that need it; a chunk that cannot
    be read leaves its samples unverified (one found corrupt or missing is the packs' finding)."""
    raw = {cid: bytearray(_length(users[cid][0])) for cid in batch}

    def read(ids: list[bytes]) -> None:
        read_chunks(ctx, {cid: [memoryview(raw[cid])] for cid in ids},
                    lambda cid: f"chunk {cid.hex()} of a hinted tensor", heal=False)

    try:
        read(batch)
        done = batch
    except StoreUnavailableError as exc:
        for cid in batch:
            for sample, _ in users[cid]:
                sample.unread = str(exc)
        return
    except (IntegrityError, MissingDataError):
        done = []
        for cid in batch:  # find which ones
            try:
                read([cid])
                done.append(cid)
            except (IntegrityError, MissingDataError):
                for sample, _ in users[cid]:
                    sample.unread = sample.unread or ""
    for cid in done:
        for sample, index in users[cid]:
            sample.take(index, raw[cid])


def _wrong(sample: _Sample) -> str:
    m = sample.manifest
    return (f"a change hint was wrong for tensor {sample.path!r} in version {sample.version_id[:12]} "
            f"(run {m.run!r}, step {m.step}): the commit reused the chunks of its parent "
            f"{(m.parent or 'none')[:12]} for it unread, but the bytes it was handed differed (their "
            "sampled fingerprint does not match), so the version restores the parent's bytes for "
            "it. Commit the state again without unchanged=/trust_versions= for that tensor (delete "
            "this version if nothing should restore it); check changed nothing")
