"""A PostgreSQL server that tests and benchmarks crash on purpose (pgserver ships the binaries).

Used by tests/catalog/test_catalog_outage.py and benchmarks/chaos.py: an immediate
shutdown kills every backend without a checkpoint, as a crashed database host
would, and :meth:`CrashablePostgres.start` brings it back on the same data
directory and socket.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path


class CrashablePostgres:
    """A PostgreSQL server of its own, crashed and restarted with pgserver's pg_ctl."""

    def __init__(self, root: Path) -> None:
        # pgserver declares no exports (no __all__, no py.typed stubs for these names)
        from pgserver import _commands, get_server  # type: ignore[attr-defined]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._server = get_server(root, cleanup_mode="stop")
        # the crashes are of processes, not of the machine: skipping fsync keeps each restart's
        # recovery (which otherwise fsyncs the whole data directory first) well under a second
        with open(self._server.pgdata / "postgresql.auto.conf", "a") as conf:
            conf.write("fsync = off\n")
        info = self._server.get_postmaster_info()
        self._socket_dir = info.socket_dir
        self._pg_ctl = _commands.pg_ctl  # type: ignore[attr-defined]  # made at import by a loop

    def new_database(self) -> str:
        """A SQLAlchemy URL of a new, empty database on this server."""
        name = f"casckpt_{uuid.uuid4().hex[:12]}"
        self._server.psql(f"CREATE DATABASE {name};")
        url = self._server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
        return url.replace("/postgres?", f"/{name}?", 1)

    def _ctl(self, *args: str) -> None:
        self._pg_ctl(list(args), pgdata=self._server.pgdata, user=self._server.system_user,
                     timeout=30)

    def crash(self) -> None:
        """Immediate shutdown: backends are killed, no checkpoint; the next start recovers."""
        self._ctl("-w", "-m", "immediate", "stop")

    def start(self) -> None:
        """Start again on the same data directory and socket; returns once it accepts queries."""
        self._ctl("-w", "-o", '-h ""', "-o", f"-k {self._socket_dir}", "-l", str(self._server.log),
                  "start")

    def stop(self) -> None:
        """Stop for good (pgserver's own cleanup only knows the first postmaster)."""
        try:
            self._ctl("-w", "-m", "fast", "stop")
        except Exception:  # noqa: BLE001 - already stopped
            pass
        self._server.cleanup()
