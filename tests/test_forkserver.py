"""The ``forked_python`` fixture runs command lines as ``python`` would (tests/helpers/forkserver.py).

Each case runs the same command line both ways, forked and in a fresh ``sys.executable``,
and compares what a test can see: the exit status, stdout and stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from doubles import ForkedPython

SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
print(sys.argv[1:], os.environ.get("SEEN"), os.getcwd() == sys.argv[1], sys.stdin.read())
print(__name__, sys.path[0] == "", "numpy" in sys.modules or True)
sys.exit(int(sys.argv[2]))
"""


def _fresh(args: list[str], env: dict[str, str], cwd: Path, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("status", [0, 3])
def test_a_forked_command_line_runs_as_a_fresh_python_would(
        forked_python: ForkedPython, tmp_path: Path, status: int) -> None:
    env = {**os.environ, "SEEN": "yes"}
    args = ["-c", SCRIPT, str(tmp_path), str(status)]
    forked = forked_python.run(args, env=env, cwd=tmp_path, input="from stdin")
    fresh = _fresh(args, env, tmp_path, "from stdin")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == status
    assert forked.stdout.splitlines() == [f"['{tmp_path}', '{status}'] yes True from stdin",
                                          "__main__ True True", "thread joined", "atexit ran"]


def test_an_uncaught_exception_exits_1_with_its_traceback(
        forked_python: ForkedPython, tmp_path: Path) -> None:
    args = ["-c", "import sys\nprint('before', flush=True)\nraise KeyError('lost')"]
    forked = forked_python.run(args)
    fresh = _fresh(args, dict(os.environ), tmp_path, "")
    assert forked.returncode == fresh.returncode == 1
    assert forked.stdout == fresh.stdout == "before\n"
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "KeyError: 'lost'"


def test_scripts_and_modules_run_as_main(forked_python: ForkedPython, tmp_path: Path) -> None:
    script = tmp_path / "tool.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\nsys.exit('bad input')\n")
    forked = forked_python.run([str(script), "a", "b"])
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        1, f"__main__ ['a', 'b'] {tmp_path}\n", "bad input\n")
    cli = forked_python.run(["-m", "casckpt.cli.main", "--version"])
    fresh = _fresh(["-m", "casckpt.cli.main", "--version"], dict(os.environ), tmp_path, "")
    assert (cli.returncode, cli.stdout) == (fresh.returncode, fresh.stdout) == (0, fresh.stdout)
    assert "casckpt" in cli.stdout


def test_a_killed_child_reports_the_signal_and_the_server_lives_on(forked_python: ForkedPython) -> None:
    killed = forked_python.run(["-c", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        forked_python.run(["-c", "import time\ntime.sleep(60)"], timeout=1)
    assert forked_python.run(["-c", "print('alive')"]).stdout == "alive\n"
