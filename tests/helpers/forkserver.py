"""A fork server: one Python with torch and casckpt imported, forking warm children.

Two ways in, one server:

- ``python forkserver.py --zygote`` (the ``forked_python`` fixture in
  tests/conftest.py) runs any Python command line in each child: ``["-c",
  CODE, *args]``, ``["-m", MODULE, *args]`` or ``[SCRIPT, *args]``, as
  ``python`` would (``sys.argv``, ``sys.path[0]``, ``__main__``, exit status,
  a traceback and status 1 for an uncaught exception, threads joined and
  atexit handlers run before exit).
- ``python HELPER.py --zygote`` (crash_child.py, hostile_child.py, ...) imports
  what its children need, then :func:`serve` runs ``main(args)`` in each.

:func:`serve` reads JSON commands on stdin until it closes: ``{"op": "spawn",
"args": [...], "stdout": PATH, "stderr": PATH}`` forks a child that runs
``main(args)`` with stdin from /dev/null (or the file ``"stdin"``) and
stdout/stderr to those files, in the directory ``"cwd"`` and with exactly the
environment ``"env"`` when given, and answers ``{"pid": N}``; ``{"op": "wait",
"pid": N}`` answers ``{"status": EXIT_CODE}`` (negative for a signal). The
children are separate processes like any other (a SIGKILL kills only the
child); the server only saves each of them the seconds of importing torch.
What a warm child cannot show is what a fresh interpreter imports, or how it
starts under other interpreter options or another PYTHONPATH: tests about
those start ``sys.executable`` themselves.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any


def serve(main: Callable[[list[str]], int]) -> int:
    """Serve spawn/wait commands until stdin closes."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _forked(main, cmd)
            reply: dict[str, int] = {"pid": pid}
        else:
            _, status = os.waitpid(cmd["pid"], 0)
            reply = {"status": os.waitstatus_to_exitcode(status)}
        print(json.dumps(reply), flush=True)
    return 0


def _forked(main: Callable[[list[str]], int], cmd: dict[str, Any]) -> None:
    """Body of a forked child: run ``main`` with its own stdio, then exit. Never returns."""
    code = 1
    try:
        source = os.open(cmd.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(source, 0)
        os.close(source)
        for fd, path in ((1, cmd["stdout"]), (2, cmd["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if cmd.get("cwd"):
            os.chdir(cmd["cwd"])
        if cmd.get("env") is not None:
            os.environ.clear()
            os.environ.update(cmd["env"])
            tempfile.tempdir = None  # TMPDIR is read again
        code = main(cmd["args"])
    except BaseException:  # noqa: BLE001 - reported on the child's stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def python(argv: list[str]) -> int:
    """Run a ``python`` command line's arguments in this (forked) process; its exit status."""
    atexit._clear()  # the server's handlers are not the command's
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - fd 0 is the command's now
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and os.path.abspath(entry) not in map(os.path.abspath, sys.path):
            sys.path.insert(1, entry)  # where python puts PYTHONPATH, for modules not yet imported
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own code
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            sys.modules.pop(argv[1], None)  # preloaded as a module; it runs again as __main__
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what -m calls
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with it
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads joined, as at exit
    atexit._run_exitfuncs()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def zygote() -> int:
    """Preload what the tests' child processes import, then serve :func:`python` children."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import casckpt  # noqa: F401
    import casckpt.cli.main  # noqa: F401

    return serve(python)


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == ["--zygote"] else "usage: forkserver.py --zygote")
