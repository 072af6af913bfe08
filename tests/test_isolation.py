"""The test suite keeps out of the real home of whoever runs it (conftest's ``isolated_home``).

A store whose blobs or catalog live elsewhere keeps its index cache per host
in ``~/.cache/casckpt/<store id>``; these tests open such stores, in this
process and in a subprocess as the multi-process tests do, and check the
cache landed in the session's temp home and not in the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import casckpt
from casckpt.testing.internals import internals

OPENER = """
import json, sys
import casckpt
from casckpt.testing.internals import internals
with casckpt.open(sys.argv[1], blobs=sys.argv[2]) as store:
    store.commit({"a": 1}, run="r", step=0)
    print(json.dumps({"id": internals(store).catalog.store_id, "cache": str(internals(store).cache.path)}))
"""


def _assert_isolated(cache: Path, store_id: str, homes: Any) -> None:
    assert cache.resolve().is_relative_to(homes.temp.resolve()), cache
    assert cache.parent.name == store_id  # .../casckpt/<store id>/index
    assert not (homes.real / ".cache" / "casckpt" / store_id).exists()


def test_the_session_home_and_cache_are_temporary(isolated_home: Any) -> None:
    assert Path.home() == isolated_home.temp
    assert Path(os.environ["XDG_CACHE_HOME"]).is_relative_to(isolated_home.temp)
    assert not isolated_home.temp.resolve().is_relative_to(isolated_home.real.resolve())


def test_a_store_cache_in_this_process_stays_in_the_temp_home(
        tmp_path: Path, isolated_home: Any) -> None:
    with casckpt.open(tmp_path / "store", blobs=str(tmp_path / "blobs")) as store:
        store.commit({"a": 1}, run="r", step=0)
        _assert_isolated(internals(store).cache.path, internals(store).catalog.store_id, isolated_home)


def test_a_store_cache_in_a_subprocess_stays_in_the_temp_home(
        tmp_path: Path, isolated_home: Any) -> None:
    done = subprocess.run([sys.executable, "-c", OPENER, str(tmp_path / "store"), str(tmp_path / "blobs")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_isolated(Path(found["cache"]), found["id"], isolated_home)
