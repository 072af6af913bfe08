"""One process of the concurrent store creation test: ``python creator.py WORKER``.

Imports casckpt once, then serves rounds read as JSON lines on stdin::

    {"root": PATH, "go": PATH, "threads": M, "how": "open" | "init", "kwargs": {...}}

For each round it prints ``{"ready": true}``, waits until ``go`` exists (the
test creates it once every process is ready, so all start together), then
lets ``M`` threads, released at once by a barrier, each create-or-open the
store at ``root``: ``casckpt.open(root, **kwargs)``, or ``casckpt init root``
through the CLI followed by an open with ``create=False``. Each thread
commits step ``WORKER * M + thread`` of run ``r``, so every commit of the
round is distinct. It then prints ``{"store_ids": [...], "commits": [...],
"errors": [...]}``: the catalog's store id each thread saw, ``[step, version
id]`` of each commit that returned, and any exception as text. Replies go to
the original stdout; what the CLI prints goes to stderr.

``python creator.py --zygote`` imports casckpt and torch once, then forks a
process per round and worker instead (see forkserver.py): ``main([JOB,
WORKER])`` runs one round and prints its reply as its last line of output.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import casckpt
from casckpt.cli.main import app
from casckpt.testing.internals import internals

RUN = "r"


def _open(root: str, how: str, kwargs: dict[str, Any]) -> Any:
    if how == "init":
        app(["init", root], standalone_mode=False)
        return casckpt.open(root, create=False)
    return casckpt.open(root, **kwargs)


def _one(root: str, how: str, kwargs: dict[str, Any], step: int, barrier: threading.Barrier,
         ids: list[str], commits: list[list[Any]], errors: list[str]) -> None:
    barrier.wait()
    try:
        with _open(root, how, kwargs) as store:
            ids.append(internals(store).catalog.store_id)
            version = store.commit({"step": torch.full((64,), float(step))}, run=RUN, step=step)
            commits.append([step, version.id])
    except BaseException:  # noqa: BLE001 - reported to the test, which asserts there are none
        errors.append(traceback.format_exc())


def _round(job: dict[str, Any], worker: int) -> dict[str, Any]:
    """Wait for the round's go file, then run its threads; returns the reply."""
    while not Path(job["go"]).exists():
        time.sleep(0.001)
    threads_n = job["threads"]
    barrier = threading.Barrier(threads_n)
    ids: list[str] = []
    commits: list[list[Any]] = []
    errors: list[str] = []
    threads = [threading.Thread(target=_one, args=(job["root"], job["how"], job["kwargs"],
                                                   worker * threads_n + t, barrier, ids, commits, errors))
               for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"store_ids": ids, "commits": commits, "errors": errors}


def serve(worker: int) -> None:
    """Run rounds until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps({"ready": True}), file=replies, flush=True)
        print(json.dumps(_round(job, worker)), file=replies, flush=True)


def main(args: list[str]) -> int:
    """One round as a forked child of ``--zygote``: ``JOB WORKER``; the reply is its last line."""
    print(json.dumps(_round(json.loads(args[0]), int(args[1]))), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        import forkserver  # beside this file: the script's directory is on sys.path

        sys.exit(forkserver.serve(main))
    serve(int(sys.argv[1]))
