"""examples/quickstart.py runs end to end: crash, resume, bit-identical continuation.

The script runs as ``python examples/quickstart.py`` would, forked warm (the ``forked_python``
fixture); it starts its own crashing child with ``sys.executable``, a fresh interpreter."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from doubles import ForkedPython

import casckpt

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "examples" / "quickstart.py"


def _quickstart_module():  # for its constants; main() only runs as a script
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_resumes_bit_identically(tmp_path: Path, forked_python: ForkedPython) -> None:
    store_path = tmp_path / "store"
    path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    proc = forked_python.run(
        [str(QUICKSTART), "--store", str(store_path)],
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "continuation is bit-identical to the uninterrupted run" in proc.stdout, output
    assert "killed at step" in proc.stdout, output
    assert "DIFFERS" not in proc.stdout, output

    qs = _quickstart_module()
    with casckpt.open(store_path, create=False) as store:
        steps = [v.step for v in store.log(qs.RUN)]
        assert steps == list(range(qs.STEPS, 0, -qs.EVERY))  # newest first, none lost
        assert store.ops.check().ok
