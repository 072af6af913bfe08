"""A store belongs to the process that opened it. A forked child inherits its catalog
connections, thread pools and LMDB environment but can use none of them: a commit there hung
on the pools' dead threads. Every use in the child is refused with a typed error before it
touches any of them; the child can open the store again and commit; closing the inherited
handle in the child releases nothing of the parent's, and the parent goes on committing and
restoring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import casckpt
from casckpt.errors import ForkedStoreError

RUN = "parent"


def _in_child(body: Callable[[], dict[str, Any]], timeout_s: float = 60.0) -> dict[str, Any]:
    """Run ``body`` in a forked child and return what it reported (a child that hangs is
    killed and fails the test)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit hooks
        os.close(read)
        try:
            said = body()
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            said = {"crashed": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(said).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child hung for {timeout_s} s")
        time.sleep(0.05)
    with os.fdopen(read, "rb") as pipe:
        report: dict[str, Any] = json.loads(pipe.read() or b"{}")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0, report
    assert "crashed" not in report, report["crashed"]
    return report


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except ForkedStoreError as exc:
        return str(exc)
    return "not refused"


def test_a_forked_child_is_refused_every_use_opens_its_own_and_the_parent_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "store"
    weights = torch.arange(4096, dtype=torch.float32)
    store = casckpt.open(root, cache=tmp_path / "cache")
    store.commit({"w": weights, "step": 1}, run=RUN, step=1)
    handle = store.commit({"w": weights + 1, "step": 2}, run=RUN, step=2, block=False)
    handle.wait()  # the worker thread stays, waiting for the next commit
    reader, writer = store.dcp_reader(f"{RUN}@1"), store.dcp_writer(run="dcp", step=1)
    state: dict[str, Any] = {"w": torch.full((4096,), 7.0), "step": 1}  # no torch work in the child
    into = {"w": torch.zeros(4096)}

    def child() -> dict[str, Any]:
        refusals = {
            "commit": _refused(lambda: store.commit(state, run="child", step=1)),
            "background commit": _refused(lambda: store.commit(state, run="child", step=1, block=False)),
            "restore": _refused(lambda: store.restore(f"{RUN}@1")),
            "log": _refused(lambda: store.log(RUN)),
            "show": _refused(lambda: store.show(f"{RUN}@1")),
            "wait_commits": _refused(store.wait_commits),
            "a parent's commit handle": _refused(handle.wait),
            "a parent's commit handle, polled": _refused(handle.done),
            "a DCP reader made before the fork": _refused(lambda: reader.reset(None)),
            "a DCP writer made before the fork": _refused(lambda: writer.reset(None)),
        }
        try:  # dcp wraps a storage error in its own
            dcp.load(into, storage_reader=reader)
            refusals["dcp.load"] = "not refused"
        except BaseException as exc:  # noqa: BLE001 - dcp raises a BaseException of its own
            refusals["dcp.load"] = f"{type(exc).__name__}: {exc}"
        store.close()  # the parent's to release: a no-op here
        with casckpt.open(root, create=False, cache=tmp_path / "child-cache") as own:
            own.commit(state, run="child", step=1)
            back = own.restore("child@1")
        return {"refusals": refusals, "restored": bool(torch.equal(back["w"], state["w"]))}

    report = _in_child(child)
    for what, message in report["refusals"].items():
        assert str(os.getpid()) in message and "Open the store again in this process" in message, \
            f"{what}: {message}"
    assert report["restored"]

    # the parent's pools, catalog and cache still work, and it sees the child's version
    store.commit({"w": weights + 2, "step": 3}, run=RUN, step=3)
    assert torch.equal(store.restore(f"{RUN}@1")["w"], weights)
    assert torch.equal(store.restore(f"{RUN}@3")["w"], weights + 2)
    assert torch.equal(store.restore("child@1")["w"], torch.full((4096,), 7.0))
    store.close()


def test_a_forked_child_that_exits_normally_leaves_the_parents_commits_to_the_parent(tmp_path: Path) -> None:
    """The commit worker's exit hook runs in a child that exits through the interpreter (not
    os._exit): it waited there for the parent's commit worker, forever."""
    script = tmp_path / "child_exits.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time, torch, casckpt
        store = casckpt.open({str(tmp_path / "store")!r}, cache={str(tmp_path / "cache")!r})
        store.commit({{"w": torch.arange(64, dtype=torch.float32)}}, run="r", step=1, block=False).wait()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the interpreter's exit hooks run here
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                sys.exit("the child hung at exit")
            time.sleep(0.05)
        store.commit({{"w": torch.arange(64, dtype=torch.float32) + 1}}, run="r", step=2)
        store.close()
        print("parent done")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0 and "parent done" in done.stdout, done.stderr
