"""The crash-test committing process (crash_child.py), with kill points for erasure-coded shards.

Usage is that of crash_child.py (``STORE SEED STEPS DONE_FILE [POINT WHEN STEP N]``); the
store must already exist (its config file sets the blob
locations and redundancy). Extra kill point:

``shard.put``  an erasure-coded shard (``packs/<xx>/<id>.s<i>``) is being written (an encoding
              worker made it as a staging file; the location moves it into place).

tests/storage/test_redundancy.py runs it forked from the warm server (the ``forked_python``
fixture).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "casckpt_tests_ec_crash_base", Path(__file__).resolve().parent / "crash_child.py")
assert _spec is not None and _spec.loader is not None
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
_base_targets = base._targets


def _is_shard(args: tuple[Any, ...]) -> bool:
    key = str(args[0])
    return key.startswith("packs/") and ".s" in key


def _targets() -> dict[str, tuple[type, str, Any]]:
    from casckpt.storage import LocalBlobStore

    targets: dict[str, tuple[type, str, Any]] = _base_targets()
    targets["shard.put"] = (LocalBlobStore, "put_file", _is_shard)
    return targets


base._targets = _targets  # crash_child._arm looks the table up at call time

if __name__ == "__main__":
    sys.exit(base.main(sys.argv[1:]))
