"""The fork server behind ``python HELPER.py --zygote`` (crash_child.py, hostile_child.py).

The helper imports what its children need (torch, casckpt), then :func:`serve`
reads JSON commands on stdin until it closes: ``{"op": "spawn", "args": [...],
"stdout": PATH, "stderr": PATH}`` forks a child that runs ``main(args)`` with
stdin from /dev/null and stdout/stderr to those files, and answers
``{"pid": N}``; ``{"op": "wait", "pid": N}`` answers ``{"status": EXIT_CODE}``
(negative for a signal). The children are separate processes like any other;
the server only saves each of them the seconds of importing torch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
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
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, cmd["stdout"]), (2, cmd["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        code = main(cmd["args"])
    except BaseException:  # noqa: BLE001 - reported on the child's stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
