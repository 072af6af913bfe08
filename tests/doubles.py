"""Test doubles shared by several test modules (tests/ is on sys.path, see conftest.py).

- :class:`WriteHookStore`: a local blob store whose writes pass through a hook
  first (to hold them or make them fail); reads go straight through.
- :class:`Zygote`: the client of a helper script's ``--zygote`` server, which
  forks warm children (torch imported once) on request.
- :class:`ForkedPython`: ``python`` command lines run by the generic fork server
  (tests/helpers/forkserver.py), behind the ``forked_python`` fixture.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from casckpt.storage import BlobInfo, LocalBlobStore


class WriteHookStore:
    """A LocalBlobStore on ``root`` whose ``put`` and ``put_file`` call :meth:`before_write` first."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalBlobStore(root)
        self.url = self.inner.url

    def before_write(self, key: str) -> None:
        """Override: raise to refuse the write, block to hold it."""

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.before_write(key)
        self.inner.put(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self.before_write(key)
        self.inner.put_file(key, path)

    def get(self, key: str, *, max_size: int | None = None) -> bytes:
        return self.inner.get(key, max_size=max_size)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        return self.inner.read_into(key, offset, buffers)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


class Zygote:
    """Talks JSON lines to ``script --zygote``; the environment defaults to ours minus CASCKPT_*."""

    def __init__(self, script: Path, env: Mapping[str, str] | None = None) -> None:
        if env is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CASCKPT_")}
        self.proc = subprocess.Popen([sys.executable, str(script), "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=dict(env))

    def ask(self, cmd: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(cmd)
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class ForkedPython:
    """Runs ``python`` command lines in children of one warm fork server (see the module doc)."""

    SERVER = Path(__file__).parent / "helpers" / "forkserver.py"

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.server = Zygote(self.SERVER)
        self.count = 0

    def run(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | str | None = None,
            input: str | bytes | None = None, timeout: float = 120,  # noqa: A002 - subprocess's name
            text: bool = True) -> subprocess.CompletedProcess[Any]:
        """Like ``subprocess.run([sys.executable, *args], capture_output=True, ...)``: the exit
        status (negative for a signal), stdout and stderr; ``subprocess.TimeoutExpired`` (the child
        killed) after ``timeout`` seconds."""
        self.count += 1
        files = {name: self.scratch / f"{self.count}.{name}" for name in ("stdin", "stdout", "stderr")}
        if input is not None:
            files["stdin"].write_bytes(input.encode() if isinstance(input, str) else input)
        cmd = {"op": "spawn", "args": list(args), "env": dict(os.environ if env is None else env),
               "cwd": str(cwd) if cwd is not None else os.getcwd(),
               "stdin": str(files["stdin"]) if input is not None else None,
               "stdout": str(files["stdout"]), "stderr": str(files["stderr"])}
        pid = self.server.ask(cmd, 60)["pid"]
        try:
            status = self.server.ask({"op": "wait", "pid": pid}, timeout)["status"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            assert self.server.proc.stdout is not None
            self.server.proc.stdout.readline()  # the wait's answer, now that the child is gone
            raise subprocess.TimeoutExpired(args, timeout) from None
        out, err = (files[name].read_bytes() for name in ("stdout", "stderr"))
        for path in files.values():
            path.unlink(missing_ok=True)
        if text:
            return subprocess.CompletedProcess(args, status, out.decode(), err.decode())
        return subprocess.CompletedProcess(args, status, out, err)

    def close(self) -> None:
        self.server.close()


def empty_postgres_catalog(url: str) -> None:
    """Drop every table of the PostgreSQL database at ``url`` (a catalog lost, the database kept)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("DROP SCHEMA public CASCADE"))
            conn.execute(sqlalchemy.text("CREATE SCHEMA public"))
    finally:
        engine.dispose()
