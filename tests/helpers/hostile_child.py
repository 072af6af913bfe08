"""One read of a store, in a process of its own, for tests/test_hostile.py.

Usage::

    python hostile_child.py STORE OP [REF]
    python hostile_child.py --zygote

OP is ``restore`` (REF), ``check``, ``check-read-data`` or ``repair`` (then
``check --read-data``). Prints one JSON
line: ``error`` (the exception's class names, most derived first, or null),
``message``, ``digest`` (restore: BLAKE3 of every restored tensor's bytes in
key order), ``problems`` (check), ``rss_before_kib`` (peak RSS once the store
is open) and ``rss_peak_kib`` (peak RSS at the end). The test runs it under
a timeout, so a read that hangs fails the test instead of the suite.

``--zygote`` imports torch and casckpt once, then forks one such process per
JSON command on stdin (forkserver.py's protocol:
``spawn`` with ``args``, ``stdout``, ``stderr`` -> ``pid``; ``wait`` -> ``status``).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


def digest(state: Any) -> str:
    """BLAKE3 of the bytes of every tensor in ``state`` (nested dicts), keys sorted."""
    import blake3
    import torch

    hasher = blake3.blake3()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in sorted(node):
                hasher.update(str(key).encode())
                walk(node[key])
        elif isinstance(node, torch.Tensor):
            hasher.update(node.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            hasher.update(repr(node).encode())

    walk(state)
    return hasher.hexdigest()


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str]) -> int:
    import casckpt

    store_dir, op = argv[0], argv[1]
    out: dict[str, Any] = {"error": None, "message": "", "digest": None, "problems": []}
    store = casckpt.open(store_dir, create=False, workers=2)
    out["rss_before_kib"] = peak_kib()
    try:
        if op == "restore":
            out["digest"] = digest(store.restore(argv[2]))
        elif op == "repair":  # then a full scrub: is every shard healthy again?
            repaired = store.ops.repair()
            out["message"] = f"repaired ok={repaired.ok}"
            report = store.ops.check(read_data=True)
            out["problems"] = [f"{p.kind} {p.subject}: {p.detail}" for p in report.problems]
        else:
            report = store.ops.check(read_data=op == "check-read-data")
            out["problems"] = [f"{p.kind} {p.subject}: {p.detail}" for p in report.problems]
    except Exception as exc:  # reported to the test, which asserts on its type
        out["error"] = [cls.__name__ for cls in type(exc).__mro__]
        out["message"] = str(exc)
    out["rss_peak_kib"] = peak_kib()
    store.close()
    print(json.dumps(out), flush=True)
    return 0


def zygote() -> int:
    """Serve spawn/wait commands until stdin closes."""
    # preloaded, with what opening a store imports, so that forked children start warm
    import blake3  # noqa: F401
    import forkserver  # beside this file: the script's directory is on sys.path
    import torch  # noqa: F401

    import casckpt.store  # noqa: F401
    from casckpt.catalog import migrate  # noqa: F401

    return forkserver.serve(main)


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == ["--zygote"] else main(sys.argv[1:]))
