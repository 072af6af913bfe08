"""A copying process for the kill tests of ``Store.copy`` (tests/engine/copying/test_copy.py).

Usage::

    python copy_child.py SOURCE DEST REF POINT N [DEST_KEY_FILE]

Opens both stores with small chunks and packs and copies REF from SOURCE to DEST, having
wrapped one step of the copy so that the process SIGKILLs itself on the N-th call of POINT:

- ``batch``: after a pack of the copy's chunks was stored and recorded at the destination
  (on an upload thread, while the copy reads and packs the next ones);
- ``manifest``: after a version's manifest object was written, before it is published;
- ``recommit``: a copy across keys (DEST_KEY_FILE given), after a version's chunks were
  written at the destination, before the commit publishes it;
- ``tag``: after a version was published with a tag, before the tag's record object is
  written on the destination's locations.

If that call never happens the process exits with status 3, so a test whose kill point is
not reached fails instead of passing vacuously.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import casckpt
from casckpt.engine.copying import copy as copy_engine
from casckpt.engine.copying import copypipe
from casckpt.engine.versions import records
from casckpt.engine.write import commit as commit_engine

CHUNK_SIZE = 4096
PACK_SIZE = 16 << 10


def main(source: str, dest: str, ref: str, point: str, nth: int, key_file: str | None) -> None:
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1
        if calls == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "batch":
        real_record = copypipe.record_pack

        def record(*args: Any, **kwargs: Any) -> Any:  # on an upload thread: kill -9 kills them all
            done = real_record(*args, **kwargs)
            count()
            return done

        copypipe.record_pack = record  # type: ignore[assignment]
    elif point == "tag":
        real_record_tag, real_record_tag_on = records.record_tag, records.record_tag_on

        def record_tag(*args: Any, **kwargs: Any) -> Any:
            count()
            return real_record_tag(*args, **kwargs)

        def record_tag_on(*args: Any, **kwargs: Any) -> Any:
            count()
            return real_record_tag_on(*args, **kwargs)

        records.record_tag = record_tag  # type: ignore[assignment]
        records.record_tag_on = record_tag_on  # type: ignore[assignment]
    elif point == "recommit":
        real_commit_publish = commit_engine.publish

        def commit_publish(*args: Any, **kwargs: Any) -> Any:
            count()
            return real_commit_publish(*args, **kwargs)

        commit_engine.publish = commit_publish  # type: ignore[assignment]
    else:
        real_publish = copy_engine._publish

        def publish(*args: Any, **kwargs: Any) -> Any:
            count()
            return real_publish(*args, **kwargs)

        copy_engine._publish = publish  # type: ignore[assignment]
    opts = {"chunk_size": CHUNK_SIZE, "pack_size": PACK_SIZE}
    with casckpt.open(source, create=False, **opts) as src, \
            casckpt.open(dest, key_file=key_file, **opts) as dst:
        src.copy(ref, to=dst)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
         sys.argv[6] if len(sys.argv) > 6 else None)
