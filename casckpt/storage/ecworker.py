"""The erasure-coding worker process: encodes pack files into shard files, off the committer's GIL.

pyeclib holds the GIL while it encodes (~150 ms per 64 MiB pack), which
stalls the hashing and compression threads of a commit; so
:class:`~casckpt.storage.ecpool.EncodePool` runs this module as a separate
process (``python -m casckpt.storage.ecworker``: a fresh interpreter, never
a fork of a process holding torch's threads, and never the user's main
module) and hands it one pack at a time.

Protocol: one JSON object per line. The worker first writes
``{"ready": PID}`` to its standard output, then answers each request read
from its standard input, in order::

    request  {"pack": PATH, "id": PACK_ID, "size": BYTES, "k": K, "m": M,
              "algorithm": NAME, "out": [PATH of shard 0, ..., PATH of shard K+M-1]}
    reply    {"stripe": S, "offset": O, "shards": [[INDEX, BYTES, CHECKSUM], ...]}
         or  {"error": MESSAGE, "kind": "full" | "invalid" | "storage",
              "location": WHERE, "needed": BYTES}

Each shard file gets exactly the bytes :meth:`ErasureCode.shards` gives in
any process (header, then fragment); files are created exclusively and not
fsynced (the blob store makes them durable as it stores them). A failed
request removes the files it created. Its memory is kept from one request
to the next and given back after a pause (see :data:`MALLOC_ENV`). The worker
exits at the end of its input -- when the pool closes it, or when the process that started it dies
-- and ignores SIGINT, so Ctrl-C reaches only that process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from casckpt.errors import CasckptError, InvalidArgumentError, StorageError, StorageFullError
from casckpt.storage.erasure import ErasureCode
from casckpt.storage.local import full_error

IDLE_TRIM_S = 2.0
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""The worker's allocator settings (glibc). By default glibc maps each large allocation
afresh and unmaps it when freed, so every encode paid for faulting in and zeroing
~256 MiB of new pages per 64 MiB pack: more CPU than the encode itself (measured:
0.45 -> 0.17 CPU-s per pack). On the heap, never trimmed while busy, the pages are
reused from one pack to the next; they are given back after a pause (see :func:`serve`)."""
_ELSEWHERE = "open the store with a cache directory on a larger disk (cache=)"


def encode(request: dict[str, Any], codes: dict[tuple[int, int, str], ErasureCode]) -> dict[str, Any]:
    """Answer one request (see the module docstring); raises what went wrong."""
    k, m, algorithm = int(request["k"]), int(request["m"]), str(request["algorithm"])
    code = codes.get((k, m, algorithm))
    if code is None:
        code = codes[(k, m, algorithm)] = ErasureCode(k, m, algorithm)
    pack, size, out = Path(request["pack"]), int(request["size"]), [Path(p) for p in request["out"]]
    if len(out) != code.k + code.m:
        raise InvalidArgumentError(f"{len(out)} shard paths for {code.k}+{code.m} shards")
    try:
        with open(pack, "rb") as f:
            data = f.read(size + 1)
    except OSError as exc:
        raise StorageError(f"cannot read the staging pack {pack}: {exc}") from exc
    if len(data) != size:
        raise StorageError(f"the staging pack {pack} holds {len(data)} bytes, not {size}")
    stripe, offset, shards = code.shards(str(request["id"]), data, range(len(out)))
    del data  # fragments hold every byte now
    written: list[list[Any]] = []
    created: list[Path] = []
    try:
        for shard in shards:
            path = out[shard.index]
            try:
                with open(path, "xb") as f:
                    created.append(path)
                    f.write(shard.header)
                    f.write(shard.fragment)
            except OSError as exc:
                raise full_error(exc, "a staging shard", str(path.parent), shard.size,
                                 elsewhere=_ELSEWHERE) from exc
            written.append([shard.index, shard.size, shard.checksum])
    except BaseException:
        for path in created:
            with suppress(OSError):
                path.unlink()
        raise
    return {"stripe": stripe, "offset": offset, "shards": written}


def _failure(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, StorageFullError):
        return {"error": str(exc), "kind": "full", "location": exc.location, "needed": exc.needed}
    if isinstance(exc, InvalidArgumentError):
        return {"error": str(exc), "kind": "invalid"}
    if isinstance(exc, CasckptError):
        return {"error": str(exc), "kind": "storage"}
    return {"error": f"{type(exc).__name__}: {exc}", "kind": "storage"}


def serve(requests: IO[str], replies: IO[str], idle_s: float = IDLE_TRIM_S) -> None:
    """Answer requests until the end of ``requests``; after ``idle_s`` without one, give the
    memory the last ones used back to the system (they come in bursts, one per commit)."""
    codes: dict[tuple[int, int, str], ErasureCode] = {}
    trim = _malloc_trim()
    trimmed = True

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    send({"ready": os.getpid()})
    while True:
        # one request is in flight at a time, so nothing waits in ``requests``' buffer
        if not trimmed and not select.select([requests], [], [], idle_s)[0]:
            trim()
            trimmed = True
            continue
        line = requests.readline()
        if not line:
            return
        trimmed = False
        try:
            reply = encode(json.loads(line), codes)
        except Exception as exc:  # every failure goes back to the caller, typed by kind
            reply = _failure(exc)
        send(reply)


def _malloc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)``, or nothing where there is none."""
    import ctypes  # here: the pool's parent imports this module for its constants only

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def main() -> None:
    """Serve on standard input and output; anything else written to fd 1 goes to stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        serve(sys.stdin, replies)
    except BrokenPipeError:  # the pool's process is gone: nobody to answer
        pass


if __name__ == "__main__":
    main()
