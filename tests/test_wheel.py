"""The built wheel works on its own: migrations shipped inside it, nothing read from the checkout.

The wheel is built from the repository, installed (without dependencies) into
a fresh virtual environment, and exercised from a neutral directory. The new
environment sees this environment's site-packages through a ``.pth`` file, for
torch and the other dependencies; a path listed in a ``.pth`` file is not a
site directory, so the editable install's own ``.pth`` (which would put the
checkout on ``sys.path``) is not processed there, and the script checks that
the checkout is indeed invisible.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
from pathlib import Path

venv, repo, expected = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve(), json.loads(sys.argv[3])
assert str(repo) not in [str(Path(p).resolve()) for p in sys.path if p], sys.path

import numpy as np
import torch

import casckpt
from casckpt.catalog.migrate import head_revision, migrations_dir

package = Path(casckpt.__file__).resolve().parent
assert package.is_relative_to(venv), f"casckpt imported from {package}, not the wheel in {venv}"
assert migrations_dir().resolve() == package / "_migrations", migrations_dir()
assert head_revision() == expected["head"], (head_revision(), expected["head"])
assert casckpt.__version__ == expected["version"]

state = {"w": torch.randn(3000, generator=torch.Generator().manual_seed(0)),
         "a": np.arange(10, dtype=np.int16), "step": 1}
with casckpt.open("store", chunk_size=4096) as store:
    store.commit(state, run="wheel", step=1, metrics={"loss": 0.5})
    got = store.restore("wheel@latest")
    assert torch.equal(got["w"], state["w"]) and np.array_equal(got["a"], state["a"])
    assert got["step"] == 1
    assert store.ops.check(read_data=True).ok
print(json.dumps({"package": str(package), "migrations": str(migrations_dir())}))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _clean_env() -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("CASCKPT_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _build_wheel(out: Path) -> Path:
    try:
        import build  # noqa: F401 - only probing that the frontend is installed
        cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(REPO)]
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(REPO)]
    _run(cmd, cwd=out.parent)
    wheels = list(out.glob("casckpt-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _head_revision_of_checkout() -> str:
    scripts = sorted(p.name for p in (REPO / "migrations" / "versions").glob("[0-9]*.py"))
    return scripts[-1].split("_", 1)[0]


def test_wheel_installs_and_works_outside_the_checkout(tmp_path: Path) -> None:
    import casckpt

    wheel = _build_wheel(tmp_path / "dist")

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "casckpt = casckpt.cli.main:main" in zf.read(entry_points).decode()
    shipped = {n.split("/")[-1] for n in names if n.startswith("casckpt/_migrations/versions/")}
    in_repo = {p.name for p in (REPO / "migrations" / "versions").glob("*.py")}
    assert in_repo and in_repo <= shipped, f"migrations missing from the wheel: {in_repo - shipped}"
    assert {"casckpt/__init__.py", "casckpt/py.typed", "casckpt/_migrations/env.py"} <= names
    assert not any(n.startswith("tests/") or "__pycache__" in n for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp_path).strip())
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "outer-site-packages.pth").write_text("".join(f"{p}\n" for p in deps))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp_path)

    work = tmp_path / "work"
    work.mkdir()
    expected = {"head": _head_revision_of_checkout(), "version": casckpt.__version__}
    out = _run([str(python), "-c", SCRIPT, str(venv), str(REPO), json.dumps(expected)],
               cwd=work, env=_clean_env())
    found = json.loads(out.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(venv.resolve())
    assert Path(found["migrations"]).is_relative_to(purelib.resolve())

    # The console script the wheel installs runs against the store the script made.
    cli = venv / "bin" / "casckpt"
    assert cli.is_file()
    log = json.loads(_run([str(cli), "--store", str(work / "store"), "log", "--json"],
                          cwd=work, env=_clean_env()))
    assert [(v["run"], v["step"]) for v in log] == [("wheel", 1)]
    shutil.rmtree(venv)
